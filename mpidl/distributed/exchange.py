"""The exchange: the one interface :class:`~mpidl.distributed.DataParallel` calls.

Every step a rank hands the exchange its *message*, one flat buffer (``FlatParameters.message``)::

    message = [ g_i (P scalars) | c_i | stop_i | nonfinite_i ]

``g_i`` is the rank's local MEAN gradient over its ``b_i`` samples and ``c_i`` its weight:
``b_i`` under balanced weighting, ``1`` under uniform weighting (the naive ``1/P`` baseline).
:meth:`Exchange.reduce` replaces it, in place, by::

    [ g = sum_i c_i g_i / sum_i c_i | sum_i c_i | sum_i stop_i | sum_i nonfinite_i ]

over the ranks that reduce together (the *step group*: the world for the exact strategies,
the node for the node strategy). Balanced, ``g = sum_i (b_i / B) g_i`` with ``B = sum_i b_i``:
exactly the gradient of the mean loss over the step's ``B`` samples, whatever the local batch
sizes. The weights need no message of their own, and the stop requests (a SIGTERM on any
rank) travel in the same SUM. A step group of one rank exchanges nothing and scales nothing,
so one process computes bit for bit what a plain loop computes.

The interface (one instance per topology and options; every call collective)::

    reduce(message)                        -> finite?      every step, after backward
                                                           (the stages, then reduced())
    after_step(steps, params, state, flags) -> flags | None after the optimizer: node's K' sync
    synchronize(params, state, flags)      -> flags        make every replica identical now
    state() / load_state(dict)                             what a checkpoint or a rollback keeps
    close()                                                free what it holds

A strategy is a list of :class:`Stage` s, the collectives :meth:`reduce` runs on the message in
order: ``flat`` one world allreduce, ``hierarchical`` node reduce -> leaders allreduce -> node
broadcast, ``node`` one node allreduce. The overlapped exchange
(:mod:`~mpidl.distributed.extras.overlap`) runs the same stages bucket by bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpidl import kernels
from mpidl.engine.backend import get_array_module, to_host
from mpidl.distributed.channel import Channel, Traffic
from mpidl.distributed.message import COUNT, NONFINITE, STOP, check_message
from mpidl.distributed.topology import Topology

__all__ = ["Stage", "Exchange", "is_finite"]


class Stage(NamedTuple):
    """One collective of a strategy's reduction: ``channel.run(op, message)``."""

    channel: Channel
    op: str


def is_finite(values) -> bool:
    """Whether every value is finite. On a device: one float64 sum (NaN or Inf anywhere makes
    it non-finite) and one read, instead of an elementwise test."""
    if get_array_module(values) is np:
        return kernels.all_finite(values)
    return bool(np.isfinite(to_host(values.sum(dtype=np.float64))))


class Exchange:
    """Base class of the strategies: the interface, and the exact strategies' defaults.

    Attributes: ``topology``; ``traffic`` (the channels' counters); ``control`` (the world
    channel for flags and the loop's small collectives, never wrapped); ``stages`` (set by
    the strategy, over channels made by :meth:`channel`);
    ``exact`` (True when every replica holds the same parameters after every step, i.e. the
    step group is the world).
    """

    name = "exchange"
    exact = True

    def __init__(self, topology: Topology, wrap=None):
        self.topology = topology
        self.traffic = Traffic()
        self._wrap = wrap
        self._wrapped: list = []
        self.control = Channel("control", topology.world, self.traffic)
        self.stages: list[Stage] = []

    def channel(self, level: str, comm):
        """A counted channel of ``level`` over ``comm``, passed through ``wrap`` (a function
        channel -> channel given at construction: compression, an EMULATED link), which the
        strategies never need to know about."""
        channel = Channel(level, comm, self.traffic)
        if self._wrap is not None:
            wrapped = self._wrap(channel)
            if wrapped is not channel:
                self._wrapped.append(wrapped)
            channel = wrapped
        return channel

    @property
    def group_size(self) -> int:
        """Ranks of the step group."""
        return self.topology.size

    def describe(self) -> str:
        """The strategy, and what its channels were wrapped in where that level moves data
        (the same text on every rank), for the log."""
        extras = dict.fromkeys(w.describe() for w in self._wrapped if self._level_moves_data(w.level))
        return "; ".join([f"strategy {self.name}", *extras])

    def _level_moves_data(self, level: str) -> bool:
        """Whether some rank's channel of ``level`` spans several ranks: a fact of the
        topology, alike on every rank (a rank's own channel may be of one rank, or none)."""
        topo = self.topology
        return {"inter": topo.num_nodes > 1, "intra": max(topo.node_sizes) > 1}.get(level, topo.size > 1)

    # ------------------------------------------------------------------ the interface
    def reduce(self, message) -> bool:
        """The weighted SUM of the step group, in place (see the module docstring); returns
        whether the reduced gradient is finite, the same answer on every rank of the group."""
        check_message(message)
        if self.group_size > 1:
            weight = float(message[COUNT])
            if weight != 1:
                message[:COUNT] *= weight
            for stage in self.stages:
                stage.channel.run(stage.op, message)
        return self.reduced(message)

    def reduced(self, message) -> bool:
        """After the SUM (the stages, blocking or bucket by bucket): divide by the summed
        weight; returns whether the gradient is finite. A group of one rank divides nothing.
        An exact exchange refuses a step whose summed weight is 0 (no rank computed a sample),
        whatever the number of ranks."""
        grad = message[:COUNT]
        total = float(message[COUNT])
        if total == 0 and self.exact:  # one rank too: the same refusal at any world size
            raise ValueError("no rank computed a sample this step (every count was 0)")
        if self.group_size > 1 and total > 0:
            grad /= total
        return is_finite(grad)

    def after_step(self, steps: int, params_data, state_buffers, flags) -> tuple | None:
        """After the optimizer step (``steps`` done so far); returns the world's ``(stop,
        nonfinite)`` sums when it synchronised the replicas, else None."""
        return None

    def synchronize(self, params_data, state_buffers, flags) -> tuple:
        """Make every replica identical now; returns the world's ``(stop, nonfinite)`` sums of
        ``flags``. The exact strategies' replicas already are: only the flags travel."""
        return self.world_flags(flags)

    def state(self) -> dict:
        """What a checkpoint or a rollback must keep of the exchange (nothing, when exact)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state`'s dict."""

    def close(self) -> None:
        """Free what the exchange holds (duplicated communicators, windows)."""

    # ------------------------------------------------------------------ helpers
    def world_flags(self, flags) -> tuple:
        """World SUM of this rank's ``(stop, nonfinite)`` (one small collective)."""
        buf = np.asarray(flags, dtype=np.float64).copy()
        self.control.allreduce(buf)
        return float(buf[0]), float(buf[1])


def reset_slots(message, stop: bool) -> None:
    """Clear a message's flags for a new step: ``stop_i`` this rank's stop request,
    ``nonfinite_i = 0``."""
    message[STOP] = 1.0 if stop else 0.0
    message[NONFINITE] = 0.0
