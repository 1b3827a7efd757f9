"""EMULATION of a heterogeneous cluster on one machine: slow ranks and slow links.

Nothing here makes anything faster or more real; it stretches time so that the effects the
framework is built for (uneven rank speeds, a slow network between nodes) can be seen and
tested on a laptop. Every number produced under emulation must be reported as emulated.

* :mod:`.slowdown`: a rank ``f`` times slower (:class:`Slowdown`, the clock :class:`SlowedClock`);
* :mod:`.link`: a slow inter-node link (:class:`EmulatedLink`, a channel around a channel).
"""

from mpidl.distributed.emulation.link import EmulatedLink, LinkTimeline
from mpidl.distributed.emulation.slowdown import (EMULATION_CLOCKS, SlowedClock, Slowdown, compute_clock,
                                                  parse_slowdowns)
from mpidl.distributed.links import LinkModel, parse_link

__all__ = ["EmulatedLink", "LinkTimeline", "Slowdown", "SlowedClock", "compute_clock", "parse_slowdowns",
           "EMULATION_CLOCKS", "LinkModel", "parse_link"]
