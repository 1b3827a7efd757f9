"""The serial parts of hiding the communication: slice optimizers and the optimizer the core
steps (intra='shm'), rebinding the flat buffers, the bucket plan, the backward hook, which
backward is a step's (overlap), the link timeline, 16-bit compression with error feedback,
and every rule of the extras' options with its message (no MPI)."""

import re

import numpy as np
import pytest

from mpidl.app.config import ConfigError, parse_config
from mpidl.distributed.build import OptionError, check_options
from mpidl.distributed.emulation import LinkModel, LinkTimeline
from mpidl.distributed.exchange import reset_slots
from mpidl.distributed.extras import ExchangeWrapper, shm, sync_overlap
from mpidl.distributed.extras.compress import Compressor, from_bf16, to_bf16
from mpidl.distributed.extras.overlap import (
    MIN_BUCKETS,
    Bucket,
    _armed,
    _disarm,
    bucket_bytes,
    plan_buckets,
    small_bucket_bytes,
)
from mpidl.distributed.extras.shm import _SliceStepping, move_state, slice_optimizer
from mpidl.distributed.message import COUNT, NONFINITE
from mpidl.engine.models import MODELS, build_model
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
    bucket = bucket_bytes(sum(sizes), 4, 1.0)
    plan = plan_buckets(sizes, bucket, 4, small_bucket_bytes(bucket))
    assert len(plan) >= 3 and plan[0].first > 0 and plan[-1].first == 0
    assert bucket_bytes(sum(sizes), 4, 1.0) == sum(sizes) * 4 / MIN_BUCKETS
    assert bucket_bytes(10 ** 8, 4, 1.0) == 2 ** 20  # the cap still bounds a large message


def plan_of(model):
    sizes = [param.size for param in model.params]
    bucket = bucket_bytes(sum(sizes), 4, 1.0)
    return sizes, plan_buckets(sizes, bucket, 4, small_bucket_bytes(bucket))


@pytest.mark.parametrize("name, shape", [("resnet8", (3, 9, 9)), ("vit", (3, 9, 9))])
def test_buckets_are_cut_by_parameter_inside_the_blocks_first_and_last_small(name, shape):
    """resnet8's top-level layers are whole residual stages, vit's whole transformer blocks:
    cut by parameter, the first bucket starts after the last few parameters and the last
    one, exposed whatever the progress, is a few per cent of the message."""
    sizes, plan = plan_of(build_model(name, shape, 10, seed=0))
    total = sum(sizes) + 3
    assert plan[0].hi == total and plan[-1].lo == 0 and all(x.lo == y.hi for x, y in zip(plan, plan[1:]))
    assert len(plan) >= 5
    assert (plan[0].hi - plan[0].lo) / total < 0.15 and (plan[-1].hi - plan[-1].lo) / total < 0.05
    assert all(b.hi - b.lo <= total / MIN_BUCKETS + max(sizes) for b in plan)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_become_final_from_the_last_parameter_to_the_first(name):
    """watch_gradients reports every parameter once per backward, in the reverse of the
    registration order (the message's order): a bucket, a tail of the message, is complete
    as soon as its own parameters are (residual blocks run the shortcut's backward first)."""
    shape = (12, 9, 9) if name == "spectral_lstm" else (3, 9, 9)
    model = build_model(name, shape, 3, seed=0)
    index = {id(param): k for k, param in enumerate(model.params)}
    seen = []
    watched = model.net.watch_gradients(lambda module: seen.append(
        sorted((index[id(p)] for p in module.parameters()), reverse=True)))
    logits = model.forward(np.random.default_rng(0).standard_normal((4, *shape)).astype(np.float32))
    model.backward(np.ones_like(logits))
    order = [k for group in seen for k in group]
    assert order == list(range(len(model.params) - 1, -1, -1)), order
    assert len(seen) == len(watched)
    model.net.unwatch_gradients()
    seen.clear()
    model.backward(np.ones_like(logits))
    assert seen == [] and all("backward" not in vars(module) for module in model.net.modules())


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


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_error_feedback_is_exact_per_exchange(kind):
    """What one exchange sends plus the new residual is, bit for bit, its input plus the old
    residual: D(q_t) + e_t == x_t + e_{t-1} in float32 (the rounding error of a 16-bit
    rounding of a float32 is itself a float32)."""
    comp = Compressor(kind)
    rng = np.random.default_rng(1)
    message = np.zeros(503, np.float32)
    for _ in range(20):
        message[:500] = rng.standard_normal(500).astype(np.float32) * np.float32(3e-3)
        old = comp.residuals.get(500, np.zeros(500, np.float32)).copy()
        packed = comp.packed(message, 500)
        out = message.copy()
        comp.unpack_sum([packed], out)
        assert np.array_equal(out[:500] + comp.residuals[500], message[:500] + old)


class LayerWise(SGD):
    """A stand-in for a layer-wise rule (LARS-like): not elementwise."""
    elementwise = False


#: every rule of the extras, through build.check_options: the option named, the whole message
RULES = [
    ({"compress": "int8"}, "compress", "compress must be one of none, bf16, fp16, got 'int8'"),
    ({"compress": "bf16"}, "compress",
     "compress acts on the leaders' gradient exchange of strategy hierarchical, not flat"),
    ({"compress": "fp16", "strategy": "node"}, "compress",
     "compress acts on the leaders' gradient exchange of strategy hierarchical, not node"),
    ({"compress": "bf16", "strategy": "hierarchical", "overlap": True}, "compress",
     "compress acts on the blocking exchange (not with overlap)"),
    ({"sync_overlap": -1, "strategy": "node"}, "sync_overlap", "sync_overlap must be an integer >= 0, got -1"),
    ({"sync_overlap": True, "strategy": "node"}, "sync_overlap", "sync_overlap must be an integer >= 0, got True"),
    ({"sync_overlap": 1, "strategy": "hierarchical"}, "sync_overlap", "sync_overlap applies to strategy='node'"),
    ({"sync_overlap": 3, "strategy": "node", "sync_every": 3}, "sync_overlap",
     "sync_overlap must be an integer in [0, sync_every=3), got 3"),
    ({"sync_overlap": 1, "strategy": "node", "intra": "shm"}, "sync_overlap", "sync_overlap works with intra='mpi'"),
    ({"overlap": True, "intra": "shm"}, "overlap",
     "overlap works with intra='mpi' (the shared window is reduced in place)"),
    ({"overlap": True, "host_memory": False}, "overlap",
     "overlap needs the CPU backend (host buffers for non-blocking MPI)"),
    ({"overlap": True, "model": FlatParameters([("w", Parameter((2,), uniform(1.0)))], seed=0)}, "overlap",
     "overlap needs a Model whose net is a Module (its layers' backward tells which gradients are final)"),
    ({"intra": "shm", "host_memory": False}, "intra", "intra='shm' shares host memory: it needs the CPU backend"),
    ({"intra": "shm", "optimizer": LayerWise}, "intra",
     "intra='shm' needs an elementwise optimizer (sgd, adam, adamw): each rank updates its slice of the "
     "shared parameters alone; LayerWise is not elementwise, use intra='mpi'"),
]


@pytest.mark.parametrize("options, option, message", RULES, ids=[f"{r[1]}-{i}" for i, r in enumerate(RULES)])
def test_every_rule_of_the_extras_names_its_option(options, option, message):
    with pytest.raises(OptionError, match=re.escape(message)) as info:
        check_options(**options)
    assert info.value.option == option and str(info.value) == message


def test_rules_only_reachable_in_their_own_module():
    """sync_overlap's compress rule is behind compress's own (which refuses node first)."""
    with pytest.raises(ValueError, match=re.escape("sync_overlap works with the uncompressed sync (no compress)")):
        sync_overlap.check_options(1, "node", 50, "mpi", "bf16")
    with pytest.raises(ValueError, match="elementwise"):
        shm.check_shared_supported(Flat(3, 0), LayerWise(Flat(3, 0), 0.1))


@pytest.mark.parametrize("options", [
    {"strategy": "node", "overlap": True}, {"strategy": "hierarchical", "overlap": True},
    {"strategy": "node", "intra": "shm", "optimizer": Adam}, {"strategy": "hierarchical", "intra": "shm",
                                                               "compress": "bf16", "optimizer": SGD},
    {"strategy": "node", "sync_overlap": 2, "sync_every": 3, "overlap": True},
])
def test_what_the_extras_combine_with(options):
    check_options(**options)


@pytest.mark.parametrize("argv, message", [
    (["--intra", "tcp"], "--intra"),
    (["--overlap", "--intra", "shm"], "--overlap: overlap works with intra='mpi'"),
    (["--overlap", "--device", "gpu"], "--overlap: overlap needs the CPU backend"),
    (["--intra", "shm", "--device", "gpu"], "--intra: intra='shm' shares host memory"),
    (["--bucket-mb", "0"], "--bucket-mb"),
    (["--compress", "int8"], "--compress"),
    (["--compress", "bf16"], "--compress: compress acts on the leaders' gradient exchange of strategy hierarchical"),
    (["--compress", "bf16", "--strategy", "node"], "--compress: .* not node"),
    (["--compress", "bf16", "--strategy", "hierarchical", "--overlap"], "not with overlap"),
    (["--sync-overlap", "--strategy", "flat"], "--sync-overlap: sync_overlap applies to strategy='node'"),
    (["--sync-overlap", "60", "--strategy", "node"], r"--sync-overlap: .*in \[0, sync_every=50\)"),
    (["--sync-overlap", "--strategy", "node", "--intra", "shm"], "--sync-overlap: sync_overlap works with intra='mpi'"),
])
def test_hiding_options_are_validated(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, world_size=2)


def test_hiding_options_parse():
    cfg = parse_config(["--strategy", "node", "--sync-overlap"], world_size=2)
    assert cfg.sync_overlap == 1
    cfg = parse_config(["--strategy", "node", "--overlap"], world_size=2)
    assert cfg.overlap
    cfg = parse_config(["--intra", "shm", "--strategy", "hierarchical", "--compress", "fp16"], world_size=2)
    assert cfg.intra == "shm" and cfg.sync_overlap == 0 and cfg.compress == "fp16"


# ------------------------------------------------------------------ the optimizer DataParallel steps (shm)
def test_the_slice_stepping_optimizer_reads_the_whole_optimizers_lr_and_state():
    shared = Flat(10, 2)
    whole = SGD(shared, 0.1, momentum=0.9)
    reference = SGD(Flat(10, 2), 0.1, momentum=0.9)
    stepping = _SliceStepping(whole, slice_optimizer(whole, 3, 8, shared.grad))
    assert stepping.params is whole.params and stepping.state_buffers()[0] is whole.state_buffers()[0]
    for lr in (0.1, 0.0, 0.05):
        whole.lr = reference.lr = lr  # a schedule sets the optimizer it built
        stepping.step()
        reference.step()
    assert stepping.step_count == whole.step_count == 3 and stepping.lr == 0.05
    assert np.array_equal(shared.data[3:8], reference.params.data[3:8])
    assert np.array_equal(shared.data[:3], Flat(10, 2).data[:3])  # the other ranks' slices
    stepping.lr = 0.2
    assert whole.lr == 0.2
    stepping._part = None  # after the window's close: the whole optimizer again
    stepping.step()
    assert whole.step_count == 4 and not np.array_equal(shared.data[:3], Flat(10, 2).data[:3])


def test_an_exchange_wrapper_reads_through_and_keeps_its_own():
    class Inner:
        name, exact, steps_since_sync = "node", False, 7

        def describe(self):
            return "strategy node"

    wrapper = ExchangeWrapper(Inner())
    wrapper.steps_since_sync = 0
    assert (wrapper.name, wrapper.exact, wrapper.describe()) == ("node", False, "strategy node")
    assert wrapper.steps_since_sync == 0 and wrapper.inner.steps_since_sync == 7
    with pytest.raises(AttributeError):
        wrapper.no_such_attribute


# ------------------------------------------------------------------ which backward is a step's (overlap)
def test_a_reduced_message_disarms_the_hooks_until_local_indices_writes_a_weight():
    """The hooks start buckets only after local_indices() wrote this rank's weight (>= 0)
    into the weight slot; an exchange leaves -1 there, a weight no step can have."""
    message = np.zeros(10)
    _disarm(message)
    assert not _armed(message) and message[COUNT] == -1
    message[COUNT] = 0.0  # local_indices() of a rank with no samples this step
    assert _armed(message)
    message[COUNT] = 16.0
    assert _armed(message)
