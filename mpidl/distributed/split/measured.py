"""The measured split (HDP): every rank's cost ``t_i(b) = a_i + c_i b`` fitted from timed passes
of the real model, the split minimizing the slowest rank's step, and the re-fit from the
steps themselves that may move it while training (the math: :mod:`.balance`).

A step's critical path on rank ``i`` is more than its compute: between two gradient
reductions the rank also applies the optimizer update and runs the loop, a per-step cost
``u_i`` that does not depend on ``b_i`` and that a slow (e.g. CPU-capped) rank pays at its
slower rate too. The compute clock does not see it, nor does the probe (a forward and
backward); :class:`~mpidl.distributed.DataParallel` measures it every step
(:meth:`MeasuredSplit.observe`'s ``outside_s``), and the split balances
``t_i(b) = (a_i + u_i) + c_i b`` (:attr:`MeasuredSplit.costs`; ``a_i, c_i`` alone are
:attr:`MeasuredSplit.compute_costs`).

The margin a re-split must pass covers two kinds of noise: the spread of the steps within a
period (:func:`~.balance.timing_noise`), and how much a rank's step at an unchanged batch size
moves from one period to the next (:func:`period_drift`: another process taking turns on the
core, a hypervisor's neighbour). The second does not shrink with more steps per period, and a
margin without it moves the split of two identical hosts back and forth.

Re-fitting until the split stops moving: after the start and after every move (or a move
proposed and waiting for its confirmation) the next re-fit comes after a short period,
:func:`settle_every` steps, so that the estimate the probe started from (without ``u_i``) is
corrected within a few dozen steps; once a re-fit keeps the split, re-fits come every
``rebalance_every`` steps again.
"""

from __future__ import annotations

import statistics
from collections import deque
from numbers import Integral, Real

from mpidl.distributed.clock import ComputeClock
from mpidl.distributed.split import balance, probe as speed_probe
from mpidl.distributed.split.base import Split, check_batch_fits

__all__ = ["MeasuredSplit", "DRIFT_PERIODS", "MIN_DRIFT_PERIODS", "RECENT_STEPS", "check_options", "period_drift", "settle_every"]

#: steps whose compute times a re-fit may use (a bound on memory, not a tuning knob)
RECENT_STEPS = 1024
#: period-to-period changes a rank's drift is the median of (the last re-fits at an unchanged size)
DRIFT_PERIODS = 5
#: changes a rank must have measured before its drift enters the margin, and every rank before
#: one period's gain may move the split alone
MIN_DRIFT_PERIODS = 2


def period_drift(previous, recent, batch_size: int) -> float | None:
    """``|median(recent) / median(previous) - 1|`` of this rank's step times ``t + u`` at
    ``batch_size`` in two consecutive periods of ``(samples, compute s, outside s)``; None when
    either period has no step at that size (the split moved in between)."""
    before = [t + u for b, t, u in previous if b == batch_size and b > 0]
    now = [t + u for b, t, u in recent if b == batch_size and b > 0]
    if not before or not now or statistics.median(before) <= 0:
        return None
    return abs(statistics.median(now) / statistics.median(before) - 1.0)


def settle_every(rebalance_every: int) -> int:
    """Steps between re-fits while the split is settling (after the start and after a move):
    half of ``rebalance_every``, at least two re-fit points' worth of steps
    (``2 * MIN_STEPS_PER_SIZE``), at most ``rebalance_every``."""
    return min(rebalance_every, max(2 * balance.MIN_STEPS_PER_SIZE, rebalance_every // 2))


def check_options(threshold, rebalance_every) -> None:
    """``threshold`` in [0, 1), ``rebalance_every`` None or an integer >= 1 (no MPI)."""
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not 0 <= threshold < 1:
        raise ValueError(f"balance_threshold must be a number in [0, 1), got {threshold!r}")
    if rebalance_every is not None and (isinstance(rebalance_every, bool) or not isinstance(
            rebalance_every, Integral) or rebalance_every < 1):
        raise ValueError(f"rebalance_every must be an integer >= 1 or None, got {rebalance_every!r}")


class MeasuredSplit(Split):
    """The split of ``batch_size`` over the ranks of ``topology`` from measured cost models.

    Parameters
    ----------
    topology : Topology
    batch_size : int
        ``B``, the global batch.
    probe : callable(n)
        One forward + backward of the real model on ``n`` samples, no communication, leaving
        the model as it found it. Run once untimed on every rank first (the Numba JIT compiles
        then, one rank per node writing the on-disk cache), then timed
        (:mod:`.probe`).
    clock : ComputeClock, optional
        Times the passes (an EMULATED slow clock stretches them like the steps).
    threshold : float in [0, 1)
        The predicted gain (a fraction of the step) an uneven split must bring over the equal
        one, and a re-split over the current one; the margin is ``max(threshold, noise)``.
    min_local_batch : int >= 0
        Samples every rank gets at least of a full global batch.
    rebalance_every : int, optional
        Every ``rebalance_every`` steps, re-fit the cost models from the ranks' own steps and
        re-split when the gain is confirmed (:meth:`rebalance`).
    Construction is collective (it measures); :meth:`from_costs` starts from known cost
    models instead. An uneven first split is measured twice before it is taken: a rank
    descheduled by another process during its probe passes looks slow in all of them alike,
    so their spread does not reveal it; a rank that is really slower is slower the second
    time too. The split then follows the two fits averaged.
    """

    source = "measured"

    def __init__(self, topology, batch_size: int, probe, clock: ComputeClock | None = None, *,
                 threshold: float = 0.05, min_local_batch: int = 1, rebalance_every: int | None = None):
        check_batch_fits(batch_size, min_local_batch, topology.size)
        check_options(threshold, rebalance_every)
        if probe is None:
            raise ValueError("a measured split measures the ranks with probe(n): pass probe, or use "
                             "MeasuredSplit.from_costs to start from known cost models")
        self.topology = topology
        self.batch_size = batch_size
        self.threshold = float(threshold)
        self.min_local_batch = min_local_batch
        self.rebalance_every = rebalance_every
        self.clock = clock if clock is not None else ComputeClock()
        #: (samples, compute seconds, outside seconds) of this rank's steps since the last re-fit,
        #: and the period before
        self._recent: deque = deque(maxlen=RECENT_STEPS)
        self._previous_period: list = []
        #: this rank's last period-to-period changes at an unchanged batch size (period_drift)
        self._drifts: deque = deque(maxlen=DRIFT_PERIODS)
        #: the split the last re-fit proposed (gain above the margin, not yet taken), or None
        self._resplit_proposed: list | None = None
        self._next_refit: int | None = None
        speed_probe.warm_up(topology, probe, batch_size)
        self.costs, self.noise, self.batch_sizes = self._first_split(probe)

    @classmethod
    def from_costs(cls, topology, batch_size: int, costs, batch_sizes, clock: ComputeClock | None = None, *,
                   threshold: float = 0.05, min_local_batch: int = 1, rebalance_every: int | None = None,
                   noise: float = 0.0, source: str = "measured") -> "MeasuredSplit":
        """A measured split whose cost models are known already: no probe, no collective; the
        steps re-fit it (``rebalance_every``).

        For equal or given speeds to start from (``source``: 'equal' | 'given'), and for the
        survivors of a lost rank (:mod:`mpidl.distributed.elastic`): their models were
        measured (and re-fitted) before the loss, the lost ranks are ranks of speed 0
        (:func:`~mpidl.distributed.elastic.recovery.resplit` gives ``batch_sizes``).
        ``noise``: the measurements' noise of the split it continues."""
        check_options(threshold, rebalance_every)
        costs, batch_sizes = list(costs), [int(b) for b in batch_sizes]
        if len(costs) != topology.size or len(batch_sizes) != topology.size:
            raise ValueError(f"{len(costs)} costs and {len(batch_sizes)} batch sizes for {topology.size} ranks")
        if sum(batch_sizes) != batch_size or min(batch_sizes) < 0:
            raise ValueError(f"batch sizes {batch_sizes} do not split a global batch of {batch_size}")
        split = cls.__new__(cls)
        split.topology, split.batch_size = topology, batch_size
        split.threshold, split.min_local_batch = float(threshold), min_local_batch
        split.rebalance_every = rebalance_every
        split.clock = clock if clock is not None else ComputeClock()
        split._recent, split._previous_period, split._resplit_proposed = deque(maxlen=RECENT_STEPS), [], None
        split._drifts = deque(maxlen=DRIFT_PERIODS)
        split._next_refit = None
        split.quotas = [(None, None)] * topology.size
        split.costs, split.noise, split.batch_sizes = costs, float(noise), batch_sizes
        split.source = source
        return split

    @property
    def costs(self) -> list:
        """Every rank's step cost ``t_i(b) = (a_i + u_i) + c_i b``: its compute model plus its
        measured per-step work outside the compute (what the split balances)."""
        return [balance.RankCost(cost.a + outside, cost.c)
                for cost, outside in zip(self.compute_costs, self.outside_s)]

    @costs.setter
    def costs(self, costs) -> None:
        """Known step costs (the probe's, a checkpoint's): taken as compute models, with no
        outside work measured yet (the steps measure it)."""
        self.compute_costs = list(costs)
        self.outside_s = [0.0] * len(self.compute_costs)

    def _choose(self, costs, noise) -> list[int]:
        return balance.choose_split(costs, self.batch_size, self.threshold, minimum=self.min_local_batch,
                                    noise=noise)[0]

    def _first_split(self, probe):
        quota = speed_probe.cpu_quota()
        measure = lambda: speed_probe.measure_costs(self.topology, probe, self.clock, self.batch_size,  # noqa: E731
                                                    quota=quota or ())
        throttled_before, began = speed_probe.throttled_s(), self.clock.now()
        costs, noise = measure()
        throttled_after, elapsed = speed_probe.throttled_s(), self.clock.now() - began
        throttled = (None if throttled_before is None or throttled_after is None or elapsed <= 0
                     else (throttled_after - throttled_before) / elapsed)
        #: per rank: (cores of its CPU quota or None, fraction of the probe it was throttled or None)
        self.quotas = self.topology.world.allgather((quota[0] if quota else None, throttled))
        sizes = self._choose(costs, noise)
        equal = balance.equal_split(self.batch_size, self.topology.size)
        if sizes == equal:
            return costs, noise, sizes
        again, noise_again = measure()
        if self._choose(again, noise_again) == equal:
            return again, noise_again, equal
        costs = [balance.RankCost(0.5 * (x.a + y.a), 0.5 * (x.c + y.c)) for x, y in zip(costs, again)]
        noise = max(noise, noise_again)
        return costs, noise, self._choose(costs, noise)

    def observe(self, count: int, seconds: float, outside_s: float = 0.0) -> None:
        self._recent.append((int(count), seconds, max(0.0, float(outside_s))))

    def after_step(self, steps: int) -> dict | None:
        """Re-fit when due: :func:`settle_every` steps after the first step seen and after a
        re-fit that moved the split or proposed a move, else ``rebalance_every`` steps after
        the last re-fit (the same steps on every rank, so the re-fit is collective)."""
        self.last_change = None
        if self.rebalance_every is None:
            return None
        if self._next_refit is None:  # the first step seen (also after a resume)
            self._next_refit = steps - 1 + settle_every(self.rebalance_every)
        if steps < self._next_refit:
            return None
        change = self.rebalance(steps)
        settling = change is not None or self._resplit_proposed is not None
        self._next_refit = steps + (settle_every(self.rebalance_every) if settling else self.rebalance_every)
        return change

    def rebalance(self, steps: int = 0) -> dict | None:
        """Re-fit every rank's cost model from its own steps and re-split when that is
        predicted to be faster than the current split by more than the margin (collective;
        every rank computes the same split from the same gathered numbers). Returns the
        change (``step``, ``old``, ``new``, predictions, costs) when the split moved, else None.

        Each rank re-fits from the steps since the last call and the ones of the call before
        (:func:`~.balance.refit_cost`): when its batch sizes span at least half of the
        largest, their medians separate ``a_i`` from ``c_i``; otherwise the model keeps its
        shape and is scaled through the window's steps; a rank whose speed changed between the
        two periods re-fits from the last one. ``u_i``: the median of the last period's outside
        work. The margin is ``max(threshold, noise)``, ``noise`` the larger of the ranks'
        median spread within the window and their largest drift between periods (1.4826 x the
        median of the last :data:`DRIFT_PERIODS` values of :func:`period_drift`: their standard
        deviation, as for normal errors, but untouched by one real change of speed). A gain
        must pass the margin in two consecutive calls moving samples the same way, or twice
        the margin in one once every rank has measured the drift between
        :data:`MIN_DRIFT_PERIODS` pairs of periods (:func:`~.balance.confirm_resplit`): no
        move on one noisy period."""
        rank = self.topology.rank
        recent, previous = list(self._recent), list(self._previous_period)
        window = previous + recent
        drift = period_drift(previous, recent, self.batch_sizes[rank])
        if drift is not None:
            self._drifts.append(drift)
        self._previous_period = recent
        self._recent.clear()
        cost = balance.refit_cost(self.compute_costs[rank], [b for b, _, _ in window],
                                  [t for _, t, _ in window], recent=len(recent))
        # u_i: the median over the current period (the last steps describe the machine now)
        outside = statistics.median(u for _, _, u in (recent or window)) if window else self.outside_s[rank]
        # the spread of the steps at the current split, from the last period alone when the
        # rank's speed changed (two machines' steps together are no measure of either's noise)
        changed = balance.speed_changed(self.compute_costs[rank], [(b, t) for b, t, _ in previous],
                                        [(b, t) for b, t, _ in recent])
        current = [t + u for b, t, u in (recent if changed else window) if b == self.batch_sizes[rank] and b > 0]
        spread = balance.timing_noise(current) if current else 0.0
        # the standard deviation of the change between periods, robustly: 1.4826 x the
        # median absolute change (as for normal errors), untouched by one real speed change
        # (from MIN_DRIFT_PERIODS changes on: one change alone is mostly the two medians' own noise)
        typical_drift = (1.4826 * statistics.median(self._drifts) if len(self._drifts) >= MIN_DRIFT_PERIODS
                         else 0.0)
        gathered = self.topology.world.allgather((cost.a, cost.c, outside, spread, typical_drift,
                                                  len(self._drifts)))
        self.compute_costs = [balance.RankCost(a, c) for a, c, *_ in gathered]
        self.outside_s = [u for _, _, u, *_ in gathered]
        # the spread within a period: the ranks' median; the drift between periods: the
        # largest, since one wandering rank is enough to make the fitted costs differ
        self.noise = max(statistics.median(g[3] for g in gathered), max(g[4] for g in gathered))
        drift_known = min(g[5] for g in gathered) >= MIN_DRIFT_PERIODS
        old = list(self.batch_sizes)
        best = balance.solve_split(self.costs, self.batch_size, self.min_local_batch)
        predicted_old, predicted = balance.step_time(self.costs, old), balance.step_time(self.costs, best)
        gain = 1.0 - predicted / predicted_old if predicted_old > 0 else 0.0
        margin = max(self.threshold, self.noise)
        # a proposal confirms only one that moves samples the same way (a positive dot product
        # of the two moves): two noisy periods pulling opposite ways confirm nothing
        before = self._resplit_proposed
        same_way = before is not None and sum((n - o) * (p - o) for n, o, p in zip(best, old, before)) > 0
        taken = best != old and balance.confirm_resplit(gain, margin, same_way, drift_known)
        self._resplit_proposed = best if best != old and gain > margin and not taken else None
        if not taken:
            return None
        self.batch_sizes = best
        self.last_change = {"step": steps, "old": old, "new": best, "predicted_old_s": predicted_old,
                            "predicted_new_s": predicted, "gain": gain, "margin": margin,
                            "costs": [[c.a, c.c] for c in self.costs], "outside_s": list(self.outside_s),
                            "noise": self.noise}
        return self.last_change

    def describe(self) -> str:
        """One line for the log: how ``B`` is split, each rank's model and predicted time."""
        if self.source != "measured":  # started from equal or given speeds (from_costs)
            speeds = ", ".join(f"{s:.3g}" for s in self.speeds)
            return (f"split ({self.source} speeds [{speeds}], re-fitted from the steps every "
                    f"{self.rebalance_every}): batch sizes {self.batch_sizes}")
        quotas = ""
        if any(cores is not None for cores, _ in self.quotas):
            def quota(cores, throttled):
                if cores is None:
                    return "none"
                return f"{cores:.3g} cores" + ("" if throttled is None else
                                               f" (throttled {100 * throttled:.0f} % of the probe)")
            quotas = "; CPU quota " + ", ".join(quota(cores, throttled) for cores, throttled in self.quotas)
        times = [cost.time(b) for cost, b in zip(self.costs, self.batch_sizes)]
        equal = balance.step_time(self.costs, balance.equal_split(self.batch_size, self.topology.size))
        a = ", ".join(f"{cost.a * 1e3:.3g}" for cost in self.costs)
        u = ", ".join(f"{outside * 1e3:.3g}" for outside in self.outside_s)
        c = ", ".join(f"{cost.c * 1e3:.3g}" for cost in self.costs)
        t = ", ".join(f"{x * 1e3:.3g}" for x in times)
        return (f"split (measured cost t_i(b) = a_i + c_i b; a [{a}] ms (of which outside the compute "
                f"[{u}] ms), c [{c}] ms/sample): "
                f"batch sizes {self.batch_sizes}, predicted step [{t}] ms (equal split "
                f"{equal * 1e3:.3g} ms; kept unless {100 * max(self.threshold, self.noise):.3g} % "
                f"faster: threshold {100 * self.threshold:g} %, measurement noise {100 * self.noise:.3g} %)"
                f"{quotas}")
