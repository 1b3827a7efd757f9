"""Hierarchical reduction: node reduce -> leaders allreduce -> node broadcast (exact).

The same sum as the flat allreduce (up to the order of floating-point additions), but only
one rank per node talks across the network, with one message per node instead of one per
rank.
"""

from __future__ import annotations

from typing import Sequence

from mpidl.distributed.reducer_base import Reducer


class HierarchicalReducer(Reducer):
    """``g = sum_i w_i g_i`` in three levels, with the world weights of :class:`FlatReducer`.

    Notes
    -----
    1. ``Reduce(SUM)`` in each node onto its leader:   ``h_n = sum_{i in node n} w_i g_i``
    2. ``Allreduce(SUM)`` among the leaders:           ``g = sum_n h_n``
    3. ``Bcast`` of ``g`` from the leader in each node.

    balanced: ``w_i = b_i / B`` over the world, uniform: ``w_i = 1 / P``; the result equals
    the flat one. Counters per step: ``intra`` 2 calls (reduce + bcast; none on a
    single-rank node), ``inter`` 1 call on leaders when there is more than one node, each of
    ``grad.nbytes``.

    EMULATION: the leaders sleep ``2 (L-1) (alpha + n / (L beta))`` after the leaders'
    allreduce (``L`` nodes); the other ranks wait for it in the broadcast.
    """

    name = "hierarchical"

    def __init__(self, topology, weighting="balanced", emulate_link=None):
        super().__init__(topology, weighting, emulate_link)
        self._world_ranks = range(topology.size)

    def reduce_gradients(self, grad, counts: Sequence[int]) -> None:
        counts = self._check(grad, counts)
        topo = self.topology
        grad *= self._weight(counts, self._world_ranks)
        self._reduce_to_root("intra", topo.node, grad)
        if topo.is_leader:
            self._allreduce("inter", topo.leaders, grad)
            if self.emulate_link is not None:
                self._emulate_inter_node(
                    self.emulate_link.allreduce_seconds(grad.nbytes, topo.num_nodes))
        self._bcast_from_root("intra", topo.node, grad)
