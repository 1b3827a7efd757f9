# python -m pytest -q tests/test_cluster_launcher.py
"""The launch lines for a cluster of jobs/cluster.sh (MPIDL_CLUSTER=NAME): the shell helper
(jobs/launcher.sh) and the Python one (tests/launcher.py) give the same command, with the hosts,
the ssh stand-in and the transports each MPI needs; the cluster's state is a file written here
(MPIDL_CLUSTER_STATE_ROOT), so no cluster needs to be up."""

import os
import subprocess

import pytest

import launcher

REPO = launcher.JOBS.parent


@pytest.fixture
def cluster_state(tmp_path, monkeypatch):
    (tmp_path / "tst").mkdir()
    (tmp_path / "tst" / "cluster.env").write_text(
        "# cluster tst\nHOSTS=3\nRANKS=2\nSUBNET=99\nOWN_CORE=no\nSLURM=0\nRATES=\"1gbit 1gbit 1gbit\"\n")
    monkeypatch.setenv("MPIDL_CLUSTER_STATE_ROOT", str(tmp_path))
    monkeypatch.setenv("MPIDL_CLUSTER", "tst")
    return tmp_path


def shell_command(kind, ranks, nodes, program):
    script = (f"source jobs/launcher.sh && mpidl_mpiexec {ranks} {nodes} {' '.join(program)} "
              "&& printf '%s\\n' \"${MPIDL_CMD[@]}\"")
    env = dict(os.environ, MPIDL_MPI_FLAVOR=kind, MPIEXEC="mpiexec")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize("kind", [launcher.MPICH, launcher.OPENMPI])
@pytest.mark.parametrize("ranks,nodes", [(2, "2"), (4, "2"), (3, "2,1"), (6, "3")])
def test_python_and_shell_agree_on_a_cluster(cluster_state, kind, ranks, nodes):
    program = ["python", "-m", "mpidl.train"]
    py = launcher.mpiexec(ranks, program, nodes, exe="mpiexec", kind=kind)
    assert py == shell_command(kind, ranks, nodes, program)
    sizes = launcher.node_sizes(ranks, nodes)
    hosts = ",".join(f"tst-node{i + 1}:{s}" for i, s in enumerate(sizes))
    assert hosts in py
    assert str(launcher.JOBS / "cluster_ssh.sh") in py
    assert py[-3:] == program
    if kind == launcher.MPICH:
        # UCX over TCP on the host's interface: its default transports would cross the
        # namespaces through shared memory, never the link.
        assert py[py.index("UCX_TLS") + 1] == "tcp,self"
        assert "MPIR_CVAR_PROGRESS_TIMEOUT" in py and "-localhost" in py
    else:
        assert py[py.index("btl_tcp_if_include") + 1] == "10.77.99.0/24"
        assert "plm_ssh_agent" in py and "MPIDL_RANKS_PER_NODE" not in " ".join(py)


def test_ulfm_on_a_cluster_under_open_mpi(cluster_state, monkeypatch):
    monkeypatch.setenv("MPIDL_FT", "ulfm")
    program = ["python", "-m", "mpidl.train"]
    py = launcher.mpiexec(4, program, "2", exe="mpiexec", kind=launcher.OPENMPI)
    assert py == shell_command(launcher.OPENMPI, 4, "2", program)
    assert py[:3] == ["mpiexec", "--with-ft", "ulfm"] and "plm_ssh_agent" in py
    with pytest.raises(ValueError, match="no usable ULFM"):
        launcher.mpiexec(4, program, "2", exe="mpiexec", kind=launcher.MPICH)


@pytest.mark.parametrize("kind", [launcher.MPICH, launcher.OPENMPI])
def test_more_nodes_than_hosts_is_refused(cluster_state, kind):
    with pytest.raises(ValueError, match="has 3 hosts"):
        launcher.mpiexec(4, ["x"], 4, exe="mpiexec", kind=kind)
    script = "source jobs/launcher.sh && mpidl_mpiexec 4 4 x"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, MPIDL_MPI_FLAVOR=kind), timeout=60)
    assert out.returncode == 2 and "has 3 hosts" in out.stderr


def test_a_cluster_that_is_not_up_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIDL_CLUSTER_STATE_ROOT", str(tmp_path))
    monkeypatch.setenv("MPIDL_CLUSTER", "nosuch")
    with pytest.raises(RuntimeError, match="nosuch.*not up"):
        launcher.mpiexec(2, ["x"], 2, exe="mpiexec", kind=launcher.MPICH)
