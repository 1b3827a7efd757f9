"""EMULATION of a slow inter-node link: a channel that sleeps the link model's time.

:class:`EmulatedLink` wraps the channel of an inter-node level (the leaders' ``inter``, or
the flat strategy's ``world`` when the ranks span several nodes): after every BLOCKING
collective it sleeps the alpha-beta time of :class:`~mpidl.distributed.links.LinkModel` for
the bytes and the ranks of that channel (a ring allreduce over ``L`` ranks: ``2 (L-1) (alpha +
n / (L beta))``). A NON-BLOCKING one (the overlapped buckets) is booked on a
:class:`LinkTimeline` instead, so that its modelled time runs concurrently with the compute
it overlaps: its request completes when both MPI and the deadline are done. The strategies
never know: they call the channel they were given.
"""

from __future__ import annotations

import time
from typing import Callable

from mpidl.distributed.links import LinkModel

__all__ = ["LinkTimeline", "EmulatedLink"]


class LinkTimeline:
    """EMULATED occupancy of one inter-node link, for collectives that do not block.

    A blocking collective sleeps its modelled time on the spot (the caller waits, as it would
    for the real link). A non-blocking one is *scheduled* instead: ``start(seconds)`` books
    the link from ``max(now, busy_until)`` for ``seconds`` (transfers on one link are
    serialized) and returns the time at which the transfer ends; ``wait(deadline)`` sleeps
    only what is left of it. The modelled time thus runs concurrently with whatever the
    caller computes in between, as a helper thread sleeping the link model would, but
    without a thread to schedule on a loaded machine: the caller is charged exactly
    ``max(0, deadline - now)`` when it needs the result.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.clock = clock
        self.sleep = sleep
        self.busy_until = 0.0

    def start(self, seconds: float) -> float:
        """Book ``seconds`` of link time now (after any transfer still on the link); returns
        the deadline (a ``clock`` time)."""
        begin = max(self.clock(), self.busy_until)
        self.busy_until = begin + max(float(seconds), 0.0)
        return self.busy_until

    def done(self, deadline: float) -> bool:
        return self.clock() >= deadline

    def wait(self, deadline: float) -> float:
        """Sleep until ``deadline``; returns the seconds slept (0 when it has passed)."""
        left = deadline - self.clock()
        if left > 0:
            self.sleep(left)
            return left
        return 0.0




class _TimedRequest:
    """An MPI request that also waits for its EMULATED deadline."""

    def __init__(self, request, timeline: LinkTimeline, deadline: float, traffic):
        self.request, self.timeline, self.deadline, self.traffic = request, timeline, deadline, traffic

    def Test(self) -> bool:  # noqa: N802 - MPI.Request's name
        if self.request is not None:
            if not self.request.Test():
                return False
            self.request = None
        return self.timeline.done(self.deadline)

    def Wait(self) -> None:  # noqa: N802
        if self.request is not None:
            self.request.Wait()
            self.request = None
        slept = self.timeline.wait(self.deadline)
        self.traffic.seconds += slept
        self.traffic.emulated_seconds += slept


class EmulatedLink:
    """A channel whose collectives also last the ``link`` model's time (see the module doc)."""

    def __init__(self, channel, link: LinkModel):
        if not isinstance(link, LinkModel):
            raise ValueError(f"link must be a LinkModel, got {link!r}")
        self.channel, self.link = channel, link
        self.timeline = LinkTimeline()

    def __getattr__(self, name):  # level, comm, traffic, size, is_root, communicators
        return getattr(self.channel, name)

    def describe(self) -> str:
        return self.link.describe()

    def _sleep(self, seconds: float) -> None:
        if seconds > 0 and self.channel.size > 1:
            time.sleep(seconds)
            self.channel.traffic.seconds += seconds
            self.channel.traffic.emulated_seconds += seconds

    def allreduce(self, array) -> None:
        self.channel.allreduce(array)
        self._sleep(self.link.allreduce_seconds(array.nbytes, self.channel.size))

    def allgather(self, array, out) -> None:
        self.channel.allgather(array, out)
        self._sleep(self.link.allgather_seconds(array.nbytes, self.channel.size))

    def reduce(self, array) -> None:
        self.channel.reduce(array)

    def bcast(self, array) -> None:
        self.channel.bcast(array)

    def run(self, op: str, array) -> None:
        getattr(self, op)(array)

    def start(self, op: str, array):
        request = self.channel.start(op, array)
        if request is None or op != "allreduce":
            return request
        deadline = self.timeline.start(self.link.allreduce_seconds(array.nbytes, self.channel.size))
        return _TimedRequest(request, self.timeline, deadline, self.channel.traffic)
