"""Surviving a lost rank with MPI alone (ULFM): detect, revoke, shrink, rebuild, re-split.

When a rank dies (its process killed, its host gone), an MPI with ULFM fault tolerance makes
the collective that needed it fail on the survivors with ``MPI_ERR_PROC_FAILED`` (or
``MPI_ERR_REVOKED`` once another survivor has revoked the communicator) instead of hanging
or ending the job. The survivors then::

    1. revoke every communicator of the job      Comm.Revoke: a survivor still blocked in any
                                                 of them returns with MPI_ERR_REVOKED
    2. shrink the world                          Comm.Shrink: a new communicator of the ranks
                                                 still alive; itself an agreement, so every
                                                 survivor gets the same members in the same order
    3. name the lost ranks and hosts             group translation against the members gathered
                                                 at start-up (:class:`Members`)
       and check the quorum                      a cut link looks like a dead host from BOTH
                                                 sides: each shrinks to its own half and would
                                                 train on alone (docs/failures.md); only the side
                                                 with a majority goes on (:func:`has_quorum`)
    4. agree on the step to go on from           the smallest step count any survivor completed
                                                 (:func:`agreed_step`); every survivor restores
                                                 its copy of the state before that step
                                                 (:class:`StepSnapshots`)
    5. rebuild the topology                      :func:`rebuild_topology`: node and leader
                                                 communicators of the shrunk world (a host may
                                                 have lost some of its ranks or all of them)
    6. re-split the global batch                 :func:`resplit`: a lost rank is a rank of speed 0

Why two snapshots. A collective can complete on some ranks and fail on others (the dead rank
had already sent what some of them needed). A survivor that completed step ``s`` goes on to
step ``s + 1`` and fails there; one that did not fails in step ``s``. Neither can complete a
step the other has not entered, since every step's exchange needs every live rank, so the
step counts of the survivors differ by at most one. Each rank therefore keeps the state
before its current step and before the previous one, and all restore the state before the
smallest count. This holds for strategies that exchange across the whole world every step
(``flat``, ``hierarchical``); under ``node`` the nodes step on their own between their syncs,
and a lost host is noticed at the next sync, where the survivors' sync simply leaves it out.
The buffers of a collective that failed are undefined (an in-place allreduce may have
half-summed them), so a step is always redone from the snapshot, never from them.

Which MPI can do this (measured, docs/failures.md): Open MPI 5 started with
``mpiexec --with-ft ulfm``. Not the MPICH 5.0.2 wheel: with ``MPIR_CVAR_ENABLE_FT=1``
``MPI_Init`` fails an assertion, and without it hydra (even with ``-disable-auto-cleanup``)
signals the survivors and they end or hang. :func:`ulfm_available` says which at start-up, so
that the caller falls back to ending the job (``on_failure='restart'``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from mpi4py import MPI

from mpidl import settings
from mpidl.distributed.split.balance import RankCost, equal_split, solve_split, split_counts
from mpidl.distributed.topology import Topology

__all__ = ["ULFM_ENV", "ulfm_available", "detector_state", "is_process_failure", "Members", "Shrunk", "shrink",
           "agreed_step", "StepSnapshots", "resplit", "rebuild_topology", "leave", "has_quorum",
           "RecoveryError", "RanksLost", "ON_FAILURE", "check_on_failure"]

#: what a job does when a rank is lost: end (resume from the checkpoint), or shrink to the
#: survivors and go on (an ElasticDataParallel around the core DataParallel)
ON_FAILURE = ("restart", "shrink")

#: ``MPIDL_ULFM=1`` / ``0`` overrides the detection of :func:`ulfm_available` (an MPI this
#: module does not know, or a test of the fallback); read, like every ``MPIDL_`` variable, once
#: by :mod:`mpidl.settings` (``settings.SETTINGS.ulfm``)
ULFM_ENV = "MPIDL_ULFM"
#: set to 1 in every rank by Open MPI's ``mpiexec --with-ft ulfm`` (Open MPI's own variable,
#: read from the environment where the launcher put it, like the detector's MCA settings)
OPENMPI_FT_ENV = "OMPI_MCA_mpi_ft_enable"
_TRUE = ("1", "true", "yes", "on", "enabled")


class RecoveryError(RuntimeError):
    """The survivors cannot go on (raised alike on every survivor). It ends this process only
    (``stops_alone``: :func:`~mpidl.distributed.launch.abort_on_uncaught_exception` does not
    call ``MPI_Abort``, which would also end the ranks that went on without this one)."""

    stops_alone = True


class RanksLost(RuntimeError):
    """Ranks were lost and the survivors went on without them (``on_failure='shrink'``).

    Raised alike on every survivor by the
    :class:`~mpidl.distributed.elastic.ElasticDataParallel` call that saw the failure, once
    the state is back to the one before :attr:`step` (the global step count every survivor
    agreed on) and the batch is re-split. The loop then runs the global
    batch of step :attr:`step` again (``divmod(dp.steps, steps_per_epoch)``): its new local
    slice covers the lost ranks' samples. :attr:`event` is the record for the metrics.
    """

    def __init__(self, event: dict, message: str):
        super().__init__(message)
        self.event = event
        self.step = int(event["step"])


def check_on_failure(on_failure: str, *, intra: str = "mpi", overlap: bool = False,
                     compress: str = "none", sync_overlap: int = 0, emulated_nodes: bool = False) -> None:
    """ValueError when ``on_failure`` is unknown, or ``'shrink'`` with an option it cannot
    rebuild after a loss (no MPI)."""
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    if on_failure != "shrink":
        return
    why = None
    if intra == "shm":
        why = "intra='shm' (the node-shared window cannot be rebuilt without the lost ranks)"
    elif overlap:
        why = "overlap (its buckets fail inside backward, outside the step that could restore them)"
    elif compress != "none":
        why = "compress (the error-feedback residuals are not part of the step snapshot)"
    elif sync_overlap:
        why = "sync_overlap (a sync in flight spans steps that cannot be redone alike)"
    elif emulated_nodes:
        why = ("emulated nodes (MPIDL_RANKS_PER_NODE / ranks_per_node group by rank, which a shrink "
               "changes); use real hosts")
    if why is not None:
        raise ValueError(f"on_failure='shrink' does not work with {why}")


# --------------------------------------------------------------------------- support
def _local_support() -> tuple[bool, str]:
    """This process's view: does its MPI and launcher give ULFM fault tolerance?"""
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Agree", "Get_failed")):
        return False, "mpi4py has no ULFM calls (Comm.Revoke/Shrink/Agree): mpi4py >= 4 is needed"
    try:
        forced = settings.SETTINGS.ulfm
    except ValueError as exc:  # a malformed value: said, and no fault tolerance (alike on every rank)
        return False, f"{exc}; fault tolerance off"
    if forced is not None:
        value = settings.SETTINGS.raw[ULFM_ENV].strip().lower()
        return forced, f"{'forced by' if forced else 'turned off by'} {ULFM_ENV}={value}"
    library = MPI.Get_library_version()
    name = " ".join(library.splitlines()[0].split(",")[0].split()) if library else "unknown MPI"
    if "Open MPI" in library:
        if os.environ.get(OPENMPI_FT_ENV, "").strip().lower() in _TRUE:
            return True, f"{name} with ULFM (mpiexec --with-ft ulfm); {detector_state(os.environ)}"
        return False, f"{name} started without fault tolerance: start it with mpiexec --with-ft ulfm"
    if "MPICH" in library:
        return False, (f"{name}: no usable failure recovery (MPIR_CVAR_ENABLE_FT=1 fails in "
                       f"MPI_Init; without it hydra ends or hangs the survivors; docs/failures.md)")
    return False, f"{name}: fault tolerance unknown (set {ULFM_ENV}=1 to try it)"


def detector_state(environ: Mapping[str, str]) -> str:
    """What Open MPI's heartbeat failure detector will catch, from the MCA settings mpiexec
    put in ``environ`` (``--mca mpi_ft_detector true`` -> ``OMPI_MCA_mpi_ft_detector``).

    Without the detector only a process that dies (its daemon sees it) or a broken connection
    is reported: a frozen host or a cut link never is. With it, a rank silent for
    ``mpi_ft_detector_timeout`` seconds is declared dead (after about three timeouts in all,
    docs/failures.md). Without ``mpi_ft_detector_thread`` the heartbeats are sent only from
    inside MPI calls, so a rank that computes (or compiles) longer than the timeout while its
    observer waits in MPI is taken for dead: the trainer's start-up did exactly that.
    """
    def mca(name: str, default: str) -> str:
        return environ.get(f"OMPI_MCA_mpi_ft_detector{name}", default).strip().lower()

    if mca("", "false") not in _TRUE:
        return ("no heartbeat detector: a frozen host or a cut link is not detected "
                "(mpiexec --mca mpi_ft_detector true --mca mpi_ft_detector_thread true)")
    timeout = mca("_timeout", "10")
    if mca("_thread", "false") not in _TRUE:
        return (f"heartbeat detector WITHOUT its thread: a rank that computes for more than {timeout} s "
                "without an MPI call is taken for dead (add --mca mpi_ft_detector_thread true)")
    return (f"heartbeat detector: a host silent for {timeout} s is declared dead "
            f"(period {mca('_period', '3')} s)")


def ulfm_available(comm: MPI.Comm | None = None) -> tuple[bool, str]:
    """Whether the job can survive a lost rank, and why (one line for the start-up log).

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank gets the same answer,
    True only if every rank's MPI and launcher give it (the reason is rank 0's, or the first
    refusing rank's).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    ok, reason = _local_support()
    views = comm.allgather((ok, reason))
    for ok_r, reason_r in views:
        if not ok_r:
            return False, reason_r
    return True, views[0][1]


def is_process_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI saying a peer failed (``ERR_PROC_FAILED``, its ``_PENDING``
    form, or ``ERR_REVOKED``, which a survivor sees once another survivor has revoked)."""
    if not isinstance(exc, MPI.Exception):
        return False
    classes = {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
               if hasattr(MPI, name)}
    return exc.Get_error_class() in classes


# --------------------------------------------------------------------------- who is who
@dataclass(frozen=True)
class Members:
    """The ranks of a communicator, by the identity they had at start-up.

    ``ids[r]`` is the start-up rank (in the first world) of the process that is rank ``r``
    now, and ``hosts[r]`` its host (``MPI.Get_processor_name()``). Gathered once, while every
    rank is alive (:meth:`gather`); after a shrink, :func:`shrink` derives the survivors' from it.
    """

    ids: tuple[int, ...]
    hosts: tuple[str, ...]

    @classmethod
    def gather(cls, comm: MPI.Comm) -> "Members":
        """Collective over ``comm``: every rank's rank and host name."""
        pairs = comm.allgather((comm.Get_rank(), MPI.Get_processor_name()))
        return cls(ids=tuple(p[0] for p in pairs), hosts=tuple(p[1] for p in pairs))

    @property
    def size(self) -> int:
        return len(self.ids)


@dataclass(eq=False)
class Shrunk:
    """The result of :func:`shrink`.

    Attributes
    ----------
    comm : MPI.Intracomm
        The survivors' communicator (errors returned as exceptions, like the one it replaces).
    members : Members
        Start-up rank and host of every rank of ``comm``.
    old_ranks : tuple[int, ...]
        ``old_ranks[r]`` is the rank in the failed communicator of the survivor that is rank
        ``r`` of ``comm`` (to re-index per-rank lists: batch sizes, costs).
    lost_ids : tuple[int, ...]
        Start-up ranks of the ranks lost, ascending.
    lost_hosts : tuple[str, ...]
        Hosts that lost at least one rank; ``emptied_hosts`` those that lost all of them.
    quorum : bool
        Whether the survivors may go on (:func:`has_quorum`); the same on every survivor.
    seconds : float
        Wall time of revoke + shrink + naming on this rank.
    """

    comm: MPI.Intracomm
    members: Members
    old_ranks: tuple[int, ...]
    lost_ids: tuple[int, ...]
    lost_hosts: tuple[str, ...]
    emptied_hosts: tuple[str, ...]
    quorum: bool
    seconds: float

    def describe(self) -> str:
        """One line for the log: who was lost, where, and what is left."""
        hosts = ", ".join(f"{h} (all its ranks)" if h in self.emptied_hosts else h for h in self.lost_hosts)
        what = "go on" if self.quorum else "are a minority and stop"
        return (f"lost rank(s) {list(self.lost_ids)} on {hosts}; {self.comm.Get_size()} rank(s) {what} "
                f"on {len(set(self.members.hosts))} host(s); shrink took {self.seconds:.3f} s")


def _revoke(comm) -> None:
    """Revoke ``comm`` unless it is null; revoking twice, or a communicator a peer revoked
    already, is harmless."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Revoke()
    except MPI.Exception:
        pass


def shrink(comm: MPI.Intracomm, members: Members, also_revoke: Sequence[MPI.Comm] = ()) -> Shrunk:
    """Revoke ``comm`` (and ``also_revoke``: the node and leader communicators built on it),
    shrink it to the ranks still alive, and name the lost ones.

    Call it on every survivor after a collective raised a process failure
    (:func:`is_process_failure`); ``members`` describes ``comm`` (:meth:`Members.gather` at
    start-up, or the previous :attr:`Shrunk.members`). Collective over the survivors of
    ``comm``. The old communicators are left to the caller (free them, or drop them).
    """
    if members.size != comm.Get_size():
        raise ValueError(f"members describe {members.size} ranks, the communicator has {comm.Get_size()}")
    start = time.perf_counter()
    for other in also_revoke:
        _revoke(other)
    _revoke(comm)
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    old_group, new_group = comm.Get_group(), new.Get_group()
    try:
        old_ranks = tuple(MPI.Group.Translate_ranks(new_group, list(range(new.Get_size())), old_group))
    finally:
        old_group.Free()
        new_group.Free()
    if any(r == MPI.UNDEFINED for r in old_ranks):
        raise RecoveryError(f"the shrunk communicator has ranks outside the old one: {old_ranks}")
    survivors = Members(ids=tuple(members.ids[r] for r in old_ranks),
                        hosts=tuple(members.hosts[r] for r in old_ranks))
    alive = set(old_ranks)
    lost_old = [r for r in range(members.size) if r not in alive]
    lost_hosts = tuple(sorted({members.hosts[r] for r in lost_old}))
    emptied = tuple(h for h in lost_hosts if h not in set(survivors.hosts))
    return Shrunk(comm=new, members=survivors, old_ranks=old_ranks,
                  lost_ids=tuple(sorted(members.ids[r] for r in lost_old)),
                  lost_hosts=lost_hosts, emptied_hosts=emptied,
                  quorum=has_quorum(members.ids, survivors.ids),
                  seconds=time.perf_counter() - start)


def has_quorum(before: Sequence[int], after: Sequence[int]) -> bool:
    """Whether the ranks ``after`` (start-up ids) may go on without the rest of ``before``.

    MPI cannot tell a dead host from one behind a cut link: the two sides of a cut each see
    the other fail and each shrink to themselves. So the survivors go on only with a strict
    majority of ``before``, or with exactly half when they hold its lowest start-up rank (a
    tie is broken the same way on both sides). The price: losing a half that holds that rank
    ends the job even when the half was really dead.
    """
    before, after = set(before), set(after)
    if not after <= before or not before:
        raise ValueError(f"survivors {sorted(after)} are not a part of {sorted(before)}")
    return 2 * len(after) > len(before) or (2 * len(after) == len(before) and min(before) in after)


# --------------------------------------------------------------------------- the step to go on from
def agreed_step(comm: MPI.Comm, completed_steps: int) -> int:
    """The step count every survivor can restore: the smallest of the survivors'
    ``completed_steps`` (collective over the shrunk ``comm``; see the module docstring for why
    the counts differ by at most one). Raises :class:`RecoveryError` on every rank alike if
    they differ by more (a loop that does not exchange over the world every step)."""
    counts = comm.allgather(int(completed_steps))
    low, high = min(counts), max(counts)
    if high - low > 1:
        raise RecoveryError(f"the survivors' completed steps differ by more than one ({counts}): "
                            "no common state to restore")
    return low


class StepSnapshots:
    """Copies of the state (parameters, optimizer buffers) before the last two steps.

    ``save(step, state, meta)`` before step ``step`` runs (``step`` = steps completed so far)
    copies every array of ``state`` into buffers allocated once (the older of two slots is
    reused) and keeps ``meta`` (small values: counters, an exchange's state dict) as given;
    ``restore(step, state)`` copies the arrays saved for ``step`` back into ``state``'s arrays,
    in place, and returns that ``meta``. Works for any array type with ``.copy()`` and slice
    assignment (NumPy, CuPy).
    """

    def __init__(self):
        self._slots: list[list] = []  # [step, arrays, meta]

    def save(self, step: int, state: Mapping[str, object], meta=None) -> None:
        for slot in self._slots:  # saved again (after a restore, or a second sync): overwrite in place
            if slot[0] == step and set(slot[1]) == set(state):
                for k, v in state.items():
                    slot[1][k][...] = v
                slot[2] = meta
                return
        if len(self._slots) < 2:
            self._slots.append([step, {k: v.copy() for k, v in state.items()}, meta])
            return
        older = min(self._slots, key=lambda s: s[0])
        self._slots.remove(older)
        arrays = older[1]
        if set(arrays) != set(state):
            arrays = {k: v.copy() for k, v in state.items()}
        else:
            for k, v in state.items():
                arrays[k][...] = v
        self._slots.append([step, arrays, meta])

    @property
    def steps(self) -> list[int]:
        """The step counts held, ascending."""
        return sorted(s[0] for s in self._slots)

    def restore(self, step: int, state: Mapping[str, object]):
        for held, saved, meta in self._slots:
            if held == step:
                if set(saved) != set(state):
                    raise RecoveryError(f"the snapshot of step {step} has {sorted(saved)}, not {sorted(state)}")
                for k, v in state.items():
                    v[...] = saved[k]
                return meta
        raise RecoveryError(f"no snapshot of step {step}; held: {self.steps}")


# --------------------------------------------------------------------------- re-split, rebuild
def resplit(total: int, old_split: Sequence[int], survivors: Sequence[int],
            costs: Sequence[RankCost] | None = None) -> list[int]:
    """The global batch of ``total`` samples over the survivors, in their new rank order.

    ``survivors[r]`` is the old rank of new rank ``r`` (:attr:`Shrunk.old_ranks`). A lost rank
    is a rank of speed 0: with the old ranks' cost models ``costs``, the optimal split of
    :func:`~mpidl.distributed.split.balance.solve_split` over the survivors' models (each at least one
    sample when ``total`` allows); without them, ``total`` in proportion to the survivors' old
    batch sizes (:func:`~mpidl.distributed.split.balance.split_counts` with the lost ranks' share set
    to 0), or equally if every survivor had 0. Sums to ``total``.
    """
    survivors = list(survivors)
    if not survivors:
        raise ValueError("no survivors")
    old_size = len(old_split)
    if any(not 0 <= r < old_size for r in survivors) or len(set(survivors)) != len(survivors):
        raise ValueError(f"survivors {survivors} are not distinct ranks of the old split of {old_size}")
    if costs is not None:
        if len(costs) != old_size:
            raise ValueError(f"{len(costs)} costs for {old_size} old ranks")
        alive = [costs[r] for r in survivors]
        return solve_split(alive, total, minimum=1 if total >= len(alive) else 0)
    alive = set(survivors)
    shares = [b if r in alive else 0 for r, b in enumerate(old_split)]
    if sum(shares) == 0:
        return equal_split(total, len(survivors))
    counts = split_counts(total, shares)
    return [counts[r] for r in survivors]


def rebuild_topology(comm: MPI.Intracomm, old: Topology | None = None) -> Topology:
    """The topology of the shrunk communicator ``comm`` (collective over it): the node split
    by shared memory finds which hosts are left and how many ranks each kept.

    Emulated nodes (``MPIDL_RANKS_PER_NODE``) group consecutive ranks, so a lost rank would
    shift every later rank into another node; that needs the start-up node of every rank and
    is refused here with a clear error (alike on every rank). ``old`` (the topology before the
    failure) is only read, to tell which case applies; its communicators are the caller's to
    free (``old.free()`` on revoked communicators returns at once under Open MPI's ULFM).
    """
    if old is not None and old.emulated_ranks_per_node is not None:
        raise RecoveryError("cannot rebuild EMULATED nodes (MPIDL_RANKS_PER_NODE) after a lost rank: "
                            "their grouping is by rank, which the shrink changed; use real hosts")
    if old is None and settings.SETTINGS.ranks_per_node is not None:
        raise RecoveryError("cannot rebuild EMULATED nodes (MPIDL_RANKS_PER_NODE) after a lost rank")
    return Topology.from_comm(comm)


def leave(comm: MPI.Comm, code: int = 0) -> None:
    """End a process that survived a failure: a barrier over the survivors' ``comm``, then
    ``os._exit(code)`` without ``MPI_Finalize``.

    Open MPI 5's ``MPI_Finalize`` waits in a runtime fence that includes the dead ranks, and
    after a shrink it hung in about one run of three here (open-mpi/ompi#11404); the survivors
    have nothing left to finalize that matters, and the launcher (``--with-ft ulfm``) takes a
    process that ends this way as a success. Flush and close files before calling this:
    Python's exit handlers do not run.
    """
    import sys

    comm.Barrier()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# --------------------------------------------------------------------------- grow back
def spawn_joiners(comm: MPI.Intracomm, host: str, count: int, command: Sequence[str]) -> MPI.Intracomm:
    """Start ``count`` new processes of ``command`` (``[executable, *args]``) on ``host`` and
    merge them into ``comm`` (collective over ``comm``): the result holds ``comm``'s ranks
    first, in their order, then the new ones (errors returned as exceptions).

    ``MPI_Comm_spawn`` with the info key ``host`` (``HOST:count``), then
    ``MPI_Intercomm_merge``. Under Open MPI the host must be in the job's allocation (a spare
    host of mpiexec's ``--host`` list); a host whose ranks died cannot take new ones
    (docs/failures.md). The new processes call :func:`join_parent`.
    """
    info = MPI.Info.Create()
    try:
        info.Set("host", f"{host}:{count}")
        inter = comm.Spawn(command[0], list(command[1:]), maxprocs=count, info=info, root=0)
    finally:
        info.Free()
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    inter.Free()
    return merged


def join_parent() -> MPI.Intracomm | None:
    """In a process started by :func:`spawn_joiners`: the merged communicator (collective with
    the spawning ranks; this process's ranks come last). None in a process started by mpiexec."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def check_grow_support() -> None:
    """ValueError when this MPI cannot bring new ranks into a running job after a loss (local,
    no communication): that needs Open MPI under ``mpiexec --with-ft ulfm``; the MPICH wheel
    has no usable ULFM, so its job never survives the loss to grow back."""
    library = MPI.Get_library_version()
    if "Open MPI" not in library:
        name = " ".join(library.splitlines()[0].split(",")[0].split()) if library else "this MPI"
        raise ValueError(f"--replace-with: {name} cannot bring a host into a running job (it has no usable "
                         "ULFM to survive the loss first; docs/failures.md): use Open MPI under "
                         "mpiexec --with-ft ulfm, or resume from --checkpoint on the new hosts")


def is_joiner() -> bool:
    """Whether this process was started into a running job by :func:`spawn_joiners`."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL
