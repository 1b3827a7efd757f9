"""Heterogeneous data parallelism: a cost model per rank, and the split that minimizes the step.

Cost model
----------
Rank ``i`` computing a local batch of ``b`` samples (read, forward, backward) takes::

    t_i(b) = a_i + c_i b    for b >= 1,          t_i(0) = 0

``a_i`` (seconds) is the fixed part of a step (kernel launches, Python, small tensors),
``c_i`` (seconds per sample) the part that grows with the batch. A split proportional to
"samples per second at one batch size" ignores ``a_i`` and is biased: per-sample cost falls
with the batch, so the fast rank looks faster than it is at the batch it will really get.
:func:`fit_cost` fits ``(a_i, c_i)`` by least squares through the medians of timed passes at
two or more batch sizes (every rank probing at the same time, so all are measured under the
contention of a real step).

The split
---------
Every step waits for its slowest rank, so the global batch ``B`` is split to minimize the
step time::

    minimize  T = max_i t_i(b_i)   subject to   sum_i b_i = B,  b_i >= 0 integers

:func:`solve_split` does it in two passes:

1. water-filling, the continuous relaxation: the level ``T_c`` at which
   ``sum_i max(0, (T_c - a_i) / c_i) = B`` (found by bisection), and ``b_i = floor((T_c - a_i) /
   c_i)`` clipped at 0, so that every ``t_i(b_i) <= T_c``;
2. integer repair: each of the ``B - sum_i b_i`` samples left goes to the rank whose time after
   taking it, ``t_i(b_i + 1)``, is the smallest (ties to the lower rank).

This is optimal: the continuous optimum is a lower bound, ``T_c <= T*``, so every starting
``b_i`` is within rank ``i``'s capacity at ``T*``; while fewer than ``B`` samples are placed,
some rank is below its capacity at ``T*``, so the smallest next time is ``<= T*``, and the
greedy never exceeds ``T*``.

**Equal unless measurably unequal.** Measured models always differ a little, even for
identical ranks. :func:`choose_split` keeps the equal split unless the optimal one is
predicted to be faster by more than a margin: ``1 - T(opt) / T(equal) > max(threshold,
noise)``. ``threshold`` is a few per cent (an option); ``noise`` is the measurements' own
uncertainty (:func:`timing_noise`): the relative standard error of the difference between two
ranks' medians of ``n`` timed passes, ``sqrt(2) * 1.2533 * sigma / sqrt(n)`` with ``sigma``
estimated robustly as the interquartile range over 1.349 (normal errors assumed), relative to
the median. On a shared, oversubscribed machine single passes of identical ranks differ by
tens of per cent, and a predicted gain within that uncertainty is not measurable.

Re-fitting while training
-------------------------
The probe measures each rank before training; the steps themselves keep measuring it.
:func:`refit_cost` fits ``t_i(b) = a_i + c_i b`` again from a rank's own steps (their local
batch sizes and compute times). Every batch size seen in at least :data:`MIN_STEPS_PER_SIZE`
steps is a point ``(b_j, median_j)``. Only when the points' sizes span at least
:data:`MIN_SIZE_SPREAD` of the largest (half of it: the probe spans three quarters) does the
least-squares line through them separate ``a_i`` from ``c_i``. Over a narrower span the slope
is mostly noise: the medians of 20 steps that vary by 10 % are each uncertain by about 3 %, so
between sizes 12 and 19 the slope is known to about a quarter of its value; and a slow phase
of the machine during one of the two periods becomes a slope (a negative intercept, clipped
to ``a = 0``, and a split that leaves the slow rank idle). So otherwise the
previous model keeps its shape and is scaled through the steps: ``a_i`` and ``c_i`` both times
the median over steps of ``seconds_k / t_i(b_k)`` (:func:`scale_cost`). The shape was measured
by the probe over a wide span, and a re-split moves the sizes only near the points that scale
it.

A re-fit's steps are the current period and the one before it (so that a move's old and new
sizes are two points of the line). When the rank's speed changed between them (its CPU share
was lowered, another job started: :func:`speed_changed`, the model's typical error differs
by more than :data:`CHANGE_RATIO` between the periods) the older period describes a machine
that is gone, and only the current one is used: a share change is followed one re-fit
sooner than by the window's median.

A re-split must beat the *current* split by the same margin, ``1 - T(opt) / T(current) >
max(threshold, noise)`` (hysteresis), and, since the steps of one period share a slow phase
of the machine that the noise of their median does not show, it must do so in two
consecutive re-fits that move samples the same way (the caller compares the two proposals),
unless its gain is more than twice the margin (:func:`confirm_resplit`): a split moves at
once for a large change, and not back and forth on one noisy period, nor on two that pull
opposite ways. The one-period shortcut needs the margin to know how much periods differ
(``drift_known``: the caller has compared periods at an unchanged split): before that, a
margin from the spread within one period is no guard against a slow period.

Everything here is a pure function of numbers every rank holds alike (after a gather), so all
ranks compute the same split without further communication, and a bad value is refused on
every rank alike.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Sequence

__all__ = ["RankCost", "fit_cost", "refit_cost", "speed_changed", "relative_spread", "timing_noise", "scale_cost",
           "costs_from_speeds", "solve_split", "step_time", "choose_split", "confirm_resplit",
           "equal_split", "split_counts", "parse_speeds", "check_speeds"]

#: steps of one local batch size a re-fit needs before that size is a point of its line
MIN_STEPS_PER_SIZE = 3
#: a re-fit separates a_i from c_i only when its sizes differ by this fraction of the largest
MIN_SIZE_SPREAD = 0.5
#: a rank whose steps' error against its model changes by more than this factor from one
#: re-fit period to the next has changed speed (its CPU share, another job): the older period
#: is dropped. Far above the few per cent by which medians of identical periods differ.
CHANGE_RATIO = 1.3


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


# --------------------------------------------------------------------------- the cost model
@dataclass(frozen=True)
class RankCost:
    """``t(b) = a + c b`` seconds for ``b >= 1`` samples, ``t(0) = 0``.

    ``a >= 0`` is the fixed part of a step, ``c > 0`` the seconds per sample.
    """

    a: float
    c: float

    def __post_init__(self):
        if isinstance(self.a, bool) or not isinstance(self.a, Real) or not math.isfinite(self.a) or self.a < 0:
            raise ValueError(f"cost a (fixed seconds per step) must be a finite number >= 0, got {self.a!r}")
        if isinstance(self.c, bool) or not isinstance(self.c, Real) or not math.isfinite(self.c) or self.c <= 0:
            raise ValueError(f"cost c (seconds per sample) must be a finite number > 0, got {self.c!r}")

    def time(self, b: int) -> float:
        """Predicted seconds for a local batch of ``b`` samples."""
        return 0.0 if b <= 0 else self.a + self.c * b


def fit_cost(batch_sizes: Sequence[int], seconds: Sequence[float]) -> RankCost:
    """Fit ``t(b) = a + c b`` to timed passes ``(batch_sizes[k], seconds[k])``.

    Notes
    -----
    The passes at each distinct batch size are reduced to their median (robust to a pass
    disturbed by another process), then ``(a, c)`` is the least-squares line through the
    medians ``(b_j, m_j)``: ``c = sum_j (b_j - mean b)(m_j - mean m) / sum_j (b_j - mean b)^2``,
    ``a = mean m - c mean b``. A negative intercept (noise) is clipped to ``a = 0`` with the
    line through the origin refitted, ``c = sum b_j m_j / sum b_j^2``; with one distinct batch
    size, ``a = 0`` and ``c = m / b``.
    """
    sizes = [_as_count(b, f"batch_sizes[{k}]", 1) for k, b in enumerate(batch_sizes)]
    times = _positive_finite(seconds, "seconds")
    if len(sizes) != len(times):
        raise ValueError(f"batch_sizes has {len(sizes)} entries, seconds {len(times)}")
    by_size: dict[int, list[float]] = {}
    for b, t in zip(sizes, times):
        by_size.setdefault(b, []).append(t)
    points = sorted((b, statistics.median(ts)) for b, ts in by_size.items())
    if len(points) == 1:
        b, m = points[0]
        return RankCost(0.0, m / b)
    mean_b = statistics.fmean(b for b, _ in points)
    mean_m = statistics.fmean(m for _, m in points)
    slope = (sum((b - mean_b) * (m - mean_m) for b, m in points)
             / sum((b - mean_b) ** 2 for b, _ in points))
    intercept = mean_m - slope * mean_b
    if slope <= 0 or intercept < 0:
        return RankCost(0.0, sum(b * m for b, m in points) / sum(b * b for b, _ in points))
    return RankCost(intercept, slope)


def relative_spread(seconds: Sequence[float]) -> float:
    """The spread of repeated timings, ``(q3 - q1) / median`` (interquartile range over the
    median; 0 for fewer than two timings)."""
    times = _positive_finite(seconds, "seconds")
    if len(times) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / median


def timing_noise(seconds: Sequence[float]) -> float:
    """The relative standard error of the difference of two medians of ``n`` timings like
    these: ``sqrt(2) * 1.2533 / 1.349 * relative_spread(seconds) / sqrt(n)`` (the standard
    error of a median is ``1.2533 sigma / sqrt(n)`` for normal errors, ``sigma ~ IQR / 1.349``)."""
    times = _positive_finite(seconds, "seconds")
    return math.sqrt(2.0) * 1.2533 / 1.349 * relative_spread(times) / math.sqrt(max(len(times), 1))


def scale_cost(cost: RankCost, batch_sizes: Sequence[int], seconds: Sequence[float]) -> RankCost:
    """Re-fit a model through steps whose sizes cannot separate ``a`` from ``c``: both are
    scaled by ``median_k(seconds[k] / t(batch_sizes[k]))``, the model's typical error on the
    steps (with one size: ``median(seconds) / t(b)``)."""
    sizes = [_as_count(b, f"batch_sizes[{k}]", 1) for k, b in enumerate(batch_sizes)]
    times = _positive_finite(seconds, "seconds")
    if len(sizes) != len(times):
        raise ValueError(f"batch_sizes has {len(sizes)} entries, seconds {len(times)}")
    factor = statistics.median(t / cost.time(b) for b, t in zip(sizes, times))
    return RankCost(cost.a * factor, cost.c * factor)


def speed_changed(previous: RankCost, earlier: Sequence[tuple[int, float]],
                  recent: Sequence[tuple[int, float]]) -> bool:
    """Whether the machine changed between two periods of steps ``(samples, seconds)``: the
    previous model's typical error (median of ``seconds / t(samples)``) differs between them by
    more than the factor :data:`CHANGE_RATIO`. Either period with fewer than
    :data:`MIN_STEPS_PER_SIZE` steps with samples shows no change."""
    errors = []
    for steps in (earlier, recent):
        ratios = [t / previous.time(b) for b, t in steps if b > 0]
        if len(ratios) < MIN_STEPS_PER_SIZE:
            return False
        errors.append(statistics.median(ratios))
    return max(errors) > CHANGE_RATIO * min(errors)


def refit_cost(previous: RankCost, batch_sizes: Sequence[int], seconds: Sequence[float],
               recent: int | None = None) -> RankCost:
    """Re-fit a rank's ``t(b) = a + c b`` from its own training steps: step ``k`` computed
    ``batch_sizes[k]`` samples in ``seconds[k]``.

    Steps without samples are left out (``t(0) = 0`` by definition). ``recent``: the last
    ``recent`` steps are the current period, the others the one before; when the two disagree
    (:func:`speed_changed`: the rank's speed changed, e.g. its CPU share) the older steps
    describe a machine that is gone and only the current period is used. Every batch size seen
    in at least :data:`MIN_STEPS_PER_SIZE` steps is a point; when the points span ``max - min >=
    MIN_SIZE_SPREAD * max``: :func:`fit_cost` of their steps (medians per size, least squares).
    Otherwise: ``previous`` scaled through all the steps (:func:`scale_cost`); with fewer than
    :data:`MIN_STEPS_PER_SIZE` steps left, ``previous`` itself.
    """
    if not isinstance(previous, RankCost):
        raise ValueError(f"previous must be a RankCost, got {previous!r}")
    sizes = [_as_count(b, f"batch_sizes[{k}]", 0) for k, b in enumerate(batch_sizes)]
    times = list(seconds)
    if len(sizes) != len(times):
        raise ValueError(f"batch_sizes has {len(sizes)} entries, seconds {len(times)}")
    if recent is not None:
        recent = _as_count(recent, "recent", 0)
        split_at = max(0, len(sizes) - recent)
        pairs = list(zip(sizes, times))
        if speed_changed(previous, pairs[:split_at], pairs[split_at:]):
            sizes, times = sizes[split_at:], times[split_at:]
    steps = [(b, t) for b, t in zip(sizes, times) if b > 0]
    if len(steps) < MIN_STEPS_PER_SIZE:  # a median of one or two steps is a guess
        return previous
    counts: dict[int, int] = {}
    for b, _ in steps:
        counts[b] = counts.get(b, 0) + 1
    points = [b for b, n in counts.items() if n >= MIN_STEPS_PER_SIZE]
    if points and max(points) - min(points) >= MIN_SIZE_SPREAD * max(points):
        fitted = [(b, t) for b, t in steps if counts[b] >= MIN_STEPS_PER_SIZE]
        return fit_cost([b for b, _ in fitted], [t for _, t in fitted])
    return scale_cost(previous, [b for b, _ in steps], [t for _, t in steps])


def costs_from_speeds(speeds: Sequence[float]) -> list[RankCost]:
    """Given relative speeds ``s_i`` (samples per second, any unit): ``t_i(b) = b / s_i``."""
    return [RankCost(0.0, 1.0 / s) for s in _positive_finite(speeds, "speeds")]


# --------------------------------------------------------------------------- the split
def step_time(costs: Sequence[RankCost], split: Sequence[int]) -> float:
    """``max_i t_i(b_i)``: the predicted compute time of a step (its slowest rank)."""
    return max(cost.time(b) for cost, b in zip(costs, split))


def equal_split(total: int, ranks: int) -> list[int]:
    """``total`` samples over ``ranks`` ranks, as equal as integers allow (the first ranks
    take the remainder)."""
    total, ranks = _as_count(total, "total", 0), _as_count(ranks, "ranks", 1)
    return [total // ranks + (1 if r < total % ranks else 0) for r in range(ranks)]


def solve_split(costs: Sequence[RankCost], total: int, minimum: int = 0) -> list[int]:
    """The integer split of ``total`` samples minimizing ``max_i t_i(b_i)`` subject to
    ``b_i >= minimum`` (see the module docstring: water-filling, then integer repair).
    Returns ``P`` integers summing to ``total``; deterministic (ties go to the lower rank).

    ``minimum = 1`` keeps every rank computing (so that its cost stays measured); the
    water-filling then starts every rank at ``max(minimum, ...)`` and the argument for
    optimality is unchanged (``T* >= max_i t_i(minimum)``)."""
    costs = list(costs)
    if not costs:
        raise ValueError("costs must not be empty")
    for i, cost in enumerate(costs):
        if not isinstance(cost, RankCost):
            raise ValueError(f"costs[{i}] must be a RankCost, got {cost!r}")
    total = _as_count(total, "total", 0)
    minimum = _as_count(minimum, "minimum", 0)
    if minimum * len(costs) > total:
        raise ValueError(f"total={total} cannot give each of the {len(costs)} ranks {minimum} sample(s)")
    # 1. water-filling: the continuous level T_c with sum_i max(0, (T - a_i) / c_i) = total.
    def capacity(level: float) -> float:
        return sum(max(float(minimum), (level - cost.a) / cost.c) for cost in costs)

    low, high = 0.0, max(cost.a + cost.c * total for cost in costs)
    for _ in range(200):  # bisection to float precision; capacity is monotone in the level
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if capacity(middle) < total else (low, middle)
    split = [max(minimum, min(total, math.floor((low - cost.a) / cost.c))) for cost in costs]
    while sum(split) > total:  # only reachable through float rounding at the level
        i = max((r for r in range(len(costs)) if split[r] > minimum),
                key=lambda r: (costs[r].time(split[r]), -r))
        split[i] -= 1
    # 2. integer repair: each remaining sample where it finishes first (a heap of the ranks'
    #    times after one more sample; the rank index breaks ties).
    heap = [(cost.time(b + 1), r) for r, (cost, b) in enumerate(zip(costs, split))]
    heapq.heapify(heap)
    for _ in range(total - sum(split)):
        _, r = heapq.heappop(heap)
        split[r] += 1
        heapq.heappush(heap, (costs[r].time(split[r] + 1), r))
    return split


def choose_split(costs: Sequence[RankCost], total: int, threshold: float = 0.05,
                 current: Sequence[int] | None = None, minimum: int = 0,
                 noise: float = 0.0) -> tuple[list[int], float]:
    """The split to use and its predicted step time: the optimal split, unless it is not
    predicted to beat the reference by more than ``max(threshold, noise)`` (fractions), in
    which case the reference is kept. The reference is ``current`` when given (re-balancing:
    hysteresis), else the equal split (the start: equal unless measurably unequal). ``noise``
    is the measurements' relative spread (:func:`relative_spread`); ``minimum`` as in
    :func:`solve_split`."""
    costs = list(costs)
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a number in [0, 1), got {threshold!r}")
    if isinstance(noise, bool) or not isinstance(noise, Real) or not math.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    threshold = max(threshold, noise)
    reference = list(current) if current is not None else equal_split(total, len(costs))
    if len(reference) != len(costs) or sum(reference) != total:
        raise ValueError(f"current split {reference} does not split {total} over {len(costs)} ranks")
    best = solve_split(costs, total, minimum)
    best_time, reference_time = step_time(costs, best), step_time(costs, reference)
    if best_time < (1.0 - min(threshold, 1.0)) * reference_time:
        return best, best_time
    return reference, reference_time


def confirm_resplit(gain: float, margin: float, proposed_before: bool, drift_known: bool = True) -> bool:
    """Whether a re-split predicted to make the step ``gain`` (a fraction) faster than the
    current split is taken: its gain passes the margin (``max(threshold, noise)``) and the
    previous re-fit's proposal did too (``proposed_before``), or its gain is more than twice
    the margin and the margin includes the drift between periods (``drift_known``; see the
    module docstring)."""
    for value, name in ((gain, "gain"), (margin, "margin")):
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    return (gain > 2.0 * margin and bool(drift_known)) or (gain > margin and bool(proposed_before))


def split_counts(total: int, proportions: Sequence[float]) -> list[int]:
    """Split ``total`` items in proportion to ``proportions`` (largest remainder; zeros allowed).

    Used for the last, smaller global batch of an epoch (``proportions`` = the batch sizes
    ``b_i``, ``total`` = the samples left).

    Returns a list of ints summing to ``total`` with ``|n_i - total p_i / sum(p)| < 1``; the
    leftover items go to the largest fractional parts, ties to the lower index. Raises
    ValueError for a negative ``total``, an empty list, a negative or non-finite proportion,
    or proportions that sum to zero.
    """
    total = _as_count(total, "total", 0)
    proportions = list(proportions)
    if not proportions:
        raise ValueError("proportions must not be empty")
    for i, p in enumerate(proportions):
        if isinstance(p, bool) or not isinstance(p, Real) or not math.isfinite(p) or p < 0:
            raise ValueError(f"proportions[{i}] must be a finite number >= 0, got {p!r}")
    weight_sum = math.fsum(proportions)
    if weight_sum <= 0:
        raise ValueError("proportions are all zero; at least one must be > 0")
    ideal = [total * p / weight_sum for p in proportions]
    counts = [math.floor(x) for x in ideal]
    order = sorted(range(len(proportions)), key=lambda i: (-(ideal[i] - counts[i]), i))
    for k in range(total - sum(counts)):
        counts[order[k % len(order)]] += 1
    return counts


# --------------------------------------------------------------------------- given speeds
def check_speeds(speeds: Sequence[float], world_size: int) -> list[float]:
    """Relative speeds given by the caller: one finite number > 0 per rank."""
    speeds = _positive_finite(speeds, "speeds")
    if len(speeds) != _as_count(world_size, "world_size", 1):
        raise ValueError(f"speeds has {len(speeds)} entries for {world_size} ranks; give one per rank")
    return speeds


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
