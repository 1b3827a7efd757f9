"""The loop side of surviving a lost host: run a stretch of steps again from where the
survivors went back to.

A training loop runs its global steps in stretches (an epoch: its steps, then the sync,
evaluation and checkpoint). When ranks are lost,
:class:`~mpidl.distributed.elastic.data_parallel.ElasticDataParallel` raises
:class:`~mpidl.distributed.elastic.recovery.RanksLost` on every survivor, with the state back
at the one before global step ``lost.step``. :func:`run_surviving` then runs the stretch
again from that step: the survivors compute the global batch of that step themselves, so no
sample is skipped and none is counted twice.
"""

from __future__ import annotations

from typing import Callable

from mpidl.distributed.elastic.recovery import RanksLost

__all__ = ["run_surviving"]


def run_surviving(dp, run: Callable[[int], object], on_lost: Callable[[RanksLost], None] | None = None):
    """``run(first_step)`` runs the stretch from global step ``first_step`` (``dp.steps`` at the
    start); after a :class:`RanksLost` whose step lies in the stretch, ``on_lost(lost)`` is
    called and the stretch runs again from ``lost.step``. A loss before the stretch's start
    (it cannot be redone here) propagates. Returns what ``run`` returns."""
    start = first = dp.steps
    while True:
        try:
            return run(start)
        except RanksLost as lost:
            if lost.step < first:
                raise
            if on_lost is not None:
                on_lost(lost)
            start = lost.step
