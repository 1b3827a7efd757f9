"""MPI tests of the exchanges (the strategies) against NumPy references; any world size.

mpiexec -n 4 -hosts localhost:2,127.0.0.1:2 -launcher fork python -m pytest --with-mpi -q tests/mpi   (MPICH)
MPIDL_RANKS_PER_NODE=2 mpiexec -n 4 --oversubscribe python -m pytest --with-mpi -q tests/mpi  (Open MPI)
(bash tests/run_all.sh mpi runs every launch of these tests, for the MPI of mpi4py.)

Rank r's local mean gradient and its sample count are deterministic functions of r, so every
rank can compute the expected reduced result itself. Each rank hands the exchange only its own
message ``[g_r | c_r | stop | nonfinite]``, with its weight ``c_r`` written in as
:class:`~mpidl.distributed.DataParallel` writes it (balanced: its samples ``b_r``; uniform: 1);
results are gathered on all ranks before asserting, so a failure on one rank never leaves the
others waiting in a collective (and no collective is ever skipped by a rank-local ``and``: a
check that failed on one rank would leave the others waiting in it).
"""

import math
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed import DataParallel, Flat, Hierarchical, Node, OptionError, make_exchange
from mpidl.distributed.channel import Channel, Traffic
from mpidl.distributed.emulation import EmulatedLink, LinkModel
from mpidl.distributed.message import COUNT, NONFINITE, SLOTS, STOP
from mpidl.distributed.topology import Topology
from mpidl.engine.backend import get_backend
from mpidl.engine.optim import SGD
from mpidl.engine.params import FlatParameters, Parameter, zeros

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
N = 13  # gradient length (odd on purpose)
TOL = 1e-12
ZERO_FLAGS = (0.0, 0.0)

# How the world is cut into nodes: the launch's own (shared memory or MPIDL_RANKS_PER_NODE),
# one rank per node, two halves (2 nodes whenever P >= 2; unequal 2+1 for P = 3), one node,
# and unequal nodes of P-1 and 1 ranks (3+1 for P = 4).
LAYOUTS = ["launch", 1, "halves", "one", "unequal"]


def build_topology(layout) -> Topology:
    if layout == "launch":
        return Topology.from_comm()
    k = {"halves": max(1, math.ceil(P / 2)), "one": P, "unequal": max(1, P - 1)}.get(layout, layout)
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


def weight(count: int, weighting: str) -> int:
    """``c_r``, as DataParallel writes it into the message."""
    return count if weighting == "balanced" else 1


def message_of(grad, count, weighting="balanced", stop=0.0, nonfinite=0.0) -> np.ndarray:
    """``[grad | c | stop | nonfinite]`` as FlatParameters.message holds it at a step."""
    message = np.zeros(grad.size + SLOTS, dtype=grad.dtype)
    message[:grad.size] = grad
    message[COUNT], message[STOP], message[NONFINITE] = weight(count, weighting), stop, nonfinite
    return message


def reduce(exchange, grad, count, weighting="balanced", **flags) -> np.ndarray:
    """Reduce ``grad`` (this rank's, with its ``count``) and return the whole message."""
    message = message_of(grad, count, weighting, **flags)
    exchange.reduce(message)
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


def node_weights(topology, counts_per_step, weighting) -> np.ndarray:
    """``v_n``: every node's summed weights over the steps (balanced: its samples; uniform:
    its ranks x steps)."""
    v = np.zeros(topology.num_nodes)
    for counts in counts_per_step:
        for r, c in enumerate(counts):
            v[topology.node_of_rank[r]] += weight(c, weighting)
    return v


# ----------------------------------------------------------------------------- the naive reference
def vector_params() -> FlatParameters:
    return FlatParameters([("w", Parameter((N,), zeros()))], get_backend("cpu", "float64"))


@pytest.mark.parametrize("strategy", ["flat", "hierarchical", "node"])
@pytest.mark.parametrize("weighting", ["balanced", "uniform"])
def test_naive_reference_every_ranks_gradient_is_its_rank(topology, strategy, weighting):
    """ChainerMN's test of a communicator: every element of rank r's gradient is r, so the
    reduced gradient must be the weighted mean ``m = sum_r c_r r / sum_r c_r`` (balanced: r + 1
    samples on rank r; uniform: 1), through DataParallel and plain SGD, twice (a second step
    catches what only the first call sets up). Node with K' = 1: a node's gradient is its
    own ranks' weighted mean, and the parameter sync after every step gives every replica
    ``theta - lr m``, the flat step."""
    counts = [r + 1 for r in range(P)]
    c = np.array([weight(b, weighting) for b in counts], dtype=np.float64)
    world_mean = float(c @ np.arange(P) / c.sum())
    mine = topology.node_ranks
    node_mean = float(sum(c[r] * r for r in mine) / sum(c[r] for r in mine))
    group_mean = node_mean if strategy == "node" and topology.num_nodes > 1 else world_mean
    params = vector_params()
    lr = 0.5
    dp = DataParallel(params, SGD(params, lr=lr), batch_size=sum(counts), weighting=weighting,
                      exchange=make_exchange(topology, strategy, sync_every=1))
    ok = True
    for k in (1, 2):
        params.grad.fill(float(RANK))
        synced = dp.step(counts[RANK])
        ok = ok and max_error(params.grad, np.full(N, group_mean)) < TOL
        ok = ok and max_error(params.data, np.full(N, -k * lr * world_mean)) < TOL
        ok = ok and synced == (strategy == "node" and topology.num_nodes > 1)
        same = [all_identical(WORLD, params.data), all_identical(topology.node, params.grad)]  # every rank
        ok = ok and all(same)
    assert everywhere(ok and dp.steps == 2)


# ----------------------------------------------------------------------------- exact strategies
@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
@pytest.mark.parametrize("weighting", ["balanced", "uniform"])
@pytest.mark.parametrize("pattern", ["unequal", "zero"])  # 'equal': see balanced == uniform
def test_exact_strategies_give_the_weighted_mean(topology, strategy, weighting, pattern):
    exchange = make_exchange(topology, strategy)
    errors, identical, totals = [], [], []
    for round_ in range(2):  # twice: catches state left over from the first call
        counts = make_counts(pattern, round_)
        grads = all_grads(counts, round_)
        message = reduce(exchange, grads[RANK].copy(), counts[RANK], weighting)
        errors.append(max_error(message[:N], weighted_sum(grads, counts, range(P), weighting)))
        identical.append(all_identical(WORLD, message))
        totals.append(message[COUNT] == (sum(counts) if weighting == "balanced" else P))
    assert everywhere(max(errors) < TOL and all(totals)), errors
    assert all(identical)  # every replica receives the very same bits


def test_flat_equals_hierarchical(topology):
    counts = make_counts("unequal")
    results = [reduce(cls(topology), local_grad(RANK), counts[RANK]) for cls in (Flat, Hierarchical)]
    assert everywhere(max_error(*results) < TOL)


def test_one_rank_group_changes_no_bit():
    """A world of one exchanges nothing and scales nothing: the plain loop's gradient."""
    topo = Topology.from_comm(MPI.COMM_SELF)
    grad = local_grad(RANK)
    for cls in (Flat, Hierarchical, Node):
        exchange = cls(topo)
        message = reduce(exchange, grad.copy(), 7)
        assert message[:N].tobytes() == grad.tobytes() and message[COUNT] == 7
        assert sum(level["calls"] for level in exchange.traffic.counts.values()) == 0
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
    results = {w: reduce(Flat(topo), samples[RANK].mean(axis=0), counts[RANK], w)[:N]
               for w in ("balanced", "uniform")}
    topo.free()
    assert everywhere(max_error(results["balanced"], large_batch) < TOL)
    assert everywhere(max_error(results["uniform"], large_batch) > 1e-3)


@pytest.mark.parametrize("strategy", ["flat", "hierarchical", "node"])
def test_balanced_equals_uniform_with_equal_counts(topology, strategy):
    counts = make_counts("equal")
    results = [reduce(make_exchange(topology, strategy), local_grad(RANK), counts[RANK], w)[:N]
               for w in ("balanced", "uniform")]
    assert everywhere(max_error(*results) < TOL)


def test_float32_messages_keep_their_dtype(topology):
    counts = make_counts("unequal")
    grads = all_grads(counts, dtype=np.float32)
    exchange = make_exchange(topology, "hierarchical")
    message = reduce(exchange, grads[RANK].copy(), counts[RANK])
    ok = message.dtype == np.float32 and max_error(message[:N], weighted_sum(grads, counts, range(P),
                                                                             "balanced")) < 1e-5
    counts_ = exchange.traffic.counts
    calls = sum(level["calls"] for level in counts_.values())
    ok = ok and sum(level["bytes"] for level in counts_.values()) == calls * 4 * (N + SLOTS)
    assert everywhere(ok)


@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
def test_exact_strategies_sum_the_flags_over_the_world(topology, strategy):
    """The stop slot reaches every rank with the gradient: a world-wide decision per step."""
    exchange = make_exchange(topology, strategy)
    message = reduce(exchange, local_grad(RANK), 1, stop=float(RANK == P - 1), nonfinite=float(RANK == 0))
    ok = message[STOP] == 1.0 and message[NONFINITE] == 1.0 and exchange.exact
    assert everywhere(ok)


def test_exact_strategies_refuse_a_step_without_samples(topology):
    for strategy in ("flat", "hierarchical"):
        with pytest.raises(ValueError, match="no rank computed a sample"):
            reduce(make_exchange(topology, strategy), np.zeros(N), 0)


# ----------------------------------------------------------------------------- node strategy
@pytest.mark.parametrize("weighting", ["balanced", "uniform"])
@pytest.mark.parametrize("pattern", ["unequal", "zero"])
def test_node_strategy_reduces_gradients_within_the_node(topology, weighting, pattern):
    exchange = make_exchange(topology, "node", sync_every=1000)
    errors, identical_in_node = [], []
    for round_ in range(2):
        counts = make_counts(pattern, round_)
        grads = all_grads(counts, round_)
        message = reduce(exchange, grads[RANK].copy(), counts[RANK], weighting)
        errors.append(max_error(message[:N], weighted_sum(grads, counts, topology.node_ranks, weighting)))
        identical_in_node.append(all_identical(topology.node, message))
    assert everywhere(max(errors) < TOL and all(identical_in_node))


def test_node_strategy_flags_stay_in_the_node_until_a_sync(topology):
    exchange = make_exchange(topology, "node", sync_every=1000)
    stopper = P - 1
    message = reduce(exchange, local_grad(RANK), 1, stop=float(RANK == stopper))
    in_my_node = stopper in topology.node_ranks
    ok = message[STOP] == float(in_my_node) and exchange.exact == (topology.num_nodes == 1)
    flags = (float(message[STOP]), 0.0)
    world = exchange.synchronize(np.zeros(N), [], flags)  # a sync spreads them to the world
    ok = ok and world[0] > 0 and world[1] == 0
    assert everywhere(ok)


def test_node_strategy_with_one_node_is_flat_without_inter_node_traffic():
    topo = build_topology("one")
    node, flat = make_exchange(topo, "node", sync_every=2), make_exchange(topo, "flat")
    params = np.ones(N)
    errors, synced = [], []
    for step in range(1, 5):
        counts = make_counts("unequal", step)
        a = reduce(node, local_grad(RANK, step), counts[RANK])
        b = reduce(flat, local_grad(RANK, step), counts[RANK])
        errors.append(max_error(a, b))
        synced.append(node.after_step(step, params, [], ZERO_FLAGS))
    node.synchronize(params, [], ZERO_FLAGS)
    topo.free()
    counters = node.traffic.counts
    ok = max(errors) < TOL and all(s is None for s in synced) and node.exact
    ok = ok and counters["inter"]["calls"] == 0 and counters["world"]["calls"] == 0
    # one node-local allreduce per step (none at all with one rank), one flag exchange at the end
    ok = ok and counters["intra"]["calls"] == (4 if P > 1 else 0)
    ok = ok and counters["control"]["calls"] == (1 if P > 1 else 0)
    assert everywhere(ok)


def sgd_run(exchange, steps, lr=0.1, pattern="unequal"):
    """Train a toy model with plain SGD (p -= lr g); the gradient depends on the parameters,
    so replicas that drift apart would show. Returns the parameters after each step and
    whether after_step reported a sync."""
    params = np.linspace(-1.0, 1.0, N)
    history = []
    for step in range(1, steps + 1):
        counts = make_counts(pattern, step)
        grad = local_grad(RANK, step) + 0.5 * params if counts[RANK] else np.zeros(N)
        params -= lr * reduce(exchange, grad, counts[RANK])[:N]
        synced = exchange.after_step(step, params, [], ZERO_FLAGS) is not None
        history.append((params.copy(), synced))
    return history


@pytest.mark.parametrize("pattern", ["unequal", "zero"])
def test_node_strategy_syncing_every_step_equals_flat(topology, pattern):
    node_history = sgd_run(make_exchange(topology, "node", sync_every=1), steps=6, pattern=pattern)
    flat_history = sgd_run(make_exchange(topology, "flat"), steps=6, pattern=pattern)
    errors = [max_error(a, b) for (a, _), (b, _) in zip(node_history, flat_history)]
    identical = [all_identical(WORLD, p) for p, _ in node_history]
    synced = [s for _, s in node_history]
    ok = max(errors) < TOL and all(identical)
    ok = ok and all(synced) == (topology.num_nodes > 1)
    assert everywhere(ok), errors


def test_node_strategy_parameter_sync_is_the_node_weighted_average(topology):
    """Between syncs nodes drift apart; at a sync the leaders average the parameters with
    weights S_n / S (samples per node since the last sync) and all replicas become equal.
    (Between syncs, the consensus a checkpoint keeps is that average too: see
    test_data_parallel.py, test_consensus_between_syncs_is_the_node_weighted_average.)"""
    sync_every = 3
    exchange = make_exchange(topology, "node", sync_every=sync_every)
    params = np.linspace(-1.0, 1.0, N)
    samples_per_node = np.zeros(topology.num_nodes)
    leaders = [topology.ranks_of_node(n)[0] for n in range(topology.num_nodes)]
    ok = True
    for step in range(1, 2 * sync_every + 2):
        counts = make_counts("unequal", step)
        for r, c in enumerate(counts):
            samples_per_node[topology.node_of_rank[r]] += c
        params -= 0.1 * reduce(exchange, local_grad(RANK, step) + 0.5 * params, counts[RANK])[:N]
        # before the sync: every rank's parameters, one node's replicas identical
        before = np.array(WORLD.allgather(params))
        ok = all_identical(topology.node, params) and ok  # the collective first: on every rank
        ok = ok and exchange.weight_since_sync == samples_per_node[topology.node_id]
        expected = sum(w * before[r] for w, r in zip(samples_per_node / samples_per_node.sum(), leaders))
        synced = exchange.after_step(step, params, [], ZERO_FLAGS) is not None
        ok = ok and synced == (step % sync_every == 0 and topology.num_nodes > 1)
        if synced:
            ok = all_identical(WORLD, params) and ok and max_error(params, expected) < TOL
            ok = ok and exchange.weight_since_sync == 0 and exchange.steps_since_sync == 0
            samples_per_node[:] = 0
    # after the steps (one past a sync), a forced sync makes all replicas equal
    exchange.synchronize(params, [], ZERO_FLAGS)
    ok = all_identical(WORLD, params) and ok
    assert everywhere(ok)


@pytest.mark.parametrize("weighting", ["balanced", "uniform"])
def test_node_strategy_parameter_weights_are_the_nodes_summed_weights(topology, weighting):
    """``v_n`` = the node's summed ``c_i`` since the last sync: its samples (balanced), its
    ranks x steps (uniform; no longer 1 per node). On unequal nodes (2 + 1, 3 + 1) the
    uniform average is then NOT the plain mean of the nodes' parameters: a node of more ranks
    counts more, as it would in the flat uniform average of its ranks."""
    exchange = make_exchange(topology, "node", sync_every=1000)
    params = np.full(N, float(topology.node_id))  # node n holds n everywhere
    steps = [make_counts("unequal", round_) for round_ in range(3)]
    for step, counts in enumerate(steps, start=1):
        reduce(exchange, local_grad(RANK, step), counts[RANK], weighting)
        assert exchange.after_step(step, params, [], ZERO_FLAGS) is None  # no sync yet
    v = node_weights(topology, steps, weighting)
    ok = exchange.weight_since_sync == v[topology.node_id] and exchange.steps_since_sync == 3
    if weighting == "uniform":
        ok = ok and v.tolist() == [3.0 * s for s in topology.node_sizes]
    exchange.synchronize(params, [], ZERO_FLAGS)
    expected = float(v @ np.arange(topology.num_nodes) / v.sum()) if topology.num_nodes > 1 else 0.0
    ok = all_identical(WORLD, params) and ok and max_error(params, np.full(N, expected)) < TOL
    if weighting == "uniform" and len(set(topology.node_sizes)) > 1:
        ok = ok and abs(expected - (topology.num_nodes - 1) / 2) > 1e-3  # not the mean of 0 .. L-1
    ok = ok and (topology.num_nodes == 1 or exchange.weight_since_sync == 0 and exchange.steps_since_sync == 0)
    assert everywhere(ok)


def test_optimizer_state_travels_with_the_parameters_and_the_same_weights(topology):
    exchange = make_exchange(topology, "node", sync_every=1, sync_optimizer_state=True)
    counts = make_counts("unequal")
    reduce(exchange, local_grad(RANK), counts[RANK])
    momentum = np.full(N, 1.0 + topology.node_id)
    second = np.full(N, 10.0 * (1 + topology.node_id))
    params = np.full(N, float(topology.node_id))
    exchange.after_step(1, params, [momentum, second], ZERO_FLAGS)
    node_totals = np.array([sum(counts[r] for r in topology.ranks_of_node(n)) for n in range(topology.num_nodes)])
    weights = node_totals / node_totals.sum()
    ids = np.arange(topology.num_nodes)
    if topology.num_nodes == 1:  # no sync at all: every buffer keeps its value
        weights = np.ones(1)
    ok = max_error(momentum, np.full(N, weights @ (1.0 + ids))) < TOL
    ok = ok and max_error(second, np.full(N, weights @ (10.0 * (1 + ids)))) < TOL
    ok = ok and max_error(params, np.full(N, weights @ ids)) < TOL
    ok = all_identical(WORLD, momentum) & all_identical(WORLD, second) and ok
    inter = exchange.traffic.counts["inter"]
    ok = ok and inter["calls"] == int(topology.is_leader and topology.num_nodes > 1)
    assert everywhere(ok)


def test_optimizer_state_stays_per_node_without_sync_optimizer_state(topology):
    exchange = make_exchange(topology, "node", sync_every=1)
    reduce(exchange, local_grad(RANK), make_counts("unequal")[RANK])
    momentum = np.full(N, 1.0 + topology.node_id)
    params = np.full(N, float(topology.node_id))
    exchange.after_step(1, params, [momentum], ZERO_FLAGS)
    ok = all_identical(WORLD, params) and np.array_equal(momentum, np.full(N, 1.0 + topology.node_id))
    assert everywhere(ok)


# ----------------------------------------------------------------------------- counters
def test_node_strategy_counters_two_nodes_100_steps():
    """K' = 50 over 100 steps on 2 nodes: 100 node allreduces and 2 parameter syncs
    (each: one leaders' allreduce and one node broadcast), plus one per forced sync."""
    if P < 2:
        pytest.skip("needs 2 nodes")
    topo = build_topology("halves")
    exchange = make_exchange(topo, "node", sync_every=50)
    params = np.zeros(N)
    counts = make_counts("equal")
    syncs = 0
    for step in range(1, 101):
        reduce(exchange, local_grad(RANK), counts[RANK])
        syncs += exchange.after_step(step, params, [], ZERO_FLAGS) is not None
    after_steps = {level: dict(c) for level, c in exchange.traffic.counts.items()}
    reduce(exchange, local_grad(RANK), counts[RANK])
    exchange.after_step(101, params, [], ZERO_FLAGS)
    exchange.synchronize(params, [], ZERO_FLAGS)
    after_forced = {level: dict(c) for level, c in exchange.traffic.counts.items()}
    exchange.traffic.reset()
    after_reset = exchange.traffic.counts
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
                               after_reset == zero and exchange.traffic.seconds == 0.0))
    assert results == [(2, True, True, True)] * P, (after_steps, after_forced)


def test_exact_strategy_counters(topology):
    steps = 5
    flat, hier = make_exchange(topology, "flat"), make_exchange(topology, "hierarchical")
    counts = make_counts("unequal")
    synced = []
    for _ in range(2):  # twice, with a reset in between
        flat.traffic.reset()
        hier.traffic.reset()
        for step in range(1, steps + 1):
            for exchange in (flat, hier):
                reduce(exchange, local_grad(RANK), counts[RANK])
                synced.append(exchange.after_step(step, np.zeros(N), [], ZERO_FLAGS))
    nbytes = (N + SLOTS) * 8
    world_calls = steps * (P > 1)
    intra_calls = 2 * steps * (topology.local_size > 1)
    inter_calls = steps * (topology.is_leader and topology.num_nodes > 1)
    none = {"calls": 0, "bytes": 0}
    ok = all(s is None for s in synced)  # exact strategies never need a parameter sync
    ok = ok and flat.traffic.counts == {"intra": none, "inter": none, "control": none,
                                        "world": {"calls": world_calls, "bytes": world_calls * nbytes}}
    ok = ok and hier.traffic.counts == {"intra": {"calls": intra_calls, "bytes": intra_calls * nbytes},
                                        "inter": {"calls": inter_calls, "bytes": inter_calls * nbytes},
                                        "world": none, "control": none}
    ok = ok and flat.traffic.seconds >= 0 and hier.traffic.seconds >= 0
    assert everywhere(ok)


def test_emulated_link_sleeps_the_modelled_time_on_the_inter_node_level():
    topo = build_topology("halves")
    link = LinkModel(latency_us=1.0, gbit_s=100.0)  # microseconds: the test stays fast
    hier = make_exchange(topo, "hierarchical", emulate_link=link)
    flat = make_exchange(topo, "flat", emulate_link="1,100")
    node = make_exchange(topo, "node", sync_every=2, emulate_link=link)
    counts = make_counts("unequal")
    params = np.zeros(N)
    for step in range(1, 5):
        for exchange in (hier, flat, node):
            reduce(exchange, local_grad(RANK), counts[RANK])
            exchange.after_step(step, params, [], ZERO_FLAGS)
    nbytes = (N + SLOTS) * 8
    multi = topo.num_nodes > 1
    per_inter = link.allreduce_seconds(nbytes, topo.num_nodes)
    expect_hier = 4 * per_inter if topo.is_leader and multi else 0.0
    expect_flat = 4 * link.allreduce_seconds(nbytes, P) if multi else 0.0
    expect_node = 2 * per_inter if topo.is_leader and multi else 0.0
    ok = all(math.isclose(e.traffic.emulated_seconds, x, rel_tol=1e-9, abs_tol=1e-15)
             for e, x in ((hier, expect_hier), (flat, expect_flat), (node, expect_node)))
    ok = ok and all(e.traffic.seconds >= e.traffic.emulated_seconds for e in (hier, flat, node))
    # the log names the emulation wherever it acts (several nodes), alike on every rank
    ok = ok and all(("EMULATED" in e.describe()) == multi for e in (hier, flat, node))
    topo.free()
    assert everywhere(ok)


def test_emulated_link_around_a_channel_counts_as_the_channel_and_sleeps_the_model():
    """``EmulatedLink`` wraps a channel: the collectives are the channel's (same results,
    same counters), and after a blocking allreduce / allgather over L > 1 ranks it sleeps the
    link model's time, counted as emulated; reduce and broadcast are not stretched; a
    non-blocking allreduce completes at its modelled deadline."""
    link = LinkModel(latency_us=300.0, gbit_s=10.0)  # ~1 ms per collective: measurable
    traffic = Traffic()
    channel = EmulatedLink(Channel("world", WORLD, traffic), link)
    data = np.full(N + SLOTS, float(RANK + 1))
    nbytes = data.nbytes
    start = time.perf_counter()
    channel.allreduce(data)
    wall = time.perf_counter() - start
    model = link.allreduce_seconds(nbytes, P)
    ok = np.all(data == P * (P + 1) / 2) and traffic.emulated_seconds == model and wall >= model
    ok = ok and traffic.counts["world"] == {"calls": int(P > 1), "bytes": nbytes * (P > 1)}
    ok = ok and traffic.seconds >= traffic.emulated_seconds and channel.level == "world" and channel.size == P
    channel.reduce(data)
    channel.bcast(data)
    ok = ok and traffic.emulated_seconds == model and traffic.counts["world"]["calls"] == 3 * (P > 1)
    gathered = np.zeros((P, 2))
    channel.allgather(np.array([RANK, 1.0]), gathered)
    model += link.allgather_seconds(16, P)
    ok = ok and gathered[:, 0].tolist() == list(range(P)) and math.isclose(traffic.emulated_seconds, model)
    data[:] = 1.0
    request = channel.start("allreduce", data)
    if request is None:  # one rank: nothing to exchange, nothing to wait for
        ok = ok and P == 1
    else:
        begun = time.perf_counter()
        request.Wait()
        waited = time.perf_counter() - begun
        deadline_model = link.allreduce_seconds(nbytes, P)
        ok = ok and np.all(data == P) and traffic.emulated_seconds <= model + deadline_model + 1e-9
        ok = ok and waited >= traffic.emulated_seconds - model - 1e-9 and traffic.counts["world"]["calls"] == 5
    ok = ok and "EMULATED inter-node link" in channel.describe()
    assert everywhere(ok)


# ----------------------------------------------------------------------------- bad input
def test_make_exchange_refuses_bad_arguments():
    topo = build_topology("one")
    for kwargs, option, match in [
        (dict(strategy="ring"), "strategy", "unknown strategy 'ring'.*flat, hierarchical, node"),
        (dict(strategy="node", sync_every=0), "sync_every", "sync_every"),
        (dict(strategy="node", sync_every=2.5), "sync_every", "sync_every"),
        (dict(strategy="node", compress="bf16"), "compress", "compress"),
        (dict(strategy="flat", emulate_link=3), "emulate_link", "emulate_link"),
        (dict(strategy="flat", emulate_link="1"), "emulate_link", "LATENCY_US,GBIT_S"),
    ]:
        with pytest.raises(OptionError, match=match) as info:
            make_exchange(topology=topo, **kwargs)
        assert info.value.option == option
    topo.free()


def test_reduce_refuses_bad_messages_on_every_rank_before_communicating():
    """The message's shape is the exchange's to check (a bad ``local_count`` is refused by
    DataParallel.step: test_data_parallel.py)."""
    topo = build_topology("launch")
    for cls in (Flat, Hierarchical, Node):
        exchange = cls(topo)
        for message, match in [
            (np.zeros((2, N + SLOTS)), "1-D"),
            (np.zeros(2 * (N + SLOTS))[::2], "contiguous"),
            (np.zeros(SLOTS), "slots"),
        ]:
            with pytest.raises(ValueError, match=match):
                exchange.reduce(message)
        assert sum(c["calls"] for c in exchange.traffic.counts.values()) == 0
    topo.free()
