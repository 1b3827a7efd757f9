"""The production extras, each an exchange or a channel around the core's, in its own file:

* :mod:`.overlap`       gradient buckets exchanged during the backward pass
* :mod:`.shm`           one copy of the model per node in an MPI-3 shared window
* :mod:`.compress`      16-bit inter-node gradient exchange with error feedback
* :mod:`.sync_overlap`  the node strategy's parameter average in the background

:func:`mpidl.distributed.build.data_parallel` composes them from options; the core
(:class:`~mpidl.distributed.DataParallel`) and the strategies never name them.

:class:`ExchangeWrapper` is what the two exchanges around an exchange (:mod:`.overlap`,
:mod:`.shm`) share: whatever a wrapper does not define itself is the inner exchange's.
"""

from __future__ import annotations

import contextlib
import time

__all__ = ["ExchangeWrapper", "timed"]


class ExchangeWrapper:
    """An exchange around an exchange (``inner``): it overrides the calls it changes, and
    every other attribute (``topology``, ``traffic``, ``control``, ``name``, ``exact``,
    ``channel()``, ``world_flags()``, ``sync_every``, ...) is read from ``inner``. Attributes
    are only READ through: a wrapper that keeps a counter keeps its own."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        # Called only for names the wrapper does not have. `inner` itself is excluded so that
        # a half-built wrapper (or copy/pickle probing it) fails plainly instead of recursing.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def describe(self) -> str:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def timed(traffic):
    """Book the wall time of the block in ``traffic.seconds``, ONCE: what the block's channels
    and requests booked meanwhile (a blocking collective's time, an EMULATED link's sleep) is
    part of that wall time and is replaced by it, not added to it."""
    before, start = traffic.seconds, time.perf_counter()
    try:
        yield
    finally:
        traffic.seconds = before + (time.perf_counter() - start)
