"""The kernel's own count of the bytes this machine (this host) put on and took off the wire.

``/sys/class/net/<interface>/statistics/{tx,rx}_bytes`` of every interface but the loopback:
on a cluster of ``jobs/cluster.sh`` that is the host's ``eth0``, the link to the other hosts,
so the difference around an epoch is the ground truth for the inter-node bytes mpidl counts
itself (``comm``: payload only; the kernel's count adds the Ethernet, IP and TCP headers of
every frame and the MPI library's own messages, a few per cent). On a machine whose interfaces
carry other traffic too, the figure is only an upper bound.
"""

from __future__ import annotations

import socket
from pathlib import Path

SYS_NET = Path("/sys/class/net")


def interface_bytes(root: Path = SYS_NET) -> dict[str, dict[str, int]]:
    """``{interface: {"tx_bytes": n, "rx_bytes": n}}`` of the non-loopback interfaces now."""
    counts = {}
    for iface in sorted(root.iterdir()) if root.is_dir() else []:
        if iface.name == "lo":
            continue
        try:
            counts[iface.name] = {key: int((iface / "statistics" / key).read_text())
                                  for key in ("tx_bytes", "rx_bytes")}
        except (OSError, ValueError):  # an interface that vanished or has no statistics
            continue
    return counts


class WireCounter:
    """Bytes on the wire of this host since :meth:`reset`: ``since()`` is
    ``{"host": hostname, "tx_bytes": sum_i (tx_i(now) - tx_i(reset)), "rx_bytes": ...}`` over
    the interfaces present at both times."""

    def __init__(self, root: Path = SYS_NET):
        self.root = root
        self.start = interface_bytes(root)

    def reset(self) -> None:
        self.start = interface_bytes(self.root)

    def since(self) -> dict:
        now = interface_bytes(self.root)
        common = set(now) & set(self.start)
        return {"host": socket.gethostname(),
                **{key: sum(now[i][key] - self.start[i][key] for i in common)
                   for key in ("tx_bytes", "rx_bytes")}}


def per_host(samples: list[dict]) -> dict[str, dict[str, int]]:
    """``{host: {"tx_bytes", "rx_bytes"}}`` from every rank's :meth:`WireCounter.since` (ranks
    of one host see the same interfaces: the first sample of each host is kept)."""
    hosts: dict[str, dict[str, int]] = {}
    for sample in samples:
        hosts.setdefault(sample["host"], {"tx_bytes": sample["tx_bytes"], "rx_bytes": sample["rx_bytes"]})
    return hosts
