"""Running benchmark jobs across the hosts of a ``jobs/cluster.sh`` cluster (no MPI, no torch here).

A :class:`Cluster` is one named cluster of network-namespace hosts on this machine
(``bash jobs/cluster.sh --name NAME ...``): it starts and stops it, changes a host's link rate
or CPU share, reads each host's kernel interface counters
(``/sys/class/net/eth0/statistics/{tx,rx}_bytes`` inside the host: the bytes that really
crossed its link, the ground truth of a run's traffic), and builds the MPICH command that puts
``sizes[i]`` ranks on host ``i+1``::

    mpiexec -n P -launcher ssh -launcher-exec jobs/cluster_ssh.sh -localhost NAME-head
            -hosts NAME-node1:s1,NAME-node2:s2 -genv UCX_TLS tcp,self -genv UCX_NET_DEVICES eth0 ...

``UCX_TLS=tcp,self``: UCX's default transports reach across network namespaces through shared
memory, and nothing would cross the link; with TCP the inter-host messages go through each
host's ``eth0`` (shaped by ``tc tbf``) while ranks of one host still use MPICH's shared memory.
``-localhost NAME-head``: the hosts' proxies call the launcher back at the bridge's address.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import common

CLUSTER_SH = common.ROOT / "jobs" / "cluster.sh"
CLUSTER_SSH = common.ROOT / "jobs" / "cluster_ssh.sh"
STATE_ROOT = Path("/run/mpidl-cluster")


class ClusterError(RuntimeError):
    """The cluster cannot be started or used here (the message says why)."""


class Cluster:
    """One cluster of ``jobs/cluster.sh``, by name (its hosts are ``NAME-node1..N``)."""

    def __init__(self, name: str = "claims", hosts: int = 2):
        self.name, self.hosts = name, hosts
        self.config: dict = {}

    # ------------------------------------------------------------------ life cycle
    def _sh(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        proc = subprocess.run(["bash", str(CLUSTER_SH), "--name", self.name, *args], capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"jobs/cluster.sh --name {self.name} {' '.join(args)}: "
                               f"{(proc.stderr or proc.stdout).strip()}")
        return proc.stdout

    def is_up(self) -> bool:
        return (STATE_ROOT / self.name / "cluster.env").is_file()

    def start(self, rate: str = "1gbit", cpus: str = "none", ranks: int = 2) -> None:
        """Bring the cluster up with ``rate`` (one tc rate, or per host ``r1,r2``; ``none``
        unshaped) and CPU shares ``cpus`` (cores per host, ``none`` unlimited). A cluster of
        this name already up with another configuration is stopped first."""
        wanted = {"rate": rate, "cpus": cpus, "ranks": ranks}
        if self.is_up() and self.config == wanted:
            return
        if self.is_up():
            self.stop()
        self._sh("start", "--hosts", str(self.hosts), "--ranks", str(ranks), "--rate", rate, "--cpu", cpus)
        self.config = wanted

    def stop(self) -> None:
        self._sh("stop", check=False)
        self.config = {}

    def set_link(self, host: int, rate: str) -> None:
        self._sh("link", str(host), rate)

    def set_cpu(self, host: int, share: str) -> None:
        self._sh("cpu", str(host), share)

    def status(self) -> str:
        return self._sh("status", check=False)

    # ------------------------------------------------------------------ ground truth
    def counters(self) -> list[dict]:
        """Per host: ``{"tx": bytes, "rx": bytes}`` of its ``eth0`` (the kernel's counters)."""
        out = []
        for i in range(1, self.hosts + 1):
            text = self._sh("run", str(i), "--", "cat", "/sys/class/net/eth0/statistics/tx_bytes",
                            "/sys/class/net/eth0/statistics/rx_bytes")
            tx, rx = (int(v) for v in text.split())
            out.append({"tx": tx, "rx": rx})
        return out

    @staticmethod
    def delta(before: list[dict], after: list[dict]) -> list[dict]:
        return [{k: a[k] - b[k] for k in ("tx", "rx")} for b, a in zip(before, after)]

    def address(self, host: int) -> str:
        env = (STATE_ROOT / self.name / "cluster.env").read_text()
        subnet = next(line.split("=", 1)[1] for line in env.splitlines() if line.startswith("SUBNET="))
        return f"10.77.{subnet.strip()}.{10 + host}"

    # ------------------------------------------------------------------ commands
    def mpiexec(self, sizes: list[int], program: list[str], env: dict | None = None) -> list[str]:
        """MPICH's command for ``sizes[i]`` ranks on host ``i+1``, every rank with ``env``."""
        if len(sizes) > self.hosts:
            raise ClusterError(f"{len(sizes)} nodes, but cluster {self.name} has {self.hosts} hosts")
        hosts = ",".join(f"{self.name}-node{i + 1}:{s}" for i, s in enumerate(sizes))
        cmd = [common.MPIEXEC, "-n", str(sum(sizes)), "-launcher", "ssh", "-launcher-exec", str(CLUSTER_SSH),
               "-localhost", f"{self.name}-head", "-hosts", hosts]
        for key, value in {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", **(env or {})}.items():
            cmd += ["-genv", key, str(value)]
        return cmd + [str(p) for p in program]


def run_measured(cluster: Cluster, cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run ``cmd`` (a job across the cluster) and return its exit code, wall seconds, the load
    average before it, and the kernel's per-host byte counts over the job."""
    load = "%.1f %.1f %.1f" % os.getloadavg()
    before = cluster.counters()
    code, seconds = common.run(cmd, log, timeout, env)
    after = cluster.counters()
    return {"code": code, "wall_s": seconds, "load": load, "kernel": Cluster.delta(before, after),
            "time": time.strftime("%H:%M:%S", time.gmtime())}
