"""``python -m mpidl.train --on-failure shrink``: a rank SIGKILLs itself mid-epoch
(``MPIDL_INJECT_FAULT=RANK:STEP:kill``) and the survivors finish the run.

Exactness (float64, flat and hierarchical): the run that loses a rank at step ``s`` ends with
the parameters (<= 1e-10) of a run that stops at step ``s`` with a checkpoint on all the ranks
and is resumed on the survivors only (their old speeds, the same data order) up to the same
step. Needs Open MPI under ``mpiexec --with-ft ulfm`` (docs/failures.md): elsewhere these
tests skip with the reason; the fallback to ``restart`` is tested under any MPI.

Every launch has a timeout, after which the launcher's process group and every process that
carries the launch's tag in its environment are killed (launcher.run_tagged).

    .venv-openmpi/bin/python -m pytest -q tests/test_shrink.py    # Open MPI: the launches run
    .venv/bin/python -m pytest -q -rs tests/test_shrink.py          # MPICH: they skip, with the reason
"""

import json
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from launcher import OPENMPI, available, flavor, mpiexec, run_tagged

LAUNCH_TIMEOUT_S = 240
TRAIN = [sys.executable, "-m", "mpidl.train", "--dtype", "float64", "--batch-size", "24",
         "--schedule", "constant", "--epochs", "1", "--progress-every", "1000"]


def _run(ranks: int, args: list[str], *, ulfm: bool = True, fault: str | None = None) -> tuple[int, str]:
    """``mpiexec -n ranks python -m mpidl.train ARGS`` (Open MPI: ``--with-ft ulfm`` when
    ``ulfm``); returns (return code, output)."""
    if not available():
        pytest.skip("no mpiexec")
    cmd = mpiexec(ranks, TRAIN + args, ft="ulfm" if ulfm and flavor() == OPENMPI else "")
    env = dict(os.environ)
    env.pop("MPIDL_INJECT_FAULT", None)
    env.pop("MPIDL_RANKS_PER_NODE", None)
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


def test_shrink_is_refused_with_what_it_cannot_rebuild(monkeypatch):
    from mpidl.engine.backend import get_backend
    from mpidl.app.config import ConfigError, parse_config
    from mpidl.distributed import DataParallel
    from mpidl.distributed.recovery import check_on_failure
    from mpidl.engine.optim import SGD
    from mpidl.engine.params import FlatParameters, Parameter, zeros

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
    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "2")
    with pytest.raises(ConfigError, match="emulated nodes"):
        parse_config(["--on-failure", "shrink"])
    monkeypatch.delenv("MPIDL_RANKS_PER_NODE")
    params = FlatParameters([("w", Parameter((3,), zeros()))], get_backend("cpu", "float64"))
    with pytest.raises(ValueError, match="intra='shm'"):  # before any collective
        DataParallel(params, SGD(params, lr=0.1), batch_size=4, intra="shm", on_failure="shrink")


def test_without_ulfm_a_dataparallel_says_why_and_restarts(monkeypatch):
    from mpidl.engine.backend import get_backend
    from mpidl.distributed import DataParallel
    from mpidl.engine.optim import SGD
    from mpidl.engine.params import FlatParameters, Parameter, zeros

    monkeypatch.setenv("MPIDL_ULFM", "0")
    params = FlatParameters([("w", Parameter((3,), zeros()))], get_backend("cpu", "float64"))
    dp = DataParallel(params, SGD(params, lr=0.1), batch_size=4, on_failure="shrink")
    assert dp.on_failure == "restart" and "turned off by MPIDL_ULFM=0" in dp.failure_note
    assert not dp.shrunk


def test_the_start_up_line_says_what_the_heartbeat_detector_will_catch():
    from mpidl.distributed.recovery import detector_state

    assert detector_state({}).startswith("no heartbeat detector: a frozen host or a cut link is not detected")
    on = {"OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_timeout": "4",
          "OMPI_MCA_mpi_ft_detector_period": "1"}
    assert "WITHOUT its thread: a rank that computes for more than 4 s" in detector_state(on)
    assert detector_state({**on, "OMPI_MCA_mpi_ft_detector_thread": "1"}) == (
        "heartbeat detector: a host silent for 4 s is declared dead (period 1 s)")


def _recovering(world):
    """A ShrinkOnFailure over a fake ``world`` whose recovery records (error class, where)."""
    from types import SimpleNamespace

    from mpidl.distributed.elastic import ShrinkOnFailure
    from mpidl.distributed.recovery import RanksLost

    class Recovering(ShrinkOnFailure):
        def __init__(self):
            self.topology, self._step_snapshots, self.recovered = SimpleNamespace(world=world), object(), []

        def _recover(self, exc, where):
            self.recovered.append((exc.Get_error_class(), where))
            raise RanksLost({"step": 3}, "lost")

    return Recovering()


def test_a_garbled_object_collective_is_a_process_failure_when_a_peer_is_known_failed():
    """A collective can complete on one rank and fail on others: the pickled allgather then
    left garbage counts on rank 3 of a cut run (MemoryError, not an MPI error). With a failed
    peer known (MPI_Comm_get_failed) it is recovered from like the MPI error; without one it
    is a real error and propagates."""
    from mpidl.distributed.elastic import OUTSIDE
    from mpidl.distributed.recovery import RanksLost

    class Group:
        def __init__(self, size):
            self.size = size

        def Get_size(self):
            return self.size

        def Free(self):
            pass

    class World:
        failed = 0

        def Get_failed(self):
            return Group(self.failed)

    def garbled():
        raise MemoryError()

    dp = _recovering(World())
    with pytest.raises(MemoryError):
        dp._guarded(OUTSIDE, garbled)
    assert dp.recovered == []
    dp.topology.world.failed = 2
    with pytest.raises(RanksLost):
        dp._guarded(OUTSIDE, garbled)
    assert dp.recovered == [(MPI.ERR_PROC_FAILED, OUTSIDE)]


def test_a_step_is_confirmed_by_an_agreement_that_fails_where_a_collective_did_not():
    """The survivors of a killed host got SUCCESS from the flat allreduce of the step their
    peers died in (a sum without them); the agreement that confirms the step raises the
    process failure instead, in that step."""
    from mpidl.distributed.elastic import IN_STEP
    from mpidl.distributed.recovery import RanksLost

    class Group:
        def Get_size(self):
            return 0

        def Free(self):
            pass

    class World:
        dead = False
        agreed = 0

        def Agree(self, flag):
            self.agreed += 1
            if self.dead:
                raise MPI.Exception(MPI.ERR_PROC_FAILED)
            return flag

        def Get_failed(self):
            return Group()

    dp = _recovering(World())
    assert dp._guarded(IN_STEP, lambda: "sum", dp._world) == "sum" and dp.topology.world.agreed == 1
    dp.topology.world.dead = True
    with pytest.raises(RanksLost):
        dp._guarded(IN_STEP, lambda: "a sum without the dead", dp._world)
    assert dp.recovered == [(MPI.ERR_PROC_FAILED, IN_STEP)]
    assert dp._guarded(IN_STEP, lambda: "unconfirmed") == "unconfirmed"  # no communicator: no agreement


def test_survivors_that_cannot_go_on_stop_alone_without_mpi_abort(monkeypatch, tmp_path):
    """A RecoveryError (a minority after a cut link, say) ends the process with one line and
    exit code 1 but never calls MPI_Abort, which would also end the other half of the job (the
    ranks that went on without this one); any other exception still aborts."""
    import mpidl.distributed.launch as launch
    from mpidl.distributed.recovery import RecoveryError

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


@pytest.mark.launcher
@pytest.mark.parametrize("strategy, victim", [("flat", 0), ("hierarchical", 2)])
def test_a_killed_rank_ends_as_the_survivors_resumed_from_its_step(tmp_path, strategy, victim):
    _needs_ulfm()
    step, steps = 4, 8
    common = ["--strategy", strategy, "--max-steps", str(steps)]
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
    rc, out = _run(3, ["--strategy", strategy, "--max-steps", str(step), "--speeds", "1,2,3",
                       "--checkpoint", str(folder)], ulfm=False)
    assert rc == 0, out[-3000:]
    rc, out = _run(2, common + ["--speeds", survivors, "--checkpoint", str(folder), "--resume"], ulfm=False)
    assert rc == 0, out[-3000:]
    (got, got_steps), (expected, expected_steps) = _params(tmp_path / "shrink"), _params(folder)
    assert got_steps == expected_steps == steps
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)


@pytest.mark.launcher
def test_without_failure_recovery_shrink_falls_back_to_restart(tmp_path):
    """Under MPICH, or Open MPI started without --with-ft ulfm: one line says why, and the run
    is an ordinary one."""
    rc, out = _run(2, ["--max-steps", "2", "--on-failure", "shrink"], ulfm=False)
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
