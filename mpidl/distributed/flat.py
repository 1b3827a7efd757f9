"""Flat reduction: one weighted allreduce over the whole world per step (the reference).

Every faster or approximate strategy is tested against this one.
"""

from __future__ import annotations

from mpidl.distributed.exchange import Exchange, Stage


class Flat(Exchange):
    """``g = sum_i c_i g_i / sum_i c_i`` by one ``Allreduce(SUM)`` of the message on the world.

    Notes
    -----
    Balanced: ``c_i = b_i``, so ``g = sum_i (b_i / B) g_i``, the gradient of the mean loss over
    the global batch. Uniform: ``c_i = 1``, ``g = (1 / P) sum_i g_i``. Counters per step:
    ``world`` 1 call of ``message.nbytes`` (none with one rank).
    """

    name = "flat"

    def __init__(self, topology, wrap=None):
        super().__init__(topology, wrap)
        self.world = self.channel("world", topology.world)
        self.stages = [Stage(self.world, "allreduce")]
