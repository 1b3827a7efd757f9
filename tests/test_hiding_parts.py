"""The serial parts of hiding the communication: slice optimizers (intra='shm'), rebinding the
flat buffers, the bucket plan, the backward hook, the link timeline, 16-bit compression with
error feedback, and the configuration options."""

import numpy as np
import pytest

from mpidl.app.config import ConfigError, parse_config
from mpidl.distributed.compress import Compressor, from_bf16, to_bf16
from mpidl.distributed.emulation import LinkModel, LinkTimeline
from mpidl.distributed.overlap import MIN_BUCKETS, Bucket, bucket_bytes, plan_buckets
from mpidl.distributed.shm import move_state, slice_optimizer
from mpidl.engine.nn import Linear, ReLU, Sequential
from mpidl.engine.optim import SGD, Adam, AdamW
from mpidl.engine.params import FlatParameters, Parameter, uniform


class Flat:
    def __init__(self, n, seed):
        rng = np.random.default_rng(seed)
        self.data, self.grad, self.size = rng.standard_normal(n), rng.standard_normal(n), n


@pytest.mark.parametrize("cls, kwargs", [
    (SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (SGD, {"momentum": 0.9, "dampening": 0.1}), (SGD, {}),
    (Adam, {"weight_decay": 1e-2}), (AdamW, {}),
])
def test_slice_steps_equal_the_whole_step(cls, kwargs):
    """Three slice optimizers on one parameter/state memory, each stepping its slice (what
    the ranks of a node do under intra='shm'), equal one whole-buffer optimizer."""
    whole, shared = Flat(11, 0), Flat(11, 0)
    reference = cls(whole, 0.1, **kwargs)
    owner = cls(shared, 0.1, **kwargs)
    parts = [slice_optimizer(owner, lo, hi, shared.grad) for lo, hi in [(0, 4), (4, 4), (4, 11)]]  # one empty
    for t in range(4):
        whole.grad[...] = shared.grad[...] = np.random.default_rng(t).standard_normal(11)
        reference.step()
        for part in parts:
            part.lr, part.step_count = owner.lr, owner.step_count
            part.step()
        owner.step_count = parts[0].step_count
    assert np.array_equal(whole.data, shared.data)
    for a, b in zip(reference.state_buffers(), owner.state_buffers()):
        assert np.array_equal(a, b)


def test_slice_optimizer_refusals():
    p = Flat(5, 1)
    with pytest.raises(ValueError, match="inside"):
        slice_optimizer(SGD(p, 0.5), 3, 9, p.grad)

    class LayerWise(SGD):
        elementwise = False
    with pytest.raises(ValueError, match="not elementwise"):
        slice_optimizer(LayerWise(p, 0.1), 0, 2, p.grad)
    opt = SGD(p, 0.1, momentum=0.9)
    with pytest.raises(ValueError, match="state buffers"):
        move_state(opt, [])


def test_rebind_moves_storage_and_views():
    a, b = Parameter((2, 3), uniform(1.0)), Parameter((4,), uniform(1.0))
    flat = FlatParameters([("a", a), ("b", b)], seed=0)
    values, message = flat.data.copy(), flat.message.copy()
    data, msg = np.zeros(10, flat.dtype), np.zeros(13, flat.dtype)
    flat.rebind(data, msg)
    assert flat.data is data and np.array_equal(data, values) and np.array_equal(msg, message)
    a.data[...] = 7
    b.grad[...] = 3
    assert np.all(data[:6] == 7) and np.all(msg[6:10] == 3) and flat.grad.base is msg
    with pytest.raises(ValueError, match="rebind"):
        flat.rebind(np.zeros(9, flat.dtype), msg)


def test_bucket_plan_covers_the_message_once_in_reverse_layer_order():
    sizes = [432, 32, 0, 4672, 14528, 57728, 0, 650]
    for bucket_bytes in (1, 4096, 0.05 * 2 ** 20, 1e12):
        plan = plan_buckets(sizes, bucket_bytes, 4)
        assert plan[0].hi == sum(sizes) + 3 and plan[-1].lo == 0
        assert all(x.lo == y.hi for x, y in zip(plan, plan[1:]))
        assert [b.first for b in plan] == sorted((b.first for b in plan), reverse=True)
    assert plan_buckets(sizes, 1e12, 4) == [Bucket(0, sum(sizes) + 3, 0)]
    assert len(plan_buckets(sizes, 1, 4)) == 6  # one per layer with parameters


def test_a_message_under_the_bucket_cap_is_still_cut_so_that_its_last_layers_travel_early():
    """One bucket would start only after layer 0's backward, with nothing left to hide it."""
    sizes = [432, 32, 0, 4672, 14528, 57728, 0, 650]  # 78,042 float32: 0.3 MB < 1 MiB
    plan = plan_buckets(sizes, bucket_bytes(sum(sizes), 4, 1.0), 4)
    assert len(plan) >= 3 and plan[0].first > 0 and plan[-1].first == 0
    assert bucket_bytes(sum(sizes), 4, 1.0) == sum(sizes) * 4 / MIN_BUCKETS
    assert bucket_bytes(10 ** 8, 4, 1.0) == 2 ** 20  # the cap still bounds a large message


def test_sequential_backward_hook_sees_the_layers_in_reverse():
    net = Sequential(Linear(3, 4), ReLU(), Linear(4, 2))
    FlatParameters(net.named_parameters(), seed=0)
    seen = []
    net.backward_hook = seen.append
    net.forward(np.ones((2, 3), np.float32))
    net.backward(np.ones((2, 2), np.float32))
    assert seen == [2, 1, 0]


def test_link_timeline_serializes_and_overlaps():
    now = [0.0]
    slept = []
    timeline = LinkTimeline(clock=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    first = timeline.start(1.0)
    second = timeline.start(0.5)      # queued behind the first transfer
    assert (first, second) == (1.0, 1.5)
    now[0] = 1.2                      # compute went on meanwhile
    assert timeline.wait(first) == 0.0 and timeline.wait(second) == pytest.approx(0.3)
    link = LinkModel(50, 10)
    assert link.allgather_seconds(1000, 2) == pytest.approx(50e-6 + 1000 / 1.25e9)


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 3.0e38], np.float32)
    back = from_bf16(to_bf16(x))
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.0 + 2 ** -6 and back[3] == -2.5
    assert np.all(np.abs(back - x) <= np.abs(x) * 2 ** -8)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_error_feedback_keeps_the_sum_of_exchanges(kind):
    """sum_t D(q_t) = sum_t x_t - e_T: the rounding errors do not accumulate."""
    comp = Compressor(kind)
    rng = np.random.default_rng(0)
    sent, true = np.zeros(1000), np.zeros(1000)
    message = np.zeros(1003, np.float32)
    largest = 0.0
    for _ in range(50):
        message[:1000] = rng.standard_normal(1000) * 1e-2
        largest = max(largest, float(np.abs(message[:1000]).max()))
        message[1000:] = [7.0, 0.0, 1.0]
        true += message[:1000]
        packed = comp.packed(message, "g")
        assert packed.nbytes == 2 * 1000 + 24  # half of float32, the slots exact
        out = message.copy()
        comp.unpack_sum([packed], out)
        assert list(out[1000:]) == [7.0, 0.0, 1.0]
        sent += out[:1000]
    residual = comp.residuals["g"]
    assert np.allclose(sent + residual, true, atol=1e-6)
    # one rounding of the largest value (2^-8 relative for bf16), not fifty accumulated
    assert np.max(np.abs(sent - true)) <= 1.1 * largest * 2 ** -8


@pytest.mark.parametrize("argv, message", [
    (["--intra", "tcp"], "--intra"),
    (["--overlap", "--strategy", "node"], "--overlap: overlap works with strategy"),
    (["--overlap", "--intra", "shm"], "--overlap: overlap works with intra='mpi'"),
    (["--overlap", "--device", "gpu"], "--overlap: overlap needs the CPU backend"),
    (["--intra", "shm", "--device", "gpu"], "--intra: intra='shm' shares host memory"),
    (["--bucket-mb", "0"], "--bucket-mb"),
    (["--compress", "int8"], "--compress"),
    (["--compress", "bf16"], "--compress: compress acts on the inter-node exchange"),
    (["--compress", "bf16", "--strategy", "hierarchical", "--overlap"], "not with overlap"),
    (["--sync-overlap", "--strategy", "flat"], "--sync-overlap: sync_overlap applies to strategy='node'"),
    (["--sync-overlap", "60", "--strategy", "node"], r"--sync-overlap: .*in \[0, sync_every=50\)"),
    (["--sync-overlap", "--strategy", "node", "--intra", "shm"], "--sync-overlap: sync_overlap works with intra='mpi'"),
    (["--sync-overlap", "--strategy", "node", "--compress", "bf16"], "uncompressed"),
])
def test_hiding_options_are_validated(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, world_size=2)


def test_hiding_options_parse():
    cfg = parse_config(["--strategy", "node", "--sync-overlap"], world_size=2)
    assert cfg.sync_overlap == 1
    cfg = parse_config(["--strategy", "node", "--compress", "bf16"], world_size=2)
    assert cfg.compress == "bf16"
    cfg = parse_config(["--intra", "shm", "--strategy", "hierarchical", "--compress", "fp16"], world_size=2)
    assert cfg.intra == "shm" and cfg.sync_overlap == 0
