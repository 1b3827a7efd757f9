"""A communicator of one level, and what passes through it: counted, timed collectives.

The strategies talk to MPI through channels only, one per level::

    intra    the node communicator        (within a node: shared memory, fast)
    inter    the leaders communicator     (between nodes: the network; leaders only)
    world    the world communicator       (the flat strategy)
    control  the world communicator       (flags, decisions, the loop's own small collectives)

A channel counts, per level, the collective calls this rank made and the ``nbytes`` of the
buffers it handed to them (what this rank contributes, not what crosses the wire: a ring
allreduce of ``n`` bytes among ``L`` ranks sends ``2 (L-1) n / L`` per rank), and the wall
seconds spent in them. A collective over a communicator of one rank moves nothing: it is
skipped, uncounted.

A channel is also the place to wrap a level: 16-bit compression
(:mod:`~mpidl.distributed.extras.compress`) and an EMULATED slow link
(:mod:`~mpidl.distributed.emulation`) are channels around a channel, so the strategies never
know about them.

GPU arrays. MPI knows nothing of CUDA streams: before a CuPy array is handed to MPI, the
current stream is synchronized (the kernels that wrote it may still be queued). Then the
array itself goes to MPI when the MPI is CUDA-aware, otherwise it is staged through a pinned
host buffer allocated once per (dtype, size).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
from mpi4py import MPI

from mpidl.engine.backend import is_device_array
from mpidl import settings

LEVELS = ("intra", "inter", "world", "control")

__all__ = ["LEVELS", "Traffic", "Channel", "mpi_is_cuda_aware"]


class Traffic:
    """Per-level counters shared by the channels of one exchange:
    ``counts[level] = {"calls": int, "bytes": int}``, ``seconds`` in collectives (waiting for
    slower ranks included), ``emulated_seconds`` of it slept by an EMULATED link."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.counts = {level: {"calls": 0, "bytes": 0} for level in LEVELS}
        self.seconds = 0.0
        self.emulated_seconds = 0.0

    def add(self, level: str, nbytes: int, seconds: float = 0.0) -> None:
        self.counts[level]["calls"] += 1
        self.counts[level]["bytes"] += int(nbytes)
        self.seconds += seconds


def mpi_is_cuda_aware() -> bool:
    """Can MPI read and write GPU memory directly? ``MPIDL_CUDA_AWARE_MPI`` decides when set
    (MPICH builds cannot be queried), else ``MPI.Query_cuda_support()`` where it exists, else
    False (the safe answer: stage through host memory)."""
    if settings.SETTINGS.cuda_aware_mpi is not None:
        return settings.SETTINGS.cuda_aware_mpi
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # NotImplementedError / MPI.Exception on libraries without the query
        return False


class _Staging:
    """Host or device buffers for MPI (see the module docstring)."""

    def __init__(self):
        self._cuda_aware: bool | None = None
        self._pinned: dict = {}

    @contextlib.contextmanager
    def buffer(self, array, copy_in: bool = True, copy_out: bool = True):
        if not is_device_array(array):
            yield array
            return
        import cupy  # noqa: PLC0415 - only reached with a CuPy array

        stream = cupy.cuda.get_current_stream()
        stream.synchronize()  # the kernels that wrote `array` must be done before MPI reads it
        if self._cuda_aware is None:
            self._cuda_aware = mpi_is_cuda_aware()
        if self._cuda_aware:
            yield array
            return
        key = (array.dtype.str, array.size)
        if key not in self._pinned:
            import cupyx  # noqa: PLC0415

            self._pinned[key] = cupyx.zeros_pinned(array.size, dtype=array.dtype)
        host = self._pinned[key]
        if copy_in:
            array.get(out=host, stream=stream)
            stream.synchronize()
        yield host
        if copy_out:
            array.set(host, stream=stream)
            stream.synchronize()  # `host` is reused by the next collective


class Channel:
    """The collectives of one ``level`` over ``comm`` (``MPI.COMM_NULL`` on ranks outside
    it), each in place, counted in ``traffic``. Every method is collective over ``comm``."""

    def __init__(self, level: str, comm, traffic: Traffic):
        if level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
        self.level, self.comm, self.traffic = level, comm, traffic
        self._staging = _Staging()

    @property
    def size(self) -> int:
        """Ranks of the communicator (0 on a rank outside it)."""
        return 0 if self.comm == MPI.COMM_NULL else self.comm.Get_size()

    @property
    def is_root(self) -> bool:
        return self.comm != MPI.COMM_NULL and self.comm.Get_rank() == 0

    def _run(self, array, call, copy_in: bool = True, copy_out: bool = True) -> None:
        if self.size <= 1:
            return  # nothing to exchange with anybody
        start = time.perf_counter()
        with self._staging.buffer(array, copy_in, copy_out) as buf:
            call(buf)
        self.traffic.add(self.level, array.nbytes, time.perf_counter() - start)

    def allreduce(self, array) -> None:
        """Every rank's ``array`` becomes ``sum_i array_i``."""
        self._run(array, lambda buf: self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def reduce(self, array) -> None:
        """Local rank 0's ``array`` becomes ``sum_i array_i``; the others' are left as they are."""
        if self.is_root:
            self._run(array, lambda buf: self.comm.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0))
        else:
            self._run(array, lambda buf: self.comm.Reduce(buf, None, op=MPI.SUM, root=0), copy_out=False)

    def bcast(self, array) -> None:
        """Every rank's ``array`` becomes local rank 0's."""
        root = self.is_root
        self._run(array, lambda buf: self.comm.Bcast(buf, root=0), copy_in=root, copy_out=not root)

    def allgather(self, array, out: np.ndarray) -> None:
        """``out[r] = array`` of rank ``r`` (host arrays)."""
        if self.size <= 1:
            out[0] = array
            return
        self._run(array, lambda buf: self.comm.Allgather(buf, out), copy_out=False)

    def start(self, op: str, array):
        """The non-blocking form of ``op`` ('allreduce' | 'reduce' | 'bcast') on a host array;
        returns its request, or None when the communicator has one rank. Counted when started."""
        if self.size <= 1:
            return None
        comm = self.comm
        if op == "allreduce":
            request = comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        elif op == "reduce":
            request = (comm.Ireduce(MPI.IN_PLACE, array, op=MPI.SUM, root=0) if self.is_root
                       else comm.Ireduce(array, None, op=MPI.SUM, root=0))
        elif op == "bcast":
            request = comm.Ibcast(array, root=0)
        else:
            raise ValueError(f"unknown collective {op!r}")
        self.traffic.add(self.level, array.nbytes)
        return request

    def run(self, op: str, array) -> None:
        """The blocking form of ``op``."""
        getattr(self, op)(array)

    def communicators(self) -> list:
        """The communicators under this channel (to revoke after a lost rank)."""
        return [self.comm]
