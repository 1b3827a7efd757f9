"""The speed probe: how :class:`~.measured.MeasuredSplit` measures the ranks before training.

``probe(n)`` is one forward + backward on ``n`` samples (the loop's own code, no
communication, leaving the model's buffers as it found them). Every rank:

1. :func:`warm_up`: one untimed ``probe(2)``, the node's first rank before the others, so that
   one process compiles the JIT kernels into the shared cache and the rest load them;
2. times ``probe(b)`` at the batch sizes of :func:`probe_sizes` in :data:`PROBE_ROUNDS` rounds
   after one untimed round, every pass started by all ranks together (a sleeping barrier), so
   that each pass is measured under the contention of a real step. On a rank under a CFS CPU
   quota (:func:`cpu_quota`), a pass is repeated back to back until it spans
   :data:`QUOTA_PERIODS` quota periods and the time per pass is their mean: a capped process
   runs at full speed until its quota of the period is spent and then stalls until the next
   period, so a pass shorter than the period may run unthrottled and look as fast as an
   uncapped one (the 10 ms quota of a half core: a 5 ms pass either takes 5 ms or 10 ms); only
   over several periods is the rate the share. Below one core the time is also at least the
   CPU seconds used over the quota's cores (exact over many periods, whatever the phase). The
   quota's own throttling counter
   (:func:`throttled_s`, ``cpu.stat``) over the probe is reported with the split;
3. fits ``t_i(b) = a_i + c_i b`` to its passes (:func:`~.balance.fit_cost`); the fits and
   each rank's timing noise are gathered on every rank.

Every decision is computed from gathered numbers, so every rank takes the same branch.
"""

from __future__ import annotations

import os
import statistics
import time

from mpidl.distributed.split import balance

__all__ = ["PROBE_ROUNDS", "QUOTA_PERIODS", "probe_sizes", "sleeping_barrier", "warm_up", "measure_costs",
           "cpu_quota", "throttled_s"]

#: timed rounds of the speed probe (each times every probe batch size once)
PROBE_ROUNDS = 7
#: quota periods a timed pass spans at least on a rank under a CPU quota (repeating the pass)
QUOTA_PERIODS = 4
#: at most this many back-to-back passes make one timed pass (a bound for tiny probes)
MAX_REPEATS = 64

_CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_dirs(root: str = _CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> list[str]:
    """The cgroup directories of this process whose cpu controller may hold a quota, innermost
    first, each followed by its ancestors (a parent's quota caps its children too)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one hierarchy, cpu.max
            bases = [root]
        elif "cpu" in controllers.split(","):
            bases = [os.path.join(root, controllers), os.path.join(root, "cpu")]
        else:
            continue
        for base in bases:
            rel = path.strip("/")
            while True:
                dirs.append(os.path.join(base, rel) if rel else base)
                if not rel:
                    break
                rel = os.path.dirname(rel)
    return list(dict.fromkeys(dirs))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cpu_quota(root: str = _CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> tuple[float, float] | None:
    """``(cores, period_s)`` of the CFS CPU quota on this process (cgroup v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, v2 ``cpu.max``), the longest period among its
    cgroup and their ancestors that have one (the window a pass must span); None without a
    quota, or when the cgroup files cannot be read."""
    found = []
    for d in _cgroup_dirs(root, proc_cgroup):
        quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
        if quota is None or period is None:
            both = _read(os.path.join(d, "cpu.max"))
            if both is None or len(both.split()) != 2:
                continue
            quota, period = both.split()
        try:
            quota_us, period_us = float(quota), float(period)
        except ValueError:  # cgroup v2 "max": no quota
            continue
        if quota_us > 0 and period_us > 0:
            found.append((quota_us / period_us, period_us * 1e-6))
    return max(found, key=lambda q: q[1]) if found else None


def throttled_s(root: str = _CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """Seconds this process's innermost cpu cgroup has been throttled by its quota so far
    (``cpu.stat``: v1 ``throttled_time`` in ns, v2 ``throttled_usec``); None when unreadable."""
    for d in _cgroup_dirs(root, proc_cgroup):
        text = _read(os.path.join(d, "cpu.stat"))
        if text is None:
            continue
        fields = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        if "throttled_time" in fields:
            return float(fields["throttled_time"]) * 1e-9
        if "throttled_usec" in fields:
            return float(fields["throttled_usec"]) * 1e-6
    return None


def probe_sizes(batch_size: int, ranks: int) -> list[int]:
    """The local batch sizes the probe times: half, one and two equal shares
    ``m = ceil(B / P)`` (at most ``B``), so the fitted line covers the splits it will choose."""
    share = -(-batch_size // ranks)
    return sorted({max(1, share // 2), share, min(batch_size, 2 * share)})


def sleeping_barrier(comm, poll_s: float) -> None:
    """A barrier over ``comm`` that sleeps ``poll_s`` between polls: a busy-waiting
    MPI_Barrier would take the cores from ranks still computing on an oversubscribed machine."""
    waiting = comm.Ibarrier()
    while not waiting.Test():
        time.sleep(poll_s)


def warm_up(topology, probe, batch_size: int) -> None:
    """One untimed ``probe(2)`` per rank, the node's first rank first (collective)."""
    for first_turn in (True, False):
        if topology.is_leader == first_turn:
            probe(min(2, batch_size))
        if first_turn:
            sleeping_barrier(topology.node, 0.005)


def timed_pass(probe, clock, b: int, window_s: float, cores: float | None = None) -> float:
    """Seconds per ``probe(b)``: one pass, or back-to-back passes until they span ``window_s``
    (at most :data:`MAX_REPEATS`), their total over their number.

    ``cores``: the CPU quota in cores. Below one core, the time is at least the CPU seconds
    used over ``cores``: the rate the quota allows over many periods, whatever the phase of
    the period the passes started in (a window of ``k`` periods alone may be off by up to
    ``(1 - cores) / k`` of it)."""
    clock.start()
    begin, passes = clock.now(), 0
    cpu_begin = clock.cpu_now() if cores is not None and cores < 1 else None
    while True:
        probe(b)
        passes += 1
        if clock.now() - begin >= window_s or passes >= MAX_REPEATS:
            break
    seconds = clock.stop()
    if cpu_begin is not None:
        seconds = max(seconds, (clock.cpu_now() - cpu_begin) / cores)
    return seconds / passes


def measure_costs(topology, probe, clock, batch_size: int, quota=None) -> tuple[list[balance.RankCost], float]:
    """Every rank's ``t_i(b) = a_i + c_i b`` and the measurements' noise (collective): the
    median over ranks of each rank's median over batch sizes of :func:`~.balance.timing_noise`.

    ``quota``: ``(cores, period_s)`` of this rank's CPU quota, default :func:`cpu_quota`
    (read here); a pass then spans :data:`QUOTA_PERIODS` periods. Each rank repeats its own
    passes; the barriers are per pass size and round on every rank alike."""
    quota = cpu_quota() if quota is None else quota
    window_s = QUOTA_PERIODS * quota[1] if quota else 0.0
    sizes = probe_sizes(batch_size, topology.size)
    measured_sizes, measured_times = [], []
    for round_ in range(PROBE_ROUNDS + 1):
        for b in sizes[round_ % len(sizes):] + sizes[:round_ % len(sizes)]:  # rotate the order
            sleeping_barrier(topology.world, 0.0005)
            seconds = timed_pass(probe, clock, b, window_s, quota[0] if quota else None)
            if round_ > 0:
                measured_sizes.append(b)
                measured_times.append(max(seconds, 1e-9))
    own = balance.fit_cost(measured_sizes, measured_times)
    spread = statistics.median(
        balance.timing_noise([t for b2, t in zip(measured_sizes, measured_times) if b2 == b])
        for b in sizes)
    gathered = topology.world.allgather((own.a, own.c, spread))
    return ([balance.RankCost(a, c) for a, c, _ in gathered],
            statistics.median(s for _, _, s in gathered))
