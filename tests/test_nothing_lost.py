"""The promises every entry point keeps (issue 31), where no single tool's test file is the
place: a data file another process holds open says so and what to do, under every tool that
reads it; a bad --model-args value names the argument and the kind it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpidl.app.outputs import LOCKED

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
HOLD_OPEN = """
import sys, time, h5py
f = h5py.File(sys.argv[1], "r+")
print("open", flush=True)
time.sleep(120)
"""


def run(args, np_=None, timeout=300):
    cmd = [sys.executable, *args]
    if np_ is not None:
        if not Path(MPIEXEC).exists():
            pytest.skip(f"no mpiexec at {MPIEXEC}")
        cmd = [MPIEXEC, "-n", str(np_), "-launcher", "fork", *cmd]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.fixture
def layout(tmp_path):
    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4, 3, 3)).astype(np.float32)
    y = np.arange(40) % 2
    path = tmp_path / "data.h5"
    write_layout(path, {"train": (x, y), "test": (x[:10], y[:10])}, ["a", "b"])
    return path


def test_a_file_held_open_by_a_writer_says_so_and_what_to_do(layout):
    """Before: "[Errno 11] Unable to synchronously open file (unable to lock file, errno = 11,
    error message = 'Resource temporarily unavailable')", nothing about another process."""
    writer = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, str(layout)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "open\n"
        expected = f"error: {layout}: cannot be read: {LOCKED}\n"
        assert LOCKED == ("another process holds it open for writing (HDF5 file locking): close that "
                          "process, or, if it has finished writing, run with HDF5_USE_FILE_LOCKING=FALSE")
        proc = run(["-m", "mpidl.data_tools", "info", str(layout)])
        assert (proc.returncode, proc.stderr) == (1, expected)
        proc = run(["-m", "mpidl.train", "--data", str(layout), "--epochs", "1"], np_=2)
        assert (proc.returncode, proc.stderr) == (2, expected)
        proc = run(["-m", "mpidl.gan", "--data", str(layout), "--epochs", "1"], np_=2)
        assert (proc.returncode, proc.stderr) == (2, expected)
    finally:
        writer.kill()
        writer.wait()
    # the writer gone, the same file trains
    proc = run(["-m", "mpidl.data_tools", "info", str(layout)])
    assert proc.returncode == 0, proc.stderr


def test_a_model_argument_of_the_wrong_kind_is_named(layout):
    """Before: "error: invalid literal for int() with base 10: 'a'"."""
    proc = run(["-m", "mpidl.train", "--data", str(layout), "--model-args", '{"channels": "ab"}'], np_=2)
    assert proc.returncode == 2
    assert proc.stderr == ("error: model 'hsicnn': argument 'channels' (--model-args) must be a list of "
                           "integers such as [64, 64], got 'ab'\n")
    proc = run(["-m", "mpidl.train", "--data", str(layout), "--model", "vit", "--model-args", '{"depth": 1.5}'],
               np_=2)
    assert proc.stderr == ("error: model 'vit': argument 'depth' (--model-args) must be an integer such as 64, "
                           "got 1.5\n")
