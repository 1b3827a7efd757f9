"""``benchmarks/cluster_claims.py node --quick`` on a real 2-host cluster of ``jobs/cluster.sh``.

Brings up its own cluster (name ``claimsq``), runs flat and node K'=10 for a few steps across
the hosts, and checks what the kernel saw on host 1's link: at least the bytes mpidl counted
for flat (the payload crossed the link), and fewer bytes for the node strategy than for flat;
then that the script left no cluster behind. Skips, saying why, where the cluster cannot be
started (not root, no namespaces or tbf, no MPICH launcher).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parents[1]
NAME = "claimsq"

pytestmark = [pytest.mark.slow, pytest.mark.launcher]


def _cluster(*args, timeout=120):
    return subprocess.run(["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", NAME, *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cluster_allowed():
    if os.geteuid() != 0:
        pytest.skip("the cluster needs root (network namespaces, tc, cgroups)")
    exe = launcher.default_mpiexec()
    if not Path(exe).exists() or launcher.flavor(exe) != launcher.MPICH:
        pytest.skip(f"cluster_claims.py launches with MPICH's hydra; {exe} is not MPICH")
    probe = _cluster("start", "--hosts", "2", "--rate", "1gbit")
    if probe.returncode != 0:
        _cluster("stop")
        pytest.skip(f"jobs/cluster.sh cannot start a cluster here: {(probe.stderr or probe.stdout).strip()[-300:]}")
    _cluster("stop")
    yield
    _cluster("stop")


def test_quick_node_table_counts_the_kernels_bytes(tmp_path, cluster_allowed):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_claims.py"), "node", "--quick",
                           "--rates", "1gbit", "--name", NAME, "--out", str(tmp_path), "--work", str(tmp_path / "w")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "cluster_node_quick.json").read_text())
    runs = {r["label"]: r for r in result["tables"][0]["runs"]}
    flat, node = runs["flat"], runs["node K'=10"]
    for run in (flat, node):
        assert run["code"] == 0 and run["epochs"], run["command"]
    flat_counted = sum(e["comm"]["world"]["bytes"] + e["comm"]["inter"]["bytes"] for e in flat["epochs"])
    assert flat_counted > 0
    assert flat["kernel"][0]["tx"] >= flat_counted, (flat["kernel"], flat_counted)
    assert node["kernel"][0]["tx"] < flat["kernel"][0]["tx"], (node["kernel"], flat["kernel"])
    text = (tmp_path / "cluster_node_quick.md").read_text()
    assert "| row | hosts x ranks | kernel: host 1 tx MB/epoch |" in text
    assert "-launcher-exec jobs/cluster_ssh.sh" in text
    assert not Path(f"/run/mpidl-cluster/{NAME}").exists()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{NAME}-node" not in netns


def test_quick_interleaved_overlap_steps_run_across_the_hosts(tmp_path, cluster_allowed):
    """``benchmarks/cluster_overlap_steps.py --quick``: one job on 2 hosts holds compute,
    blocking and overlap for both models; the record has every round and the bucket plan."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cluster_overlap_steps.py"), "--quick",
                           "--rate", "1gbit", "--name", NAME, "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "cluster_overlap_steps_quick.json").read_text())
    assert record["ranks"] == 2 and set(record["models"]) == {"resnet8", "vit"}
    for model in record["models"].values():
        assert model["buckets"] >= 5
        assert all(len(model["rounds"][c]["step_s"]) == 2 for c in ("compute", "blocking", "overlap"))
    assert (tmp_path / "cluster_overlap_steps_quick.md").is_file()
    assert not list(tmp_path.glob("*.tmp")), "the job's raw file is left behind"
    assert not Path(f"/run/mpidl-cluster/{NAME}").exists()
    assert f"{NAME}-node" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
