"""Fault injection for the tests: not a user option.

``MPIDL_INJECT_FAULT=RANK:STEP[:KIND]`` in the environment of ``python -m mpidl.train`` makes
rank ``RANK``, at global step ``STEP``, raise :class:`InjectedFault` (``raise``, the default),
put NaN into its local gradient (``nan``: the collective non-finite decision), send itself
SIGTERM (``term``: the real signal handler at a known step), or SIGKILL (``kill``: a lost
rank, for ``--on-failure shrink``).
Several, comma-separated (``4:9:kill,5:9:kill``: a host of two ranks lost at once).
``RANK`` is the rank at start-up (a survivor of a shrink keeps it). The tests use it to check that a
failure on one rank ends, or stops, every rank alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "MPIDL_INJECT_FAULT"
KINDS = ("raise", "nan", "term", "kill")

__all__ = ["ENV", "KINDS", "Fault", "InjectedFault", "parse_fault", "fault_from_environment"]


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str = "raise"

    def at(self, rank: int, step: int) -> str | None:
        """The kind of fault to inject on ``rank`` at ``step``, or None."""
        return self.kind if (rank, step) == (self.rank, self.step) else None


def parse_fault(text: str, world_size: int) -> Fault:
    """``"1:5"`` / ``"2:3:nan"`` -> :class:`Fault`; ValueError naming the variable otherwise."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in KINDS):
            raise ValueError
        fault = Fault(int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "raise")
    except ValueError:
        raise ValueError(f"{ENV} is RANK:STEP[:{'|'.join(KINDS)}] (e.g. 1:5), got {text!r}") from None
    if not 0 <= fault.rank < world_size or fault.step < 0:
        raise ValueError(f"{ENV}={text}: rank must be in [0, {world_size}) and step >= 0")
    return fault


@dataclass(frozen=True)
class Faults:
    """Several faults (at most one per rank and step)."""

    faults: tuple[Fault, ...]

    def at(self, rank: int, step: int) -> str | None:
        return next((f.kind for f in self.faults if f.at(rank, step)), None)


def fault_from_environment(world_size: int) -> Fault | Faults | None:
    """The fault(s) :data:`ENV` asks for, or None when it is unset or empty."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    faults = [parse_fault(part.strip(), world_size) for part in text.split(",")]
    return faults[0] if len(faults) == 1 else Faults(tuple(faults))
