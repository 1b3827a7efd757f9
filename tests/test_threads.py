"""The thread policy (mpidl/engine/threads.py), each case in a fresh interpreter with its own environment.

The policy is applied by one explicit call, ``threads.apply()``, the first thing a training
program does: the probes below make it, as such a program would, and check that nothing else
(building a model or a parameter buffer, running kernels) changes the process."""

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
import json, time, numpy
from mpidl.engine.models import build_model
from mpidl.engine import threads
{setup}
threads.apply()
build_model("hsicnn", (4, 4, 4), 3)
a = numpy.ones((512, 512), numpy.float32)
a @ a  # a product large enough for BLAS's threads, whatever their count
start = time.process_time()
time.sleep(0.3)  # BLAS's idle workers spin now, or sleep
info = threads.describe()
info["idle_cpu_s"] = time.process_time() - start
print(json.dumps(info))
"""


def _policy(setup: str = "", **env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM_THREADS", "MPI_LOCALNRANKS",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_"))}
    clean.update(env)
    clean["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(setup=setup)], env=clean, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.slow
def test_nothing_set_gives_blas_threads_that_sleep_and_passive_openmp():
    """NumPy imported before mpidl (as a user would): BLAS still runs T threads whose idle
    workers sleep right after a call (OpenBLAS's default keeps them spinning about 0.1 s, which
    would show as CPU time while the process sleeps), and mpidl does not split products."""
    info = _policy()
    cores = _cores()
    assert info["omp_wait_policy"] == "PASSIVE"
    assert info["threads"] == cores and info["numba"] == cores
    assert info["malloc_policy"] is (platform.libc_ver()[0] == "glibc")
    assert info["blas"], info
    if cores == 1:
        assert all(count == 1 for count in info["blas"].values()), info["blas"]
        return
    assert info["blas_workers_sleep"] is True, info
    assert info["gemm_threads"] == 1 and all(count == cores for count in info["blas"].values()), info
    assert info["idle_cpu_s"] < 0.03, info


@pytest.mark.slow
def test_blas_that_cannot_sleep_runs_one_thread_and_mpidl_splits_the_products():
    info = _policy(setup="threads._openblas_workers_sleep = lambda: False")
    assert info["threads"] == _cores() and info["gemm_threads"] == _cores()
    assert all(count == 1 for count in info["blas"].values()), info["blas"]
    assert info["idle_cpu_s"] < 0.03, info  # one thread per call: no worker exists to spin


@pytest.mark.slow
def test_explicit_settings_win():
    info = _policy(OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   MALLOC_MMAP_THRESHOLD_="131072")
    assert info["omp_wait_policy"] == "ACTIVE"
    assert info["malloc_policy"] is False
    assert info["threads"] == 1 and info["numba"] == 1 and info["gemm_threads"] == 1


@pytest.mark.slow
def test_every_openblas_runs_one_multithreaded_product_and_keeps_the_users_count():
    """A process on one thread never runs a multithreaded product by itself, and its OpenBLAS
    then runs long one-thread products 2-3x slower (mpidl/engine/threads.py, ``_prime_openblas``):
    the policy primes NumPy's and SciPy's OpenBLAS (Numba's ``np.dot``) all the same, and
    both still run the user's one thread after."""
    info = _policy(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if not any("openblas" in name for name in info["blas"]):
        pytest.skip(f"no OpenBLAS loaded: {info['blas']}")
    assert info["threads"] == 1
    assert sorted(info["openblas_primed"]) == sorted(name for name in info["blas"] if "openblas" in name), info
    assert any("scipy_openblas64" in name for name in info["openblas_primed"]), info  # NumPy's
    assert len(info["openblas_primed"]) >= 2, info  # and SciPy's
    assert all(count == 1 for count in info["blas"].values()), info


_NESTED_BLAS_PROBE = """
import json
from threadpoolctl import threadpool_info
from mpidl.engine import threads

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


@pytest.mark.slow
def test_srun_step_layout_divides_the_cores():
    """Under ``srun`` (no ``mpiexec`` variable), this node's entry of the step's layout."""
    info = _policy(SLURM_STEP_TASKS_PER_NODE=f"1,{_cores()}", SLURM_NODEID="1")
    assert info["threads"] == 1 and info["numba"] == 1


_NOTHING_BUT_APPLY_PROBE = """
import json, os
import numpy as np
import numba
from threadpoolctl import threadpool_info
from mpidl.engine import threads
from mpidl.engine.models import build_model
from mpidl.engine.nn import Linear, ReLU, Sequential, SoftmaxCrossEntropy
from mpidl.engine.params import FlatParameters
import scipy.linalg.cython_blas  # every BLAS a kernel may call, loaded before the first look

def state():
    return {"environ": dict(os.environ), "numba": numba.get_num_threads(),
            "blas": {p["filepath"]: p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"},
            "applied": threads.describe()["threads"], "malloc_policy": threads.describe()["malloc_policy"]}

before = state()
net = Sequential(Linear(8, 16), ReLU(), Linear(16, 3))
FlatParameters(net.named_parameters())  # a network of one's own
model = build_model("hsicnn", (4, 4, 4), 3)  # a named model: conv kernels (BLAS inside Numba's threads)
loss = SoftmaxCrossEntropy()
x = np.random.default_rng(0).standard_normal((8, 4, 4, 4)).astype(np.float32)
loss.forward(model.forward(x), np.zeros(8, int))
model.backward(loss.backward())
after_kernels = state()
applied = threads.apply()
os.environ["OMP_NUM_THREADS"] = "1"  # decided once: a later call changes nothing
again = threads.apply()
print(json.dumps({"before": before, "after_kernels": after_kernels, "applied": applied, "again": again}))
"""


@pytest.mark.slow
def test_only_apply_changes_the_process_and_decides_once():
    """Building a network of one's own or a named model and running its kernels change
    nothing of the process (environment, Numba's and BLAS's thread counts, malloc): only
    :func:`mpidl.engine.threads.apply` does, once per process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM_THREADS"))}
    clean["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _NOTHING_BUT_APPLY_PROBE], env=clean, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = result["before"], result["after_kernels"]
    assert before["applied"] is None and after["applied"] is None, result
    assert after["malloc_policy"] is False, result
    assert after["environ"] == before["environ"]
    assert after["numba"] == before["numba"] and after["blas"] == before["blas"], result
    applied = result["applied"]
    assert applied["threads"] == threads_expected() and applied["omp_wait_policy"] == "PASSIVE", applied
    assert result["again"]["threads"] == applied["threads"], result
    assert result["again"]["numba"] == applied["numba"], result


def threads_expected() -> int:
    from mpidl.engine import threads
    return max(1, _cores() // threads.launcher_local_size())


#: The programs that may apply the policy: the command lines (and their shared entry code) and
#: the example training script. No library module does (a constructor, an import, a kernel).
PROGRAMS = ("mpidl/train.py", "mpidl/gan.py", "mpidl/predict.py", "mpidl/app/cli.py", "mpidl/examples/")


def _calls_apply(source: str) -> bool:
    """Whether ``source`` calls :func:`mpidl.engine.threads.apply`, under whatever name it
    imported the module or the function as."""
    import ast

    modules, functions = set(), set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("mpidl.engine", "mpidl.engine.threads"):
            for alias in node.names:
                if node.module == "mpidl.engine" and alias.name == "threads":
                    modules.add(alias.asname or alias.name)
                if node.module == "mpidl.engine.threads" and alias.name == "apply":
                    functions.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(alias.asname for alias in node.names if alias.name == "mpidl.engine.threads" and alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in functions:
                return True
            if isinstance(func, ast.Attribute) and func.attr == "apply" and (
                    isinstance(func.value, ast.Name) and func.value.id in modules
                    or ast.unparse(func.value) == "mpidl.engine.threads"):
                return True
    return False


def test_only_the_programs_apply_the_policy():
    """In the package, the kernels and the data tools, only a command line's module (or the
    example script) calls :func:`mpidl.engine.threads.apply`: a library module never changes
    the process for its caller (a parameter buffer used to, when it was built)."""
    assert _calls_apply("from mpidl.engine import threads as t\nt.apply()")  # the check sees a call
    assert _calls_apply("from mpidl.engine.threads import apply as a\na()")
    assert not _calls_apply('"""threads.apply()"""')
    callers = sorted(str(path.relative_to(ROOT)) for folder in ("mpidl", "kernels", "data_tools")
                     for path in (ROOT / folder).rglob("*.py") if _calls_apply(path.read_text()))
    assert [c for c in callers if not c.startswith(PROGRAMS)] == [], callers


def test_slurm_step_layout():
    from mpidl.engine.threads import slurm_step_local_size

    layout = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}
    assert [slurm_step_local_size({**layout, "SLURM_NODEID": str(node)}) for node in range(3)] == [4, 4, 3]
    assert slurm_step_local_size({**layout, "SLURM_NODEID": "3"}) is None  # not in the layout
    assert slurm_step_local_size(layout) is None  # no node id
    assert slurm_step_local_size({"SLURM_STEP_TASKS_PER_NODE": "4(x", "SLURM_NODEID": "0"}) is None
    assert slurm_step_local_size({}) is None


def test_launcher_count_order(monkeypatch):
    from mpidl.engine import threads

    for name in (*threads.LAUNCHER_LOCAL_SIZE, threads.SLURM_LOCAL_SIZE, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    assert threads.launcher_local_size() == 1
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")  # --ntasks-per-node, as Slurm writes it
    assert threads.launcher_local_size() == 8
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "6,2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert threads.launcher_local_size() == 2  # the step's own layout first
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")
    assert threads.launcher_local_size() == 3  # mpiexec's count first


def test_threads_per_process_arithmetic(monkeypatch):
    from mpidl.engine import threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert threads.threads_per_process(3) == 2
    assert threads.threads_per_process(16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.threads_per_process(16) == 3


def test_malloc_policy_respects_the_users_variables(monkeypatch):
    from mpidl.engine import threads
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert threads.set_malloc_policy() is False


def test_malloc_policy_is_set_on_glibc(monkeypatch):
    from mpidl.engine import threads

    for name in threads._MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    expected = platform.libc_ver()[0] == "glibc"
    assert threads.set_malloc_policy() is expected


def _fake_cgroup(tmp_path, self_cgroup: str, files: dict) -> tuple[str, str]:
    """A cgroup mount under ``tmp_path/cgroup`` holding ``files`` (relative path -> text), and a
    ``/proc/self/cgroup`` of ``self_cgroup``'s lines."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    proc = tmp_path / "self_cgroup"
    proc.write_text(self_cgroup)
    return str(root), str(proc)


def test_cgroup_v1_quota_of_the_process_and_its_ancestors(tmp_path):
    """A host of jobs/cluster.sh: cgroup v1, the cpu controller at cpu,cpuacct with a ``cpu``
    link, the host's cgroup two levels down: 1 core (10 ms per 10 ms)."""
    from mpidl.engine.threads import cgroup_cpu_limit

    node = "cpu/mpidl-cluster-x/node1"
    root, proc = _fake_cgroup(tmp_path, "12:freezer:/mpidl-cluster-x/node1\n"
                              "4:cpu,cpuacct:/mpidl-cluster-x/node1\n3:cpuset:/mpidl-cluster-x/node1\n",
                              {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
                               "cpu/mpidl-cluster-x/cpu.cfs_quota_us": "-1\n",
                               "cpu/mpidl-cluster-x/cpu.cfs_period_us": "100000\n",
                               f"{node}/cpu.cfs_quota_us": "10000\n", f"{node}/cpu.cfs_period_us": "10000\n"})
    assert cgroup_cpu_limit(root, proc) == 1.0
    # a parent's quota binds: 0.5 core above the host's 1
    (tmp_path / "cgroup/cpu/mpidl-cluster-x/cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_cpu_limit(root, proc) == 0.5
    # no quota anywhere (-1): no limit
    for name in ("cpu/mpidl-cluster-x/cpu.cfs_quota_us", f"{node}/cpu.cfs_quota_us"):
        (tmp_path / "cgroup" / name).write_text("-1\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_cgroup_v2_cpu_max_and_unreadable_cases(tmp_path):
    from mpidl.engine.threads import cgroup_cpu_limit

    root, proc = _fake_cgroup(tmp_path, "0::/job/step\n", {"cpu.max": "max 100000\n", "job/cpu.max": "250000 100000\n",
                                                           "job/step/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 2.5
    assert cgroup_cpu_limit(root, str(tmp_path / "missing")) is None  # no /proc/self/cgroup: no limit
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    root2, proc2 = _fake_cgroup(garbled, "0::/\n", {"cpu.max": "lots\n"})
    assert cgroup_cpu_limit(root2, proc2) is None


def test_threads_follow_the_cgroup_quota_not_the_affinity(monkeypatch):
    """Issue 40: a 1-core-quota host whose cpuset holds 2 cores ran 2 threads and was throttled.
    T is the affinity's cores capped by the quota, rounded down, at least 1."""
    from mpidl.engine import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name in (*threads.LAUNCHER_LOCAL_SIZE, threads.SLURM_LOCAL_SIZE, "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "affinity_cores", lambda: 8)
    for quota, expected in ((None, 8), (1.0, 1), (1.5, 1), (0.25, 1), (2.0, 2), (3.99, 3), (16.0, 8)):
        monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda quota=quota: quota)
        assert threads.usable_cores() == expected, quota
        assert threads.threads_per_process(1) == expected
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 4.0)
    assert threads.threads_per_process(2) == 2  # the quota's cores shared by the machine's ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.threads_per_process(1) == 3  # the user's count still wins
