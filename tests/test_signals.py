"""SIGTERM (what Slurm sends before the time limit) stops a job cleanly, and --resume finishes it.

Each test launches ``python -m mpidl.train`` under ``mpiexec -n 2`` (tests/launcher.py: MPICH
or Open MPI) or alone, waits until training has started (the metrics file has its ``start``
record, written after the signal handler is installed), sends the signal, and checks: exit code
0, an ``end`` record with ``stopped: signal``, a checkpoint. A signal sent to the launcher is
sent while the ranks are stopped (SIGSTOP), and they go on (SIGCONT) once it is pending on
each of them: the run cannot end before the signal arrives, however long the launcher takes
to pass it on (it used to race the run's 45 steps on a loaded machine). The resumed run must reach the
configured epochs and, in float64 with fixed speeds, end with bitwise the parameters of an
uninterrupted run.

MPICH's ``mpiexec`` (hydra) forwards SIGTERM and SIGUSR1 to every rank. Open MPI's (prterun)
forwards SIGUSR1, but takes SIGTERM as "abort the job": it kills the ranks about a second later
and exits non-zero, checkpoint or not (the ``launcher-TERM`` case checks that too, since the
docs/running.md tells Open MPI users to send SIGUSR1 instead). Under Slurm the signal goes to every task
of the step (srun); one rank receiving it is enough, which the ``one-rank`` case checks.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import launcher
from mpidl.app.checkpoint import CHECKPOINT_NAME, read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = launcher.default_mpiexec()
EPOCHS, STEPS_PER_EPOCH = 3, 15  # 240 samples, global batch 16

pytestmark = pytest.mark.launcher


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """240 training patches of 4 bands x 5 x 5 pixels in the mpidl layout: fast to train."""
    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(0)

    def split(n):
        y = rng.integers(0, 3, n)
        return rng.standard_normal((n, 4, 5, 5)).astype(np.float32) + 0.5 * y[:, None, None, None], y

    path = tmp_path_factory.mktemp("data") / "tiny.h5"
    write_layout(path, {"train": split(240), "test": split(40)}, ["a", "b", "c"], source="test_signals")
    return str(path)


def command(data, *extra, ranks=2):
    args = [sys.executable, "-m", "mpidl.train", "--data", data, "--epochs", str(EPOCHS),
            "--batch-size", "16", "--dtype", "float64", "--speeds", ",".join(["1"] * (ranks or 1)),
            "--schedule", "cosine", *extra]
    if ranks is None:
        return args
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    return launcher.mpiexec(ranks, args, exe=MPIEXEC)


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def wait_for_start(proc, metrics, timeout=60.0):
    """Until the metrics file has the ``start`` record (the run loop begins right after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the job ended before training started:\n{out}\n{err}")
        if metrics.exists() and '"event": "start"' in metrics.read_text():
            return
        time.sleep(0.02)
    proc.kill()
    pytest.fail("training did not start in time")


def rank_pids(mpiexec_pid):
    """``{rank: pid}`` of the ranks under an mpiexec (hydra: mpiexec -> proxy -> ranks; prterun:
    mpiexec -> ranks), from each process's environment (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``)."""
    found, todo = {}, [mpiexec_pid]
    while todo:
        pid = todo.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = launcher.rank_of_environ(dict(e.split(b"=", 1) for e in env if b"=" in e))
        if rank is not None:
            found[rank] = pid
        todo += [int(c) for c in children]
    return found


def pending_signals(pid) -> int | None:
    """The signals pending on process ``pid`` (``SigPnd | ShdPnd`` of /proc/PID/status, bit
    ``n - 1`` for signal ``n``), or None when it is gone (or a zombie)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if fields.get("State", "").split()[:1] == ["Z"]:
        return None
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def is_stopped(pid) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def signal_launcher_while_ranks_wait(proc, signum, metrics, ranks=2, timeout=60.0):
    """Send ``signum`` to the launcher ``proc`` while its ranks are stopped, and let them go
    on only once the launcher's doing has reached every rank (the signal pending on it, or
    the rank gone). The ranks are stopped (SIGSTOP) right after the run loop has started (the
    metrics' ``start`` record), before the signal is sent: however slowly the launcher passes
    the signal on, on however loaded a machine, the run cannot reach its end before the signal
    reaches the ranks. Returns the ranks' pids."""
    deadline = time.monotonic() + timeout
    pids = {}
    while len(pids) < ranks:
        assert time.monotonic() < deadline, f"found the ranks {pids} of {ranks} only"
        pids = rank_pids(proc.pid)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    while not all(is_stopped(pid) or pending_signals(pid) is None for pid in pids.values()):
        assert time.monotonic() < deadline, "the ranks did not stop"
        time.sleep(0.005)
    assert '"event": "end"' not in metrics.read_text(), \
        "the run ended before its ranks were stopped: the test's premise (a run of 45 steps) failed"
    proc.send_signal(signum)
    mask = (1 << (signum - 1)) | (1 << (signal.SIGKILL - 1))
    while not all(pending_signals(pid) is None or pending_signals(pid) & mask for pid in pids.values()):
        assert time.monotonic() < deadline, \
            f"the launcher did not pass signal {signum} on to the ranks within {timeout} s"
        time.sleep(0.01)
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return pids


def params_of(saved_model):
    with h5py.File(saved_model) as f:
        return [f[name][()] for name in json.loads(f.attrs["param_order"])]


@pytest.mark.parametrize("target", ["launcher-TERM", "launcher-USR1", "one-rank", "serial"])
def test_signal_checkpoints_exits_0_and_resume_completes(tmp_path, tiny_data, target):
    ranks = None if target == "serial" else 2
    folder, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    # The signal is sent as soon as the run loop starts: every rank stops after the step that
    # carries the flag (the next one), well before the last step (45).
    first = subprocess.Popen(
        command(tiny_data, "--checkpoint", str(folder), "--metrics", str(metrics), ranks=ranks),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_start(first, metrics)
    if target == "launcher-TERM" and launcher.flavor(MPIEXEC) == launcher.OPENMPI:
        # prterun aborts on SIGTERM whatever the ranks do: it exits non-zero and kills the
        # ranks about a second later, so a checkpoint is written only when the ranks happen to
        # get there first. This is why docs/running.md and jobs/ send SIGUSR1 to an Open MPI launcher.
        signal_launcher_while_ranks_wait(first, signal.SIGTERM, metrics)
        out, err = first.communicate(timeout=60)
        assert first.returncode != 0, (out, err)
        return
    if target == "one-rank":
        pids = {}
        for _ in range(100):  # the ranks are running: their PMI_RANK is there to read
            pids = rank_pids(first.pid)
            if len(pids) == 2:
                break
            time.sleep(0.05)
        assert 1 in pids, pids
        os.kill(pids[1], signal.SIGTERM)  # rank 1 alone: its next gradient message tells rank 0
    elif target == "serial":
        first.send_signal(signal.SIGTERM)  # the process itself: no launcher in between
    else:
        signal_launcher_while_ranks_wait(first, signal.SIGUSR1 if target == "launcher-USR1" else signal.SIGTERM,
                                         metrics)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, (out, err)
    end = records(metrics)[-1]
    assert end["event"] == "end" and end["stopped"] == "signal", end
    assert 0 < end["step"] < EPOCHS * STEPS_PER_EPOCH, end
    meta = read_checkpoint_meta(str(folder))
    assert meta["distributed"]["steps"] == end["step"]
    assert (meta["epoch"], meta["step_in_epoch"]) == divmod(end["step"], STEPS_PER_EPOCH)
    assert "checkpoint:" in out and "Traceback" not in err

    resumed = subprocess.run(
        command(tiny_data, "--checkpoint", str(folder), "--resume", "--metrics", str(metrics),
                "--save", str(tmp_path / "resumed.h5"), ranks=ranks),
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    end = records(metrics)[-1]
    assert end["stopped"] == "completed" and end["step"] == EPOCHS * STEPS_PER_EPOCH
    assert records(metrics)[-2]["epoch"] == EPOCHS

    if target == "launcher-USR1":  # the same job without interruption: bitwise the same model
        whole = subprocess.run(command(tiny_data, "--save", str(tmp_path / "whole.h5"), ranks=ranks),
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert whole.returncode == 0, whole.stderr
        for a, b in zip(params_of(tmp_path / "resumed.h5"), params_of(tmp_path / "whole.h5")):
            assert a.tobytes() == b.tobytes()
    assert not any(name.endswith(".tmp") for name in os.listdir(folder))
    assert CHECKPOINT_NAME in os.listdir(folder)
