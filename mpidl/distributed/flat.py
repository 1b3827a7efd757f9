"""Flat reduction: one weighted allreduce over the whole world per step (the reference).

Every faster or approximate strategy is tested against this one.
"""

from __future__ import annotations

from typing import Sequence

from mpidl.distributed.reducer_base import Reducer


class FlatReducer(Reducer):
    """``g = sum_i w_i g_i`` by one ``Allreduce(SUM)`` on the world communicator.

    Notes
    -----
    balanced: ``w_i = b_i / B`` with ``B = sum_j b_j``, so ``g`` is the gradient of the mean
    loss over the ``B`` samples of the global batch. uniform: ``w_i = 1 / P``.

    Counters per step: ``world`` 1 call of ``grad.nbytes`` (none with one rank).

    EMULATION: with an inter-node link model and more than one node, every rank sleeps the
    time of a ring allreduce over all ``P`` ranks, ``2 (P-1) (alpha + n / (P beta))``: in a
    ring spanning nodes every one of the ``2 (P-1)`` steps waits for the slow link.
    """

    name = "flat"

    def __init__(self, topology, weighting="balanced", emulate_link=None):
        super().__init__(topology, weighting, emulate_link)
        self._world_ranks = range(topology.size)

    def reduce_gradients(self, grad, counts: Sequence[int]) -> None:
        counts = self._check(grad, counts)
        grad *= self._weight(counts, self._world_ranks)
        self._allreduce("world", self.topology.world, grad)
        if self.emulate_link is not None and self.topology.num_nodes > 1:
            self._emulate_inter_node(
                self.emulate_link.allreduce_seconds(grad.nbytes, self.topology.size))
