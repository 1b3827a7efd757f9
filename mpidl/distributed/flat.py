"""Flat reduction: one weighted allreduce over the whole world per step (the reference).

Every faster or approximate strategy is tested against this one.
"""

from __future__ import annotations

from mpidl.distributed.reducer_base import Reducer, check_message


class FlatReducer(Reducer):
    """``g = sum_i c_i g_i / sum_i c_i`` by one ``Allreduce(SUM)`` of the message on the world.

    Notes
    -----
    balanced: ``c_i = b_i``, so ``g = sum_i (b_i / B) g_i`` with ``B = sum_j b_j``: the gradient
    of the mean loss over the ``B`` samples of the global batch. uniform: ``c_i = 1``, so
    ``g = (1 / P) sum_i g_i``.

    Counters per step: ``world`` 1 call of ``message.nbytes`` (none with one rank).

    EMULATION: with an inter-node link model and more than one node, every rank sleeps the
    time of a ring allreduce over all ``P`` ranks, ``2 (P-1) (alpha + n / (P beta))``: in a
    ring spanning nodes every one of the ``2 (P-1)`` steps waits for the slow link.
    """

    name = "flat"

    def reduce_gradients(self, message, count: int) -> None:
        check_message(message)
        topo = self.topology
        total = self._weighted_sum("world", topo.world, message, count, self.allreduce)
        if total == 0:
            raise ValueError("no rank computed a sample this step (every count was 0)")
        if self.emulate_link is not None and topo.num_nodes > 1:
            self._emulate_inter_node(self.emulate_link.allreduce_seconds(message.nbytes, topo.size))
