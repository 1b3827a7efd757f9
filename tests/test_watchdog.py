"""The failure bound (mpidl/distributed/watchdog.py): the bound, who is silent, who speaks, the
message; one real heartbeat exchange over UDP on this machine. Times are passed in (a fake
clock): nothing here depends on how fast the machine is."""

import socket
import threading
import time

import pytest

from mpidl.app.config import ConfigError, parse_config
from mpidl.distributed.watchdog import (EXIT_FAILURE_BOUND, FACTOR, FLOOR_S, WARMUP_MARKS, WARMUP_S, Peers,
                                        Progress, ProgressWatchdog, describe_silent, parse_failure_timeout,
                                        stall_message)


def test_the_failure_timeout_is_auto_or_positive_seconds():
    assert parse_failure_timeout("auto") is None
    assert parse_failure_timeout(None) is None
    assert parse_failure_timeout("12.5") == 12.5
    for bad in ("0", "-3", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match="--failure-timeout"):
            parse_failure_timeout(bad)


def test_the_command_line_checks_the_failure_timeout_before_mpi():
    assert parse_config(["--failure-timeout", "30"]).failure_timeout == "30"
    with pytest.raises(ConfigError, match="--failure-timeout"):
        parse_config(["--failure-timeout", "never"])


def test_a_fixed_bound_is_the_option():
    p = Progress(fixed_s=10.0)
    p.arm(0.0)
    assert p.bound_s == 10.0
    assert not p.stalled(9.9)
    assert p.stalled(10.1)
    p.mark(10.05, "step 1")
    assert not p.stalled(20.0) and p.stalled(20.1)


def test_the_auto_bound_waits_out_the_warm_up_then_scales_with_the_longest_gap():
    p = Progress(fixed_s=None)
    p.arm(0.0)
    assert p.bound_s == WARMUP_S
    t = 0.0
    for i in range(WARMUP_MARKS):
        t += 40.0 if i == 0 else 0.1  # the first step compiles: its gap is not a step's
        p.mark(t, f"step {i + 1}")
    # the gap before the first mark (compilation) is not counted
    assert p.longest_gap_s == pytest.approx(0.1)
    assert p.bound_s == FLOOR_S
    p.mark(t + 9.0, "the checkpoint")  # a long checkpoint write widens the bound
    assert p.bound_s == pytest.approx(FACTOR * 9.0)
    assert not p.stalled(t + 9.0 + FACTOR * 9.0 - 0.1)
    assert p.stalled(t + 9.0 + FACTOR * 9.0 + 0.1)


def test_silent_ranks_are_the_ones_not_heard_from():
    peers = Peers(rank=1, hosts=["h1", "h1", "h2", "h2", "h3"], started_at=0.0)
    for r in (0, 2, 3):
        peers.heard(r, 10.0)
    peers.heard(1, 10.0)  # itself: ignored
    peers.heard(9, 10.0)  # not a rank of the job: ignored
    assert peers.silent(11.0, 2.0) == [4]  # never heard: silent since the start
    assert peers.silent(13.0, 2.0) == [0, 2, 3, 4]
    peers.forget([4])
    assert peers.silent(11.0, 2.0) == []


def test_the_first_rank_to_end_speaks_and_is_not_named_as_lost():
    hosts = ["h1", "h2", "h3"]
    one = Peers(1, hosts, started_at=0.0)
    for r in range(3):
        one.heard(r, 10.0)
    assert one.speaks_for_job()
    one.heard(0, 10.5, ending=True)  # rank 0's bound passed first: it speaks
    assert not one.speaks_for_job()
    assert one.silent(30.0, 2.0) == [2]  # rank 0 is alive and ending, not lost


def test_the_message_names_the_silent_host_and_says_what_to_do():
    peers = Peers(0, ["a", "a", "b", "b", "c", "c"], started_at=0.0)
    for r in (1, 2, 3, 5):
        peers.heard(r, 99.0)
    peers.heard(4, 50.0)
    assert describe_silent(peers, [4]) == "rank [4] on c"
    assert describe_silent(peers, [4, 5]) == "ranks [4, 5] on c (all its ranks)"
    progress = Progress(fixed_s=10.0)
    progress.arm(0.0)
    progress.mark(88.0, "step 57")
    text = stall_message(progress, peers, 100.0, 1.0)
    assert "no progress for 12.0 s after step 57 (bound 10.0 s, --failure-timeout)" in text
    assert "rank [4] on c" in text and "(c)" in text
    assert "for 50.0 s" in text
    assert f"exit code {EXIT_FAILURE_BOUND}" in text and "NOT complete" in text and "--resume" in text


def test_ranks_that_fell_silent_later_are_named_apart_from_the_lost_host():
    peers = Peers(0, ["a", "b", "c"], started_at=0.0)
    peers.heard(1, 93.0)  # went quiet 3 s after host c
    peers.heard(2, 90.0)
    progress = Progress(fixed_s=10.0)
    progress.arm(0.0)
    progress.mark(89.0, "step 9")
    text = stall_message(progress, peers, 100.0, 1.0)
    assert "no heartbeat from rank [2] on c (all its ranks) for 10.0 s: that host is lost, frozen or cut off (c)" in text
    assert "rank [1] on b (all its ranks) fell silent 3.0 s later" in text


def test_the_message_says_when_it_cannot_name_the_host():
    peers = Peers(0, ["a", "b"], started_at=0.0)
    progress = Progress(fixed_s=5.0)
    progress.arm(0.0)
    # never heard anyone, but the start was long ago: rank 1 is silent, named as such
    assert "rank [1] on b" in stall_message(progress, peers, 6.0, 1.0)
    peers.heard(1, 5.9)
    assert "every rank is still heard from" in stall_message(progress, peers, 6.0, 1.0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_check_ends_the_job_once_and_only_when_the_bound_is_passed():
    clock, ended = FakeClock(), []
    dog = ProgressWatchdog(0, ["a", "b"], None, None, 5.0, end=ended.append, clock=clock)
    dog.progress.arm(0.0)
    dog.peers.started_at = 0.0
    clock.now = 4.0
    dog.mark("step 1")
    assert not dog.check(8.9) and ended == []
    assert dog.check(9.1)
    assert len(ended) == 1 and "rank [1] on b" in ended[0]
    assert not dog.check(20.0) and len(ended) == 1


def test_a_rank_that_does_not_speak_for_the_job_still_ends_without_a_message():
    clock, ended = FakeClock(), []
    dog = ProgressWatchdog(1, ["a", "b"], None, None, 5.0, end=ended.append, clock=clock)
    dog.progress.arm(0.0)
    dog.peers.heard(0, 5.0, ending=True)  # rank 0 ends the job and says why
    assert dog.check(5.5)
    assert ended == [""]


def test_heartbeats_cross_udp_and_a_stopped_rank_falls_silent():
    """Two watchdogs in this process, as two ranks: each hears the other; once one stops, the
    other names it. Generous waits (a loaded machine), no timing asserted."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    addresses = [s.getsockname() for s in socks]
    ended = []
    dogs = [ProgressWatchdog(r, ["h0", "h1"], addresses, socks[r], 1000.0, end=ended.append) for r in range(2)]
    for d in dogs:
        d.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(d.peers.heard_at for d in dogs):
            time.sleep(0.05)
        assert dogs[0].peers.heard_at.get(1) is not None and dogs[1].peers.heard_at.get(0) is not None
        dogs[1].stop()
        last = dogs[0].peers.heard_at[1]
        time.sleep(3 * dogs[0].period_s)
        assert dogs[0].peers.heard_at[1] == last  # nothing heard since
        assert dogs[0].peers.silent(time.monotonic(), 2 * dogs[0].period_s) == [1]
    finally:
        for d in dogs:
            d.stop()
    assert ended == []
    assert not any(t.name == "mpidl-failure-bound" and t.is_alive() for t in threading.enumerate())


def test_stop_wakes_the_thread_at_once(monkeypatch):
    """``stop()`` does not wait out the thread's ``select`` (every run's end would pay up to a
    heartbeat period): with a ``select`` that would wait 60 s, the thread is gone when
    ``stop()`` returns (it joins for at most ``2 x period + 1`` = 5 s)."""
    import mpidl.distributed.watchdog as watchdog_module  # noqa: PLC0415

    real_select = watchdog_module.select.select
    monkeypatch.setattr(watchdog_module.select, "select", lambda r, w, x, _timeout: real_select(r, w, x, 60.0))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    dog = ProgressWatchdog(0, ["h0"], [sock.getsockname()], sock, 1000.0, end=lambda message: None)
    dog.start()
    time.sleep(0.5)  # the thread is in its select by now (it would still be woken if not)
    dog.stop()
    assert not dog._thread.is_alive()
