"""This rank's compute clock: the time from taking a local batch to handing its gradient over."""

from __future__ import annotations

import time
from typing import Callable


class ComputeClock:
    """:meth:`start`, then :meth:`stop` returns the seconds since (after ``synchronize()``,
    which waits for a device to finish its queued work). :meth:`now` is the same clock's
    reading, for the step's own work outside the compute (the optimizer update, the loop):
    one time source, so that a test feeding recorded timings feeds both."""

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self.synchronize = synchronize
        self.start()

    def now(self) -> float:
        """Seconds on this clock (an arbitrary origin; differences only)."""
        return time.perf_counter()

    def cpu_now(self) -> float:
        """CPU seconds this process has used (all its threads: what a CPU quota charges)."""
        return time.process_time()

    def start(self) -> None:
        self._mark = time.perf_counter()

    def stop(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter() - self._mark
