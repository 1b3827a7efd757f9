"""Hierarchical reduction: node reduce -> leaders allreduce -> node broadcast (exact).

The same sum as the flat allreduce (up to the order of floating-point additions), but only
one rank per node talks across the network, with one message per node instead of one per
rank.
"""

from __future__ import annotations

from mpidl.distributed.reducer_base import Reducer, check_message


class HierarchicalReducer(Reducer):
    """``g = sum_i c_i g_i / sum_i c_i`` in three levels, with the world weights of
    :class:`~mpidl.distributed.flat.FlatReducer`.

    Notes
    -----
    With ``m_i = [c_i g_i | c_i | flags_i]`` the rank's message:

    1. ``Reduce(SUM)`` in each node onto its leader:   ``h_n = sum_{i in node n} m_i``
    2. ``Allreduce(SUM)`` among the leaders:           ``m = sum_n h_n``
    3. ``Bcast`` of ``m`` from the leader in each node; every rank divides the gradient part
       by the summed count.

    The result equals the flat one. Counters per step: ``intra`` 2 calls (reduce + bcast;
    none on a single-rank node), ``inter`` 1 call on leaders when there is more than one
    node, each of ``message.nbytes``.

    EMULATION: the leaders sleep ``2 (L-1) (alpha + n / (L beta))`` after the leaders'
    allreduce (``L`` nodes); the other ranks wait for it in the broadcast.

    With a compressor (``compress='bf16'|'fp16'``) step 2 is the compressed exchange of
    :mod:`~mpidl.distributed.compress`: the leaders' ``inter`` bytes halve.
    """

    name = "hierarchical"

    def reduce_gradients(self, message, count: int) -> None:
        check_message(message)
        total = self._weighted_sum("world", self.topology.world, message, count, self._three_levels)
        if total == 0:
            raise ValueError("no rank computed a sample this step (every count was 0)")

    def _three_levels(self, level, world, message) -> None:
        topo = self.topology
        self._reduce_to_root("intra", topo.node, message)
        if topo.is_leader:
            self.inter_sum(message)
        self._bcast_from_root("intra", topo.node, message)
