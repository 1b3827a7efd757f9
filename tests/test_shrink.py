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
    from mpidl.backend import get_backend
    from mpidl.config import ConfigError, parse_config
    from mpidl.distributed import DataParallel
    from mpidl.distributed.recovery import check_on_failure
    from mpidl.optim import SGD
    from mpidl.params import FlatParameters, Parameter, zeros

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
    from mpidl.backend import get_backend
    from mpidl.distributed import DataParallel
    from mpidl.optim import SGD
    from mpidl.params import FlatParameters, Parameter, zeros

    monkeypatch.setenv("MPIDL_ULFM", "0")
    params = FlatParameters([("w", Parameter((3,), zeros()))], get_backend("cpu", "float64"))
    dp = DataParallel(params, SGD(params, lr=0.1), batch_size=4, on_failure="shrink")
    assert dp.on_failure == "restart" and "turned off by MPIDL_ULFM=0" in dp.failure_note
    assert not dp.shrunk


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
