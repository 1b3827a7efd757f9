"""The README's custom-loop example: the file is the README's code block, and it runs as
printed under mpiexec with 4 ranks as 2 emulated nodes (the ``node`` strategy)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "mpidl" / "examples" / "custom_loop.py"
MPIEXEC = launcher.default_mpiexec()


def test_the_readme_prints_the_example_file():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert EXAMPLE.read_text() in blocks


def test_the_example_is_short():
    assert len(EXAMPLE.read_text().splitlines()) <= 40


@pytest.mark.launcher
def test_the_example_runs_as_printed_on_two_emulated_nodes():
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    env = dict(os.environ, MPIDL_RANKS_PER_NODE="2", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    proc = subprocess.run(launcher.mpiexec(4, [sys.executable, "-m", "mpidl.examples.custom_loop"],
                                           exe=MPIEXEC), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2", "epoch 3"], proc.stdout
    accuracy = float(lines[-1].rsplit(" ", 1)[1].rstrip("%"))
    assert accuracy > 80.0, proc.stdout
