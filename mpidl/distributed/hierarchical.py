"""Hierarchical reduction: node reduce -> leaders allreduce -> node broadcast (exact).

The same sum as the flat allreduce (up to the order of floating-point additions), but only
one rank per node talks across the network, with one message per node instead of one per
rank.
"""

from __future__ import annotations

from mpidl.distributed.exchange import Exchange, Stage


class Hierarchical(Exchange):
    """``g = sum_i c_i g_i / sum_i c_i`` in three levels; the same result as
    :class:`~mpidl.distributed.flat.Flat`.

    Notes
    -----
    With ``m_i = [c_i g_i | c_i | flags_i]`` the rank's message:

    1. ``Reduce(SUM)`` in each node onto its leader:   ``h_n = sum_{i in node n} m_i``
    2. ``Allreduce(SUM)`` among the leaders:           ``m = sum_n h_n``
    3. ``Bcast`` of ``m`` from the leader in each node; every rank divides by the summed count.

    Counters per step: ``intra`` 2 calls (none on a one-rank node); ``inter`` 1 call on the
    leaders when there are several nodes; each of ``message.nbytes``.
    """

    name = "hierarchical"

    def __init__(self, topology, wrap=None):
        super().__init__(topology, wrap)
        self.intra = self.channel("intra", topology.node)
        self.inter = self.channel("inter", topology.leaders)
        self.stages = [Stage(self.intra, "reduce"), Stage(self.inter, "allreduce"),
                       Stage(self.intra, "bcast")]
