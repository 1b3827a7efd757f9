"""The alpha-beta model of a link, for the EMULATED slow links and for the planner.

A message of ``n`` bytes over a link of latency ``alpha`` (s) and bandwidth ``beta``
(bytes/s) takes ``alpha + n / beta``; :class:`LinkModel` gives the time of the collectives
built from such messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

__all__ = ["LinkModel", "parse_link", "parse_numbers"]


def parse_numbers(text: str, what: str) -> list[float]:
    """``"1,2.5"`` -> ``[1.0, 2.5]``; ValueError naming ``what`` and the bad entry."""
    parts = [p.strip() for p in str(text).split(",")]
    values = []
    for i, part in enumerate(parts):
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"{what}: entry {i} ({part!r}) is not a number in {text!r}") from None
        if not math.isfinite(values[-1]):
            raise ValueError(f"{what}: entry {i} ({part!r}) must be finite")
    return values


@dataclass(frozen=True)
class LinkModel:
    """A link's alpha-beta model of latency and bandwidth (an EMULATED inter-node link, or
    a link of the planner's scenario).

    Parameters
    ----------
    latency_us : float
        ``alpha``, the start-up time of one message, in microseconds (>= 0).
    gbit_s : float
        Link bandwidth in Gbit/s (> 0); ``beta = gbit_s * 1e9 / 8`` bytes per second.

    Notes
    -----
    Time of one collective on ``n`` bytes among ``L`` participants (0 when ``L <= 1``):

    * ring allreduce (reduce-scatter + allgather, ``2 (L-1)`` steps of ``n / L`` bytes)::

          T = 2 (L - 1) (alpha + n / (L beta))

    * ring allgather of ``n`` bytes from every participant: ``T = (L - 1) (alpha + n / beta)``
    * binomial tree allreduce: ``T = 2 ceil(log2 L) (alpha + n / beta)``; broadcast or
      reduce: half of it
    """

    latency_us: float
    gbit_s: float

    def __post_init__(self):
        for name, value, ok in (("latency_us", self.latency_us, lambda v: v >= 0),
                                ("gbit_s", self.gbit_s, lambda v: v > 0)):
            if isinstance(value, bool) or not isinstance(value, Real) \
                    or not math.isfinite(value) or not ok(value):
                need = ">= 0" if name == "latency_us" else "> 0"
                raise ValueError(f"link {name} must be a finite number {need}, got {value!r}")

    @property
    def alpha(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Bandwidth in bytes per second."""
        return self.gbit_s * 1e9 / 8.0

    def allreduce_seconds(self, nbytes: int, participants: int) -> float:
        """``2 (L-1) (alpha + n / (L beta))`` for a ring allreduce of ``n`` bytes among ``L``."""
        if participants <= 1:
            return 0.0
        return 2 * (participants - 1) * (self.alpha + nbytes / (participants * self.beta))

    def allgather_seconds(self, nbytes: int, participants: int) -> float:
        """``(L-1) (alpha + n / beta)`` for a ring allgather of ``n`` bytes from each of ``L``."""
        if participants <= 1:
            return 0.0
        return (participants - 1) * (self.alpha + nbytes / self.beta)

    def tree_allreduce_seconds(self, nbytes: float, participants: int) -> float:
        """``2 ceil(log2 L) (alpha + n / beta)``: binomial reduce + broadcast among ``L``."""
        return 2 * self.tree_bcast_seconds(nbytes, participants)

    def tree_bcast_seconds(self, nbytes: float, participants: int) -> float:
        """``ceil(log2 L) (alpha + n / beta)``: a binomial broadcast (or reduce) among ``L``."""
        if participants <= 1:
            return 0.0
        return math.ceil(math.log2(participants)) * (self.alpha + nbytes / self.beta)

    def __str__(self) -> str:
        return f"{self.latency_us:g} us, {self.gbit_s:g} Gbit/s"

    def describe(self) -> str:
        return f"EMULATED inter-node link: {self.latency_us:g} us latency, {self.gbit_s:g} Gbit/s"


def parse_link(text: str) -> LinkModel:
    """Parse ``"50,1"`` = 50 microseconds latency, 1 Gbit/s, for ``--emulate-link``."""
    values = parse_numbers(text, "link")
    if len(values) != 2:
        raise ValueError(f"link: expected 'LATENCY_US,GBIT_S' (e.g. '50,1'), got {text!r}")
    return LinkModel(latency_us=values[0], gbit_s=values[1])
