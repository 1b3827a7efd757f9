"""Node-based reduction (the TNNLS scheme): exact inside a node, periodic between nodes.

Every step the ranks of a node average their gradients (fast shared-memory traffic); the
nodes train on their own for ``K'`` steps, then the leaders average the PARAMETERS, weighted
by how much each node computed since the last sync, and broadcast them in their node.
Inter-node traffic falls by a factor of about ``K'`` times the ranks per node.
"""

from __future__ import annotations

from numbers import Integral

from mpidl.engine.backend import get_array_module
from mpidl.distributed.exchange import Exchange, Stage
from mpidl.distributed.message import COUNT, NONFINITE, STOP


class Node(Exchange):
    """Node-local weighted gradient allreduce every step; weighted parameter average between
    nodes every ``sync_every`` (K') steps.

    Notes
    -----
    Gradients, every step, within node ``n`` (``R_n`` its ranks)::

        g_n = sum_{i in R_n} c_i g_i / sum_{i in R_n} c_i

    so the replicas of one node stay identical and each node follows the exact gradient of
    its own samples. Parameters, when ``steps % K' == 0`` (and at :meth:`synchronize`)::

        theta = sum_n v_n theta_n / sum_n v_n,     v_n = sum over the steps since the last sync
                                                         of sum_{i in R_n} c_i

    ``v_n`` is the node's samples since the last sync under balanced weighting (its ranks x
    steps under uniform): the per-step reductions already summed it, so no extra message is
    needed. Each leader sends ``[v_n theta_n | v_n | stop | nonfinite]`` in one
    ``Allreduce(SUM)`` among the leaders and broadcasts the sum in its node; every rank
    divides, so afterwards all replicas are bitwise identical. With ``sync_optimizer_state``
    the optimizer's state buffers travel in the same message, averaged with the same weights.
    With ``K' = 1`` and plain SGD this is the flat scheme:
    ``sum_n v_n (theta - lr g_n) / sum_n v_n = theta - lr sum_i (b_i / B) g_i``.

    One node: the flat scheme on the node communicator, and no inter-node traffic at all.
    Counters: per step ``intra`` 1 call; per sync ``inter`` 1 call (leaders) and ``intra`` 1
    call (the broadcast).
    """

    name = "node"

    def __init__(self, topology, sync_every: int = 50, sync_optimizer_state: bool = False, wrap=None):
        super().__init__(topology, wrap)
        self.sync_every = check_sync_every(sync_every)
        self.sync_optimizer_state = bool(sync_optimizer_state)
        self.intra = self.channel("intra", topology.node)
        self.inter = self.channel("inter", topology.leaders)
        self.stages = [Stage(self.intra, "allreduce")]
        #: v_n: the node's summed weights since the last sync
        self.weight_since_sync = 0.0
        #: optimizer steps since the last sync (the same on every rank)
        self.steps_since_sync = 0
        self._scratch = None

    @property
    def exact(self) -> bool:
        """One node is the flat scheme; several differ between syncs."""
        return self.topology.num_nodes == 1

    @property
    def group_size(self) -> int:
        return self.topology.local_size

    def describe(self) -> str:
        return super().describe().replace("strategy node", f"strategy node (K'={self.sync_every})", 1)

    def reduced(self, message) -> bool:
        self.weight_since_sync += float(message[COUNT])
        return super().reduced(message)

    def after_step(self, steps, params_data, state_buffers, flags):
        self.steps_since_sync += 1
        if self.exact or steps % self.sync_every != 0:
            return None
        return self.average(params_data, state_buffers, flags)

    def synchronize(self, params_data, state_buffers, flags):
        if self.exact or self.steps_since_sync == 0:
            return self.world_flags(flags)
        return self.average(params_data, state_buffers, flags)

    def state(self) -> dict:
        return {"steps_since_sync": self.steps_since_sync, "weight_since_sync": self.weight_since_sync}

    def load_state(self, state: dict) -> None:
        self.steps_since_sync = int(state.get("steps_since_sync", 0))
        self.weight_since_sync = float(state.get("weight_since_sync", 0.0))

    def average(self, params_data, state_buffers, flags) -> tuple:
        """``theta <- sum_n v_n theta_n / sum_n v_n`` on every rank (and the optimizer state
        with ``sync_optimizer_state``); returns the world's ``(stop, nonfinite)`` sums."""
        buffers = [params_data, *state_buffers] if self.sync_optimizer_state else [params_data]
        size = params_data.size
        length = size * len(buffers) + 3
        if self._scratch is None or self._scratch.size != length:
            self._scratch = get_array_module(params_data).zeros(length, dtype=params_data.dtype)
        message = self._scratch
        if self.topology.is_leader:
            weight = self.weight_since_sync
            for k, buf in enumerate(buffers):
                part = message[k * size:(k + 1) * size]
                part[...] = buf
                part *= weight
            message[COUNT], message[STOP], message[NONFINITE] = weight, flags[0], flags[1]
            self.inter.allreduce(message)
        self.intra.bcast(message)
        total = float(message[COUNT])
        if total <= 0:
            raise RuntimeError("node parameter sync: no node computed a sample since the last sync "
                               "(every count was 0); the parameter average is undefined")
        for k, buf in enumerate(buffers):
            buf[...] = message[k * size:(k + 1) * size]
            buf /= total
        self.weight_since_sync, self.steps_since_sync = 0.0, 0
        return float(message[STOP]), float(message[NONFINITE])


def check_sync_every(sync_every) -> int:
    """``K'`` must be an integer >= 1."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    return int(sync_every)
