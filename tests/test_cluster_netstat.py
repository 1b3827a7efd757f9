# python -m pytest -q tests/test_cluster_netstat.py
"""mpidl/app/netstat.py: the kernel's byte counters of the non-loopback interfaces, as differences
since a reset, merged per host (on a fake /sys/class/net tree)."""

import socket

from mpidl.app.netstat import WireCounter, interface_bytes, per_host


def write_iface(root, name, tx, rx):
    stats = root / name / "statistics"
    stats.mkdir(parents=True, exist_ok=True)
    (stats / "tx_bytes").write_text(f"{tx}\n")
    (stats / "rx_bytes").write_text(f"{rx}\n")


def test_loopback_is_left_out_and_counts_are_read(tmp_path):
    write_iface(tmp_path, "lo", 10**9, 10**9)
    write_iface(tmp_path, "eth0", 100, 200)
    assert interface_bytes(tmp_path) == {"eth0": {"tx_bytes": 100, "rx_bytes": 200}}


def test_since_is_the_difference_over_interfaces_present_both_times(tmp_path):
    write_iface(tmp_path, "eth0", 100, 200)
    write_iface(tmp_path, "eth1", 5, 5)
    counter = WireCounter(tmp_path)
    write_iface(tmp_path, "eth0", 1100, 2200)
    write_iface(tmp_path, "eth1", 6, 5)
    write_iface(tmp_path, "veth9", 10**6, 10**6)  # appeared after the reset: not counted
    assert counter.since() == {"host": socket.gethostname(), "tx_bytes": 1001, "rx_bytes": 2000}
    counter.reset()
    assert counter.since()["tx_bytes"] == 0


def test_per_host_keeps_one_sample_per_host():
    samples = [{"host": "a", "tx_bytes": 1, "rx_bytes": 2}, {"host": "a", "tx_bytes": 3, "rx_bytes": 4},
               {"host": "b", "tx_bytes": 5, "rx_bytes": 6}]
    assert per_host(samples) == {"a": {"tx_bytes": 1, "rx_bytes": 2}, "b": {"tx_bytes": 5, "rx_bytes": 6}}


def test_a_missing_tree_gives_no_interfaces(tmp_path):
    assert interface_bytes(tmp_path / "absent") == {}
