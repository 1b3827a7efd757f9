"""Hiding the communication, under mpiexec: bucketed overlap, the node-shared window
(intra='shm'), 16-bit compression and the overlapped node sync, each against the blocking,
replicated exchange it wraps (and one process, where the strategy is exact).

Tiny float64 loops built with :func:`mpidl.distributed.data_parallel`; every rank asserts
only after a collective agreement. Layouts: the launch's own nodes (one node, the
``MPIDL_RANKS_PER_NODE`` grouping, or MPICH's ``-hosts`` split into real shared-memory
nodes) and two emulated nodes of ``P/2`` ranks.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed import Node, NonFiniteGradient, Topology, data_parallel
from mpidl.distributed.checkpoint import load_state_dict, state_dict
from mpidl.distributed.extras.sync_overlap import OverlappedSyncNode
from mpidl.distributed.message import COUNT
from mpidl.engine.backend import get_backend
from mpidl.engine.models import build_model
from mpidl.engine.nn import SoftmaxCrossEntropy
from mpidl.engine.optim import SGD, Adam

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
BACKEND = get_backend("cpu", "float64")
SHAPE, CLASSES, N = (5, 5, 5), 3, 40
_rng = np.random.default_rng(0)
X = _rng.standard_normal((N, *SHAPE))
Y = _rng.integers(0, CLASSES, N)
B = 4 * P + 2  # uneven on purpose
UNEVEN = [float(r + 1) for r in range(P)]
#: the launch's own nodes, and two nodes of P/2 ranks
LAYOUTS = [None, max(1, P // 2)]
LAYOUT_IDS = ["launch", "2nodes"]


def all_agree(ok) -> bool:
    """True on every rank iff ``ok`` on every rank (assert after this, never before)."""
    return bool(WORLD.allreduce(bool(ok), op=MPI.LAND))


def tiny_model(seed=3, backend=BACKEND):
    return build_model("hsicnn", SHAPE, CLASSES, backend=backend, seed=seed, channels=(4, 4), hidden=8)


def make(comm=WORLD, ranks_per_node=None, optimizer=SGD, seed=3, momentum=0.9, **kwargs):
    model = tiny_model(seed)
    opt = optimizer(model.params, lr=0.05, **({"momentum": momentum} if optimizer is SGD else {}))
    kwargs.setdefault("batch_size", B)
    return model, data_parallel(model, opt, topology=Topology.from_comm(comm, ranks_per_node=ranks_per_node),
                                **kwargs)


def batches(steps, seed=0):
    """The same global batches on every rank (a pure function of the seed)."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(N)[:B] for _ in range(steps)]


def train(model, dp, steps, seed=0, inputs=X):
    """The loop of the README: local slice, forward, backward, dp.step."""
    loss_fn = SoftmaxCrossEntropy()
    for batch in batches(steps, seed):
        local = dp.local_indices(batch)
        if len(local):
            loss_fn.forward(model.forward(inputs[local]), Y[local])
            model.backward(loss_fn.backward())
        else:
            model.params.grad.fill(0)
        dp.step(len(local))
    return model.params.data.copy()


def rel_diff(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def live_stage_levels(exchange) -> dict:
    """{level: stages of the exchange whose communicator has more than one rank here}."""
    levels: dict = {}
    for stage in exchange.stages:
        if stage.channel.size > 1:
            levels[stage.channel.level] = levels.get(stage.channel.level, 0) + 1
    return levels


STRATEGIES = [("flat", {}), ("hierarchical", {}), ("node", {"sync_every": 2}),
              ("node", {"sync_every": 2, "sync_overlap": 1})]
STRATEGY_IDS = ["flat", "hierarchical", "node", "node-sync_overlap"]


# ------------------------------------------------------------------ overlap
@pytest.mark.parametrize("ranks_per_node", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("strategy, options", STRATEGIES, ids=STRATEGY_IDS)
def test_overlap_equals_the_blocking_exchange(strategy, options, ranks_per_node):
    kwargs = dict(strategy=strategy, speeds=UNEVEN, ranks_per_node=ranks_per_node, **options)
    model, dp = make(overlap=True, bucket_mb=1e-4, **kwargs)
    overlapped = train(model, dp, steps=4)
    ref_model, ref_dp = make(**kwargs)
    blocking = train(ref_model, ref_dp, steps=4)
    err = rel_diff(overlapped, blocking)
    assert all_agree(err <= 1e-10), f"{strategy}: {err:.3e}"
    if dp.exchange.exact:
        one_model, one_dp = make(comm=MPI.COMM_SELF, strategy=strategy, **options)
        assert all_agree(rel_diff(overlapped, train(one_model, one_dp, steps=4)) <= 1e-10)
    if P > 1:
        # n buckets: n counted collectives per live stage and step where the blocking
        # exchange makes one, the same bytes in all (the node syncs are the same in both)
        n = len(dp.exchange.buckets)
        ok = n >= 3 and f"overlap in {n} buckets" in dp.exchange.describe()
        for level, stages in live_stage_levels(ref_dp.exchange).items():
            got, want = dp.counters[level], ref_dp.counters[level]
            ok = ok and got["calls"] - want["calls"] == 4 * stages * (n - 1) and got["bytes"] == want["bytes"]
        assert all_agree(ok), (dp.counters, ref_dp.counters)
    dp.close()
    ref_dp.close()
    assert all_agree(all("backward" not in vars(module) for module in model.net.modules()))


@pytest.mark.parametrize("strategy", ["flat", "node"])
def test_overlap_hooks_start_the_buckets_during_backward(strategy):
    model, dp = make(overlap=True, bucket_mb=1e-4, strategy=strategy)
    loss_fn = SoftmaxCrossEntropy()
    local = dp.local_indices(batches(1)[0])
    loss_fn.forward(model.forward(X[local]), Y[local])
    model.backward(loss_fn.backward())
    exchanging = dp.exchange.group_size > 1  # a node of one rank exchanges nothing per step
    started = dp.exchange.started_buckets() if exchanging else 0
    dp.step()
    assert all_agree(started == (len(dp.exchange.buckets) if exchanging else 0)), started
    dp.close()


def test_overlap_a_backward_outside_a_step_starts_nothing():
    """The speed probe's backward, before the first step and between steps: no bucket
    starts (the other ranks would never match it), and the steps stay exact."""
    model, dp = make(overlap=True, bucket_mb=1e-4)
    ref_model, ref_dp = make()
    loss_fn = SoftmaxCrossEntropy()

    def probe():
        loss_fn.forward(model.forward(X[:3]), Y[:3])
        model.backward(loss_fn.backward())
        return dp.exchange.started_buckets() if P > 1 else 0

    started = [probe()]
    train(model, dp, steps=2)
    started.append(probe())
    got = train(model, dp, steps=2, seed=1)
    train(ref_model, ref_dp, steps=2)
    want = train(ref_model, ref_dp, steps=2, seed=1)
    assert all_agree(started == [0, 0] and rel_diff(got, want) <= 1e-10), (started, rel_diff(got, want))
    dp.close()


def test_overlap_step_with_another_count_than_local_indices_raises():
    """The hooks sent the gradient weighted by local_indices()'s count; step(count + 1)
    raises after completing the collectives (the next step is fine on every rank)."""
    model, dp = make(overlap=True, bucket_mb=1e-4)
    loss_fn = SoftmaxCrossEntropy()
    local = dp.local_indices(batches(1)[0])
    loss_fn.forward(model.forward(X[local]), Y[local])
    model.backward(loss_fn.backward())
    message = ""
    try:
        dp.step(len(local) + 1)
    except ValueError as exc:
        message = str(exc)
    assert all_agree(P == 1 or ("backward hooks already sent" in message and "local_indices()" in message)), message
    train(model, dp, steps=1)
    digests = WORLD.allgather(float(model.params.data.sum()))
    assert all_agree(len(set(digests)) == 1)
    dp.close()


@pytest.mark.mpi(min_size=2)
def test_overlap_buckets_cross_the_emulated_link():
    """The duplicates' channels are made by the exchange's channel(): the inter-node stage is
    EMULATED like the blocking one (its modelled time booked, the result unchanged)."""
    kwargs = dict(strategy="hierarchical", ranks_per_node=max(1, P // 2), emulate_link="2000,10")
    model, dp = make(overlap=True, bucket_mb=1e-4, **kwargs)
    got = train(model, dp, steps=2)
    ref_model, ref_dp = make(**kwargs)
    want = train(ref_model, ref_dp, steps=2)
    inter = [s.channel for s in dp.exchange.stages if s.channel.level == "inter"]
    emulated = all(type(c).__name__ == "EmulatedLink" for c in inter) and len(inter) == 1
    # Booked on the link's timeline: what the caller then sleeps is only what is left of the
    # modelled time, which a loaded machine's slower compute may already have covered.
    booked = all(c.timeline.busy_until > 0 for c in inter) or not (dp.topology.is_leader and dp.topology.num_nodes > 1)
    assert all_agree(emulated and booked and rel_diff(got, want) <= 1e-10)
    dp.close()


#: models whose top-level layers are whole residual stages (resnet8) or transformer blocks (vit)
BLOCK_MODELS = {"resnet8": {"widths": (4, 8, 8)}, "vit": {"dim": 8, "depth": 2, "heads": 2, "mlp_dim": 16}}
X_8x8 = np.random.default_rng(1).standard_normal((N, 3, 8, 8))  # resnet8 needs 8 x 8 pixels


@pytest.mark.mpi(min_size=2)  # one rank exchanges nothing: no overlap is built
@pytest.mark.parametrize("name", sorted(BLOCK_MODELS))
@pytest.mark.parametrize("strategy, ranks_per_node", [("flat", None), ("hierarchical", max(1, P // 2))],
                         ids=["flat", "hierarchical-2nodes"])
def test_overlap_cut_inside_the_blocks_equals_the_blocking_exchange(name, strategy, ranks_per_node):
    """The product's bucket plan (``bucket_mb`` 1: the cap does not bind) cuts inside the
    residual stages and transformer blocks, every bucket but the last has started before
    the backward of layer 0, and the result is the blocking exchange's: bitwise for flat on
    2 ranks (one ``a + b`` per element either way), else within 1e-10 (float64)."""
    def build(**kwargs):
        model = build_model(name, X_8x8.shape[1:], CLASSES, backend=BACKEND, seed=3, **BLOCK_MODELS[name])
        opt = SGD(model.params, lr=0.05, momentum=0.9)
        topology = Topology.from_comm(WORLD, ranks_per_node=ranks_per_node)
        return model, data_parallel(model, opt, batch_size=B, topology=topology, strategy=strategy,
                                    speeds=UNEVEN, **kwargs)

    model, dp = build(overlap=True, bucket_mb=1.0)
    started_before_layer_0 = []

    # Instrument the start of layer 0's backward: inside the overlap's report wrapper when
    # layer 0 owns parameters (resnet8's first convolution), else on the layer (vit's Patchify).
    layer_0 = model.net.layers[0]
    watched = vars(layer_0).get("backward")
    host = watched if watched is not None else layer_0
    inner = host.backward

    def backward_of_layer_0(dy):
        if dp.exchange._step is not None:
            started_before_layer_0.append(dp.exchange.started_buckets())
        return inner(dy)

    host.backward = backward_of_layer_0
    got = train(model, dp, steps=3, inputs=X_8x8)
    if watched is not None:
        watched.backward = inner
    else:
        del layer_0.backward
    ref_model, ref_dp = build()
    want = train(ref_model, ref_dp, steps=3, inputs=X_8x8)
    buckets = dp.exchange.buckets
    # the message offsets where a top-level layer's parameters begin
    layer_of = [int(param_name.split(".")[0]) for param_name in model.params.names]
    layer_starts = {off for k, off in enumerate(model.params.offsets) if k == 0 or layer_of[k] != layer_of[k - 1]}
    inside = any(b.lo not in layer_starts for b in buckets)
    early = all(n >= len(buckets) - 1 for n in started_before_layer_0)
    exact = np.array_equal(got, want) if (strategy == "flat" and P == 2) else rel_diff(got, want) <= 1e-10
    assert all_agree(len(buckets) >= 5 and inside and early and exact), (
        [(b.lo, b.hi) for b in buckets], sorted(layer_starts), started_before_layer_0, rel_diff(got, want))
    dp.close()
    ref_dp.close()
    assert all_agree(all("backward" not in vars(module) for module in model.net.modules()))


# ------------------------------------------------------------------ intra='shm'
@pytest.mark.parametrize("ranks_per_node", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("strategy, optimizer", [("flat", SGD), ("hierarchical", Adam), ("hierarchical", SGD)])
def test_shm_equals_mpi_and_one_process(strategy, optimizer, ranks_per_node):
    kwargs = dict(strategy=strategy, speeds=UNEVEN, ranks_per_node=ranks_per_node, optimizer=optimizer)
    model, dp = make(intra="shm", **kwargs)
    shm = train(model, dp, steps=5)
    ref_model, ref_dp = make(**kwargs)
    mpi = train(ref_model, ref_dp, steps=5)
    one_model, one_dp = make(comm=MPI.COMM_SELF, strategy=strategy, optimizer=optimizer)
    one = train(one_model, one_dp, steps=5)
    assert all_agree(rel_diff(shm, mpi) <= 1e-12), f"{strategy}: {rel_diff(shm, mpi):.3e}"
    assert all_agree(rel_diff(shm, one) <= 1e-10)
    state_shm = dp.optimizer.state_buffers()[0].copy()
    assert all_agree(rel_diff(state_shm, ref_dp.optimizer.state_buffers()[0]) <= 1e-12)
    assert all_agree(dp.optimizer.step_count == 5 and dp.optimizer.params is model.params)
    dp.close()
    # after close the model and the optimizer are private again, with their values
    ok = dp.exchange.window is None and np.array_equal(model.params.data, shm)
    ok = ok and np.array_equal(dp.optimizer.state_buffers()[0], state_shm)
    model.params.grad.fill(0.1)
    dp.optimizer.step()  # the whole optimizer again: every parameter moves
    ok = ok and np.all(model.params.data != shm)
    assert all_agree(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync_optimizer_state", [False, True])
def test_shm_node_strategy_equals_mpi_between_and_at_syncs(sync_optimizer_state):
    kwargs = dict(strategy="node", sync_every=3, ranks_per_node=max(1, P // 2), speeds=UNEVEN,
                  sync_optimizer_state=sync_optimizer_state)
    model, dp = make(intra="shm", **kwargs)
    ref_model, ref_dp = make(**kwargs)
    for seed in (2, 4):  # step 2 between syncs, step 4 after the sync at step 3
        shm = train(model, dp, steps=2, seed=seed)
        mpi = train(ref_model, ref_dp, steps=2, seed=seed)
        assert all_agree(rel_diff(shm, mpi) <= 1e-12), f"{rel_diff(shm, mpi):.3e}"
        assert all_agree(dp.exchange.state() == ref_dp.exchange.state())
    dp.sync()
    ref_dp.sync()
    assert all_agree(rel_diff(model.params.data, ref_model.params.data) <= 1e-12)
    assert all_agree(rel_diff(dp.optimizer.state_buffers()[0], ref_dp.optimizer.state_buffers()[0]) <= 1e-12)
    digests = WORLD.allgather(float(model.params.data.sum()))
    assert all_agree(len(set(digests)) == 1)
    assert all_agree(dp.counters["intra"]["calls"] == 0)  # the window moves no message
    dp.close()


def test_shm_holds_one_copy_per_node():
    model, dp = make(intra="shm")
    node = dp.topology.node
    window = dp.exchange.window
    # every rank of the node sees the same memory for the parameters
    offsets = node.allgather(model.params.data.__array_interface__["data"][0] -
                             window.__array_interface__["data"][0])
    assert all_agree(len(set(offsets)) == 1)
    parts = dp.exchange.resident_bytes()
    R = node.Get_size()
    assert all_agree(parts["params"] == model.params.nbytes and parts["slots"] == R * model.params.message.nbytes
                     and parts["state"] == model.params.nbytes)  # SGD momentum: one buffer
    dp.close()


def test_shm_reads_the_learning_rate_of_the_optimizer_the_schedule_sets():
    """A trainer sets lr on the optimizer it built; the slice steps read it every step."""
    model = tiny_model()
    opt = SGD(model.params, lr=0.05)
    dp = data_parallel(model, opt, batch_size=B, intra="shm")
    opt.lr = 0.0
    before = train(model, dp, steps=1)
    opt.lr = 0.05
    after = train(model, dp, steps=1)
    assert all_agree(dp.optimizer.lr == 0.05 and not np.array_equal(before, after))
    frozen = model.params.data.copy()
    opt.lr = 0.0
    assert all_agree(np.array_equal(train(model, dp, steps=1), frozen) and opt.step_count == 3)
    dp.close()


@pytest.mark.parametrize("ranks_per_node", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
def test_shm_non_finite_gradient_raises_on_every_rank(strategy, ranks_per_node):
    model, dp = make(strategy=strategy, intra="shm", ranks_per_node=ranks_per_node)
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


@pytest.mark.parametrize("strategy, ranks_per_node", [("flat", None), ("node", max(1, P // 2))])
def test_shm_state_dict_then_load_continues_exactly(strategy, ranks_per_node):
    kwargs = dict(strategy=strategy, ranks_per_node=ranks_per_node, intra="shm", sync_every=3)
    model, dp = make(**kwargs)
    train(model, dp, steps=2)
    state = WORLD.bcast(state_dict(dp), root=0)
    expected = train(model, dp, steps=2, seed=9)
    model2, dp2 = make(seed=11, **kwargs)
    load_state_dict(dp2, state)
    got = train(model2, dp2, steps=2, seed=9)
    assert all_agree(rel_diff(got, expected) <= 1e-12), rel_diff(got, expected)
    dp.close()
    dp2.close()


# ------------------------------------------------------------------ compression
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("intra", ["mpi", "shm"])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compressed_hierarchical_is_close_and_halves_the_inter_bytes(kind, intra):
    rpn = max(1, P // 2)
    results = {}
    for compress in ("none", kind):
        model = tiny_model(backend=get_backend("cpu", "float32"))
        dp = data_parallel(model, SGD(model.params, lr=0.05), batch_size=B, strategy="hierarchical",
                           topology=Topology.from_comm(WORLD, ranks_per_node=rpn), compress=compress, intra=intra)
        results[compress] = (train(model, dp, steps=3), dict(dp.counters["inter"]), model.params.message.nbytes,
                             dp.exchange.describe())
        dp.close()
    (exact, inter0, nbytes, _), (packed, inter1, _, described) = results["none"], results[kind]
    named = f"inter-node {kind}" in described or not dp.topology.is_leader
    assert all_agree(0 < rel_diff(packed, exact) < 1e-2 and named), (rel_diff(packed, exact), described)
    if dp.topology.is_leader:
        n = nbytes // 4 - 3  # float32 gradients, then 3 slots
        ok = inter0["bytes"] == 3 * nbytes and inter1["bytes"] == 3 * (2 * n + 24) and inter1["calls"] == 3
    else:
        ok = inter0["calls"] == inter1["calls"] == 0
    assert all_agree(ok), (inter0, inter1, nbytes)


# ------------------------------------------------------------------ the overlapped node sync
def node_message(n, count):
    message = np.zeros(n + 3)
    message[COUNT] = count
    return message


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("moved", [False, True])
def test_sync_overlap_applies_the_average_at_its_start_plus_the_progress_since(moved):
    """Sync started at step 2 from theta_2, applied at step 3 as avg(theta_2) + (theta_3 -
    theta_2): the blocking sync's result when nothing moved in between."""
    topo = Topology.from_comm(WORLD, ranks_per_node=max(1, P // 2))
    background, blocking = OverlappedSyncNode(topo, sync_every=2, sync_overlap=1), Node(topo, sync_every=2)
    n = 7
    theta_node = np.arange(n) + 10.0 * (topo.node_id + 1)            # the same on a node's ranks
    delta = (0.5 * np.arange(n) - topo.node_id) if moved else np.zeros(n)
    theta, reference = theta_node.copy(), theta_node.copy()
    flags = (1.0 if RANK == 0 else 0.0, 0.0)
    for step in (1, 2):
        for exchange in (background, blocking):
            exchange.reduce(node_message(n, RANK + 1))
        assert background.after_step(step, theta, [], flags) is None
        blocking.after_step(step, reference, [], flags)
    started = background.in_flight and np.array_equal(theta, theta_node)   # nothing applied yet
    theta += delta
    background.reduce(node_message(n, RANK + 1))
    sums = background.after_step(3, theta, [], (0.0, 0.0))
    expected = reference + delta
    ok = started and not background.in_flight and sums == (1.0, 0.0)
    ok = ok and rel_diff(theta, expected) <= 1e-15 * (1 + 100 * moved)
    # counters: the leaders' one background allreduce of [v_n theta | v_n | flags]; within the
    # node 3 per-step allreduces and the one broadcast of the result
    counts = background.traffic.counts
    inter_ok = counts["inter"] == ({"calls": 1, "bytes": (n + 3) * 8} if topo.is_leader else {"calls": 0, "bytes": 0})
    intra_ok = counts["intra"]["calls"] == (4 if topo.local_size > 1 else 0)
    assert all_agree(ok and inter_ok and intra_ok), (theta, expected, counts)
    background.close()
    blocking.close()
    topo.free()


@pytest.mark.mpi(min_size=2)
def test_sync_overlap_equals_blocking_when_nothing_moved_meanwhile():
    out = []
    for delay in (0, 1):
        model, dp = make(strategy="node", sync_every=3, speeds=UNEVEN, sync_overlap=delay,
                         ranks_per_node=max(1, P // 2), momentum=0.0)
        train(model, dp, steps=3)            # the sync starts (or happens) at step 3
        in_flight = getattr(dp.exchange, "in_flight", False)
        model.params.grad.fill(0.0)
        dp.step(2)                           # step 4 moves nothing; the overlapped sync lands
        out.append(model.params.data.copy())
        assert all_agree(in_flight == bool(delay) and not getattr(dp.exchange, "in_flight", False))
        dp.close()
    assert all_agree(rel_diff(out[1], out[0]) <= 1e-12), rel_diff(out[1], out[0])


@pytest.mark.mpi(min_size=2)
def test_sync_overlap_lands_later_and_sync_makes_the_replicas_identical():
    model, dp = make(strategy="node", sync_every=3, speeds=UNEVEN, sync_overlap=2, ranks_per_node=max(1, P // 2))
    train(model, dp, steps=4)  # started at 3, not applied yet
    pending = dp.exchange.in_flight
    train(model, dp, steps=1, seed=5)  # applied at 5
    assert all_agree(pending and not dp.exchange.in_flight)
    assert all_agree("sync applied 2 step(s) after it starts" in dp.exchange.describe())
    train(model, dp, steps=1, seed=6)  # started again at 6
    dp.sync()                          # applies it, then averages
    digests = WORLD.allgather(float(model.params.data.sum()))
    assert all_agree(not dp.exchange.in_flight and len(set(digests)) == 1)
    dp.close()
