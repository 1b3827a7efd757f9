"""The job as a whole: which rank this is, set-up errors agreed by every rank, and ending the
whole job when one rank fails.

* :func:`world` -- this process's world rank and size.
* :func:`agree_on_error` -- every rank passes its own set-up error (or None); every rank gets
  the first one back, naming the ranks that saw it, so that a problem seen by one rank only
  (a file missing on one node) ends every rank cleanly instead of leaving the others waiting
  in a collective.
* :func:`abort_on_uncaught_exception` -- an exception hook for errors *during* training: one
  rank may fail while the others wait inside a collective, which would hang forever. The hook
  prints ``mpidl: rank R failed: ...`` with the traceback and calls ``MPI_Abort``, which makes
  the launcher kill every rank: the job ends within seconds with a non-zero exit code. (A
  collective error check after every step would also work, but costs a collective per step
  and still hangs if a rank dies inside one.)
"""

from __future__ import annotations

import os
import sys
import traceback

from mpi4py import MPI


def world(comm=None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``comm`` (default ``MPI.COMM_WORLD``)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    return comm.Get_rank(), comm.Get_size()


def allgather(value, comm=None) -> list:
    """Collective: every rank's ``value`` (any picklable object), in rank order, on every rank."""
    comm = MPI.COMM_WORLD if comm is None else comm
    return comm.allgather(value)


def machine_rank_and_size(comm=None) -> tuple[int, int]:
    """``(rank, size)`` of this process among the ranks of ``comm`` on its machine
    (``Split_type(COMM_TYPE_SHARED)``; collective): the rank picks the GPU."""
    comm = MPI.COMM_WORLD if comm is None else comm
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return machine.Get_rank(), machine.Get_size()
    finally:
        machine.Free()


def first_error(errors: list) -> str | None:
    """The first error of ``errors`` (one entry per rank in rank order, None where a rank had
    none), with ``(on rank[s] [...])`` when not every rank had one; None when no rank had.
    The one rule by which the ranks agree on an error (set-up, checkpoint, output)."""
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return None
    failing = [r for r, e in enumerate(errors) if e is not None]
    if len(failing) == len(errors):
        return first
    return f"{first} (on rank{'s' if len(failing) > 1 else ''} {failing})"


def agree_on_error(error: str | None, comm=None) -> str | None:
    """Collective: :func:`first_error` of every rank's ``error``, the same on every rank."""
    comm = MPI.COMM_WORLD if comm is None else comm
    return first_error(comm.allgather(error))


def abort_on_uncaught_exception(exc_type, exc, tb) -> None:
    """``sys.excepthook`` for an MPI job: report this rank's failure, then end every rank.

    The report is written once, by this (the failing) rank, and has left the process
    (:func:`report`) before ``MPI_Abort`` is called, which may kill this process at once."""
    global _reported
    rank, size = world()
    if not _reported:
        _reported = True
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        report(f"mpidl: rank {rank} failed: {exc_type.__name__}: {exc}\n{text}")
    if size > 1:
        MPI.COMM_WORLD.Abort(1)
    sys.exit(1)


_reported = False


def report(message: str) -> None:
    """Write ``message`` to stderr so that it is out of this process when this returns:
    pending stdout and stderr output is flushed first, then the bytes go straight to the
    file descriptor (no Python buffer left to lose when the process is killed)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        fd = sys.stderr.fileno()
    except (OSError, ValueError, AttributeError):  # a replaced stderr (tests): its own write
        sys.stderr.write(message)
        sys.stderr.flush()
        return
    _write_all(fd, message.encode("utf-8", errors="replace"))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return  # stderr is gone: nothing more can be said
        data = data[written:]


def gather_to_root(obj, root: int = 0, comm=None):
    """Collective: the list of every rank's ``obj`` (in rank order) on ``root``, None elsewhere."""
    comm = MPI.COMM_WORLD if comm is None else comm
    return comm.gather(obj, root=root)


def barrier(comm=None) -> None:
    """Collective: return once every rank of ``comm`` (default the world) has called it."""
    (MPI.COMM_WORLD if comm is None else comm).Barrier()
