"""EMULATION of a slow rank: :class:`Slowdown` makes a rank ``f`` times slower (after a compute
interval of ``t`` seconds it sleeps ``(f - 1) t``, or, on the CPU clock, up to ``f`` times the
interval's CPU seconds); :class:`SlowedClock` is the compute clock that does it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from numbers import Real
from typing import Callable

from mpidl.distributed.clock import ComputeClock
from mpidl.distributed.links import parse_numbers



# --------------------------------------------------------------------------- slow ranks
#: what a slowdown multiplies: an interval's wall seconds, or its CPU seconds
EMULATION_CLOCKS = ("wall", "cpu")


@dataclass
class Slowdown:
    """EMULATED slow rank: stretch every measured compute interval by ``factor``.

    ``factor = 1`` is a no-op; ``factor = 3`` makes the rank three times slower. ``sleep`` and
    ``clock`` are injectable so tests can record instead of wait.

    Usage: ``t = measured compute seconds; t += slowdown.stretch(t, cpu_seconds)``.

    What is multiplied (``basis``)
    ------------------------------
    ``"wall"`` (default): the interval's wall time ``t``; it lasts ``f t``. ``"cpu"``: its CPU
    time ``u`` (``time.process_time()``, every thread of the process); it lasts ``max(t, f u)``,
    i.e. the sleep is ``f u - t`` when positive. The two agree on a rank that has its cores to
    itself (``u = t`` for one busy thread). With more ranks than cores they do not: ``t`` then
    includes the time a rank waited for a core another rank held, which changes from step to
    step with what the others compute at that moment, and the wall basis multiplies that
    waiting by ``f`` as well, which makes the emulated ranks wait for each other more than
    the emulated cluster would. The cluster being
    emulated gives every rank its own processor, so its step time is ``f`` times its own work:
    the CPU basis, as long as ``f u >= t`` (the factors must exceed the contention, as the HDP
    experiment's x3 does). On several threads ``u`` adds them up: the emulated rank runs its
    threads' work one after another, ``f`` times slower.

    Notes
    -----
    ``time.sleep(s)`` returns late (by a fraction of a millisecond, a few per cent of a short
    step), which a rank would lose on every step without any part of it being counted. So :meth:`stretch` asks for ``s - o`` where ``o`` is a running estimate of the
    lateness (``o <- o + (late - o) / 4`` after every sleep, ``0 <= o <= s / 2``), and returns
    the seconds it really slept: the emulated interval is then ``f t`` to within the lateness's
    jitter, and whatever is left is counted as the rank's compute, not lost.
    """

    factor: float = 1.0
    basis: str = "wall"
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    #: running estimate of how late ``sleep`` returns (seconds)
    lateness: float = field(default=0.0, repr=False)

    def __post_init__(self):
        if isinstance(self.factor, bool) or not isinstance(self.factor, Real) \
                or not math.isfinite(self.factor) or self.factor < 1:
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {self.factor!r}")
        self.factor = float(self.factor)
        if self.basis not in EMULATION_CLOCKS:
            raise ValueError(f"emulation clock must be one of {', '.join(EMULATION_CLOCKS)}, got {self.basis!r}")

    def extra_seconds(self, elapsed: float, cpu_seconds: float | None = None) -> float:
        """The sleep that stretches an interval of ``elapsed`` wall seconds: ``(factor - 1) *
        elapsed`` on the wall basis; ``max(0, factor * cpu_seconds - elapsed)`` on the CPU
        basis (which needs ``cpu_seconds``)."""
        elapsed = max(float(elapsed), 0.0)
        if self.basis == "wall" or self.factor == 1.0:
            return (self.factor - 1.0) * elapsed
        if cpu_seconds is None:
            raise ValueError("a slowdown on the cpu basis needs the interval's cpu_seconds")
        return max(0.0, self.factor * max(float(cpu_seconds), 0.0) - elapsed)

    def stretch(self, elapsed: float, cpu_seconds: float | None = None) -> float:
        """Sleep about :meth:`extra_seconds` after a compute interval (the sleep's own
        lateness allowed for); return the seconds really slept."""
        extra = self.extra_seconds(elapsed, cpu_seconds)
        if extra <= 0:
            return 0.0
        asked = max(0.0, extra - min(self.lateness, 0.5 * extra))
        start = self.clock()
        self.sleep(asked)
        slept = self.clock() - start
        self.lateness = max(0.0, self.lateness + 0.25 * ((slept - asked) - self.lateness))
        return slept


class SlowedClock(ComputeClock):
    """EMULATION: a :class:`ComputeClock` whose :meth:`stop` first sleeps the
    :class:`Slowdown`'s stretch of the interval, and counts it."""

    def __init__(self, slowdown: Slowdown, synchronize: Callable[[], None] | None = None):
        self.slowdown = slowdown
        super().__init__(synchronize)

    def start(self) -> None:
        super().start()
        self._cpu_mark = time.process_time()

    def stop(self) -> float:
        seconds = super().stop()
        return seconds + self.slowdown.stretch(seconds, time.process_time() - self._cpu_mark)


def compute_clock(factor: float = 1.0, basis: str = "wall",
                  synchronize: Callable[[], None] | None = None) -> ComputeClock:
    """The plain clock, or the EMULATED slow one when ``factor != 1`` (both checked)."""
    slowdown = Slowdown(factor, basis)
    return ComputeClock(synchronize) if slowdown.factor == 1.0 else SlowedClock(slowdown, synchronize)


def parse_slowdowns(text: str, world_size: int) -> list[float]:
    """Parse ``"1,1,2,4"`` (one slowdown factor per rank, each >= 1) for ``--emulate-slowdown``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    values = parse_numbers(text, "slowdowns")
    if len(values) != world_size:
        raise ValueError(f"slowdowns: {len(values)} entries in {text!r} but there are "
                         f"{world_size} ranks; give one factor per rank")
    for i, v in enumerate(values):
        if v < 1:
            raise ValueError(f"slowdowns: entry {i} ({v}) must be >= 1 (1 = full speed)")
    return values
