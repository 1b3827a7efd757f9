"""MPI tests of the gradient reducers against NumPy references; any world size.

mpiexec -n 4 -hosts localhost:2,127.0.0.1:2 -launcher fork python -m pytest --with-mpi -q tests/mpi   (MPICH)
MPIDL_RANKS_PER_NODE=2 mpiexec -n 4 --oversubscribe python -m pytest --with-mpi -q tests/mpi  (Open MPI)
(bash tests/run_all.sh mpi runs every launch of these tests, for the MPI of mpi4py.)

Rank r's local mean gradient and its sample count are deterministic functions of r, so every
rank can compute the expected reduced result itself. Each rank hands the reducer only its
own count (inside its message); results are gathered on all ranks before asserting, so a
failure on one rank never leaves the others waiting in a collective.
"""

import math

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed.emulation import LinkModel
from mpidl.distributed.reducer_base import COUNT, NONFINITE, SLOTS, STOP
from mpidl.distributed.reducers import FlatReducer, HierarchicalReducer, NodeReducer, make_reducer
from mpidl.distributed.topology import Topology

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
N = 13  # gradient length (odd on purpose)
TOL = 1e-12
ZERO_FLAGS = (0.0, 0.0)

# How the world is cut into nodes: the launch's own (shared memory or MPIDL_RANKS_PER_NODE),
# one rank per node, two halves (2 nodes whenever P >= 2; unequal 2+1 for P = 3), one node.
LAYOUTS = ["launch", 1, "halves", "one"]


def build_topology(layout) -> Topology:
    if layout == "launch":
        return Topology.from_comm()
    k = {"halves": max(1, math.ceil(P / 2)), "one": P}.get(layout, layout)
    return Topology.from_comm(ranks_per_node=k)


# Module scope: each layout's communicators are built once (tests are grouped by layout in
# the same order on every rank), which keeps the oversubscribed test runs short.
@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: f"layout={layout}")
def topology(request):
    topo = build_topology(request.param)
    yield topo
    topo.free()


def local_grad(rank: int, round_: int = 0, dtype=np.float64) -> np.ndarray:
    """Rank r's local mean gradient, different for every rank and round."""
    i = np.arange(N)
    return (np.sin(0.7 * i * (rank + 1) + round_) + 0.1 * rank + 0.01 * round_).astype(dtype)


def make_counts(pattern: str, round_: int = 0) -> list[int]:
    """Samples per rank this step: 'equal', 'unequal', or 'zero' (the last rank got none)."""
    if pattern == "equal":
        return [8] * P
    counts = [3 + 5 * r + round_ for r in range(P)]
    if pattern == "zero" and P > 1:
        counts[-1] = 0
    return counts


def all_grads(counts, round_=0, dtype=np.float64) -> np.ndarray:
    """(P, N): every rank's local gradient as it is passed (zeros where a rank has no samples)."""
    return np.stack([local_grad(r, round_, dtype) if counts[r] > 0 else np.zeros(N, dtype)
                     for r in range(P)])


def message_of(grad, stop=0.0, nonfinite=0.0) -> np.ndarray:
    """``[grad | count | stop | nonfinite]`` as FlatParameters.message holds it."""
    message = np.zeros(grad.size + SLOTS, dtype=grad.dtype)
    message[:grad.size] = grad
    message[STOP], message[NONFINITE] = stop, nonfinite
    return message


def reduce(reducer, grad, count, **flags) -> np.ndarray:
    """Reduce ``grad`` (this rank's, with its ``count``) and return the whole message."""
    message = message_of(grad, **flags)
    reducer.reduce_gradients(message, count)
    return message


def weighted_sum(grads, counts, group, weighting) -> np.ndarray:
    """Reference: sum over `group` of w_r g_r (balanced w_r = b_r / sum b, uniform 1/|group|)."""
    group = list(group)
    total = sum(counts[r] for r in group)
    if weighting == "uniform":
        weights = {r: 1.0 / len(group) for r in group}
    else:
        weights = {r: (counts[r] / total if total else 0.0) for r in group}
    return sum(weights[r] * grads[r].astype(np.float64) for r in group)


def everywhere(ok: bool) -> bool:
    """True on every rank iff ``ok`` holds on every rank (collective)."""
    return WORLD.allreduce(bool(ok), op=MPI.LAND)


def all_identical(comm, array) -> bool:
    """Are the arrays bitwise identical on all ranks of ``comm``? (collective over comm)."""
    return len(set(comm.allgather(np.asarray(array).tobytes()))) == 1


def max_error(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------- exact strategies
@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
@pytest.mark.parametrize("weighting", ["balanced", "uniform"])
@pytest.mark.parametrize("pattern", ["unequal", "zero"])  # 'equal': see balanced == uniform
def test_exact_strategies_give_the_weighted_mean(topology, strategy, weighting, pattern):
    reducer = make_reducer(strategy, topology, weighting)
    errors, identical, totals = [], [], []
    for round_ in range(2):  # twice: catches state left over from the first call
        counts = make_counts(pattern, round_)
        grads = all_grads(counts, round_)
        message = reduce(reducer, grads[RANK].copy(), counts[RANK])
        errors.append(max_error(message[:N], weighted_sum(grads, counts, range(P), weighting)))
        identical.append(all_identical(WORLD, message))
        totals.append(message[COUNT] == (sum(counts) if weighting == "balanced" else P))
    assert everywhere(max(errors) < TOL and all(totals)), errors
    assert all(identical)  # every replica receives the very same bits


def test_flat_equals_hierarchical(topology):
    counts = make_counts("unequal")
    results = [reduce(cls(topology), local_grad(RANK), counts[RANK]) for cls in (FlatReducer, HierarchicalReducer)]
    assert everywhere(max_error(*results) < TOL)


def test_one_rank_group_changes_no_bit():
    """A world of one exchanges nothing and scales nothing: the plain loop's gradient."""
    topo = Topology.from_comm(MPI.COMM_SELF)
    grad = local_grad(RANK)
    for cls in (FlatReducer, HierarchicalReducer, NodeReducer):
        message = reduce(cls(topo), grad.copy(), 7)
        assert message[:N].tobytes() == grad.tobytes() and message[COUNT] == 7
    topo.free()


def test_balanced_is_the_large_batch_gradient_and_uniform_is_not():
    """The balanced gradient of uneven local means equals the mean gradient of all samples;
    the uniform average does not (it over-weights the small batches)."""
    if P < 2:
        pytest.skip("needs 2 ranks with different batch sizes")
    topo = build_topology("launch")
    counts = make_counts("unequal")
    # per-sample gradients: sample k of rank r has gradient x_{r,k}; the local mean is g_r
    rng = np.random.default_rng(0)
    samples = [rng.normal(size=(c, N)) for c in counts]
    large_batch = np.concatenate(samples).mean(axis=0)
    results = {w: reduce(make_reducer("flat", topo, w), samples[RANK].mean(axis=0), counts[RANK])[:N]
               for w in ("balanced", "uniform")}
    topo.free()
    assert everywhere(max_error(results["balanced"], large_batch) < TOL)
    assert everywhere(max_error(results["uniform"], large_batch) > 1e-3)


@pytest.mark.parametrize("strategy", ["flat", "hierarchical", "node"])
def test_balanced_equals_uniform_with_equal_counts(topology, strategy):
    counts = make_counts("equal")
    results = [reduce(make_reducer(strategy, topology, w), local_grad(RANK), counts[RANK])[:N]
               for w in ("balanced", "uniform")]
    assert everywhere(max_error(*results) < TOL)


def test_float32_messages_keep_their_dtype(topology):
    counts = make_counts("unequal")
    grads = all_grads(counts, dtype=np.float32)
    reducer = make_reducer("hierarchical", topology)
    message = reduce(reducer, grads[RANK].copy(), counts[RANK])
    ok = message.dtype == np.float32 and max_error(message[:N], weighted_sum(grads, counts, range(P),
                                                                             "balanced")) < 1e-5
    calls = sum(level["calls"] for level in reducer.counters.values())
    ok = ok and sum(level["bytes"] for level in reducer.counters.values()) == calls * 4 * (N + SLOTS)
    assert everywhere(ok)


@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
def test_exact_strategies_sum_the_flags_over_the_world(topology, strategy):
    """The stop slot reaches every rank with the gradient: a world-wide decision per step."""
    reducer = make_reducer(strategy, topology)
    message = reduce(reducer, local_grad(RANK), 1, stop=float(RANK == P - 1), nonfinite=float(RANK == 0))
    ok = message[STOP] == 1.0 and message[NONFINITE] == 1.0 and reducer.step_is_global
    assert everywhere(ok)


def test_exact_strategies_refuse_a_step_without_samples(topology):
    for strategy in ("flat", "hierarchical"):
        with pytest.raises(ValueError, match="no rank computed a sample"):
            reduce(make_reducer(strategy, topology), np.zeros(N), 0)


# ----------------------------------------------------------------------------- node strategy
@pytest.mark.parametrize("weighting", ["balanced", "uniform"])
@pytest.mark.parametrize("pattern", ["unequal", "zero"])
def test_node_strategy_reduces_gradients_within_the_node(topology, weighting, pattern):
    reducer = make_reducer("node", topology, weighting, sync_every=1000)
    errors, identical_in_node = [], []
    for round_ in range(2):
        counts = make_counts(pattern, round_)
        grads = all_grads(counts, round_)
        message = reduce(reducer, grads[RANK].copy(), counts[RANK])
        errors.append(max_error(message[:N], weighted_sum(grads, counts, topology.node_ranks, weighting)))
        identical_in_node.append(all_identical(topology.node, message))
    assert everywhere(max(errors) < TOL and all(identical_in_node))


def test_node_strategy_flags_stay_in_the_node_until_a_sync(topology):
    reducer = make_reducer("node", topology, sync_every=1000)
    stopper = P - 1
    message = reduce(reducer, local_grad(RANK), 1, stop=float(RANK == stopper))
    in_my_node = stopper in topology.node_ranks
    ok = message[STOP] == float(in_my_node) and reducer.step_is_global == (topology.num_nodes == 1)
    flags = (float(message[STOP]), 0.0)
    world = reducer.synchronize(np.zeros(N), [], flags)  # a sync spreads them to the world
    ok = ok and world[0] > 0 and world[1] == 0
    assert everywhere(ok)


def test_node_strategy_with_one_node_is_flat_without_inter_node_traffic():
    topo = build_topology("one")
    node, flat = make_reducer("node", topo, sync_every=2), make_reducer("flat", topo)
    params = np.ones(N)
    errors, synced = [], []
    for step in range(1, 5):
        counts = make_counts("unequal", step)
        a = reduce(node, local_grad(RANK, step), counts[RANK])
        b = reduce(flat, local_grad(RANK, step), counts[RANK])
        errors.append(max_error(a, b))
        synced.append(node.after_step(params, [], ZERO_FLAGS, step))
    node.synchronize(params, [], ZERO_FLAGS)
    topo.free()
    ok = max(errors) < TOL and all(s is None for s in synced) and node.exact
    ok = ok and node.counters["inter"]["calls"] == 0 and node.counters["world"]["calls"] == 0
    # one node-local allreduce per step (none at all with one rank), one flag exchange at the end
    ok = ok and node.counters["intra"]["calls"] == (4 if P > 1 else 0)
    ok = ok and node.counters["control"]["calls"] == (1 if P > 1 else 0)
    assert everywhere(ok)


def sgd_run(reducer, steps, lr=0.1, pattern="unequal"):
    """Train a toy model with plain SGD (p -= lr g); the gradient depends on the parameters,
    so replicas that drift apart would show. Returns the parameters after each step and
    whether after_step reported a sync."""
    params = np.linspace(-1.0, 1.0, N)
    history = []
    for step in range(1, steps + 1):
        counts = make_counts(pattern, step)
        grad = local_grad(RANK, step) + 0.5 * params if counts[RANK] else np.zeros(N)
        params -= lr * reduce(reducer, grad, counts[RANK])[:N]
        synced = reducer.after_step(params, [], ZERO_FLAGS, step) is not None
        history.append((params.copy(), synced))
    return history


@pytest.mark.parametrize("pattern", ["unequal", "zero"])
def test_node_strategy_syncing_every_step_equals_flat(topology, pattern):
    node_history = sgd_run(make_reducer("node", topology, sync_every=1), steps=6, pattern=pattern)
    flat_history = sgd_run(make_reducer("flat", topology), steps=6, pattern=pattern)
    errors = [max_error(a, b) for (a, _), (b, _) in zip(node_history, flat_history)]
    identical = [all_identical(WORLD, p) for p, _ in node_history]
    synced = [s for _, s in node_history]
    ok = max(errors) < TOL and all(identical)
    ok = ok and all(synced) == (topology.num_nodes > 1)
    assert everywhere(ok), errors


def test_node_strategy_parameter_sync_is_the_node_weighted_average(topology):
    """Between syncs nodes drift apart; at a sync the leaders average the parameters with
    weights S_n / S (samples per node since the last sync) and all replicas become equal.
    Between syncs, consensus() is that average too, and leaves the replicas alone."""
    sync_every = 3
    reducer = make_reducer("node", topology, sync_every=sync_every)
    params = np.linspace(-1.0, 1.0, N)
    samples_per_node = np.zeros(topology.num_nodes)
    leaders = [topology.ranks_of_node(n)[0] for n in range(topology.num_nodes)]
    ok = True
    for step in range(1, 2 * sync_every + 2):
        counts = make_counts("unequal", step)
        for r, c in enumerate(counts):
            samples_per_node[topology.node_of_rank[r]] += c
        params -= 0.1 * reduce(reducer, local_grad(RANK, step) + 0.5 * params, counts[RANK])[:N]
        # before the sync: every rank's parameters, one node's replicas identical
        before = np.array(WORLD.allgather(params))
        ok = ok and all_identical(topology.node, params)
        expected = sum(w * before[r] for w, r in zip(samples_per_node / samples_per_node.sum(), leaders))
        if step == 2:  # between two syncs
            own = params.copy()
            ok = ok and max_error(reducer.consensus(params), expected) < TOL and np.array_equal(own, params)
        synced = reducer.after_step(params, [], ZERO_FLAGS, step) is not None
        ok = ok and synced == (step % sync_every == 0 and topology.num_nodes > 1)
        if synced:
            ok = ok and max_error(params, expected) < TOL and all_identical(WORLD, params)
            ok = ok and reducer.samples_since_sync == 0 and reducer.steps_since_sync == 0
            samples_per_node[:] = 0
    # after the steps (one past a sync), a forced sync makes all replicas equal
    reducer.synchronize(params, [], ZERO_FLAGS)
    ok = ok and all_identical(WORLD, params)
    assert everywhere(ok)


def test_node_strategy_uniform_parameter_weights(topology):
    reducer = make_reducer("node", topology, "uniform", sync_every=1000)
    params = np.full(N, float(topology.node_id))  # node n holds n everywhere
    reduce(reducer, local_grad(RANK), make_counts("unequal")[RANK])
    assert reducer.after_step(params, [], ZERO_FLAGS, 1) is None  # one step, no sync yet
    reducer.synchronize(params, [], ZERO_FLAGS)
    expected = (topology.num_nodes - 1) / 2  # mean of 0 .. L-1
    assert everywhere(max_error(params, np.full(N, expected)) < TOL)


def test_optimizer_state_travels_with_the_parameters_and_the_same_weights(topology):
    reducer = make_reducer("node", topology, sync_every=1)
    counts = make_counts("unequal")
    reduce(reducer, local_grad(RANK), counts[RANK])
    momentum = np.full(N, 1.0 + topology.node_id)
    second = np.full(N, 10.0 * (1 + topology.node_id))
    params = np.full(N, float(topology.node_id))
    reducer.after_step(params, [momentum, second], ZERO_FLAGS, 1)
    node_totals = np.array([sum(counts[r] for r in topology.ranks_of_node(n)) for n in range(topology.num_nodes)])
    weights = node_totals / node_totals.sum()
    ids = np.arange(topology.num_nodes)
    if topology.num_nodes == 1:  # no sync at all: every buffer keeps its value
        weights = np.ones(1)
    ok = max_error(momentum, np.full(N, weights @ (1.0 + ids))) < TOL
    ok = ok and max_error(second, np.full(N, weights @ (10.0 * (1 + ids)))) < TOL
    ok = ok and max_error(params, np.full(N, weights @ ids)) < TOL
    ok = ok and all_identical(WORLD, momentum) and all_identical(WORLD, second)
    inter = reducer.counters["inter"]
    ok = ok and inter["calls"] == int(topology.is_leader and topology.num_nodes > 1)
    assert everywhere(ok)


# ----------------------------------------------------------------------------- counters
def test_node_strategy_counters_two_nodes_100_steps():
    """K' = 50 over 100 steps on 2 nodes: 100 node allreduces and 2 parameter syncs
    (each: one leaders' allreduce and one node broadcast), plus one per forced sync."""
    if P < 2:
        pytest.skip("needs 2 nodes")
    topo = build_topology("halves")
    reducer = make_reducer("node", topo, sync_every=50)
    params = np.zeros(N)
    counts = make_counts("equal")
    syncs = 0
    for step in range(1, 101):
        reduce(reducer, local_grad(RANK), counts[RANK])
        syncs += reducer.after_step(params, [], ZERO_FLAGS, step) is not None
    after_steps = {level: dict(c) for level, c in reducer.counters.items()}
    reduce(reducer, local_grad(RANK), counts[RANK])
    reducer.after_step(params, [], ZERO_FLAGS, 101)
    reducer.synchronize(params, [], ZERO_FLAGS)
    after_forced = {level: dict(c) for level, c in reducer.counters.items()}
    reducer.reset_counters()
    after_reset = reducer.counters
    nbytes = (N + SLOTS) * 8
    in_node = topo.local_size > 1  # a node of one rank skips its (empty) node collectives
    leader = topo.is_leader
    none = {"calls": 0, "bytes": 0}
    expected = {
        "intra": {"calls": (100 + 2) * in_node, "bytes": (100 + 2) * in_node * nbytes},
        "inter": {"calls": 2 * leader, "bytes": 2 * leader * nbytes},
        "world": none, "control": none,
    }
    expected_forced = {
        "intra": {"calls": 104 * in_node, "bytes": 104 * in_node * nbytes},
        "inter": {"calls": 3 * leader, "bytes": 3 * leader * nbytes},
        "world": none, "control": none,
    }
    zero = {level: {"calls": 0, "bytes": 0} for level in ("intra", "inter", "world", "control")}
    topo.free()
    results = WORLD.allgather((syncs, after_steps == expected, after_forced == expected_forced,
                               after_reset == zero and reducer.comm_seconds == 0.0))
    assert results == [(2, True, True, True)] * P, (after_steps, after_forced)


def test_exact_strategy_counters(topology):
    steps = 5
    flat, hier = make_reducer("flat", topology), make_reducer("hierarchical", topology)
    counts = make_counts("unequal")
    synced = []
    for _ in range(2):  # twice, with a reset in between
        flat.reset_counters()
        hier.reset_counters()
        for step in range(1, steps + 1):
            for reducer in (flat, hier):
                reduce(reducer, local_grad(RANK), counts[RANK])
                synced.append(reducer.after_step(np.zeros(N), [], ZERO_FLAGS, step))
    nbytes = (N + SLOTS) * 8
    world_calls = steps * (P > 1)
    intra_calls = 2 * steps * (topology.local_size > 1)
    inter_calls = steps * (topology.is_leader and topology.num_nodes > 1)
    none = {"calls": 0, "bytes": 0}
    ok = all(s is None for s in synced)  # exact strategies never need a parameter sync
    ok = ok and flat.counters == {"intra": none, "inter": none, "control": none,
                                  "world": {"calls": world_calls, "bytes": world_calls * nbytes}}
    ok = ok and hier.counters == {"intra": {"calls": intra_calls, "bytes": intra_calls * nbytes},
                                  "inter": {"calls": inter_calls, "bytes": inter_calls * nbytes},
                                  "world": none, "control": none}
    ok = ok and flat.comm_seconds >= 0 and hier.comm_seconds >= 0
    assert everywhere(ok)


def test_emulated_link_sleeps_the_modelled_time_on_the_inter_node_level():
    topo = build_topology("halves")
    link = LinkModel(latency_us=1.0, gbit_s=100.0)  # microseconds: the test stays fast
    hier = make_reducer("hierarchical", topo, emulate_link=link)
    flat = make_reducer("flat", topo, emulate_link="1,100")
    node = make_reducer("node", topo, sync_every=2, emulate_link=link)
    counts = make_counts("unequal")
    params = np.zeros(N)
    for step in range(1, 5):
        for reducer in (hier, flat, node):
            reduce(reducer, local_grad(RANK), counts[RANK])
            reducer.after_step(params, [], ZERO_FLAGS, step)
    nbytes = (N + SLOTS) * 8
    multi = topo.num_nodes > 1
    per_inter = link.allreduce_seconds(nbytes, topo.num_nodes)
    expect_hier = 4 * per_inter if topo.is_leader and multi else 0.0
    expect_flat = 4 * link.allreduce_seconds(nbytes, P) if multi else 0.0
    expect_node = 2 * per_inter if topo.is_leader and multi else 0.0
    ok = all(math.isclose(r.emulated_seconds, e, rel_tol=1e-9, abs_tol=1e-15)
             for r, e in ((hier, expect_hier), (flat, expect_flat), (node, expect_node)))
    ok = ok and all(r.comm_seconds >= r.emulated_seconds for r in (hier, flat, node))
    ok = ok and "EMULATED" in hier.describe()
    topo.free()
    assert everywhere(ok)


# ----------------------------------------------------------------------------- bad input
def test_make_reducer_refuses_bad_arguments():
    topo = build_topology("one")
    for kwargs, match in [
        (dict(strategy="ring"), "unknown strategy 'ring'.*flat, hierarchical, node"),
        (dict(strategy="flat", weighting="mean"), "unknown weighting"),
        (dict(strategy="node", sync_every=0), "sync_every"),
        (dict(strategy="node", sync_every=2.5), "sync_every"),
        (dict(strategy="flat", emulate_link=3), "emulate_link"),
        (dict(strategy="flat", emulate_link="1"), "LATENCY_US,GBIT_S"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_reducer(topology=topo, **kwargs)
    topo.free()


def test_reduce_gradients_refuses_bad_input_on_every_rank_before_communicating():
    topo = build_topology("launch")
    for cls in (FlatReducer, HierarchicalReducer, NodeReducer):
        reducer = cls(topo)
        for message, count, match in [
            (np.zeros(N + SLOTS), -1, "count must be an integer >= 0"),
            (np.zeros(N + SLOTS), 1.5, "count must be an integer >= 0"),
            (np.zeros(N + SLOTS), True, "count must be an integer >= 0"),
            (np.zeros((2, N + SLOTS)), 1, "1-D"),
            (np.zeros(2 * (N + SLOTS))[::2], 1, "contiguous"),
            (np.zeros(SLOTS), 1, "slots"),
        ]:
            with pytest.raises(ValueError, match=match):
                reducer.reduce_gradients(message, count)
        assert sum(c["calls"] for c in reducer.counters.values()) == 0
    topo.free()
