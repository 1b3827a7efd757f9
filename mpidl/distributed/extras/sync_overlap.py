"""The node strategy's parameter average in the background (``sync_overlap=k``).

:class:`OverlappedSyncNode` is :class:`~mpidl.distributed.node.Node` whose sync at step ``t``
starts the leaders' ``Iallreduce`` of ``[v_n theta_t | v_n s_t | v_n | flags]`` and applies it
``k`` steps later, at step ``t + k``, as::

    theta <- avg(theta_t) + (theta_now - theta_t)

the average of the nodes' parameters at the start plus the progress this node made meanwhile
(the same for the optimizer state with ``sync_optimizer_state``). It equals the blocking sync
when nothing changed the parameters meanwhile (``theta_now = theta_t``); otherwise the local
steps taken between ``t`` and ``t + k`` were computed at the un-averaged ``theta``, which is
the price of not waiting for the network.
"""

from __future__ import annotations

from numbers import Integral

from mpi4py import MPI

from mpidl.engine.backend import get_array_module
from mpidl.distributed.extras import timed
from mpidl.distributed.message import COUNT, NONFINITE, STOP
from mpidl.distributed.node import Node

__all__ = ["OverlappedSyncNode", "check_options"]


def check_options(sync_overlap, strategy: str, sync_every: int, intra: str, compress: str) -> None:
    """``sync_overlap`` must be an integer in ``[0, K')``; when > 0: the node strategy, private
    replicas (``intra='mpi'``) and the uncompressed sync."""
    if isinstance(sync_overlap, bool) or not isinstance(sync_overlap, Integral) or sync_overlap < 0:
        raise ValueError(f"sync_overlap must be an integer >= 0, got {sync_overlap!r}")
    if not sync_overlap:
        return
    if strategy != "node":
        raise ValueError("sync_overlap applies to strategy='node'")
    if isinstance(sync_every, Integral) and not sync_overlap < sync_every:
        raise ValueError(f"sync_overlap must be an integer in [0, sync_every={sync_every}), got {sync_overlap!r}")
    if intra != "mpi":
        raise ValueError("sync_overlap works with intra='mpi'")
    if compress != "none":
        raise ValueError("sync_overlap works with the uncompressed sync (no compress)")


class OverlappedSyncNode(Node):
    """:class:`~mpidl.distributed.node.Node` with its syncs applied ``sync_overlap`` steps after
    they start (see the module docstring). Collective construction (the leaders duplicate
    their communicator: the background sync must not mix with the blocking collectives)."""

    def __init__(self, topology, sync_every: int = 50, sync_optimizer_state: bool = False,
                 sync_overlap: int = 1, wrap=None):
        check_options(sync_overlap, "node", sync_every, "mpi", "none")
        if not sync_overlap:
            raise ValueError("OverlappedSyncNode needs sync_overlap >= 1 (0 is the blocking Node)")
        super().__init__(topology, sync_every, sync_optimizer_state, wrap)
        self.sync_overlap = int(sync_overlap)
        self._comm = topology.leaders.Dup() if topology.is_leader and not self.exact else MPI.COMM_NULL
        #: the leaders' level on the duplicate: counted (and EMULATED) like the blocking one
        self.background = self.channel("inter", self._comm)
        self._pending = None

    def describe(self) -> str:
        return super().describe().replace(
            f"(K'={self.sync_every})", f"(K'={self.sync_every}, sync applied {self.sync_overlap} step(s) after it starts)", 1)

    @property
    def in_flight(self) -> bool:
        """True between the start of a sync and its application."""
        return self._pending is not None

    def after_step(self, steps, params_data, state_buffers, flags):
        self.steps_since_sync += 1
        if self.exact:
            return None
        result = None
        if self._pending is not None and steps >= self._pending["apply_at"]:
            result = self._finish(params_data, state_buffers)
        if steps % self.sync_every == 0:
            self._start(params_data, state_buffers, flags, steps + self.sync_overlap)
        return result

    def synchronize(self, params_data, state_buffers, flags):
        pending = self._finish(params_data, state_buffers) if self._pending is not None else None
        sums = super().synchronize(params_data, state_buffers, flags)
        return sums if pending is None else (sums[0] + pending[0], sums[1] + pending[1])

    def state(self) -> dict:
        if self._pending is not None:
            raise RuntimeError("a parameter sync is in flight: synchronize() before taking the state")
        return super().state()

    def close(self) -> None:
        """Free the duplicate. A sync still in flight is completed among the leaders (its
        buffer must outlive the collective) and dropped, not applied."""
        if self._pending is not None and self._pending["request"] is not None:
            self._pending["request"].Wait()
        self._pending = None
        if self._comm != MPI.COMM_NULL:
            self._comm.Free()
            self._comm = MPI.COMM_NULL

    def _buffers(self, params_data, state_buffers) -> list:
        return [params_data, *state_buffers] if self.sync_optimizer_state else [params_data]

    def _start(self, params_data, state_buffers, flags, apply_at: int) -> None:
        buffers = self._buffers(params_data, state_buffers)
        size = params_data.size
        pending = {"apply_at": apply_at, "request": None}
        if self.topology.is_leader:
            message = get_array_module(params_data).zeros(size * len(buffers) + 3, dtype=params_data.dtype)
            for k, buf in enumerate(buffers):
                part = message[k * size:(k + 1) * size]
                part[...] = buf
                part *= self.weight_since_sync
            message[COUNT], message[STOP], message[NONFINITE] = self.weight_since_sync, flags[0], flags[1]
            pending["message"] = message
            pending["snapshot"] = [buf.copy() for buf in buffers]
            pending["request"] = self.background.start("allreduce", message)
        self._pending = pending
        self.weight_since_sync, self.steps_since_sync = 0.0, 0

    def _finish(self, params_data, state_buffers) -> tuple:
        pending, self._pending = self._pending, None
        buffers = self._buffers(params_data, state_buffers)
        size = params_data.size
        with timed(self.traffic):
            if self.topology.is_leader:
                message = pending["message"]
                if pending["request"] is not None:
                    pending["request"].Wait()   # (an EMULATED link sleeps what is left of its time)
                total = float(message[COUNT])
                if total > 0:
                    for k, snap in enumerate(pending["snapshot"]):
                        part = message[k * size:(k + 1) * size]
                        part /= total
                        part -= snap   # avg(theta_t) - theta_t
            else:
                message = get_array_module(params_data).zeros(size * len(buffers) + 3, dtype=params_data.dtype)
            self.intra.bcast(message)
        if float(message[COUNT]) <= 0:
            raise RuntimeError("node parameter sync: no node computed a sample since the last sync "
                               "(every count was 0); the parameter average is undefined")
        for k, buf in enumerate(buffers):
            buf += message[k * size:(k + 1) * size]
        return float(message[STOP]), float(message[NONFINITE])
