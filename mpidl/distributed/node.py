"""Node-based reduction (the TNNLS scheme): exact inside a node, periodic between nodes.

Every step the ranks of a node average their gradients (fast shared-memory traffic); the
nodes train independently for ``K'`` steps, then the leaders average the PARAMETERS,
weighted by how many samples each node processed since the last sync, and broadcast them in
their node. Inter-node traffic falls by a factor of about ``K'`` times the ranks per node.
"""

from __future__ import annotations

from numbers import Integral
from typing import Sequence

from mpidl.distributed.reducer_base import Reducer, _check_buffer, _check_step


class NodeReducer(Reducer):
    """Node-local weighted gradient allreduce every step; node-weighted parameter average
    every ``sync_every`` steps.

    Notes
    -----
    Gradients, every step, within node ``n`` (``R_n`` its ranks)::

        g_n = sum_{i in R_n} w_i g_i,   balanced: w_i = b_i / sum_{j in R_n} b_j,
                                        uniform:  w_i = 1 / |R_n|

    so the replicas of one node stay identical and each node follows the exact gradient of
    its own samples (a node whose ranks computed nothing this step gets ``g_n = 0``).

    Parameters, when ``step % sync_every == 0`` (and at :meth:`sync_parameters`)::

        theta = sum_n v_n theta_n,      balanced: v_n = S_n / sum_m S_m,  uniform: v_n = 1 / L

    where ``S_n`` is the number of samples node ``n`` processed since the last sync (summed
    from the ``counts`` given to :meth:`reduce_gradients`; every rank knows all of them, so
    no extra message is needed) and ``L`` the number of nodes. The leaders compute it with one
    ``Allreduce(SUM)`` of ``v_n theta_n`` and broadcast it in their node: afterwards all
    replicas are identical. With ``sync_every = 1`` and plain SGD this equals the flat
    scheme: ``sum_n v_n (theta - lr g_n) = theta - lr sum_i (b_i / B) g_i``.

    With a single node this is the flat scheme on the node communicator, and there is no
    inter-node traffic at all (no parameter syncs, ``after_step`` returns False).

    Counters: per step ``intra`` 1 call; per parameter sync ``inter`` 1 call (leaders) and
    ``intra`` 1 call (the broadcast), each of the buffer's ``nbytes``.

    EMULATION: leaders sleep ``2 (L-1) (alpha + n / (L beta))`` after each leaders' allreduce.
    """

    name = "node"
    exact = False

    def __init__(self, topology, weighting="balanced", sync_every: int = 50, emulate_link=None):
        super().__init__(topology, weighting, emulate_link)
        self.sync_every = check_sync_every(sync_every)
        self._node_ranks = topology.node_ranks
        self._node_of_rank = topology.node_of_rank
        #: samples each node processed since the last parameter sync, indexed by node id
        self.node_samples = [0] * topology.num_nodes
        self._last_sync_weights: list[float] | None = None

    def describe(self) -> str:
        return super().describe() + f", parameter sync every {self.sync_every} steps"

    def reduce_gradients(self, grad, counts: Sequence[int]) -> None:
        counts = self._check(grad, counts)
        for rank, count in enumerate(counts):
            self.node_samples[self._node_of_rank[rank]] += count
        grad *= self._weight(counts, self._node_ranks)
        self._allreduce("intra", self.topology.node, grad)

    def node_weights(self) -> list[float]:
        """``v_n`` for the next parameter sync, indexed by node id (sums to 1)."""
        num_nodes = self.topology.num_nodes
        total = sum(self.node_samples)
        if self.weighting == "uniform" or total == 0:
            # (total == 0 only when syncing twice in a row: replicas are already equal.)
            return [1.0 / num_nodes] * num_nodes
        return [s / total for s in self.node_samples]

    def after_step(self, params_data, step: int) -> bool:
        """Sync the parameters when ``step`` (optimizer steps done) is a multiple of
        ``sync_every``; True if it did."""
        step = _check_step(step)
        if step % self.sync_every != 0 or self.topology.num_nodes == 1:
            return False
        self.sync_parameters(params_data)
        return True

    def sync_parameters(self, params_data) -> None:
        """Forced node-weighted parameter average (epoch end); always syncs with > 1 node."""
        if self.topology.num_nodes > 1:
            self._last_sync_weights = self.node_weights()
            self._average_over_nodes(params_data, self._last_sync_weights)
        self.node_samples = [0] * self.topology.num_nodes

    def sync_optimizer_state(self, buffers: Sequence) -> None:
        """Average flat optimizer-state buffers (momentum, Adam moments) over the nodes with
        the weights ``v_n`` of the last parameter sync; call it right after a sync
        (``after_step`` returned True, or after ``sync_parameters``)."""
        if self.topology.num_nodes == 1:
            return
        weights = self._last_sync_weights or self.node_weights()
        for buf in buffers:
            _check_buffer(buf)
            self._average_over_nodes(buf, weights)

    def _average_over_nodes(self, buf, weights: list[float]) -> None:
        """``buf <- sum_n weights[n] buf_n``: leaders allreduce, then broadcast in the node."""
        topo = self.topology
        if topo.is_leader:
            buf *= weights[topo.node_id]
            self._allreduce("inter", topo.leaders, buf)
            if self.emulate_link is not None:
                self._emulate_inter_node(
                    self.emulate_link.allreduce_seconds(buf.nbytes, topo.num_nodes))
        self._bcast_from_root("intra", topo.node, buf)


def check_sync_every(sync_every) -> int:
    """``K'`` must be an integer >= 1."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    return int(sync_every)
