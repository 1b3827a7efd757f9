"""Fault injection for the tests (the product knows nothing of it).

``MPIDL_INJECT_FAULT=RANK:STEP[:KIND]`` in the environment of ``python tests/faulty_train.py``
(the command line of ``python -m mpidl.train`` with :func:`inject` applied) makes rank
``RANK``, at global step ``STEP``, raise :class:`InjectedFault` (``raise``, the default),
put NaN into its local gradient (``nan``: the collective non-finite decision), send itself
SIGTERM (``term``: the real signal handler at a known step), SIGKILL (``kill``: a lost
rank, for ``--on-failure shrink``), or SIGSTOP (``stop``: a frozen rank, for the failure bound).
Several, comma-separated (``4:9:kill,5:9:kill``: a host of two ranks lost at once).
``RANK`` is the rank at start-up (a survivor of a shrink keeps it). The tests use it to check that a
failure on one rank ends, or stops, every rank alike.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "MPIDL_INJECT_FAULT"
KINDS = ("raise", "nan", "term", "kill", "stop")

__all__ = ["ENV", "KINDS", "Fault", "InjectedFault", "parse_fault", "fault_from_environment", "inject"]


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


def inject(trainer_class, faults) -> None:
    """Make ``trainer_class.train_step`` inject ``faults`` (a :class:`Fault`, :class:`Faults` or
    None) on the rank it names (its rank at start-up) before the step ``dp.steps``: ``kill``
    SIGKILLs the process, ``raise`` raises :class:`InjectedFault`, ``term`` sends it SIGTERM
    (the real handler), ``nan`` poisons its local gradient after the backward."""
    if faults is None:
        return
    step_once = trainer_class.train_step
    compute = trainer_class.compute

    def train_step(self, local):
        kind = faults.at(self.startup_rank, self.dp.steps)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stop":  # frozen, as a frozen host: alive, silent, never stepping again
            os.kill(os.getpid(), signal.SIGSTOP)
        if kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at step {self.dp.steps} ({ENV})")
        if kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if kind != "nan":
            return step_once(self, local)

        def poisoned(self_, indices):
            loss = compute(self_, indices)
            self_.params.grad[0] = float("nan")
            return loss

        self.compute = poisoned.__get__(self)
        try:
            return step_once(self, local)
        finally:
            del self.compute

    trainer_class.train_step = train_step
