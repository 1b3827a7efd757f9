"""The core's exchange as the elastic wrapper sees it: each collective confirmed by an agreement,
and the place the core is in when a failure is seen.

:class:`~mpidl.distributed.elastic.data_parallel.ElasticDataParallel` composes its core
:class:`~mpidl.distributed.DataParallel` with a :class:`ConfirmedExchange` around the
strategy. The core calls it like any exchange (it is one: every attribute it does not define is
the strategy's); the wrapper learns from it what the core's ``step()`` and ``sync()`` are
doing, which the core itself never says:

==================  ==========================================================================
core calls          what is added
==================  ==========================================================================
``reduce``          ``where = 'step'``; after the stages, ``Agree`` over the step group (the
                    world, or the node under ``node`` on several nodes)
``after_step``      not exact (``node`` on several nodes): ``before_sync('after_step', flags)``
                    (the wrapper keeps the state right before a possible sync), ``where =
                    'sync'``; when it synchronised the replicas: ``Agree`` over the world
``synchronize``     the same, with ``'synchronize'``; always ``Agree`` over the world
==================  ==========================================================================

and ``where = 'outside'`` again once each returns: a failure seen later in the step (a
re-split of a measured split) or between steps leaves the state whole.

Why an agreement. ULFM does not make a collective fail on every rank alike: across hosts the
flat allreduce of the step in which a host's ranks died returned SUCCESS on the survivors,
with a sum that lacked the dead ranks' gradients (docs/failures.md); they applied it and failed
one step later, from a state that held a wrong step. ``MPI_Comm_agree`` (``Comm.Agree``) fails
on every live member alike when a member has failed, so the step is seen to fail where it
happened, and is redone from its snapshot. One agreement per step: tens of microseconds
(``benchmarks/agree_cost.py``).
"""

from __future__ import annotations

from typing import Callable

from mpi4py import MPI

__all__ = ["ConfirmedExchange", "IN_STEP", "IN_SYNC", "OUTSIDE", "REDO_AFTER_STEP", "REDO_SYNCHRONIZE", "agree"]

#: where a failure was seen: in the step's exchange, in a parameter sync, or elsewhere
#: (decisions, metrics, evaluation, a re-split: the state is whole there)
IN_STEP, IN_SYNC, OUTSIDE = "step", "sync", "outside"
#: which sync a state kept before it redoes: the node strategy's K' sync inside ``step()``,
#: or ``sync()``
REDO_AFTER_STEP, REDO_SYNCHRONIZE = "after_step", "synchronize"


def agree(comm) -> None:
    """``MPI_Comm_agree`` over ``comm`` (nothing for ``COMM_NULL``): raises the process
    failure on every live member alike when one of them failed."""
    if comm is not None and comm != MPI.COMM_NULL:
        comm.Agree(1)


class ConfirmedExchange:
    """``exchange`` (any strategy) with its collectives confirmed and watched.

    ``before_sync(redo, flags)`` is called before each call that may synchronise the
    replicas across nodes, when the exchange is not exact (``redo`` is
    :data:`REDO_AFTER_STEP` or :data:`REDO_SYNCHRONIZE`; ``flags`` the core's ``(stop,
    nonfinite)`` it passes on); :attr:`where` says which call is running.
    """

    def __init__(self, exchange, before_sync: Callable[[str, tuple], None]):
        self.inner = exchange
        self.before_sync = before_sync
        self.where = OUTSIDE

    def __getattr__(self, name):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def step_group(self):
        """The communicator of a step's exchange: the world, or the node when not exact."""
        topology = self.inner.topology
        return topology.world if self.inner.exact else topology.node

    def reduce(self, message) -> bool:
        self.where = IN_STEP
        finite = self.inner.reduce(message)
        agree(self.step_group())
        self.where = OUTSIDE
        return finite

    def after_step(self, steps, params_data, state_buffers, flags):
        if not self.inner.exact:
            self.before_sync(REDO_AFTER_STEP, flags)
            self.where = IN_SYNC
        sums = self.inner.after_step(steps, params_data, state_buffers, flags)
        if sums is not None:
            agree(self.inner.topology.world)
        self.where = OUTSIDE
        return sums

    def synchronize(self, params_data, state_buffers, flags):
        if not self.inner.exact:
            self.before_sync(REDO_SYNCHRONIZE, flags)
        self.where = IN_SYNC
        sums = self.inner.synchronize(params_data, state_buffers, flags)
        agree(self.inner.topology.world)
        self.where = OUTSIDE
        return sums
