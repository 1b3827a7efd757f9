"""The thread policy (mpidl/threads.py), each case in a fresh interpreter with its own environment."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_PROBE = """
import json, numpy
from mpidl.models import build_model
from mpidl import threads
build_model("hsicnn", (4, 4, 4), 3)
print(json.dumps(threads.describe()))
"""


def _policy(**env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM_THREADS", "MPI_LOCALNRANKS",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"))}
    clean.update(env)
    clean["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.slow
def test_nothing_set_gives_one_blas_thread_and_passive_openmp():
    info = _policy()
    assert info["omp_wait_policy"] == "PASSIVE"
    assert info["threads"] == _cores() and info["numba"] == _cores() and info["gemm_threads"] == _cores()
    assert info["blas"] and all(count == 1 for count in info["blas"].values()), info["blas"]
    assert info["malloc_policy"] is (platform.libc_ver()[0] == "glibc")


@pytest.mark.slow
def test_explicit_settings_win():
    info = _policy(OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   MALLOC_MMAP_THRESHOLD_="131072")
    assert info["omp_wait_policy"] == "ACTIVE"
    assert info["malloc_policy"] is False
    assert info["threads"] == 1 and info["numba"] == 1 and info["gemm_threads"] == 1


_NESTED_BLAS_PROBE = """
import json
from threadpoolctl import threadpool_info
from mpidl import threads

def blas():
    return {lib["filepath"].rsplit("/", 1)[-1]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

with threads.one_blas_thread():
    import scipy.linalg.cython_blas  # the BLAS Numba's np.dot calls: limited even if first loaded here
    inside = blas()
print(json.dumps({"inside": inside, "after": blas()}))
"""


@pytest.mark.slow
def test_blas_called_from_parallel_kernels_runs_one_thread_even_when_the_user_sets_more():
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM_THREADS"))}
    clean.update(OPENBLAS_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _NESTED_BLAS_PROBE], env=clean, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert any("scipy" in name for name in result["inside"]), result  # SciPy's BLAS was loaded and seen
    assert result["inside"] and all(count == 1 for count in result["inside"].values()), result
    assert all(count == 2 for count in result["after"].values()), result  # the user's count is back


@pytest.mark.slow
def test_launcher_count_divides_the_cores():
    info = _policy(MPI_LOCALNRANKS=str(_cores()))
    assert info["threads"] == 1 and info["numba"] == 1 and info["gemm_threads"] == 1


def test_threads_per_process_arithmetic(monkeypatch):
    from mpidl import threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert threads.threads_per_process(3) == 2
    assert threads.threads_per_process(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.threads_per_process(16) == 3


def test_malloc_policy_respects_the_users_variables(monkeypatch):
    from mpidl import threads
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert threads.set_malloc_policy() is False


def test_malloc_policy_is_set_on_glibc(monkeypatch):
    from mpidl import threads

    for name in threads._MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    expected = platform.libc_ver()[0] == "glibc"
    assert threads.set_malloc_policy() is expected
