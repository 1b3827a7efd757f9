"""Heterogeneous data parallelism: from measured rank speeds to local batch sizes.

A rank that processes ``s_i`` samples per second gets a local batch proportional to its
speed, so that every rank of a global step of ``B`` samples finishes at the same time:

    b_i ≈ B * s_i / S,    S = sum_j s_j,    sum_i b_i = B exactly,   b_i >= 1.

The epoch's data is shared the same way, ``n_i = N * b_i / B`` (use :func:`split_counts`),
so every rank runs the same number of steps. Everything here is a pure function of numbers
that every rank holds alike (after :func:`gather_speeds`), so all ranks compute the same
batch sizes without further communication, and a bad value is refused on every rank alike.
"""

from __future__ import annotations

import math
import statistics
import time
from numbers import Integral, Real
from typing import Callable, Sequence


# --------------------------------------------------------------------------- validation
def _as_count(value, name: str, minimum: int) -> int:
    """An integer >= minimum (numpy integers welcome, bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _positive_finite(values: Sequence[float], name: str) -> list[float]:
    """A non-empty list of finite numbers > 0."""
    values = list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}[{i}] must be a finite number > 0, got {v!r}")
    return [float(v) for v in values]


# --------------------------------------------------------------------------- apportionment
def _largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Integers ``n_i`` summing to ``total`` with ``|n_i - total * w_i / W| < 1``.

    Each ``n_i`` starts at ``floor(total * w_i / W)``; the ``total - sum(floors)`` samples
    left over go one each to the largest fractional parts (ties to the lower index, so the
    result is deterministic and identical on every rank).
    """
    weight_sum = math.fsum(weights)
    ideal = [total * w / weight_sum for w in weights]
    counts = [math.floor(x) for x in ideal]
    left = total - sum(counts)
    # Rounding in `ideal` can push a floor one too high or low; clamp so the loop below
    # always distributes a number in [0, len(weights)].
    order = sorted(range(len(weights)), key=lambda i: (-(ideal[i] - counts[i]), i))
    while left < 0:  # pragma: no cover - only on pathological float rounding
        i = max(range(len(counts)), key=lambda j: (counts[j] - ideal[j], -j))
        counts[i] -= 1
        left += 1
    for k in range(left):
        counts[order[k % len(order)]] += 1
    return counts


def batch_sizes(speeds: Sequence[float], global_batch: int) -> list[int]:
    """Local batch sizes proportional to rank speeds, summing exactly to ``global_batch``.

    Parameters
    ----------
    speeds : sequence of float, length P
        Samples per second of every rank (only the ratios matter).
    global_batch : int
        ``B``, the samples of one global step; ``B >= P`` so that every rank computes.

    Returns
    -------
    list of int, length P, each >= 1, summing to B.

    Notes
    -----
    ``b_i ≈ B s_i / S`` with ``S = sum_j s_j``, rounded by largest remainder. When every
    share ``B s_i / S`` is at least 1, each ``b_i`` is within one sample of it:
    ``|b_i - B s_i / S| < 1``. A rank whose share is below one sample is pinned to
    ``b_i = 1`` (every rank computes something, so its speed stays measurable), and the
    remaining ``B - #pinned`` samples are shared among the other ranks in proportion to
    their speeds, repeating until no new rank falls below one sample.

    Raises ValueError for an empty list, a speed that is not a finite number > 0, or
    ``B < P``.
    """
    speeds = _positive_finite(speeds, "speeds")
    total = _as_count(global_batch, "global_batch", 1)
    ranks = len(speeds)
    if total < ranks:
        raise ValueError(f"global_batch={total} is smaller than the number of ranks ({ranks}); "
                         "every rank needs at least one sample per step")
    pinned: set[int] = set()
    while True:
        free = [i for i in range(ranks) if i not in pinned]
        budget = total - len(pinned)
        speed_sum = math.fsum(speeds[i] for i in free)
        below_one = [i for i in free if budget * speeds[i] / speed_sum < 1.0]
        if not below_one:
            break
        pinned.update(below_one)
    sizes = [1] * ranks
    for i, n in zip(free, _largest_remainder(budget, [speeds[i] for i in free])):
        sizes[i] = n
    return sizes


def split_counts(total: int, proportions: Sequence[float]) -> list[int]:
    """Split ``total`` items in proportion to ``proportions`` (largest remainder; zeros allowed).

    Used for the last, smaller global batch of an epoch (``proportions`` = the batch sizes
    ``b_i``, ``total`` = the samples left) and for the data shares ``n_i = N b_i / B``.

    Returns a list of ints summing to ``total`` with ``|n_i - total p_i / sum(p)| < 1``.
    Raises ValueError for a negative ``total``, an empty list, a negative or non-finite
    proportion, or proportions that sum to zero.
    """
    total = _as_count(total, "total", 0)
    proportions = list(proportions)
    if not proportions:
        raise ValueError("proportions must not be empty")
    for i, p in enumerate(proportions):
        if isinstance(p, bool) or not isinstance(p, Real) or not math.isfinite(p) or p < 0:
            raise ValueError(f"proportions[{i}] must be a finite number >= 0, got {p!r}")
    if math.fsum(proportions) <= 0:
        raise ValueError("proportions are all zero; at least one must be > 0")
    return _largest_remainder(total, [float(p) for p in proportions])


# --------------------------------------------------------------------------- measuring speed
def measure_speed(step_fn: Callable[[int], None], probe_batch: int, repeats: int = 3,
                  warmup: int = 1, synchronize: Callable[[], None] | None = None) -> float:
    """Samples per second of ``step_fn`` on this rank: ``probe_batch / median(seconds)``.

    ``step_fn(n)`` runs one training-like step (forward + backward, no communication) on
    ``n`` samples. It is called ``warmup`` times untimed (first-call costs: allocation, JIT
    compilation, kernel caches), then ``repeats`` times timed; the median ignores a single
    disturbed repeat. ``synchronize`` (e.g. ``backend.synchronize``) is called before the
    clock starts and before it stops, because GPU work is asynchronous and would otherwise
    be timed as queued, not as done.
    """
    probe_batch = _as_count(probe_batch, "probe_batch", 1)
    repeats = _as_count(repeats, "repeats", 1)
    warmup = _as_count(warmup, "warmup", 0)
    sync = synchronize if synchronize is not None else (lambda: None)
    for _ in range(warmup):
        step_fn(probe_batch)
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step_fn(probe_batch)
        sync()
        seconds.append(time.perf_counter() - start)
    # A step faster than the clock's resolution would give an infinite speed.
    return probe_batch / max(statistics.median(seconds), 1e-9)


def check_speeds(speeds: Sequence[float], world_size: int) -> list[float]:
    """Relative speeds given by the caller: one finite number > 0 per rank."""
    speeds = _positive_finite(speeds, "speeds")
    if len(speeds) != _as_count(world_size, "world_size", 1):
        raise ValueError(f"speeds has {len(speeds)} entries for {world_size} ranks; give one per rank")
    return speeds


def gather_speeds(comm, local: float) -> list[float]:
    """Every rank's speed, on every rank (``comm.allgather``), validated after the gather.

    Validation happens after the collective on the gathered list, so a bad value on one
    rank raises the same ValueError on all ranks instead of leaving the others waiting.
    """
    speeds = comm.allgather(float(local))
    return _positive_finite(speeds, "gathered speeds")


def parse_speeds(text: str, world_size: int) -> list[float]:
    """Parse ``"1,2,2,4"`` (one relative speed per rank) for ``--speeds``.

    Raises ValueError naming the problem: garbage entries, wrong number of entries, or an
    entry that is not a finite number > 0.
    """
    world_size = _as_count(world_size, "world_size", 1)
    parts = [p.strip() for p in str(text).split(",")]
    if parts == [""]:
        raise ValueError("speeds: empty list; give one number per rank, e.g. '1,2,2,4'")
    values = []
    for i, part in enumerate(parts):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"speeds: entry {i} ({part!r}) is not a number in {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"speeds: entry {i} ({part!r}) must be a finite number > 0")
        values.append(value)
    if len(values) != world_size:
        raise ValueError(f"speeds: {len(values)} entries in {text!r} but there are "
                         f"{world_size} ranks; give one per rank")
    return values


# --------------------------------------------------------------------------- re-balancing
def rebalance(compute_seconds: Sequence[float], samples: Sequence[int],
              previous_speeds: Sequence[float] | None = None, smoothing: float = 0.0) -> list[float]:
    """New rank speeds from the compute time every rank measured over an epoch.

    The new batch sizes are then ``batch_sizes(rebalance(...), B)``.

    Parameters
    ----------
    compute_seconds : sequence of float, length P
        Rank i's compute seconds in the epoch (forward + backward, emulated slowdown
        included; communication and waiting excluded). The trainer allgathers them.
    samples : sequence of int, length P
        The samples rank i computed in the epoch.
    previous_speeds : sequence of float, optional
        The speeds the current batch sizes came from (any unit).
    smoothing : float in [0, 1)
        Weight of the previous speeds (needs ``previous_speeds``); 0 (default) uses only
        the new measurement.

    Returns
    -------
    list of float, length P: samples per second of every rank.

    Notes
    -----
    The measured speed is samples over compute time, ``s_i = n_i / c_i = 1 / t_i`` with
    ``t_i`` the seconds per sample. With smoothing ``a`` (damping noisy epochs), the previous
    speeds are first rescaled to the same total, since only ratios matter::

        s_i <- a * p_i * (sum_j s_j / sum_j p_j) + (1 - a) * s_i

    When the model holds (time per sample independent of the batch size), the batch sizes
    ``b_i ≈ B s_i / S`` make the ranks finish a step together: ``b_i t_i ≈ B / S`` for all i.

    A rank that computed nothing (``n_i = 0`` or ``c_i = 0``) has no speed to measure: the
    previous speeds are returned unchanged then (ValueError without them).
    """
    seconds = list(compute_seconds)
    counts = list(samples)
    if not seconds:
        raise ValueError("compute_seconds must not be empty")
    if len(counts) != len(seconds):
        raise ValueError(f"samples has {len(counts)} entries, compute_seconds has {len(seconds)}")
    for i, c in enumerate(seconds):
        if isinstance(c, bool) or not isinstance(c, Real) or not math.isfinite(c) or c < 0:
            raise ValueError(f"compute_seconds[{i}] must be a finite number >= 0, got {c!r}")
    for i, n in enumerate(counts):
        _as_count(n, f"samples[{i}]", 0)
    if isinstance(smoothing, bool) or not isinstance(smoothing, Real) or not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be a number in [0, 1), got {smoothing!r}")
    previous = None
    if previous_speeds is not None:
        previous = _positive_finite(previous_speeds, "previous_speeds")
        if len(previous) != len(seconds):
            raise ValueError(f"previous_speeds has {len(previous)} entries, "
                             f"compute_seconds has {len(seconds)}")
    elif smoothing > 0:
        raise ValueError("smoothing > 0 needs previous_speeds")
    unmeasured = [i for i, (c, n) in enumerate(zip(seconds, counts)) if c == 0 or n == 0]
    if unmeasured:
        if previous is None:
            raise ValueError(f"cannot rebalance: rank(s) {unmeasured} computed nothing this "
                             "epoch and no previous speeds were given")
        return previous
    speeds = [n / c for n, c in zip(counts, seconds)]
    if previous is not None and smoothing > 0:
        scale = math.fsum(speeds) / math.fsum(previous)
        speeds = [smoothing * p * scale + (1 - smoothing) * s for p, s in zip(previous, speeds)]
    return speeds
