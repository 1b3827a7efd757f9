"""``ElasticDataParallel``: a :class:`~mpidl.distributed.DataParallel` that survives lost ranks.

The core DataParallel knows nothing of failures. This wrapper holds one (its *core*) and stands
in for it: a loop calls it exactly as it would call the core, and every attribute it does not
define is the core's (read, and written: ``dp.steps = ...`` reaches the core)::

    dp = data_parallel(model, opt, batch_size=B, strategy="hierarchical", on_failure="shrink")
    # = ElasticDataParallel.around(DataParallel(...), rebuild=lambda topology: make_exchange(topology, ...))
    while dp.steps < total_steps:
        epoch, j = divmod(dp.steps, steps_per_epoch)
        try:
            local = dp.local_indices(perm(epoch)[j * B:(j + 1) * B])
            ...                                   # forward, loss, backward on x[local]
            dp.step()
        except RanksLost as lost:                 # the same on every survivor
            log(lost.event)                       # nothing else: run global step dp.steps again
    dp.sync()
    if dp.shrunk:
        dp.leave(0)                               # not MPI_Finalize, which may wait for the dead

(:func:`~mpidl.distributed.elastic.loop.run_surviving` is that ``try`` for a loop that runs
its steps in stretches, as the trainer's epochs.)

Guarded calls. Every collective call of the core (``step``, ``sync``, ``any``, ``all``,
``sum``, ``all_gather_object``, ``agree_on_error``, ``timings``) runs guarded: a process
failure it raises (``MPI_ERR_PROC_FAILED``, or ``MPI_ERR_REVOKED`` once another survivor
revoked) is recovered from, and the call raises
:class:`~mpidl.distributed.elastic.recovery.RanksLost` instead. The core's exchange is seen
through a :class:`~mpidl.distributed.elastic.confirmed.ConfirmedExchange`, which confirms each
step's exchange and each sync by an agreement (a collective can succeed on the survivors with
a sum missing the dead ranks: its docstring says why) and tells the wrapper where the core is.

The state kept (:class:`~mpidl.distributed.elastic.recovery.StepSnapshots`, two of each):

* exact exchanges (every step spans the world): before each step, the parameters, the
  optimizer state, ``steps``, ``optimizer.step_count`` and ``exchange.state()``;
* ``node`` on several nodes: the same right before each call that may synchronise the nodes
  (the K' sync inside ``step``, and ``sync``), with the flags that call carries.

On a process failure every survivor (:meth:`ElasticDataParallel._recover`):

1. revokes the world and every communicator of the topology and the exchange, shrinks the
   world and names the lost ranks and hosts; without a quorum it stops
   (:class:`~mpidl.distributed.elastic.recovery.RecoveryError`, alike on every survivor);
2. agrees on the state to go back to and restores its copy of it:

   * exact exchanges: the step count ``s`` = the smallest the survivors reached (they differ
     by at most one); the state before step ``s`` for a survivor that failed in a step or is
     one step ahead; a survivor that failed between steps keeps its state (it is whole);
   * ``node`` on several nodes: the nodes step on their own, so an intact node notices a lost
     host only at the next sync. Every survivor goes back to its state right before that
     sync, which is redone over the nodes left: ``theta = sum_n S_n theta_n / sum_n S_n``
     (a node that lost all its ranks is gone with the samples it took since the last sync).
     A node that lost only SOME of its ranks between two syncs cannot redo its steps alone:
     that stops the job (RecoveryError);

3. rebuilds the topology of the survivors, an exchange over it (``rebuild(topology)``), the
   split of the global batch (:func:`~mpidl.distributed.elastic.recovery.resplit`: a lost
   rank is a rank of speed 0, the survivors keep their cost models; a measured split goes on
   re-fitting) and a NEW core DataParallel of them, with the same model and optimizer; sets
   its ``steps``, loads the exchange's state, and redoes the node sync where one was cut;
4. records the event in :attr:`failures` and raises ``RanksLost`` whose ``step`` is
   ``dp.steps``: the loop runs that global batch again with the new split.

Growing back (:meth:`ElasticDataParallel.grow`, on every rank of the job, and
:meth:`ElasticDataParallel.join` in the processes it starts): new ranks are started on a host
(``MPI_Comm_spawn``) and merged into the world (``MPI_Intercomm_merge``); rank 0 broadcasts the
state (parameters, optimizer state, counters, the exchange's state, buffers, the split's cost
models, the members, the loop's own ``extra``); every rank rebuilds the topology, the exchange,
the split of the same global batch and a new core, as after a loss. The loop goes on at
``dp.steps``.

Memory: two copies of the parameters and optimizer state; time: one copy and one agreement
per step. Where the MPI cannot shrink (:func:`~mpidl.distributed.elastic.recovery.ulfm_available`)
:attr:`on_failure` falls back to ``'restart'``, :attr:`failure_note` says why, and every call
passes through to the core unguarded.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from mpidl.distributed.data_parallel import DataParallel, NonFiniteGradient
from mpidl.distributed.elastic.confirmed import (IN_STEP, IN_SYNC, OUTSIDE, REDO_AFTER_STEP,
                                                 REDO_SYNCHRONIZE, ConfirmedExchange)
from mpidl.distributed.elastic.recovery import (Members, RanksLost, RecoveryError, StepSnapshots,
                                                is_process_failure, join_parent, leave, rebuild_topology,
                                                resplit, shrink, spawn_joiners, ulfm_available)
from mpidl.distributed.split import FixedSplit, MeasuredSplit
from mpidl.distributed.split.balance import RankCost

__all__ = ["ElasticDataParallel"]


class ElasticDataParallel:
    """A core :class:`~mpidl.distributed.DataParallel` that goes on without lost ranks
    (``on_failure='shrink'``; the module docstring says how). Build it with :meth:`around`.

    Attributes
    ----------
    (its own; every other attribute is the current core's, read and written)
    on_failure : 'shrink' | 'restart'
        What this job really does when a rank is lost.
    failure_note : str
        One line for the start-up log: shrink, and the MPI's support; or why it fell back.
    joined : bool
        True in a process that joined the running job (:meth:`join`).
    failures : list[dict]
        One record per failure survived, and one ``join`` record per :meth:`grow` (its
        docstring); a failure's: ``step``, ``where`` ('step' | 'sync' | 'outside'),
        ``lost_ranks`` (start-up ranks), ``lost_hosts``, ``emptied_hosts``, ``ranks_left``,
        ``hosts_left``, ``node_sizes``, ``batch_sizes``, ``synced_again``, ``error``,
        ``shrink_s``, ``recovered_s`` (failure seen to state rebuilt), ``recovery_s`` (failure
        seen to the next completed step, filled then), ``seen_at_unix``, ``next_step_at_unix``.
    """

    #: the wrapper's own attributes; writing any other name writes the core's
    _OWN = frozenset({"on_failure", "failure_note", "failures", "_core", "_rebuild", "_members", "_world",
                      "_step_snapshots", "_sync_snapshots", "_unreported", "_stop_asked",
                      "joined", "_next_id", "_extra"})

    def __init__(self, core: DataParallel, rebuild: Callable, *, on_failure: str, failure_note: str,
                 members: Members | None = None):
        """Use :meth:`around`, which does the collective part."""
        self._core = core
        self._rebuild = rebuild
        self._members = members
        #: the shrunk world this wrapper made (freed at the next shrink), or None
        self._world = None
        self.on_failure = on_failure
        self.failure_note = failure_note
        self.failures: list[dict] = []
        self._step_snapshots = StepSnapshots() if on_failure == "shrink" else None
        self._sync_snapshots = StepSnapshots() if on_failure == "shrink" else None
        self._unreported: list = []  # (record, perf_counter at its start): closed by the next step
        self._stop_asked = False
        #: True in a process that joined a running job (:meth:`join`)
        self.joined = False
        #: the start-up id the next joiner gets (ids are never reused)
        self._next_id = members.size if members is not None else 0
        self._extra = None

    @classmethod
    def around(cls, dp: DataParallel, rebuild: Callable) -> "ElasticDataParallel":
        """The elastic wrapper of ``dp`` (collective): errors returned as exceptions on the
        communicators of its topology, the MPI's support agreed (:func:`ulfm_available`), every
        rank's start-up rank and host gathered (:meth:`Members.gather`).

        ``rebuild(topology)`` builds the exchange ``dp`` uses over another topology (the
        survivors'). With support, the core is composed anew from ``dp``'s parts (its model,
        optimizer, split, clock and options; its exchange seen through a
        :class:`ConfirmedExchange`), so ``dp`` itself is not used afterwards: the agreement
        that confirms a step, and the state right before a node sync, belong between the core's
        calls to its exchange, which only the exchange sees (the core is never changed from
        outside). Without support, ``dp`` is the core and every call passes through."""
        topology = dp.topology
        for comm in (topology.world, topology.node, topology.leaders):
            if comm != MPI.COMM_NULL:
                comm.Set_errhandler(MPI.ERRORS_RETURN)
        ok, reason = ulfm_available(topology.world)
        if not ok:
            return cls(dp, rebuild, on_failure="restart", failure_note=(
                f"on_failure shrink is not available ({reason}): falling back to restart (a lost rank "
                "ends the job within the failure bound, exit code 3; resume from the checkpoint)"))
        elastic = cls(dp, rebuild, on_failure="shrink", members=Members.gather(topology.world),
                      failure_note=f"on_failure shrink: the survivors of a lost rank go on ({reason})")
        elastic._core = elastic._compose(dp.exchange, dp.split, dp)
        return elastic

    # ------------------------------------------------------------------ the core's attributes
    def __getattr__(self, name):
        if name == "_core":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._core, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. checkpoint.load_state_dict's dp.steps = ...
            setattr(self._core, name, value)

    @property
    def core(self) -> DataParallel:
        """The DataParallel in use now (a new one after each recovery)."""
        return self._core

    @property
    def startup_id(self) -> int:
        """This rank's start-up rank (a rank that joined: the id the job gave it; never reused)."""
        return self._members.ids[self._core.rank] if self._members is not None else self._core.rank

    @property
    def shrunk(self) -> bool:
        """True once ranks were lost and this process went on without them: end it with
        :meth:`leave` rather than ``MPI_Finalize``."""
        return bool(self.failures) or self.joined

    def leave(self, code: int = 0) -> None:
        """End this process after a shrink (:func:`~mpidl.distributed.elastic.recovery.leave`):
        a barrier of the survivors, then exit without ``MPI_Finalize``, which may wait for the
        dead. Close files first. A rank that joined (:meth:`join`) leaves the same way: its
        ``MPI_Finalize`` disconnects from the job that started it, dead ranks included, and
        crashed across hosts (a segmentation fault in Open MPI's TCP transport, reaching for a
        dead rank); Open MPI's mpiexec then returns 1, the job's result is its ``end`` record
        and checkpoint (docs/failures.md)."""
        leave(self._core.topology.world, code)

    def request_stop(self) -> None:
        """The core's :meth:`~mpidl.distributed.DataParallel.request_stop`, remembered: a core
        built after a loss asks again (the collective that carried the request may have been
        cut)."""
        self._stop_asked = True
        self._core.request_stop()

    # ------------------------------------------------------------------ the guarded calls
    def step(self, local_count: int | None = None) -> bool:
        """The core's :meth:`~mpidl.distributed.DataParallel.step`, after keeping the state
        before it (exact exchanges); raises RanksLost when ranks were lost."""
        if self._step_snapshots is not None and self._core.exchange.exact:
            self._step_snapshots.save(self._core.steps, self._arrays(), self._counters())
        synced = self._guarded(lambda: self._core.step(local_count))
        self._step_completed()
        return synced

    def sync(self) -> None:
        """The core's :meth:`~mpidl.distributed.DataParallel.sync` (the state kept before it by
        the exchange's watch, under ``node`` on several nodes)."""
        self._guarded(self._core.sync)

    def any(self, flag: bool) -> bool:
        return self._guarded(lambda: self._core.any(flag))

    def all(self, flag: bool) -> bool:
        return self._guarded(lambda: self._core.all(flag))

    def sum(self, array):
        return self._guarded(lambda: self._core.sum(array))

    def all_gather_object(self, value) -> list:
        return self._guarded(lambda: self._core.all_gather_object(value))

    def agree_on_error(self, error: str | None) -> str | None:
        return self._guarded(lambda: self._core.agree_on_error(error))

    def timings(self) -> dict:
        return self._guarded(self._core.timings)

    def __enter__(self) -> "ElasticDataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self._core.close()

    def _guarded(self, call):
        """``call()``; a process failure it raises is recovered from (:meth:`_recover`, which
        raises RanksLost or RecoveryError on every survivor alike).

        A collective may complete on one rank and fail on another; a pickled one (an allgather
        of objects: the sizes first, then the bytes) then hands the rank that saw no error
        garbage sizes, and the error is a MemoryError or an unpickling error instead of MPI's.
        It is taken for a process failure when MPI knows of a failed peer."""
        if self._step_snapshots is None:
            return call()
        watch = self._core.exchange
        watch.where = OUTSIDE
        try:
            return call()
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            error = exc
        except Exception:
            if not self._peer_failed():
                raise
            error = MPI.Exception(MPI.ERR_PROC_FAILED)
        self._recover(error, watch.where)

    def _peer_failed(self) -> bool:
        """Whether this process knows of a failed process of the world (local, no communication)."""
        try:
            failed = self._core.topology.world.Get_failed()
        except (MPI.Exception, NotImplementedError):  # NotImplementedError: an MPI without ULFM (forced on)
            return False
        try:
            return failed.Get_size() > 0
        finally:
            failed.Free()

    # ------------------------------------------------------------------ the kept state
    def _arrays(self) -> dict:
        core = self._core
        state = {"params": core.params.data}
        for i, buffer in enumerate(core.optimizer.state_buffers()):
            state[f"optimizer{i}"] = buffer
        return state

    def _counters(self, **extra) -> dict:
        core = self._core
        return {"steps": core.steps, "step_count": core.optimizer.step_count,
                "exchange": dict(core.exchange.state()), **extra}

    def _keep_sync_state(self, redo: str, flags) -> None:
        """Called by the exchange's watch before a call that may synchronise the nodes."""
        self._sync_snapshots.save(self._core.steps, self._arrays(),
                                  self._counters(redo=redo, flags=tuple(float(f) for f in flags)))

    def _step_completed(self) -> None:
        """The first step completed after a recovery closes its record (``recovery_s``)."""
        for event, failed_at in self._unreported:
            event["first_step_s" if event["event"] == "join" else "recovery_s"] = time.perf_counter() - failed_at
            event["first_step_at_unix" if event["event"] == "join" else "next_step_at_unix"] = time.time()
        self._unreported = []

    # ------------------------------------------------------------------ composing a core
    def _compose(self, exchange, split, like: DataParallel) -> DataParallel:
        """A core of ``like``'s model, optimizer, options and clock over ``exchange`` (seen
        through a ConfirmedExchange) and ``split`` (collective). Its construction broadcasts
        rank 0's parameters and buffers; every rank's own are put back (under ``node`` the
        nodes' replicas differ between syncs, and batch-norm statistics are each rank's)."""
        model = like.model if like.model is not None else like.params
        params = like.params
        kept, buffers = params.data.copy(), like.buffers_host()
        core = DataParallel(model, like.optimizer, batch_size=like.batch_size,
                            exchange=ConfirmedExchange(exchange, self._keep_sync_state), split=split,
                            weighting=like.weighting, on_nan=like.on_nan, clock=like.clock)
        params.data[...] = kept
        if buffers:
            like.model.load_buffers_host(buffers)
        core.steps = like.steps
        if like.should_stop:
            core.should_stop = True
        if self._stop_asked or like.should_stop:
            core.request_stop()
        return core

    def _resplit(self, old_split, old_sizes, old_costs, survivors, topology):
        """The split of the survivors (new rank order) from the old one's costs."""
        batch_size = old_split.batch_size
        sizes = resplit(batch_size, old_sizes, survivors, old_costs)
        costs = [old_costs[r] for r in survivors]
        if isinstance(old_split, MeasuredSplit):
            return MeasuredSplit.from_costs(topology, batch_size, costs, sizes, old_split.clock,
                                            threshold=old_split.threshold, min_local_batch=old_split.min_local_batch,
                                            rebalance_every=old_split.rebalance_every, noise=old_split.noise)
        equal = getattr(old_split, "source", None) == "equal"
        split = FixedSplit(batch_size, topology.size, None if equal else [1.0 / c.c for c in costs],
                           min_local_batch=0)
        split.costs, split.batch_sizes = costs, sizes
        return split

    # ------------------------------------------------------------------ recovery
    def _recover(self, exc: MPI.Exception, where: str) -> None:
        """Shrink, go back, rebuild, re-split; raises RanksLost (or RecoveryError) on every
        survivor alike (the module docstring)."""
        failed_at, seen_unix = time.perf_counter(), time.time()
        core = self._core
        try:
            shrunk = shrink(core.topology.world, self._members,
                            also_revoke=_communicators(core.topology, core.exchange))
        except MPI.Exception as again:
            raise RecoveryError(f"the shrink after a lost rank failed: {again.Get_error_string()}") from exc
        if not shrunk.quorum:
            raise RecoveryError(shrunk.describe()) from exc
        try:
            event = self._go_on(core, shrunk, exc, where, failed_at, seen_unix)
        except MPI.Exception as again:
            raise RecoveryError(f"{shrunk.describe()}; a failure during the recovery: "
                                f"{again.Get_error_string()}") from exc
        raise RanksLost(event, f"{shrunk.describe()}; going on from step {event['step']} with batch "
                               f"sizes {event['batch_sizes']}") from None

    def _go_on(self, core: DataParallel, shrunk, exc, where: str, failed_at: float, seen_unix: float) -> dict:
        comm = shrunk.comm
        old_split = core.split
        # where each survivor was, and one survivor's split (the same on all, unless a re-split was cut)
        reports = comm.allgather((where, core.steps, list(old_split.batch_sizes),
                                  [(c.a, c.c) for c in old_split.costs]))
        keys = [r[1] for r in reports]
        agreed = min(keys)
        problem, snapshots = None, None
        if core.exchange.exact:
            if max(keys) - agreed > 1:
                problem = f"the survivors' completed steps differ by more than one ({keys})"
            elif where == IN_STEP or agreed < core.steps:
                snapshots = self._step_snapshots
        elif any(r[0] == IN_STEP for r in reports):
            problem = ("strategy node: a node lost only some of its ranks between two parameter syncs, "
                       "and its survivors cannot redo its steps alone (use hierarchical, or restart "
                       "from the checkpoint)")
        elif any(r[0] == IN_SYNC and r[1] == agreed for r in reports):
            snapshots = self._sync_snapshots
        elif len(set(keys)) > 1:
            problem = f"the survivors stopped at different steps outside a sync ({keys})"
        saved = None
        if problem is None and snapshots is not None:
            try:
                saved = snapshots.restore(agreed, self._arrays())
            except RecoveryError as error:
                problem = str(error)
        problems = [p for p in comm.allgather(problem) if p is not None]
        if problems:
            raise RecoveryError(f"{shrunk.describe()}; cannot go on: {problems[0]}") from exc
        counters = saved if saved is not None else self._counters()
        # ---- the survivors' topology, exchange, split and core
        _free(core.topology, core.exchange, self._world)
        self._world = comm
        topology = rebuild_topology(comm, core.topology)
        old_costs = [RankCost(a, c) for a, c in reports[0][3]]
        split = self._resplit(old_split, reports[0][2], old_costs, shrunk.old_ranks, topology)
        self._members = shrunk.members
        new = self._compose(self._rebuild(topology), split, core)
        new.steps = agreed
        new.optimizer.step_count = int(counters["step_count"])
        new.exchange.load_state(counters["exchange"])
        self._core = new
        redo = saved.get("redo") if snapshots is self._sync_snapshots else None
        sums = None
        if redo == REDO_AFTER_STEP:
            sums = new.exchange.after_step(new.steps, new.params.data, new.optimizer.state_buffers(), saved["flags"])
        elif redo == REDO_SYNCHRONIZE:
            sums = new.exchange.synchronize(new.params.data, new.optimizer.state_buffers(), saved["flags"])
        event = {"event": "failure", "step": new.steps, "where": where,
                 "lost_ranks": list(shrunk.lost_ids), "lost_hosts": list(shrunk.lost_hosts),
                 "emptied_hosts": list(shrunk.emptied_hosts), "ranks_left": comm.Get_size(),
                 "hosts_left": len(set(shrunk.members.hosts)), "node_sizes": list(topology.node_sizes),
                 "batch_sizes": list(new.batch_sizes), "synced_again": redo is not None,
                 "error": exc.Get_error_string(), "shrink_s": shrunk.seconds,
                 "recovered_s": time.perf_counter() - failed_at, "recovery_s": None,
                 "seen_at_unix": seen_unix, "next_step_at_unix": None}
        self.failures.append(event)
        self._unreported.append((event, failed_at))
        if sums is not None:
            _apply_flags(new, sums)
        return event


    # ------------------------------------------------------------------ grow back
    def grow(self, host: str, count: int, command: Sequence[str], extra=None) -> dict:
        """Bring ``count`` new ranks on ``host`` into the job (collective over the current
        world; every rank must call it, after a shrink or at any point between steps).

        ``command`` (``[executable, *args]``) starts the new processes; each of them calls
        :meth:`join` with the same model, optimizer and options. Rank 0 ships them the
        parameters, the optimizer state, the step counters, the exchange's state, the model's
        buffers, the members and ``extra`` (the loop's own position, picklable); then every
        rank rebuilds the topology with the new ranks, an exchange over it (``rebuild``) and
        the split of the same global batch (a joiner's cost model is the mean of the old
        ranks'; a measured split re-fits it), and a new core. Returns the ``join`` record, also
        appended to :attr:`failures` (``first_step_s``: the request to the first step completed
        with the new ranks, filled then). Only the step counters travel with the state: the
        loop goes on at ``dp.steps`` with the same global batches, so no step and no sample is
        lost."""
        if self.on_failure != "shrink":
            raise RecoveryError(f"cannot grow the job: {self.failure_note}")
        requested, requested_unix = time.perf_counter(), time.time()
        core = self._core
        merged = spawn_joiners(core.topology.world, host, count, command)
        spawned_s = time.perf_counter() - requested
        shipped = None
        if merged.Get_rank() == 0:
            shipped = self._shipment(extra, count)
        event = self._adopt(merged, shipped, core)
        event.update({"host": host, "spawn_s": spawned_s, "join_s": time.perf_counter() - requested,
                      "requested_at_unix": requested_unix})
        self._unreported.append((event, requested))
        return event

    @classmethod
    def join(cls, model, optimizer, rebuild: Callable, *, batch_size: int, weighting: str = "balanced",
             on_nan: str = "stop", clock=None):
        """In a process started by :meth:`grow`: merge with the running job and take its state
        (collective with the ranks in :meth:`grow`). ``model``, ``optimizer`` and the options
        must be built as the running ranks built theirs (the same command line). Returns
        ``(dp, extra)``: the wrapper, whose core is at the running job's ``steps``, and what the
        job shipped as ``extra``."""
        from mpidl.distributed.emulation import compute_clock  # noqa: PLC0415

        merged = join_parent()
        if merged is None:
            raise RecoveryError("ElasticDataParallel.join: this process was not started by grow (no parent)")
        params = getattr(model, "params", model)
        if clock is None:
            clock = compute_clock(1.0, "wall", getattr(getattr(model, "backend", None), "synchronize", None))
        elastic = cls(None, rebuild, on_failure="shrink",
                      failure_note="on_failure shrink: joined a running job (ULFM)")
        elastic.joined = True
        like = SimpleNamespace(model=model if params is not model else None, params=params, optimizer=optimizer,
                               batch_size=batch_size, weighting=weighting, on_nan=on_nan, clock=clock,
                               steps=0, should_stop=False, buffers_host=lambda: {})
        elastic._adopt(merged, None, like)
        return elastic, elastic._extra

    def _shipment(self, extra, count: int) -> dict:
        """What rank 0 sends the joiners (host copies)."""
        core = self._core
        split = core.split
        spec = {"batch_size": split.batch_size, "costs": [(c.a, c.c) for c in split.costs],
                "equal": getattr(split, "source", None) == "equal", "measured": isinstance(split, MeasuredSplit)}
        if spec["measured"]:
            spec.update(threshold=split.threshold, min_local_batch=split.min_local_batch,
                        rebalance_every=split.rebalance_every, noise=split.noise)
        ids = list(self._members.ids) + list(range(self._next_id, self._next_id + count))
        return {"arrays": {k: np.asarray(v) for k, v in self._arrays().items()}, "counters": self._counters(),
                "buffers": core.buffers_host(), "split": spec, "ids": ids, "extra": extra,
                "should_stop": bool(core.should_stop or self._stop_asked)}

    def _adopt(self, merged, shipped, like) -> dict:
        """Every rank of ``merged`` (the old ranks first): take rank 0's shipment, rebuild the
        topology, the exchange, the split and the core over ``merged``. Returns the join record."""
        shipped = merged.bcast(shipped, root=0)
        self._extra = shipped["extra"]
        if self.joined and self._core is None:  # the joiner takes the state (the old ranks have it)
            for name, value in self._arrays_of(like).items():
                value[...] = shipped["arrays"][name]
            if shipped["buffers"] and like.model is not None:
                like.model.load_buffers_host(shipped["buffers"])
            if shipped["should_stop"]:
                self._stop_asked = True
        hosts = merged.allgather(MPI.Get_processor_name())
        ids = shipped["ids"]
        self._members = Members(ids=tuple(ids), hosts=tuple(hosts))
        self._next_id = max(ids) + 1
        old_size = len(shipped["split"]["costs"])
        topology = rebuild_topology(merged, None if self._core is None else self._core.topology)
        split = self._joined_split(shipped["split"], topology, like.clock)
        new = self._compose(self._rebuild(topology), split, like)
        counters = shipped["counters"]
        new.steps = int(counters["steps"])
        new.optimizer.step_count = int(counters["step_count"])
        new.exchange.load_state(counters["exchange"])
        if self._core is not None:
            _free(self._core.topology, self._core.exchange, self._world)
        self._world = merged
        self._core = new
        event = {"event": "join", "step": new.steps, "joined_ranks": list(range(old_size, merged.Get_size())),
                 "joined_ids": list(ids[old_size:]), "ranks": merged.Get_size(), "hosts": len(set(hosts)),
                 "node_sizes": list(topology.node_sizes), "batch_sizes": list(new.batch_sizes),
                 "first_step_s": None, "first_step_at_unix": None}
        self.failures.append(event)
        return event

    @staticmethod
    def _arrays_of(like) -> dict:
        state = {"params": like.params.data}
        for i, buffer in enumerate(like.optimizer.state_buffers()):
            state[f"optimizer{i}"] = buffer
        return state

    def _joined_split(self, spec: dict, topology, clock):
        """The split of the same global batch over the grown world: the old ranks' cost models,
        the mean of them for each new rank."""
        old = [RankCost(a, c) for a, c in spec["costs"]]
        mean = RankCost(sum(c.a for c in old) / len(old), sum(c.c for c in old) / len(old))
        costs = old + [mean] * (topology.size - len(old))
        sizes = resplit(spec["batch_size"], [1] * topology.size, list(range(topology.size)), costs)
        if spec["measured"]:
            return MeasuredSplit.from_costs(topology, spec["batch_size"], costs, sizes, clock,
                                            threshold=spec["threshold"], min_local_batch=spec["min_local_batch"],
                                            rebalance_every=spec["rebalance_every"], noise=spec["noise"])
        split = FixedSplit(spec["batch_size"], topology.size, None if spec["equal"] else [1.0 / c.c for c in costs],
                           min_local_batch=0)
        split.costs, split.batch_sizes = costs, sizes
        return split

def _apply_flags(core: DataParallel, sums) -> None:
    """The world's ``(stop, nonfinite)`` sums of a sync the wrapper redid, applied to ``core``
    as its own sync would have: a stop agreed; a skipped step reported (``on_nan='skip'``), or
    NonFiniteGradient on every rank (``'stop'``)."""
    stop, nonfinite = sums
    if stop > 0:
        core.request_stop()
        core.should_stop = True
    if nonfinite > 0 and core.on_nan == "skip":
        core.skip_agreed = True
    elif nonfinite > 0:
        raise NonFiniteGradient(f"non-finite (NaN/Inf) gradient on some node before step {core.steps}; "
                                "stopping (on_nan='stop')")


def _communicators(topology, exchange) -> list:
    """Every communicator of ``topology`` and of ``exchange``'s channels but the world (to
    revoke with it)."""
    found = []
    candidates = [topology.node, topology.leaders]
    for stage in getattr(exchange, "stages", []):
        candidates += stage.channel.communicators()
    for comm in candidates:
        if comm != MPI.COMM_NULL and comm != topology.world and not any(comm == c for c in found):
            found.append(comm)
    return found


def _free(topology, exchange, owned_world) -> None:
    """Free what a failed core held: its exchange, the node and leader communicators of its
    topology, and the world when it is a shrunk one this wrapper made (all revoked: under Open
    MPI's ULFM these return at once). Errors are ignored: they are of the dead."""
    for free in (exchange.close, topology.free, getattr(owned_world, "Free", None)):
        if free is None:
            continue
        try:
            free()
        except MPI.Exception:
            pass
