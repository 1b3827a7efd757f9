"""Hiding the communication: node-shared buffers (intra='shm'), bucketed overlap,
compression and the overlapped node sync, each against the blocking replicated reference.

The same tiny float64 loops as ``test_data_parallel.py``; every rank asserts only after a
collective agreement.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed import DataParallel, NonFiniteGradient, Topology
from mpidl.engine.optim import SGD, Adam
from test_data_parallel import B, P, RANK, UNEVEN, WORLD, make, rel_diff, tiny_model, train
from trainer_harness import all_agree

pytestmark = pytest.mark.mpi


class LayerWise(SGD):
    """A stand-in for a layer-wise rule (LARS-like): not elementwise."""
    elementwise = False


# ------------------------------------------------------------------ intra='shm'
@pytest.mark.parametrize("strategy, ranks_per_node, optimizer", [
    ("flat", None, SGD), ("hierarchical", None, SGD), ("hierarchical", None, Adam),
    ("flat", 1, SGD), ("hierarchical", 2, Adam),
])
def test_shm_equals_mpi_and_one_process(strategy, ranks_per_node, optimizer):
    model, dp = make(strategy=strategy, speeds=UNEVEN, ranks_per_node=ranks_per_node,
                     optimizer=optimizer, intra="shm")
    shm = train(model, dp, steps=5)
    ref_model, ref_dp = make(strategy=strategy, speeds=UNEVEN, ranks_per_node=ranks_per_node,
                             optimizer=optimizer)
    mpi = train(ref_model, ref_dp, steps=5)
    one_model, one_dp = make(comm=MPI.COMM_SELF, strategy=strategy, optimizer=optimizer)
    one = train(one_model, one_dp, steps=5)
    assert all_agree(WORLD, rel_diff(shm, mpi) <= 1e-12), f"{strategy}: {rel_diff(shm, mpi):.3e}"
    assert all_agree(WORLD, rel_diff(shm, one) <= 1e-10)
    state_shm = dp.optimizer.state_buffers()[0].copy()
    assert all_agree(WORLD, rel_diff(state_shm, ref_dp.optimizer.state_buffers()[0]) <= 1e-12)
    dp.close()
    # after close the model is private again and keeps its values
    assert all_agree(WORLD, np.array_equal(model.params.data, shm) and dp.exchange.shared is None)


@pytest.mark.mpi(min_size=2)
def test_shm_node_strategy_equals_mpi_between_and_at_syncs():
    kwargs = dict(strategy="node", sync_every=3, ranks_per_node=max(1, P // 2), speeds=UNEVEN,
                  sync_optimizer_state=True)
    model, dp = make(intra="shm", **kwargs)
    ref_model, ref_dp = make(**kwargs)
    for steps in (2, 2):  # step 2 between syncs, step 4 after the sync at step 3
        shm = train(model, dp, steps=steps, seed=steps)
        mpi = train(ref_model, ref_dp, steps=steps, seed=steps)
        assert all_agree(WORLD, rel_diff(shm, mpi) <= 1e-12), f"{rel_diff(shm, mpi):.3e}"
        assert all_agree(WORLD, rel_diff(dp.consensus(), ref_dp.consensus()) <= 1e-12)
    dp.sync()
    ref_dp.sync()
    assert all_agree(WORLD, rel_diff(model.params.data, ref_model.params.data) <= 1e-12)
    dp.close()


def test_shm_holds_one_copy_per_node():
    model, dp = make(intra="shm")
    node = dp.topology.node
    # every rank of the node sees the same memory for the parameters
    addresses = node.allgather(model.params.data.__array_interface__["data"][0] -
                               dp.exchange.shared.window.__array_interface__["data"][0])
    assert all_agree(WORLD, len(set(addresses)) == 1)
    parts = dp.exchange.shared.resident_bytes()
    R = node.Get_size()
    assert all_agree(WORLD, parts["params"] == model.params.nbytes and
                     parts["slots"] == R * model.params.message.nbytes)
    dp.close()


def test_shm_refuses_a_layer_wise_optimizer_before_any_collective():
    model = tiny_model()
    with pytest.raises(ValueError, match="elementwise"):
        DataParallel(model, LayerWise(model.params, lr=0.1), batch_size=B, intra="shm")
    with pytest.raises(ValueError, match="intra must be"):
        DataParallel(model, SGD(model.params, lr=0.1), batch_size=B, intra="tcp")


@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
def test_shm_non_finite_gradient_raises_on_every_rank(strategy):
    model, dp = make(strategy=strategy, intra="shm")
    raised = None
    for t in range(3):
        model.params.grad.fill(0.1)
        if t == 1 and RANK == P - 1:
            model.params.grad[model.params.size - 1] = np.nan
        try:
            dp.step(2)
        except NonFiniteGradient:
            raised = t
            break
    assert WORLD.allgather(raised) == [1] * P
    dp.close()


def test_shm_state_dict_then_load_continues_exactly():
    model, dp = make(intra="shm")
    train(model, dp, steps=2)
    state = WORLD.bcast(dp.state_dict(), root=0)
    expected = train(model, dp, steps=2, seed=9)
    model2, dp2 = make(intra="shm", seed=11)
    dp2.load_state_dict(state)
    got = train(model2, dp2, steps=2, seed=9)
    assert all_agree(WORLD, rel_diff(got, expected) <= 1e-12)
    dp.close()
    dp2.close()


# ------------------------------------------------------------------ overlap
@pytest.mark.parametrize("strategy, ranks_per_node, optimizer", [
    ("flat", None, SGD), ("hierarchical", None, Adam), ("hierarchical", 1, SGD),
    ("hierarchical", 2, SGD),
])
def test_overlap_equals_blocking_and_one_process(strategy, ranks_per_node, optimizer):
    kwargs = dict(strategy=strategy, speeds=UNEVEN, ranks_per_node=ranks_per_node, optimizer=optimizer)
    model, dp = make(overlap=True, bucket_mb=1e-4, **kwargs)
    overlapped = train(model, dp, steps=4)
    ref_model, ref_dp = make(**kwargs)
    blocking = train(ref_model, ref_dp, steps=4)
    one_model, one_dp = make(comm=MPI.COMM_SELF, strategy=strategy, optimizer=optimizer)
    one = train(one_model, one_dp, steps=4)
    assert all_agree(WORLD, rel_diff(overlapped, blocking) <= 1e-12), f"{rel_diff(overlapped, blocking):.3e}"
    assert all_agree(WORLD, rel_diff(overlapped, one) <= 1e-10)
    if P > 1:
        # several buckets, each one counted collective per stage
        n = len(dp.exchange.buckets)
        level = "world" if strategy == "flat" else "inter" if dp.topology.is_leader and dp.topology.num_nodes > 1 else None
        assert all_agree(WORLD, n >= 3 and (level is None or dp.counters[level]["calls"] == 4 * n))
        assert all_agree(WORLD, sum(c["bytes"] for lv, c in dp.counters.items() if lv == (level or "x"))
                         in (0, 4 * model.params.message.nbytes))
    dp.close()
    assert all_agree(WORLD, model.net.backward_hook is None)


def test_overlap_hook_starts_buckets_during_backward():
    """The first buckets are started by the hook, before step() is called."""
    model, dp = make(overlap=True, bucket_mb=1e-4)
    from test_data_parallel import DATA, batches
    from mpidl.engine.nn import SoftmaxCrossEntropy
    loss_fn = SoftmaxCrossEntropy()
    batch = batches(1)[0]
    local = dp.local_indices(batch)
    x, y = DATA.read(local)
    loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    started = dp.exchange.started_buckets() if P > 1 else 0
    dp.step()
    assert all_agree(WORLD, P == 1 or started == len(dp.exchange.buckets))
    dp.close()


def test_overlap_refuses_what_it_cannot_do():
    model = tiny_model()
    opt = SGD(model.params, lr=0.1)
    for kwargs, match in (({"strategy": "node"}, "overlap works with strategy"),
                          ({"intra": "shm"}, "intra='mpi'"),
                          ({"bucket_mb": 0}, "bucket_mb")):
        with pytest.raises(ValueError, match=match):
            DataParallel(model, opt, batch_size=B, overlap=True, **kwargs)
    with pytest.raises(ValueError, match="Sequential"):
        DataParallel(model.params, opt, batch_size=B, overlap=True)


# ------------------------------------------------------------------ compression
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compressed_hierarchical_is_close_and_halves_the_inter_bytes(kind):
    from mpidl.engine.backend import get_backend
    from mpidl.engine.models import build_model
    from test_data_parallel import DATA
    rpn = max(1, P // 2)
    results = {}
    for compress in ("none", kind):
        model = build_model("hsicnn", DATA.sample_shape, DATA.num_classes, seed=3,
                            backend=get_backend("cpu", "float32"), channels=(4, 4), hidden=8)
        dp = DataParallel(model, SGD(model.params, lr=0.05), batch_size=B, strategy="hierarchical",
                          topology=Topology.from_comm(WORLD, ranks_per_node=rpn), compress=compress)
        results[compress] = (train(model, dp, steps=3), dict(dp.counters["inter"]), model.params.message.nbytes)
    (exact, inter0, nbytes), (packed, inter1, _) = results["none"], results[kind]
    assert all_agree(WORLD, 0 < rel_diff(packed, exact) < 1e-2 or dp.topology.num_nodes == 1)
    if dp.topology.is_leader and dp.topology.num_nodes > 1:
        ok = inter0["bytes"] == 3 * nbytes and inter1["bytes"] <= 3 * (nbytes // 2 + 24)
    else:
        ok = True
    assert all_agree(WORLD, ok), (inter0, inter1, nbytes)


@pytest.mark.mpi(min_size=2)
def test_compressed_node_sync_averages_the_changes():
    kwargs = dict(strategy="node", sync_every=2, ranks_per_node=max(1, P // 2), speeds=UNEVEN)
    model, dp = make(compress="bf16", **kwargs)
    ref_model, ref_dp = make(**kwargs)
    got, want = train(model, dp, steps=4), train(ref_model, ref_dp, steps=4)
    # the changes since the last sync are small: bf16 rounding of them is far below bf16 of theta
    assert all_agree(WORLD, rel_diff(got, want) < 1e-3), rel_diff(got, want)


# ------------------------------------------------------------------ overlapped node sync
@pytest.mark.mpi(min_size=2)
def test_sync_overlap_equals_blocking_when_nothing_moved_meanwhile():
    rpn = max(1, P // 2)
    out = []
    for delay in (0, 1):
        model = tiny_model()
        dp = DataParallel(model, SGD(model.params, lr=0.05), batch_size=B, strategy="node",
                          sync_every=3, speeds=UNEVEN, sync_overlap=delay,
                          topology=Topology.from_comm(WORLD, ranks_per_node=rpn))
        train(model, dp, steps=3)          # the sync starts (or happens) at step 3
        model.params.grad.fill(0.0)
        dp.step(2)                          # step 4 moves nothing; the overlapped sync lands
        out.append(model.params.data.copy())
        assert all_agree(WORLD, dp.reducer._async is None)
    assert all_agree(WORLD, rel_diff(out[1], out[0]) <= 1e-12), rel_diff(out[1], out[0])


@pytest.mark.mpi(min_size=2)
def test_sync_overlap_applies_the_average_plus_local_progress():
    rpn = max(1, P // 2)
    kwargs = dict(strategy="node", sync_every=3, ranks_per_node=rpn, speeds=UNEVEN)
    model, dp = make(sync_overlap=2, **kwargs)
    train(model, dp, steps=4)  # started at 3, not applied yet
    assert all_agree(WORLD, dp.reducer._async is not None)
    train(model, dp, steps=1, seed=5)  # applied at 5
    assert all_agree(WORLD, dp.reducer._async is None)
    dp.sync()
    digest = model.params.data.sum()
    assert all_agree(WORLD, len(set(WORLD.allgather(float(digest)))) == 1)
