"""The heterogeneous split of :class:`~mpidl.distributed.DataParallel` (HDP): how the global
batch ``B`` is shared by the ranks, from their cost models ``t_i(b) = a_i + c_i b``
(:mod:`~mpidl.distributed.balance`), and the re-fit that may move it while training.

A part of :class:`~mpidl.distributed.DataParallel` (its base class), kept in its own file
so that the step reads on its own.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from numbers import Integral, Real
from typing import Callable

from mpidl.distributed import balance
from mpidl.distributed import probe as speed_probe

#: steps whose compute times a re-fit may use (a bound on memory, not a tuning knob)
RECENT_STEPS = 1024


def check_split_options(batch_size, speeds, probe, balance_threshold, min_local_batch,
                        rebalance_every) -> None:
    """ValueError for a bad value of the split's options (no MPI)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(speeds, str) and speeds not in ("equal", "auto"):
        raise ValueError(f"speeds must be 'equal', 'auto' or one number per rank, got {speeds!r}")
    if speeds == "auto" and probe is None:
        raise ValueError("speeds='auto' measures the ranks with probe(n): pass probe=")
    if isinstance(balance_threshold, bool) or not isinstance(balance_threshold, Real) \
            or not 0 <= balance_threshold < 1:
        raise ValueError(f"balance_threshold must be a number in [0, 1), got {balance_threshold!r}")
    if isinstance(min_local_batch, bool) or not isinstance(min_local_batch, Integral) or min_local_batch < 0:
        raise ValueError(f"min_local_batch must be an integer >= 0, got {min_local_batch!r}")
    if rebalance_every is not None and (isinstance(rebalance_every, bool) or not isinstance(
            rebalance_every, Integral) or rebalance_every < 1):
        raise ValueError(f"rebalance_every must be an integer >= 1 or None, got {rebalance_every!r}")


def check_split_fits(batch_size: int, min_local_batch: int, world_size: int) -> None:
    """The one rule on the global batch: a full batch gives every rank at least
    ``min_local_batch`` samples, ``min_local_batch * P <= B``. With ``min_local_batch = 0``
    (a loop that handles an empty local batch) any ``B >= 1`` fits: a rank may then compute
    nothing in a step (the equal split of ``B < P``, or a rank the balance leaves out) and
    still join every exchange with weight 0."""
    if min_local_batch * world_size > batch_size:
        raise ValueError(f"batch_size {batch_size} is smaller than {min_local_batch} x {world_size} ranks: "
                         f"every rank needs at least {min_local_batch} sample{'s' if min_local_batch > 1 else ''} "
                         "of each global batch (min_local_batch)")


class ComputeClock:
    """Times this rank's compute: :meth:`start`, then :meth:`stop` returns the seconds since
    (after ``synchronize()``, which waits for a device to finish)."""

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self.synchronize = synchronize
        self.start()

    def start(self) -> None:
        self._mark = time.perf_counter()

    def stop(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter() - self._mark


class HeterogeneousSplit:
    """The split of ``B`` (:attr:`batch_sizes`), the ranks' cost models (:attr:`costs`) and
    re-balancing (:meth:`rebalance`). Uses the DataParallel's ``topology``, ``batch_size``,
    ``min_local_batch``, ``balance_threshold``, ``steps`` and ``all_gather_object``."""

    def split(self, n: int) -> list[int]:
        """Samples of every rank in a global batch of ``n``: :attr:`batch_sizes` for a full
        batch, the same proportions (largest remainder, zeros allowed) for a smaller one."""
        if n == self.batch_size:
            return list(self.batch_sizes)
        return balance.split_counts(n, self.batch_sizes)

    def shard(self, n: int) -> tuple[int, int]:
        """``[lo, hi)`` of this rank's equal share of ``n`` items (e.g. the test set)."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def _first_split(self, speeds, given, probe) -> None:
        """The split before the first step (collective with ``speeds='auto'``)."""
        topo = self.topology
        if speeds == "auto":
            #: every rank's cost model t_i(b) = a_i + c_i b (seconds), indexed by rank
            self.costs, self.noise, self.batch_sizes, self.predicted_step_s = speed_probe.measured_split(self, probe)
            self.speeds_source = "measured"
        else:
            self.costs = balance.costs_from_speeds(given if given is not None else [1.0] * topo.size)
            self.noise = 0.0
            self.speeds_source = "given" if given is not None else "equal"
            self.batch_sizes = (balance.solve_split(self.costs, self.batch_size, self.min_local_batch)
                                if given is not None
                                else balance.equal_split(self.batch_size, topo.size))
            self.predicted_step_s = balance.step_time(self.costs, self.batch_sizes)
        #: (samples, compute seconds) of this rank's steps since the last re-fit (the latest
        #: only), and those of the period before it: the window of the next re-fit
        self._recent: deque = deque(maxlen=RECENT_STEPS)
        self._previous_period: list = []
        #: the last re-fit proposed a re-split that was not taken (to be confirmed)
        self._resplit_proposed = False

    @property
    def speeds(self) -> list[float]:
        """Every rank's marginal speed ``1 / c_i`` (samples per second) from its cost model."""
        return [1.0 / cost.c for cost in self.costs]

    def describe_split(self) -> str:
        """One line for the log: how ``B`` is split, each rank's model and predicted time."""
        times = [cost.time(b) for cost, b in zip(self.costs, self.batch_sizes)]
        if self.speeds_source != "measured":
            speeds = ", ".join(f"{s:.3g}" for s in self.speeds)
            return f"split ({self.speeds_source} speeds [{speeds}]): batch sizes {self.batch_sizes}"
        equal = balance.step_time(self.costs, balance.equal_split(self.batch_size, self.size))
        a = ", ".join(f"{cost.a * 1e3:.3g}" for cost in self.costs)
        c = ", ".join(f"{cost.c * 1e3:.3g}" for cost in self.costs)
        t = ", ".join(f"{x * 1e3:.3g}" for x in times)
        return (f"split (measured cost t_i(b) = a_i + c_i b; a [{a}] ms, c [{c}] ms/sample): "
                f"batch sizes {self.batch_sizes}, predicted step [{t}] ms (equal split "
                f"{equal * 1e3:.3g} ms; kept unless {100 * max(self.balance_threshold, self.noise):.3g} % "
                f"faster: threshold {100 * self.balance_threshold:g} %, measurement noise "
                f"{100 * self.noise:.3g} %)")

    def rebalance(self) -> tuple[list[int], list[int]] | None:
        """Re-fit every rank's cost model from its own steps and re-split when that is
        predicted to be faster than the current split by more than the margin (collective;
        every rank computes the same split from the same gathered numbers). Returns ``(old,
        new)`` batch sizes when they changed, else None.

        Each rank re-fits from the steps since the last call and the ones of the call before
        (:func:`~mpidl.distributed.balance.refit_cost`): when its batch sizes span at least half
        of the largest, their medians separate ``a_i`` from ``c_i``; otherwise the model keeps
        its shape and is scaled through the window's steps. The margin is ``max(balance_threshold, noise)`` (``noise``:
        the median over ranks of their steps' :func:`~mpidl.distributed.balance.timing_noise`),
        and a gain must pass it in two consecutive calls, or pass twice the margin in one
        (:func:`~mpidl.distributed.balance.confirm_resplit`): no move on one noisy period."""
        window = list(self._previous_period) + list(self._recent)
        self._previous_period = list(self._recent)
        self._recent.clear()
        cost = balance.refit_cost(self.costs[self.rank], [b for b, _ in window], [t for _, t in window])
        current = [t for b, t in window if b == self.batch_sizes[self.rank] and b > 0]
        spread = balance.timing_noise(current) if current else 0.0
        gathered = self.all_gather_object((cost.a, cost.c, spread))
        self.costs = [balance.RankCost(a, c) for a, c, _ in gathered]
        self.noise = statistics.median(s for _, _, s in gathered)
        old = list(self.batch_sizes)
        best = balance.solve_split(self.costs, self.batch_size, self.min_local_batch)
        predicted_old, predicted = balance.step_time(self.costs, old), balance.step_time(self.costs, best)
        gain = 1.0 - predicted / predicted_old if predicted_old > 0 else 0.0
        margin = max(self.balance_threshold, self.noise)
        taken = best != old and balance.confirm_resplit(gain, margin, self._resplit_proposed)
        self._resplit_proposed = best != old and gain > margin and not taken
        self.predicted_step_s = predicted if taken else predicted_old
        if not taken:
            return None
        self.batch_sizes = best
        self.last_rebalance = {"step": self.steps, "old": old, "new": best,
                               "predicted_old_s": predicted_old, "predicted_new_s": predicted,
                               "gain": gain, "margin": margin,
                               "costs": [[c.a, c.c] for c in self.costs], "noise": self.noise}
        return old, best
