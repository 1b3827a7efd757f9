# python -m pytest -q tests/test_jobs.py
"""The launch scripts in jobs/: they parse, they say how they are run, they use only options
that `python -m mpidl.train` knows, and the emulated two-node run really trains (under MPICH
or Open MPI, whichever mpi4py runs on)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launcher
from mpidl.app.config import build_parser

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted((REPO / "jobs").glob("*.sh"))
EXPECTED = {"local.sh", "local_cluster.sh", "slurm_cpu_single_node.sh", "slurm_cpu_multi_node.sh",
            "slurm_gpu.sh", "slurm_hetjob.sh", "gpu_check.sh", "launcher.sh", "local_slurm.sh",
            "slurm_packages.sh"}
# Options of the launchers (srun, scancel, Open MPI's mpirun, `mpiexec --version`) and of the
# tools jobs/local_slurm.sh calls (apt-get, mungekey) that appear next to training options;
# every other --option in a script must be one of `python -m mpidl.train`.
LAUNCHER_OPTIONS = {"--mpi", "--cpu-bind", "--map-by", "--gpus-per-task", "--cpus-per-task",
                    "--ntasks-per-node", "--oversubscribe", "--bind-to", "--mca", "--allow-run-as-root",
                    "--version", "--signal", "--batch", "--no-install-recommends", "--create",
                    "--keyfile", "--host", "--prtemca", "--name", "--with-ft"}
# The cluster's own tools (jobs/cluster*.sh) start no training: their options are theirs.
CLUSTER_TOOLS = {"cluster.sh", "cluster_slurm.sh", "cluster_ssh.sh"}


def _ids(paths):
    return [p.name for p in paths]


def test_every_job_is_there():
    assert EXPECTED <= {p.name for p in JOBS}


@pytest.mark.parametrize("script", JOBS, ids=_ids(JOBS))
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", JOBS, ids=_ids(JOBS))
def test_script_starts_with_the_line_that_runs_it(script):
    lines = script.read_text().splitlines()
    first = lines[1] if lines[0].startswith("#!") else lines[0]
    # e.g. "# sbatch jobs/slurm_gpu.sh ...", "# NP=4 bash jobs/local.sh ...", and for a file of
    # shell functions without "#!": "# source jobs/launcher.sh ..."
    runner = ("sbatch" if any(line.startswith("#SBATCH") for line in lines)
              else "bash" if lines[0].startswith("#!") else "source")
    pattern = rf"# ([A-Z_]+=\S+ )*{runner} jobs/{re.escape(script.name)}( |$)"
    assert re.match(pattern, first), f"{script.name}: first line {first!r} should match {pattern!r}"


@pytest.mark.parametrize("script", JOBS, ids=_ids(JOBS))
def test_script_uses_only_known_options(script):
    """A misspelt option (--sync_every, --ranks_per_node) would only fail on the cluster."""
    if script.name in CLUSTER_TOOLS:
        pytest.skip("a tool of the cluster, not a training launcher")
    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    # Lines that run a benchmark script use that script's options, not mpidl.train's.
    text = "\n".join(line for line in script.read_text().splitlines()
                     if not line.startswith("#SBATCH") and "benchmarks/" not in line)
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    unknown = used - known - LAUNCHER_OPTIONS
    assert not unknown, f"{script.name} uses options that mpidl.train does not know: {sorted(unknown)}"


def test_hetjob_gives_each_component_its_device():
    text = (REPO / "jobs" / "slurm_hetjob.sh").read_text()
    assert "#SBATCH hetjob" in text
    assert "--speeds auto" in text
    launch = text[text.index("\nexec srun "):]
    cpu_part, gpu_part = launch.split("\n    : ")
    assert "--device cpu" in cpu_part and "--device gpu" in gpu_part


@pytest.mark.launcher
def test_local_cluster_trains_on_two_emulated_nodes(tmp_path):
    mpiexec = launcher.default_mpiexec()
    if not launcher.available(mpiexec):
        pytest.skip("no mpiexec beside the interpreter or on PATH (pip install 'mpidl[mpich]')")

    metrics = tmp_path / "metrics.jsonl"
    # Tiny and fast: 3 steps, given speeds (no measuring), a small batch, an inter-node sync
    # inside the 3 steps so the node strategy's parameter average runs too.
    args = ["--epochs", "1", "--max-steps", "3", "--batch-size", "16", "--speeds", "1,1,1,1",
            "--sync-every", "2", "--quiet", "--metrics", str(metrics)]
    env = {**os.environ, "MPIEXEC": mpiexec, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(REPO / "jobs" / "local_cluster.sh"), *args], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"

    from mpidl.plot import load_metrics

    start, epochs, _ = load_metrics(metrics)
    # The point of the script: two nodes of two ranks (MPICH: MPI's own shared-memory split;
    # Open MPI: MPIDL_RANKS_PER_NODE=2).
    assert start["world_size"] == 4 and start["num_nodes"] == 2 and start["node_sizes"] == [2, 2]
    assert epochs[-1]["strategy"] == "node"


def _cluster(name, *args):
    return subprocess.run(["bash", str(REPO / "jobs" / "cluster.sh"), "--name", name, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def _cluster_leftovers(name):
    """What of cluster NAME is still on the machine: namespaces, cgroup folders, links, state."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in netns.splitlines() if line.startswith(f"{name}-")]
    left += [f"link {name}-br"] if f" {name}-br" in links else []
    left += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/mpidl-cluster-{name}")]
    left += [f"/run/mpidl-cluster/{name}"] if Path(f"/run/mpidl-cluster/{name}").exists() else []
    return left


@pytest.fixture
def cluster_name():
    """A cluster name of this test's own (beside any other cluster), stopped at the end even
    when the test fails; skips where this machine cannot run a cluster."""
    if os.geteuid() != 0:
        pytest.skip("jobs/cluster.sh needs root")
    name = f"tj{os.getpid() % 100000}"
    check = _cluster(name, "check")
    if check.returncode != 0:
        pytest.skip(f"no cluster here: {(check.stdout + check.stderr).strip()}")
    yield name
    _cluster(name, "stop")


@pytest.mark.parametrize("start_args, hosts", [
    (["--rate", "none"], 2),            # unshaped links: status finds no tbf line
    (["--hosts", "3", "--own-core", "no"], 3),  # hosts share the cores: the cpuset is inherited
], ids=["rate-none", "three-hosts-shared-cores"])
def test_cluster_start_and_stop_leave_nothing(cluster_name, start_args, hosts):
    started = _cluster(cluster_name, "start", *start_args)
    assert started.returncode == 0, f"stdout:\n{started.stdout}\nstderr:\n{started.stderr}"
    host_lines = [line for line in started.stdout.splitlines() if f"{cluster_name}-node" in line]
    assert len(host_lines) == hosts
    if "none" in start_args:
        assert all("link unshaped" in line for line in host_lines)
    for i in range(1, hosts + 1):
        cpus = Path(f"/sys/fs/cgroup/cpuset/mpidl-cluster-{cluster_name}/node{i}/cpuset.cpus")
        assert cpus.read_text().strip(), f"host {i} has no cpus in its cpuset"
    # A CPU share is a quota over a short period (a slower core at the scale of a step, not
    # a full one that stalls); shares under 0.1 core stretch the period to the kernel's 1 ms
    # smallest quota. status reads the share back.
    cpu = Path(f"/sys/fs/cgroup/cpu/mpidl-cluster-{cluster_name}/node2")
    for share, quota, period, shown in (("0.5", 5000, 10000, "cpu 0.50"), ("0.05", 1000, 20000, "cpu 0.05")):
        assert _cluster(cluster_name, "cpu", "2", share).returncode == 0
        limits = [int((cpu / f"cpu.cfs_{part}_us").read_text()) for part in ("quota", "period")]
        assert limits == [quota, period]
        status = [line for line in _cluster(cluster_name, "status").stdout.splitlines()
                  if f"{cluster_name}-node2" in line]
        assert status and shown in status[0], status
    # The thread policy inside a host reads its quota: 0.05 core -> 1 thread.
    policy = _cluster(cluster_name, "run", "2", "--", sys.executable, "-c",
                      "from mpidl.engine import threads; print(threads.cgroup_cpu_limit(), threads.usable_cores())")
    assert policy.returncode == 0 and policy.stdout.split() == ["0.05", "1"], policy.stdout + policy.stderr
    # CPU weight: the cluster weighs as its ranks (2 per host by default), each host
    # as its own, not the whole cluster as one ordinary process (cpu.shares 1024).
    weight = Path(f"/sys/fs/cgroup/cpu/mpidl-cluster-{cluster_name}")
    assert int((weight / "cpu.shares").read_text()) == 1024 * hosts * 2
    assert all(int((weight / f"node{i}" / "cpu.shares").read_text()) == 1024 * 2 for i in range(1, hosts + 1))
    # A process really runs inside a host: it joins the host's cgroups (cpuset included).
    inside = _cluster(cluster_name, "run", "1", "--", "hostname")
    assert inside.returncode == 0 and inside.stdout.strip() == f"{cluster_name}-node1", inside.stderr
    stopped = _cluster(cluster_name, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert _cluster_leftovers(cluster_name) == []
