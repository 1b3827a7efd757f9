"""Every bad output path and input value of the command line ends the job before training with
one ``error:`` line naming it (exit code 2); a final write that fails keeps the trained model.

Subprocesses (``python -m mpidl.train``, some under ``mpiexec -n 2|4 -launcher fork``) on a tiny
layout file. "Before training" is checked by the absence of any epoch line and of the metrics
file's records, never by time.
"""

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpidl.app.checkpoint import CHECKPOINT_NAME

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def tiny(path, n_train=60, n_test=20, seed=0, nan_at=()):
    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(seed)

    def split(n):
        y = rng.integers(0, 3, n)
        return rng.standard_normal((n, 2, 5, 5)).astype(np.float32) + y[:, None, None, None], y

    write_layout(path, {"train": split(n_train), "test": split(n_test)}, ["a", "b", "c"], source="tiny")
    if nan_at:
        with h5py.File(path, "r+") as f:
            for i in nan_at:
                f["train/x"][i, 1, 2, 2] = np.nan
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("data") / "tiny.h5")


def train(args, np_=None, data=None, timeout=180):
    base = [sys.executable, "-m", "mpidl.train", "--epochs", "1", "--batch-size", "8",
            "--speeds", ",".join(["1"] * (np_ or 1))]
    if data is not None:
        base += ["--data", data]
    cmd = base + list(args)
    if np_ is not None:
        if not Path(MPIEXEC).exists():
            pytest.skip(f"no mpiexec at {MPIEXEC}")
        cmd = [MPIEXEC, "-n", str(np_), "-launcher", "fork", *cmd]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_setup_error(proc, message):
    """One ``error:`` line with ``message``, exit 2, no traceback, no training."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "epoch" not in proc.stdout and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- output paths
@pytest.mark.parametrize("args, message", [
    (["--save", "/proc/x"], "--save /proc/x: cannot write in /proc"),
    (["--checkpoint", "/proc/x"], "--checkpoint /proc/x: cannot create the folder /proc/x"),
    (["--metrics", "/proc/x/m.jsonl"], "--metrics /proc/x/m.jsonl: cannot create the folder /proc/x"),
    (["--timing-dir", "/proc/x"], "--timing-dir /proc/x: cannot create the folder /proc/x"),
])
def test_unwritable_outputs_are_setup_errors(data, args, message):
    assert_setup_error(train(args, np_=2, data=data), message)


def test_checkpoint_naming_a_file_is_a_setup_error(data, tmp_path):
    existing = tmp_path / "ck"
    existing.write_text("not a folder")
    assert_setup_error(train(["--checkpoint", str(existing)], np_=2, data=data),
                       f"--checkpoint {existing}: is a file, not a folder")


def test_save_naming_a_folder_is_a_setup_error(data, tmp_path):
    assert_setup_error(train(["--save", str(tmp_path)], data=data), f"--save {tmp_path}: is a directory")


def test_stale_temporaries_are_removed_at_the_next_start(data, tmp_path):
    """A write killed with SIGKILL leaves ``.checkpoint.h5.XXXXXXXX.tmp`` (tests/test_checkpoint.py
    shows it); the next start in that folder removes exactly those names."""
    folder = tmp_path / "ck"
    folder.mkdir()
    stale = [".checkpoint.h5.k9x2_a1b.tmp", ".model.h5.0123abcd.tmp"]
    kept = ["notes.tmp", ".checkpoint.h5.mine.tmp", ".other.h5.0123abcd.tmp"]
    for name in stale + kept:
        target = folder / name
        target.write_text("partial")
    proc = train(["--max-steps", "2", "--checkpoint", str(folder), "--save", str(folder / "model.h5")],
                 np_=2, data=data)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(folder)) == sorted(kept + [CHECKPOINT_NAME, "model.h5"])


# ---------------------------------------------------------------- input values
def test_nan_in_the_training_data_is_a_setup_error(tmp_path):
    path = tiny(tmp_path / "nan.h5", nan_at=(17, 40))
    assert_setup_error(train([], np_=2, data=path),
                       f"--data {path}: train/x holds non-finite values (NaN or Inf): 2 value(s) in "
                       "2 sample(s), the first at sample 17")


def test_an_empty_test_split_is_refused(tmp_path):
    path = tiny(tmp_path / "notest.h5", n_test=0)
    assert_setup_error(train([], np_=2, data=path), f"--data {path}: the test split is empty")


def test_a_directory_as_data_says_so(tmp_path):
    assert_setup_error(train(["--data", str(tmp_path)]), f"--data {tmp_path}: is a directory")


def test_negative_numbers_in_list_options_parse(data):
    assert_setup_error(train(["--speeds", "-1,1"], np_=2, data=data),
                       "--speeds: entry 0 ('-1') must be a finite number > 0")


def test_argparse_errors_are_one_line_under_four_ranks():
    proc = train(["--no-such-flag"], np_=4)
    assert_setup_error(proc, "unrecognized arguments: --no-such-flag")
    assert "usage:" not in proc.stderr


def test_help_is_printed_once_under_two_ranks():
    proc = train(["--help"], np_=2)
    assert proc.returncode == 0 and proc.stdout.count("usage:") == 1, proc.stdout


# ---------------------------------------------------------------- resume
def test_resume_on_other_data_at_an_epoch_boundary_is_refused(tmp_path):
    one = tiny(tmp_path / "one.h5", seed=0)
    other = tiny(tmp_path / "other.h5", seed=1)  # the same counts and shapes, other values
    folder = str(tmp_path / "ck")
    first = train(["--checkpoint", folder], np_=2, data=one)
    assert first.returncode == 0, first.stderr
    proc = train(["--epochs", "2", "--checkpoint", folder, "--resume"], np_=2, data=other)
    assert_setup_error(proc, "was written on other data")
    assert "fingerprint" in proc.stderr
    again = train(["--epochs", "2", "--checkpoint", folder, "--resume"], np_=2, data=one)
    assert again.returncode == 0 and "resumed" in again.stdout, again.stderr


def test_resume_with_other_options_is_refused(data, tmp_path):
    folder = str(tmp_path / "ck")
    assert train(["--checkpoint", folder], data=data).returncode == 0
    proc = train(["--epochs", "2", "--checkpoint", folder, "--resume", "--lr", "0.5", "--seed", "4"], data=data)
    assert_setup_error(proc, "was written with --seed 0 --lr 0.02; this run has --seed 4 --lr 0.5")


# ---------------------------------------------------------------- the final write
def test_save_failing_at_the_end_rescues_the_model(data, tmp_path):
    """The disk fills while training: the final --save fails (emulated deterministically by a
    sitecustomize hook that makes the trainer's save_model raise ENOSPC for that folder), and
    the model goes to the working folder, which the message names."""
    out = tmp_path / "out"
    out.mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import errno, os, mpidl.app.trainer as t\n"
        "real = t.save_model\n"
        "def full(path, model):\n"
        f"    if path.startswith({str(out)!r}):\n"
        "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "    return real(path, model)\n"
        "t.save_model = full\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "mpidl.train", "--data", data, "--epochs", "1", "--batch-size", "8",
           "--speeds", "1", "--save", str(out / "model.h5"), "--metrics", str(tmp_path / "m.jsonl")]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    rescued, = work.glob("mpidl-rescued-model.*.h5")
    assert proc.stderr.strip() == (
        f"error: cannot write the final model to {out / 'model.h5'}: No space left on device (ENOSPC); the "
        f"trained model was saved to {rescued} instead (mpidl.app.checkpoint.load_model reads it)")
    assert "epoch   1/1" in proc.stdout  # the training did happen
    from mpidl.app.checkpoint import load_model

    assert load_model(str(rescued)).name == "hsicnn"


def test_a_frozen_rank_ends_the_job_within_the_failure_bound_naming_it(data):
    """Rank 1 SIGSTOPs itself at step 3 (a frozen host, on one machine): rank 0 waits in the
    step's allreduce, which never returns; its failure bound (--failure-timeout 5) ends the job
    with exit code 3 and a line that names rank 1. The time is not asserted beyond the
    subprocess's generous limit (a loaded machine)."""
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    cmd = [MPIEXEC, "-n", "2", "-launcher", "fork", sys.executable, str(ROOT / "tests" / "faulty_train.py"),
           "--data", data, "--epochs", "3", "--batch-size", "8", "--speeds", "1,1", "--failure-timeout", "5"]
    env = dict(os.environ, MPIDL_INJECT_FAULT="1:3:stop")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "failure bound: a rank without progress for 5 s (--failure-timeout)" in out
    assert "no heartbeat from rank [1] on" in out and "Ending the job (exit code 3)" in out, out
    assert out.count("Ending the job") == 1, out  # one line for the job, by rank 0
