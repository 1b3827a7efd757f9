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
  and still hangs if a rank dies inside one.) Not after a shrink that leaves the survivors
  unable to go on: they all stop alike, and an abort would also end the ranks that went on
  without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import struct
import sys
import termios
import time
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

    The report -- one line ``mpidl: rank R failed: Type: message (host H, pid P)``, then the
    traceback -- is written once, by this (the failing) rank: to stderr, where it has been
    read by the launcher before ``MPI_Abort`` is called (:func:`report`: the abort makes the
    launcher kill every process, its own readers of the ranks' output included, so bytes
    still in the pipe would be lost), and to the failure file (:func:`report_failures_to`).

    An exception with a true ``stops_alone`` attribute (the elastic package's RecoveryError:
    survivors of a lost rank that cannot go on, a minority or a node that lost only part of
    its ranks) ends this process only:
    one line ``mpidl: rank R stops: RecoveryError: ...`` (the traceback goes to the failure
    file), then exit code 1 without ``MPI_Abort``."""
    global _reported
    rank, size = world()
    # After a shrink (on_failure='shrink') that leaves these survivors unable to go on (a
    # minority, a node that lost part of its ranks): every survivor raises the same
    # RecoveryError, so none is left waiting, and MPI_Abort would reach the ranks that went on
    # WITHOUT this one (the other half of a cut link, once it is back) and end them too.
    alone = getattr(exc, "stops_alone", False)
    if not _reported:
        _reported = True
        message = str(exc).strip().splitlines()
        verb = "stops" if alone else "failed"
        line = (f"mpidl: rank {rank} {verb}: {exc_type.__name__}: {message[0] if message else ''} "
                f"(host {socket.gethostname()}, pid {os.getpid()})")
        text = line + "\n" + "".join(traceback.format_exception(exc_type, exc, tb))
        if _failure_file is not None:
            try:
                with open(_failure_file, "a", encoding="utf-8") as f:
                    f.write(text)
            except OSError:
                pass  # the terminal still gets the report
        report(line + "\n" if alone else text)
    if alone:
        os._exit(1)  # not MPI_Finalize either: it may wait for the ranks lost (recovery.leave)
    if size > 1:
        try:
            MPI.COMM_WORLD.Abort(1)
        finally:
            # MPI_Abort should not return, but on an MPI already failing (MPICH after its
            # progress timeout on a cut link) it has returned; Python's exit would then call
            # MPI_Finalize, which waits for the ranks that can no longer be reached, for ever.
            # Ending the process lets the launcher see this rank gone and end the others.
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(1)
    sys.exit(1)


_reported = False
_failure_file = None


def report_failures_to(path: str | None) -> None:
    """Also append a failing rank's report (:func:`abort_on_uncaught_exception`) to ``path``
    (the trainer: beside the metrics), so that it is kept whatever the terminal keeps."""
    global _failure_file
    _failure_file = path


def failure_file_for(metrics: str) -> str:
    """Where a run with ``--metrics METRICS`` keeps its failure reports: ``m.jsonl`` ->
    ``m.failure.txt`` in the same folder."""
    root, ext = os.path.splitext(metrics)
    return (root if ext else metrics) + ".failure.txt"


#: the longest :func:`report` waits for the launcher to read what it wrote (a launcher that
#: never reads must not keep a failing job alive)
READ_WAIT_S = 5.0


def report(message: str) -> None:
    """Write ``message`` to stderr so that the launcher has read it when this returns:
    pending stdout and stderr output is flushed first, the bytes go straight to the file
    descriptor (no Python buffer left to lose when the process is killed), then, where
    stdout or stderr is a pipe (the launcher's), wait until the reader has taken every byte
    out of it (at most :data:`READ_WAIT_S`): what an abort kills with the reader is then
    only what this process never wrote."""
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
    wait_until_read((1, fd), READ_WAIT_S)


def unread_bytes(fd: int) -> int:
    """Bytes written to the pipe ``fd`` that its reader has not read yet (``FIONREAD``, which
    Linux answers for either end of a pipe); 0 for anything that is not a pipe (a terminal
    or a file keeps what was written)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def wait_until_read(fds, limit_s: float) -> None:
    """Return once every pipe of ``fds`` is empty, or after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while any(unread_bytes(fd) for fd in fds) and time.monotonic() < deadline:
        time.sleep(0.01)


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
