"""The public distributed API, ``DataParallel``, under mpiexec with any world size.

Each test is a small training loop of the kind a user writes (a tiny float64 ``hsicnn``, the
softmax cross-entropy, SGD), run on ``MPI.COMM_WORLD`` and, as the reference, on
``MPI.COMM_SELF`` over the same global batches. Every rank asserts only after a collective
agreement, so a failure on one rank never leaves the others waiting.

Two ways to build one, both tested here: the core composed by hand, ``DataParallel(model,
optimizer, batch_size=, exchange=, split=, clock=)``, and the options path
``mpidl.distributed.data_parallel(model, optimizer, batch_size=, strategy=, speeds=, ...)``
(:func:`make`), which returns the same composed core. A custom exchange (any object with the
interface of :mod:`mpidl.distributed.exchange`) drives the core like the built-in ones.
"""

import math
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.engine.backend import get_backend
from mpidl.distributed import (DataParallel, FixedSplit, Flat, Hierarchical, MeasuredSplit, Node, NonFiniteGradient,
                               Topology, data_parallel)
from mpidl.distributed.channel import Channel, Traffic
from mpidl.distributed.clock import ComputeClock
from mpidl.distributed.checkpoint import load_state_dict, state_dict
from mpidl.distributed.emulation import compute_clock
from mpidl.distributed.message import COUNT, check_message
from mpidl.distributed.split.balance import equal_split
from mpidl.distributed.split.probe import PROBE_ROUNDS, probe_sizes
from mpidl.engine.models import build_model
from mpidl.engine.nn import SoftmaxCrossEntropy
from mpidl.engine.optim import SGD, Adam
from trainer_harness import all_agree, tiny_dataset

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
BACKEND = get_backend("cpu", "float64")
DATA = tiny_dataset(n=40)
B = 4 * P + 2  # uneven on purpose
UNEVEN = [float(r + 1) for r in range(P)]


def tiny_model(seed=3):
    return build_model("hsicnn", DATA.sample_shape, DATA.num_classes, backend=BACKEND, seed=seed,
                       channels=(4, 4), hidden=8)


def make(comm=WORLD, ranks_per_node=None, optimizer=SGD, seed=3, **kwargs):
    """A tiny model and its DataParallel from options (``data_parallel``) on ``comm``."""
    model = tiny_model(seed)
    opt = make_optimizer(optimizer, model)
    topo = Topology.from_comm(comm, ranks_per_node=ranks_per_node)
    kwargs.setdefault("batch_size", B)
    return model, data_parallel(model, opt, topology=topo, **kwargs)


def make_optimizer(optimizer, model):
    return optimizer(model.params, lr=0.05, **({"momentum": 0.9} if optimizer is SGD else {}))


def batches(steps, seed=0):
    """The same global batches on every rank (a pure function of the seed)."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(DATA.num_samples)[:B] for _ in range(steps)]


#: seconds per sample that the HDP tests add to a step, so that its cost dominates the jitter
#: of a tiny model's microsecond steps on a loaded machine (sleep is not CPU)
SLEEP_PER_SAMPLE = 0.002


def train(model, dp, steps, loss_fn=None, seed=0, sleep_per_sample=0.0):
    """The loop of the README: local slice, forward, backward, dp.step."""
    loss_fn = loss_fn or SoftmaxCrossEntropy()
    for batch in batches(steps, seed):
        local = dp.local_indices(batch)
        if len(local):
            x, y = DATA.read(local)
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward())
            time.sleep(sleep_per_sample * len(local))
        else:
            model.params.grad.fill(0)
        dp.step(len(local))
    return model.params.data.copy()


def rel_diff(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def two_nodes():
    return max(1, math.ceil(P / 2))


# ------------------------------------------------------------------ set-up and split
def test_construction_broadcasts_rank_0s_parameters():
    model, dp = make(seed=RANK)  # every rank draws different initial weights
    reference = tiny_model(seed=0).params.data
    assert all_agree(WORLD, np.array_equal(model.params.data, reference))


def test_local_indices_split_every_batch_in_rank_order():
    _, dp = make(speeds=UNEVEN)
    full = np.arange(100, 100 + B)
    short = np.arange(7)  # a last, smaller batch: the same proportions, zeros allowed
    gathered = WORLD.allgather((dp.local_indices(full), dp.local_indices(short)))
    ok = np.array_equal(np.concatenate([g[0] for g in gathered]), full)
    ok = ok and np.array_equal(np.concatenate([g[1] for g in gathered]), short)
    ok = ok and [len(g[0]) for g in gathered] == dp.batch_sizes == dp.split.counts(B) and sum(dp.batch_sizes) == B
    ok = ok and [len(g[1]) for g in gathered] == dp.split.counts(7)
    ok = ok and dp.split.speeds == UNEVEN and dp.split.source == "given"
    assert all_agree(WORLD, ok)


def test_shard_covers_n_items_once():
    _, dp = make()
    shards = WORLD.allgather(dp.shard(11))
    assert shards[0][0] == 0 and shards[-1][1] == 11
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))


# ------------------------------------------------------------------ the step equals one process
@pytest.mark.parametrize("strategy, kwargs, ranks_per_node", [
    ("flat", {}, None),
    ("hierarchical", {}, None),
    ("hierarchical", {}, 1),
    ("node", {"sync_every": 3}, P),  # one node: the flat scheme
])
def test_custom_loop_equals_one_process(strategy, kwargs, ranks_per_node):
    model, dp = make(strategy=strategy, speeds=UNEVEN, ranks_per_node=ranks_per_node, **kwargs)
    distributed = train(model, dp, steps=5)
    ref_model, ref_dp = make(comm=MPI.COMM_SELF, strategy=strategy, **kwargs)
    reference = train(ref_model, ref_dp, steps=5)
    diff = rel_diff(distributed, reference)
    assert all_agree(WORLD, diff <= 1e-10), f"{strategy}: {diff:.3e}"
    assert all_agree(WORLD, dp.steps == 5 and dp.exchange.exact)


@pytest.mark.parametrize("exchange_class", [Flat, Hierarchical, lambda topo: Node(topo, sync_every=3)],
                         ids=["flat", "hierarchical", "node"])
def test_the_core_composed_by_hand_equals_the_options_path(exchange_class):
    """``DataParallel(model, opt, exchange=, split=)`` is what ``data_parallel`` returns: the
    same parts give the same bits (node: the launch's own nodes, K' = 3)."""
    model = tiny_model()
    topo = Topology.from_comm(WORLD)
    exchange = exchange_class(topo)
    dp = DataParallel(model, make_optimizer(SGD, model), batch_size=B, exchange=exchange,
                      split=FixedSplit(B, P, UNEVEN))
    by_hand = train(model, dp, steps=5)
    dp.sync()
    options_model, options_dp = make(strategy=exchange.name, sync_every=3, speeds=UNEVEN)
    by_options = train(options_model, options_dp, steps=5)
    options_dp.sync()
    same = np.array_equal(model.params.data, options_model.params.data) and np.array_equal(by_hand, by_options)
    same = same and type(options_dp.exchange) is type(exchange) and options_dp.batch_sizes == dp.batch_sizes
    assert all_agree(WORLD, same and dp.counters == options_dp.counters)


def test_min_local_batch_0_leaves_out_a_rank_too_slow_to_help():
    """Given speeds, the last rank a million times slower: by default it keeps one sample of
    each global batch; with min_local_batch=0 it gets none, joins every exchange with weight
    0, and the run still equals one process."""
    speeds = [1.0] * (P - 1) + [1e-6]
    _, default = make(speeds=speeds)
    model, dp = make(speeds=speeds, min_local_batch=0)
    assert sum(dp.batch_sizes) == B
    if P > 1:
        assert all_agree(WORLD, default.batch_sizes[-1] == 1 and dp.batch_sizes[-1] == 0
                         and min(dp.batch_sizes[:-1]) > 0)
    distributed = train(model, dp, steps=4)
    ref_model, ref_dp = make(comm=MPI.COMM_SELF)
    diff = rel_diff(distributed, train(ref_model, ref_dp, steps=4))
    assert all_agree(WORLD, diff <= 1e-10), f"{diff:.3e}"


@pytest.mark.parametrize("bad, message", [
    (-1, "min_local_batch must be an integer >= 0"),
    (1.5, "min_local_batch must be an integer >= 0"),
    (True, "min_local_batch must be an integer >= 0"),
    (B + 1, f"batch_size {B} is smaller than {B + 1} x {P} ranks: every rank needs at least {B + 1} samples"),
])
def test_min_local_batch_is_checked(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(min_local_batch=bad)


def test_two_objects_over_one_topology_train_independently():
    """A GAN's shape: two models, two optimizers, one topology, an exchange each, steps
    interleaved."""
    topo = Topology.from_comm(WORLD)
    models = [tiny_model(3), tiny_model(4)]
    dps = [DataParallel(m, SGD(m.params, lr=0.05, momentum=0.9), batch_size=B, exchange=Flat(topo),
                        split=FixedSplit(B, P, UNEVEN)) for m in models]
    refs = [tiny_model(3), tiny_model(4)]
    alone = Topology.from_comm(MPI.COMM_SELF)
    ref_dps = [DataParallel(m, SGD(m.params, lr=0.05, momentum=0.9), batch_size=B, exchange=Flat(alone))
               for m in refs]
    loss_fn = SoftmaxCrossEntropy()
    for batch in batches(4):
        for group in ((models, dps), (refs, ref_dps)):
            for model, dp in zip(*group):
                local = dp.local_indices(batch)
                x, y = DATA.read(local)
                loss_fn.forward(model.forward(x), y)
                model.backward(loss_fn.backward())
                dp.step()  # the count of the slice local_indices returned
    diffs = [rel_diff(m.params.data, r.params.data) for m, r in zip(models, refs)]
    assert all_agree(WORLD, max(diffs) <= 1e-10), diffs


# ------------------------------------------------------------------ a custom exchange
class GatherExchange:
    """An exchange written from the interface alone (``mpidl/distributed/exchange.py``),
    nothing inherited: every rank gathers every rank's weighted message with mpi4py's object
    ``allgather`` and sums them in rank order, so every replica gets the same bits. Exact:
    the step group is the world. Counts one ``world`` call per step, with ``traffic`` and
    ``control`` built from the public channel module."""

    name = "gather"
    exact = True

    def __init__(self, topology):
        self.topology = topology
        self.traffic = Traffic()
        self.control = Channel("control", topology.world, self.traffic)
        self.closed = False

    def describe(self) -> str:
        return "strategy gather (a test's own)"

    def reduce(self, message) -> bool:
        check_message(message)
        mine = message.copy()
        mine[:COUNT] *= mine[COUNT]
        everyone = self.topology.world.allgather(mine)
        self.traffic.add("world", message.nbytes)
        total = everyone[0].copy()
        for other in everyone[1:]:
            total += other
        if total[COUNT] == 0:
            raise ValueError("no rank computed a sample this step (every count was 0)")
        total[:COUNT] /= total[COUNT]
        message[...] = total
        return bool(np.isfinite(message[:COUNT]).all())

    def after_step(self, steps, params_data, state_buffers, flags):
        return None

    def synchronize(self, params_data, state_buffers, flags):
        buf = np.asarray(flags, dtype=np.float64).copy()
        self.control.allreduce(buf)
        return float(buf[0]), float(buf[1])

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_custom_exchange_is_all_the_core_needs():
    """A minimal exchange of the interface drives DataParallel: the same training as ``Flat``
    and as one process, identical replicas, the loop's small collectives (on its control
    channel), its counters, a checkpoint's state, a stop request agreed at a sync (the flags
    through its synchronize) and close."""
    topo = Topology.from_comm(WORLD)
    model = tiny_model()
    exchange = GatherExchange(topo)
    with DataParallel(model, make_optimizer(SGD, model), batch_size=B, exchange=exchange,
                      split=FixedSplit(B, P, UNEVEN)) as dp:
        custom = train(model, dp, steps=5)
        counted = dp.counters["world"] == {"calls": 5, "bytes": 5 * model.params.message.nbytes}
        flat_model, flat_dp = make(speeds=UNEVEN)
        flat = train(flat_model, flat_dp, steps=5)
        ref_model, ref_dp = make(comm=MPI.COMM_SELF)
        reference = train(ref_model, ref_dp, steps=5)
        ok = rel_diff(custom, flat) <= 1e-12 and rel_diff(custom, reference) <= 1e-10 and counted
        collectives = [len(set(WORLD.allgather(custom.tobytes()))) == 1, dp.any(RANK == 0), dp.all(True),
                       dp.sum(np.ones(1))[0] == P]  # on every rank, whatever ok is here
        ok = ok and all(collectives)
        state = state_dict(dp)
        ok = ok and (RANK != 0 or (state["strategy"] == "gather" and state["steps"] == 5 and state["nodes"] is None))
        if RANK == P - 1:
            dp.request_stop()
        dp.sync()  # the flags travel through synchronize
        ok = ok and dp.should_stop
    assert all_agree(WORLD, ok and exchange.closed)


# ------------------------------------------------------------------ collective decisions
@pytest.mark.parametrize("strategy, ranks_per_node", [("flat", None), ("hierarchical", None), ("node", P)])
def test_a_stop_request_on_one_rank_stops_every_rank_after_the_next_step(strategy, ranks_per_node):
    model, dp = make(strategy=strategy, ranks_per_node=ranks_per_node)
    stopped_at = None
    loss_fn = SoftmaxCrossEntropy()
    for t, batch in enumerate(batches(6)):
        x, y = DATA.read(dp.local_indices(batch))
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        dp.step()
        if t == 1 and RANK == P - 1:
            dp.request_stop()  # what the SIGTERM handler does
        if dp.should_stop:
            stopped_at = t
            break
    assert WORLD.allgather(stopped_at) == [2] * P


@pytest.mark.mpi(min_size=2)
def test_node_strategy_agrees_on_a_stop_at_the_next_sync():
    model, dp = make(strategy="node", sync_every=3, ranks_per_node=1)
    stops = []
    loss_fn = SoftmaxCrossEntropy()
    for t, batch in enumerate(batches(6)):
        x, y = DATA.read(dp.local_indices(batch))
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        synced = dp.step()
        if t == 0 and RANK == P - 1:
            dp.request_stop()
        stops.append((dp.should_stop, synced))
    # steps 1, 2 carry the flag only inside the node; the sync after step 3 spreads it
    assert WORLD.allgather(stops) == [[(False, False), (False, False), (True, True),
                                       (True, False), (True, False), (True, True)]] * P


@pytest.mark.parametrize("strategy, ranks_per_node", [("flat", None), ("node", P)])
def test_a_non_finite_gradient_raises_on_every_rank_at_the_same_step(strategy, ranks_per_node):
    model, dp = make(strategy=strategy, ranks_per_node=ranks_per_node)
    raised = None
    for t in range(3):
        model.params.grad.fill(0.1)
        if t == 1 and RANK == 0:
            model.params.grad[5] = np.nan
        try:
            dp.step(2)
        except NonFiniteGradient:
            raised = t
            break
    assert WORLD.allgather(raised) == [1] * P


def test_on_nan_skip_skips_the_update_everywhere():
    model, dp = make(on_nan="skip")
    before = model.params.data.copy()
    model.params.grad.fill(0.1)
    if RANK == P - 1:
        model.params.grad[0] = np.inf
    dp.step(2)
    assert all_agree(WORLD, dp.last_step_skipped and np.array_equal(model.params.data, before))
    model.params.grad.fill(0.1)
    dp.step(2)
    assert all_agree(WORLD, not dp.last_step_skipped and not np.array_equal(model.params.data, before))


@pytest.mark.mpi(min_size=2)
def test_node_strategy_raises_a_nodes_non_finite_gradient_at_the_next_sync():
    model, dp = make(strategy="node", sync_every=100, ranks_per_node=1)
    events = []
    for t in range(3):
        model.params.grad.fill(0.1)
        if t == 0 and RANK == 0:
            model.params.grad[5] = np.nan  # node 0 skips its update and remembers
        dp.step(2)
        events.append(dp.last_step_skipped)
    try:
        dp.sync()
        events.append("synced")
    except NonFiniteGradient:
        events.append("raised")
    expected = [[RANK == 0, False, False, "raised"]]
    assert WORLD.allgather(events == expected[0]) == [True] * P


def test_any_and_all():
    _, dp = make()
    results = (dp.any(RANK == P - 1), dp.all(RANK == P - 1), dp.all(True), dp.any(False))
    assert WORLD.allgather(results) == [(True, P == 1, True, False)] * P


# ------------------------------------------------------------------ consensus and state
@pytest.mark.mpi(min_size=2)
def test_consensus_between_syncs_is_the_node_weighted_average():
    """Between two syncs the state's ``params`` (what a checkpoint keeps, rank 0's
    ``state_dict``) is the nodes' sample-weighted average, and taking it leaves the replicas
    alone; the sync then gives every replica exactly that average."""
    model, dp = make(strategy="node", sync_every=100, ranks_per_node=1, speeds=UNEVEN)
    train(model, dp, steps=3)
    theirs = np.array(WORLD.allgather(model.params.data.copy()))
    samples = np.array(WORLD.allgather(dp.exchange.weight_since_sync), dtype=np.float64)
    expected = (samples[:, None] * theirs).sum(axis=0) / samples.sum()
    own = model.params.data.copy()
    consensus = WORLD.bcast(state_dict(dp), root=0)["params"]
    ok = rel_diff(consensus, expected) <= 1e-12 and np.array_equal(own, model.params.data)
    ok = ok and samples.tolist() == [3.0 * b for b in dp.batch_sizes]  # v_n = b_n x steps
    dp.sync()  # then every replica holds exactly that average
    ok = ok and rel_diff(model.params.data, expected) <= 1e-12
    assert all_agree(WORLD, ok)
    assert len(set(WORLD.allgather(model.params.data.tobytes()))) == 1


@pytest.mark.parametrize("strategy, ranks_per_node", [("flat", None), ("node", 1)])
def test_state_dict_then_load_continues_exactly(strategy, ranks_per_node):
    kwargs = dict(strategy=strategy, ranks_per_node=ranks_per_node, speeds=UNEVEN, sync_every=4,
                  optimizer=Adam)
    model, dp = make(**kwargs)
    train(model, dp, steps=6)
    reference = train(model, dp, steps=3, seed=1)

    model, dp = make(**kwargs)
    train(model, dp, steps=6)  # between two node syncs: the nodes' parameters differ
    state = WORLD.bcast(state_dict(dp), root=0)  # what every rank would read from the file
    fresh_model, fresh_dp = make(**{**kwargs, "speeds": "equal"})
    load_state_dict(fresh_dp, state)
    resumed = train(fresh_model, fresh_dp, steps=3, seed=1)
    ok = rel_diff(resumed, reference) <= 1e-12 and fresh_dp.steps == 9
    ok = ok and fresh_dp.batch_sizes == dp.batch_sizes  # the same world: the split is restored
    assert all_agree(WORLD, ok), rel_diff(resumed, reference)


def test_load_state_dict_refuses_a_mismatch_on_every_rank():
    model, dp = make()
    state = WORLD.bcast(state_dict(dp), root=0)
    state["params"] = np.zeros(3)
    with pytest.raises(ValueError, match=f"3 parameters, the model {model.params.size}"):
        load_state_dict(dp, state)


# ------------------------------------------------------------------ counters, timings, helpers
def test_timings_and_counters_per_period():
    model, dp = make(strategy="hierarchical")
    train(model, dp, steps=3)
    timing = dp.timings()
    ok = timing["steps"] == 3 and len(timing["comp_s"]) == P and min(timing["comp_s"]) > 0
    ok = ok and all(c >= 0 for c in timing["comm_s"]) and all(i >= 0 for i in timing["idle_s"])
    counted = sum(level["calls"] for name, level in dp.counters.items() if name != "control")
    ok = ok and counted == (0 if P == 1 else 3 * (dp.topology.local_size > 1) * 2
                            + 3 * (dp.topology.is_leader and dp.topology.num_nodes > 1))
    dp.reset_counters()
    ok = dp.timings()["steps"] == 0 and ok and dp.counters["intra"]["calls"] == 0
    assert all_agree(WORLD, ok)


def test_sum_and_allgather():
    _, dp = make()
    total = dp.sum(np.array([RANK, 1], dtype=np.int64))
    assert all_agree(WORLD, total.tolist() == [P * (P - 1) // 2, P])
    assert dp.all_gather_object(RANK * 10) == [r * 10 for r in range(P)]


def test_measured_costs_split_away_from_a_slow_rank_identically_everywhere():
    """speeds='auto': every rank probes its real compute (here EMULATED 8x slower on the last
    rank), fits t(b) = a + c b, and every rank computes the same split from the gathered fits."""
    loss_fn = SoftmaxCrossEntropy()
    model = tiny_model()

    def probe(n):
        x, y = DATA.read(np.resize(np.arange(DATA.num_samples), n))
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        time.sleep(SLEEP_PER_SAMPLE * n)  # a cost that a loaded machine cannot blur

    dp = data_parallel(model, SGD(model.params, lr=0.05), batch_size=B, speeds="auto", probe=probe,
                       emulate_slowdown=[1.0] * (P - 1) + [8.0])
    gathered = WORLD.allgather((dp.batch_sizes, dp.split.costs))
    assert all(g == gathered[0] for g in gathered)
    ok = sum(dp.batch_sizes) == B and dp.split.source == "measured" and isinstance(dp.split, MeasuredSplit)
    ok = ok and (P == 1 or dp.batch_sizes[-1] < dp.batch_sizes[0])
    assert all_agree(WORLD, ok), dp.split.describe()


def test_a_rank_disturbed_during_the_first_probe_only_keeps_the_equal_split():
    """The last rank is slow (8x the per-sample sleep) through the whole first measurement and
    normal afterwards, as a rank descheduled by another job would be: the confirming second
    measurement finds the ranks alike, so the start keeps the equal split on every rank. The
    threshold is 20 % here, not the default 5 %: the 8x slowdown predicts a gain far above
    either, while 4 ranks oversubscribing 2 cores can make the undisturbed second measurement
    differ by more than 5 % (seen once in a full run: both measurements then chose uneven
    splits), which is the noise the default threshold is for, not what this test checks."""
    loss_fn = SoftmaxCrossEntropy()
    model = tiny_model()
    first_measurement = 1 + (PROBE_ROUNDS + 1) * len(probe_sizes(B, P))  # the warm-up call too
    calls = [0]

    def probe(n):
        calls[0] += 1
        x, y = DATA.read(np.resize(np.arange(DATA.num_samples), n))
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        disturbed = RANK == P - 1 and calls[0] <= first_measurement
        time.sleep(SLEEP_PER_SAMPLE * n * (8 if disturbed else 1))

    dp = data_parallel(model, SGD(model.params, lr=0.05), batch_size=B, speeds="auto", probe=probe,
                       balance_threshold=0.2)
    measured_twice = calls[0] == 1 + 2 * (first_measurement - 1)
    ok = dp.batch_sizes == equal_split(B, P) and (P == 1 or measured_twice)
    assert all_agree(WORLD, ok), (calls[0], dp.split.describe())


def test_rebalance_follows_the_measured_compute_time():
    """The core composed by hand: a measured split that starts from the equal one (no probe),
    and the last rank's compute EMULATED 6x slower by its clock; a re-fit from the steps moves
    samples away from it, confirmed by the second period (one period alone moves nothing
    before the ranks know how much their periods differ)."""
    model = tiny_model()
    topo = Topology.from_comm(WORLD)
    clock = compute_clock(([1.0] * (P - 1) + [6.0])[RANK])
    equal = FixedSplit(B, P)
    split = MeasuredSplit.from_costs(topo, B, equal.costs, equal.batch_sizes, clock, source="equal")
    dp = DataParallel(model, make_optimizer(SGD, model), batch_size=B, exchange=Flat(topo), split=split,
                      clock=clock)
    train(model, dp, steps=8, sleep_per_sample=SLEEP_PER_SAMPLE)
    first = dp.split.rebalance(dp.steps)  # re-fits from the eight steps (the same at every rank alike)
    train(model, dp, steps=8, sleep_per_sample=SLEEP_PER_SAMPLE)
    change = dp.split.rebalance(dp.steps)
    ok = P == 1 or (first is None and change is not None and dp.batch_sizes[-1] < dp.batch_sizes[0])
    assert all_agree(WORLD, ok and sum(dp.batch_sizes) == B)
    assert len(set(map(tuple, WORLD.allgather(dp.batch_sizes)))) == 1


def test_the_cpu_clock_stretches_work_and_not_waiting():
    # EMULATION on the CPU clock: a step's compute lasts max(wall, f * cpu). A compute that
    # only sleeps (the rank waiting for a core held by another) is not stretched; one that
    # computes is, f times its CPU seconds.
    model, dp = make(emulate_slowdown=3.0, emulate_clock="cpu")
    batch = batches(1)[0]

    def one_step(work):
        start = time.perf_counter()
        local = dp.local_indices(batch)  # starts the compute clock
        model.params.grad.fill(0)
        work()
        wall = time.perf_counter() - start
        dp.step(len(local))
        return dp.timings()["step_comp_s"][-1], wall

    def busy(seconds=0.03):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    waited, wall = one_step(lambda: time.sleep(0.03))
    worked, _ = one_step(busy)
    # the sleep's interval keeps its wall time (however late the sleep returned); the busy
    # one lasts 3 x its 0.03 CPU seconds (on the wall clock the sleep would also be 3x)
    ok = 0.03 <= waited <= wall + 0.005 and worked >= 3 * 0.03 * 0.95
    assert all_agree(WORLD, ok), (waited, wall, worked)


# ------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ring"}, "unknown strategy 'ring'"),
    ({"strategy": "node", "compress": "bf16"}, "compress acts on"),
    ({"emulate_link": 3}, "emulate_link must be a LinkModel"),
    ({"weighting": "mean"}, "unknown weighting"),
    ({"on_nan": "ignore"}, "on_nan must be one of"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"batch_size": P - 1 if P > 1 else 0}, "batch_size"),
    ({"speeds": "fast"}, "speeds must be 'equal', 'auto'"),
    ({"speeds": "auto"}, "probe"),
    ({"speeds": [1.0] * (P + 1)}, "entries for"),
    ({"speeds": [0.0] * P}, r"speeds\[0\] must be a finite number > 0"),
    ({"emulate_slowdown": [1.0] * (P + 1)}, "emulate_slowdown has"),
    ({"emulate_slowdown": 0.5}, "slowdown factor must be"),
    ({"emulate_clock": "gpu"}, "emulation clock must be one of wall, cpu"),
    ({"sync_every": 0, "strategy": "node"}, "sync_every"),
    ({"balance_threshold": 1.0}, "balance_threshold"),
    ({"rebalance_every": 0}, "rebalance_every"),
])
def test_bad_arguments_are_refused_before_any_collective(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_the_optimizer_must_own_the_models_parameters():
    model, other = tiny_model(), tiny_model()
    with pytest.raises(ValueError, match="same parameters"):
        DataParallel(model, SGD(other.params, lr=0.1), batch_size=B)
    with pytest.raises(ValueError, match="a Model or a FlatParameters"):
        DataParallel(object(), SGD(model.params, lr=0.1), batch_size=B)


@pytest.mark.parametrize("kwargs, match", [
    ({"weighting": "mean"}, "weighting must be one of balanced, uniform"),
    ({"on_nan": "ignore"}, "on_nan must be one of stop, skip"),
    ({"split": FixedSplit(B + 1, P)}, f"the split is of a global batch of {B + 1}, not {B}"),
])
def test_the_core_refuses_bad_parts(kwargs, match):
    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        DataParallel(model, SGD(model.params, lr=0.1), batch_size=B, **kwargs)


@pytest.mark.parametrize("count", [-1, 1.5, True])
def test_a_bad_local_count_is_refused_before_anything_is_recorded(count):
    model, dp = make()
    model.params.grad.fill(0.1)
    before = model.params.data.copy()
    with pytest.raises(ValueError, match="local_count must be an integer >= 0"):
        dp.step(count)
    untouched = dp.timings()["steps"] == 0 and dp.steps == 0 and np.array_equal(model.params.data, before)
    calls = sum(level["calls"] for name, level in dp.counters.items() if name != "control")
    assert all_agree(WORLD, untouched and calls == 0)


def test_continuous_rebalance_is_a_collective_decision_logged_once():
    model, dp = make(emulate_slowdown=[1.0] * (P - 1) + [6.0], rebalance_every=4)
    changes = []
    loss_fn = SoftmaxCrossEntropy()
    for batch in batches(8):
        local = dp.local_indices(batch)
        x, y = DATA.read(local)
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        time.sleep(SLEEP_PER_SAMPLE * len(local))
        dp.step()
        changes.append(None if dp.split.last_change is None else dp.split.last_change["new"])
    gathered = WORLD.allgather(changes)
    assert all(g == gathered[0] for g in gathered)
    # decisions only every 4 steps; the first proposes to move samples away from the EMULATED
    # slow rank, the second confirms it (one period alone moves nothing before the ranks
    # know how much their periods differ)
    assert all(changes[k] is None for k in range(7)), changes
    if P > 1:
        assert changes[7] is not None and changes[7][-1] < changes[7][0], changes


class RecordedComputeClock(ComputeClock):
    """A compute clock that only moves when told (recorded timings, no real time)."""

    def __init__(self):
        self.t = 0.0
        super().__init__()

    def now(self):
        return self.t

    def start(self):
        self._mark = self.t

    def stop(self):
        return self.t - self._mark


def test_the_split_observes_the_update_and_the_loop_outside_the_compute():
    """Step k's critical path on a rank: the previous step's optimizer update and the loop up
    to ``local_indices``, then the compute. The split is told both (recorded times): the
    compute 0.010 s; outside it the update 0.003 s plus the loop 0.002 s (none before the first
    step; after a ``sync`` only the update: the loop's time then (evaluation, checkpoint) is no
    step's work)."""
    model = tiny_model()
    clock = RecordedComputeClock()
    split = FixedSplit(B, P)
    observed = []
    split.observe = lambda count, seconds, outside_s=0.0: observed.append((seconds, outside_s))
    optimizer = make_optimizer(SGD, model)
    update = optimizer.step

    def timed_update():
        clock.t += 0.003
        update()
    optimizer.step = timed_update
    dp = DataParallel(model, optimizer, batch_size=B, exchange=Flat(Topology.from_comm(WORLD)), split=split,
                      clock=clock)
    loss_fn = SoftmaxCrossEntropy()
    for k, batch in enumerate(batches(4)):
        if k == 2:
            dp.sync()
            clock.t += 1.0  # an evaluation after the sync
        clock.t += 0.002  # the loop
        local = dp.local_indices(batch)
        x, y = DATA.read(local)
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        clock.t += 0.010  # the compute
        dp.step()
    expected = [(0.010, 0.0), (0.010, 0.005), (0.010, 0.003), (0.010, 0.005)]
    ok = all(s == pytest.approx(es) and u == pytest.approx(eu) for (s, u), (es, eu) in zip(observed, expected))
    assert all_agree(WORLD, ok and len(observed) == 4), observed
