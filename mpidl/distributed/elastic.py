"""``on_failure='shrink'`` of :class:`~mpidl.distributed.DataParallel`: the state kept before
each step, and what the survivors do when ranks are lost (the MPI part is
:mod:`~mpidl.distributed.recovery`; which MPI can do it: docs/failures.md).

A part of :class:`~mpidl.distributed.DataParallel` (its base class), kept in its own file so
that the step reads on its own. Every collective of a DataParallel runs inside
:meth:`ShrinkOnFailure._guarded`, and each step's exchange and each parameter sync is
confirmed by an agreement (``MPI_Comm_agree``, one per step), since a collective may succeed
on some ranks with a result that misses the dead; when one raises a process failure, every
survivor

1. revokes the world and every communicator of the exchange (``exchange.communicators()``),
   shrinks the world and names the lost ranks and hosts; without a quorum it stops
   (:class:`~mpidl.distributed.recovery.RecoveryError`, alike on every survivor);
2. agrees on the state to go back to and restores its copy of it:

   * exact strategies (every step spans the world): the step count ``s`` = the smallest the
     survivors completed (they differ by at most one); the state before step ``s``
     (parameters, optimizer state and step count), kept before each step's exchange;
   * ``node`` on several nodes: the nodes step on their own, so an intact node notices a lost
     host only at the next parameter sync. The state is the one right before the sync every
     survivor can redo (the smallest sync step), kept before each sync; the sync is then
     redone over the remaining nodes, so it is the weighted average ``sum_n S_n theta_n /
     sum_n S_n`` of the nodes left (a node that lost all its ranks is gone with the samples it
     took since the last sync). A node that lost only SOME of its ranks between two syncs
     cannot redo its steps alone: that stops the job (RecoveryError);

3. rebuilds the topology and the exchange on the shrunk world and re-splits the global batch
   over the survivors (:func:`~mpidl.distributed.recovery.resplit`: a lost rank is a rank of
   speed 0, the survivors keep their cost models);
4. raises :class:`~mpidl.distributed.recovery.RanksLost` whose ``step`` is ``dp.steps``: the
   loop runs that global batch again with the new split.

Memory: two copies of the parameters and optimizer state (the states before the last two
steps, or syncs), only with ``on_failure='shrink'``; time: the copy and one agreement a step.
"""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from mpidl.distributed.recovery import (Members, RanksLost, RecoveryError, StepSnapshots,
                                        check_on_failure, is_process_failure, leave,
                                        rebuild_topology, resplit, shrink, ulfm_available)

#: where a failure was seen: in the step's exchange, in a parameter sync, or elsewhere
#: (decisions, metrics, evaluation: the state is whole there)
IN_STEP, IN_SYNC, OUTSIDE = "step", "sync", "outside"
#: how a kept sync is redone: the node strategy's K' sync, or DataParallel.sync()
REDO_AFTER_STEP, REDO_SYNCHRONIZE = 1, 2


class ShrinkOnFailure:
    """The ``on_failure`` option. Uses the DataParallel's ``topology``, ``exchange``,
    ``params``, ``optimizer``, ``steps``, ``batch_size``, ``batch_sizes``, ``costs``."""

    # until _start_on_failure runs (the collectives of the construction are not guarded)
    _step_snapshots = _sync_snapshots = None

    def _start_on_failure(self, on_failure: str) -> None:
        """Collective with ``'shrink'``: errors returned as exceptions on every communicator
        of the topology, the MPI's support checked (:func:`ulfm_available`; without it the
        job falls back to ``'restart'``, :attr:`failure_note` says why), the members named."""
        #: 'restart' or 'shrink': what this job really does when a rank is lost
        self.on_failure = on_failure
        #: one line for the start-up log when on_failure='shrink' was asked, else None
        self.failure_note = None
        #: the failure events of this job (see :meth:`_recover`)
        self.failures: list[dict] = []
        self._members = None
        self._step_snapshots = self._sync_snapshots = None
        self._unreported = None
        if on_failure != "shrink":
            return
        topo = self.topology
        for comm in (topo.world, topo.node, topo.leaders):
            if comm != MPI.COMM_NULL:
                comm.Set_errhandler(MPI.ERRORS_RETURN)
        ok, reason = ulfm_available(topo.world)
        if not ok:
            self.on_failure = "restart"
            self.failure_note = (f"on_failure shrink is not available ({reason}): falling back to "
                                 "restart (a lost rank ends the job; resume from the checkpoint)")
            return
        self.failure_note = f"on_failure shrink: the survivors of a lost rank go on ({reason})"
        self._members = Members.gather(topo.world)
        self._step_snapshots, self._sync_snapshots = StepSnapshots(), StepSnapshots()

    @staticmethod
    def _check_on_failure(on_failure, topology, exchange_options) -> None:
        """ValueError (no MPI) when ``on_failure`` does not fit the exchange or the topology."""
        emulated = topology is not None and topology.emulated_ranks_per_node is not None
        if topology is None:
            emulated = bool(os.environ.get("MPIDL_RANKS_PER_NODE", "").strip())
        check_on_failure(on_failure, intra=exchange_options["intra"], overlap=exchange_options["overlap"],
                         compress=exchange_options["compress"],
                         sync_overlap=exchange_options["sync_overlap"], emulated_nodes=emulated)

    @property
    def shrunk(self) -> bool:
        """True once ranks were lost and this process went on without them: end it with
        :meth:`leave` rather than ``MPI_Finalize``."""
        return bool(self.failures)

    def leave(self, code: int = 0) -> None:
        """End this process after a shrink (:func:`~mpidl.distributed.recovery.leave`): a
        barrier of the survivors, then exit without ``MPI_Finalize``, which may wait for the
        dead. Close files first."""
        leave(self.topology.world, code)

    # ------------------------------------------------------------------ the kept state
    def _snapshot(self, counters: np.ndarray) -> dict:
        state = {"params": self.params.data, "counters": counters}
        for i, buf in enumerate(self.optimizer.state_buffers()):
            state[f"optimizer{i}"] = buf
        return state

    def _counters(self, redo: int = 0) -> np.ndarray:
        return np.array([self.steps, self.optimizer.step_count, self.exchange.steps_since_sync,
                         self.exchange.pending_samples(), redo], dtype=np.int64)

    def _keep_step_state(self) -> None:
        """Before a step's exchange: the state before step :attr:`steps`."""
        if self._step_snapshots is not None:
            self._step_snapshots.save(self.steps, self._snapshot(self._counters()))

    def _keep_sync_state(self, redo: int) -> None:
        """Before a parameter sync across nodes (the node strategy on several nodes)."""
        if self._sync_snapshots is not None and not self.exchange.step_is_global:
            self._sync_snapshots.save(self.steps, self._snapshot(self._counters(redo)))

    def _restore(self, snapshots: StepSnapshots, key: int) -> np.ndarray:
        counters = np.zeros(5, dtype=np.int64)
        snapshots.restore(key, self._snapshot(counters))
        self.steps, self.optimizer.step_count = int(counters[0]), int(counters[1])
        return counters

    # ------------------------------------------------------------------ failures
    def _guarded(self, where: str, call, confirm_over=None):
        """``call()``; with on_failure='shrink', a process failure it raises is recovered
        from (:meth:`_recover`) and turned into :class:`RanksLost`.

        ``confirm_over`` (a communicator, or a function giving it): the collectives of
        ``call`` are confirmed by an agreement over it (``MPI_Comm_agree``), which fails on
        every member alike when one of them failed. ULFM does not promise that a collective
        fails everywhere: across hosts a flat allreduce can return success on the survivors
        with a sum that lacks the ranks that died before contributing, and they would apply
        that update and fail only in the next step. The agreement makes such a step fail
        where it happened, and it is redone from its snapshot (docs/failures.md)."""
        if self._step_snapshots is None:
            return call()
        try:
            result = call()
            if confirm_over is not None:
                comm = confirm_over() if callable(confirm_over) else confirm_over
                if comm != MPI.COMM_NULL:
                    comm.Agree(1)
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            self._recover(exc, where)
        except Exception:
            # A collective may complete on one rank and fail on another; a pickled one
            # (allgather of objects: counts first, then the bytes) then hands the rank that
            # saw no error garbage counts, and the error is a MemoryError or an unpickling
            # error instead of MPI's. It is a process failure if MPI knows of a failed peer.
            if not self._peer_failed():
                raise
            self._recover(MPI.Exception(MPI.ERR_PROC_FAILED), where)
        return result

    def _world(self):
        """The world communicator (read when called: a recovery replaces it)."""
        return self.topology.world

    def _step_group(self):
        """Who takes part in a step's exchange: the world, or the node (``node`` strategy)."""
        return self.topology.world if self.exchange.step_is_global else self.topology.node

    def _peer_failed(self) -> bool:
        """Whether this process knows of a failed process of the world (local, no communication)."""
        try:
            failed = self.topology.world.Get_failed()
        except MPI.Exception:
            return False
        try:
            return failed.Get_size() > 0
        finally:
            failed.Free()

    def _step_completed(self) -> None:
        """The first step completed after a recovery closes its record (``recovery_s``)."""
        if self._unreported is not None:
            event, failed_at = self._unreported
            event["recovery_s"] = time.perf_counter() - failed_at
            event["next_step_at_unix"] = time.time()
            self._unreported = None

    def _recover(self, exc: MPI.Exception, where: str) -> None:
        """Shrink, restore, rebuild, re-split; raises RanksLost (or RecoveryError) on every
        survivor alike. See the module docstring."""
        failed_at, seen_unix = time.perf_counter(), time.time()
        old_topology, old_exchange = self.topology, self.exchange
        global_steps = old_exchange.step_is_global
        shrunk = shrink(old_topology.world, self._members, also_revoke=old_exchange.communicators())
        comm = shrunk.comm
        if not shrunk.quorum:
            raise RecoveryError(shrunk.describe()) from exc
        reports = comm.allgather((where, self.steps))
        problem, restore_from, redo = None, None, 0
        keys = [key for _, key in reports]
        if global_steps:
            agreed = min(keys)
            if max(keys) - agreed > 1:
                problem = f"the survivors' completed steps differ by more than one ({keys})"
            elif where == IN_STEP or agreed < self.steps:
                restore_from = self._step_snapshots
        else:
            agreed = min(keys)
            if any(w == IN_STEP for w, _ in reports):
                problem = ("strategy node: a node lost only some of its ranks between two parameter "
                           "syncs, and its survivors cannot redo its steps alone (use hierarchical, "
                           "or restart from the checkpoint)")
            elif any(w == IN_SYNC and key == agreed for w, key in reports):
                restore_from = self._sync_snapshots
            elif len(set(keys)) > 1:
                problem = f"the survivors stopped at different steps outside a sync ({keys})"
        counters = None
        if problem is None and restore_from is not None:
            try:
                counters = self._restore(restore_from, agreed)
            except RecoveryError as error:
                problem = str(error)
        problems = [p for p in comm.allgather(problem) if p is not None]
        if problems:
            raise RecoveryError(f"{shrunk.describe()}; cannot go on: {problems[0]}") from exc
        self.steps = agreed
        # ---- the topology, the exchange and the split of the survivors
        for comm_ in old_exchange.communicators():
            if comm_ != MPI.COMM_NULL:
                try:
                    comm_.Free()
                except MPI.Exception:
                    pass
        self.topology = rebuild_topology(comm, old_topology)
        old_sizes, old_costs = list(self.batch_sizes), list(self.costs)
        self.batch_sizes = resplit(self.batch_size, old_sizes, shrunk.old_ranks, old_costs)
        self.costs = [old_costs[r] for r in shrunk.old_ranks]
        self.exchange = self._build_exchange(self.topology)
        self.exchange.set_reference(self.params.data, self._synced_state())
        if counters is not None:
            redo = int(counters[4]) if restore_from is self._sync_snapshots else 0
            self.exchange.restore(int(counters[2]), int(counters[3]))
        else:
            self.exchange.restore(old_exchange.steps_since_sync, old_exchange.pending_samples())
        self._members = shrunk.members
        self._local_count = None
        self.last_rebalance = None
        if redo == REDO_AFTER_STEP:
            sums = self.exchange.after_step(self.params.data, self._synced_state(), self._flags(), self.steps)
        elif redo == REDO_SYNCHRONIZE:
            sums = self.exchange.synchronize(self.params.data, self._synced_state(), self._flags())
        else:
            sums = None
        if sums is not None:
            self._agree(sums)
        event = {"event": "failure", "step": self.steps, "where": where,
                 "lost_ranks": list(shrunk.lost_ids), "lost_hosts": list(shrunk.lost_hosts),
                 "emptied_hosts": list(shrunk.emptied_hosts), "ranks_left": comm.Get_size(),
                 "hosts_left": len(set(shrunk.members.hosts)), "node_sizes": list(self.topology.node_sizes),
                 "batch_sizes": list(self.batch_sizes), "synced_again": bool(redo),
                 "error": exc.Get_error_string(), "shrink_s": shrunk.seconds,
                 "recovered_s": time.perf_counter() - failed_at, "recovery_s": None,
                 "seen_at_unix": seen_unix, "next_step_at_unix": None}
        self.failures.append(event)
        self._unreported = (event, failed_at)
        self.clock.start()
        raise RanksLost(event, f"{shrunk.describe()}; going on from step {self.steps} with batch "
                               f"sizes {self.batch_sizes}") from None

