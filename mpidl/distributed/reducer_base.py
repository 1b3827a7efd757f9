"""What every gradient reducer shares: weights, counted collectives, GPU buffers for MPI.

A reducer turns each rank's local MEAN gradient ``g_i`` (computed on ``b_i`` samples) into
the gradient the optimizer applies, in place, on a flat 1-D buffer.

Weighting over the ranks that reduce together (the world for the exact strategies, the
node for the node-based one), followed by a SUM:

* ``balanced``:  ``g = sum_i (b_i / sum_j b_j) g_i`` -- exactly the gradient of the mean loss
  over all the samples of the step, whatever the local batch sizes;
* ``uniform``:   ``g = sum_i (1 / n) g_i`` over the ``n`` ranks -- the naive baseline, which is
  wrong (biased towards small batches) when the local batch sizes differ.

Every collective goes through :meth:`Reducer._collective`, which counts it per level:

* ``'intra'``  node communicator  (within a node),
* ``'inter'``  leaders communicator (between nodes; leaders only),
* ``'world'``  world communicator (the flat strategy).

``counters[level]['calls']`` is the number of collective calls this rank made on that level
and ``counters[level]['bytes']`` the sum of the ``nbytes`` of the buffer this rank handed to
each of them (what this rank contributes, not what crosses the wire: a ring allreduce of
``n`` bytes among ``L`` ranks sends ``2 (L-1) n / L`` per rank). A collective over a
communicator of one rank moves nothing and is skipped, uncounted.
"""

from __future__ import annotations

import contextlib
import os
import time
from numbers import Integral
from typing import Sequence

from mpi4py import MPI

from mpidl.backend import is_device_array
from mpidl.distributed.emulation import LinkModel, parse_link
from mpidl.distributed.topology import Topology

LEVELS = ("intra", "inter", "world")
WEIGHTINGS = ("balanced", "uniform")
CUDA_AWARE_ENV = "MPIDL_CUDA_AWARE_MPI"


def mpi_is_cuda_aware() -> bool:
    """Can MPI read and write GPU memory directly?

    ``MPIDL_CUDA_AWARE_MPI=1|0`` decides when set (MPICH builds cannot be queried);
    otherwise ``MPI.Query_cuda_support()`` where this mpi4py/MPI provides it, else False
    (the safe answer: stage through host memory).
    """
    forced = os.environ.get(CUDA_AWARE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except Exception:  # NotImplementedError / MPI.Exception on libraries without the query
        return False


class _MPIBuffers:
    """Hands NumPy or CuPy 1-D arrays to MPI's buffer API.

    NumPy arrays go straight through. For a CuPy array, the current stream is synchronized
    first, then the array itself is passed (CUDA-aware MPI) or it is staged through a pinned
    host buffer that is allocated once per (dtype, size) and reused every step.
    """

    def __init__(self):
        self._cuda_aware: bool | None = None  # decided on the first device buffer
        self._pinned: dict = {}

    @contextlib.contextmanager
    def on_host_or_device(self, array, copy_in: bool = True, copy_out: bool = True):
        """Yield the buffer to give MPI; copy back into ``array`` afterwards if staged."""
        if not is_device_array(array):
            yield array
            return
        import cupy  # noqa: PLC0415 - only reached with a CuPy array

        stream = cupy.cuda.get_current_stream()
        # MPI knows nothing about CUDA streams: the kernels that wrote `array` (backward,
        # the weight scaling) may still be queued. Wait for them before MPI reads the memory.
        stream.synchronize()
        if self._cuda_aware is None:
            self._cuda_aware = mpi_is_cuda_aware()
        if self._cuda_aware:
            yield array
            return
        key = (array.dtype.str, array.size)
        if key not in self._pinned:
            import cupyx  # noqa: PLC0415

            # Pinned (page-locked) memory: faster copies, and allocated once, not per step.
            self._pinned[key] = cupyx.zeros_pinned(array.size, dtype=array.dtype)
        host = self._pinned[key]
        if copy_in:
            array.get(out=host, stream=stream)
            stream.synchronize()  # the host copy must be complete before MPI reads it
        yield host
        if copy_out:
            array.set(host, stream=stream)
            stream.synchronize()  # `host` is reused by the next collective: finish reading it


class Reducer:
    """Base class: the weighting, the counted collectives and the per-step interface.

    Per training step the trainer calls, in order::

        reducer.reduce_gradients(params.grad, counts)   # after backward, before optimizer.step
        optimizer.step()
        reducer.after_step(params.data, step)           # step = optimizer steps done (1, 2, ...)

    and ``reducer.sync_parameters(params.data)`` at the end of every epoch (before
    evaluation and checkpoints). The exact strategies keep all replicas identical every step,
    so for them ``after_step`` returns False and the syncs are no-ops.
    """

    name = "base"
    exact = True

    def __init__(self, topology: Topology, weighting: str = "balanced",
                 emulate_link: LinkModel | str | None = None):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
        if isinstance(emulate_link, str):
            emulate_link = parse_link(emulate_link)
        if emulate_link is not None and not isinstance(emulate_link, LinkModel):
            raise ValueError(f"emulate_link must be a LinkModel, a 'LATENCY_US,GBIT_S' string "
                             f"or None, got {emulate_link!r}")
        self.topology = topology
        self.weighting = weighting
        self.emulate_link = emulate_link
        self._buffers = _MPIBuffers()
        self.reset_counters()

    # -- counters --------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero ``counters``, ``comm_seconds`` and ``emulated_seconds``."""
        self.counters = {level: {"calls": 0, "bytes": 0} for level in LEVELS}
        #: wall seconds spent in collectives, including waiting there for slower ranks,
        #: GPU staging copies and EMULATED link sleeps (not the weight scaling)
        self.comm_seconds = 0.0
        #: of which EMULATED link time slept (see emulation.LinkModel)
        self.emulated_seconds = 0.0

    def describe(self) -> str:
        link = f"; {self.emulate_link.describe()}" if self.emulate_link else ""
        return f"{self.name} reducer, {self.weighting} weighting{link}"

    # -- the per-step interface ------------------------------------------------------------
    def reduce_gradients(self, grad, counts: Sequence[int]) -> None:
        """Replace this rank's local mean gradient ``grad`` (1-D) by the reduced one, in place.

        ``counts[r]`` = samples world rank ``r`` computed this step (the same list on every
        rank). A rank with 0 samples passes a zeroed ``grad`` and still joins every collective.
        """
        raise NotImplementedError

    def after_step(self, params_data, step: int) -> bool:
        """Called after every optimizer step; True when it synchronised parameters."""
        _check_step(step)
        return False

    def sync_parameters(self, params_data) -> None:
        """Make all replicas identical (a no-op when they already are)."""

    def sync_optimizer_state(self, buffers: Sequence) -> None:
        """Average flat optimizer-state buffers like the parameters (no-op when exact)."""

    def average_buffers(self, buffers: Sequence, weight: float) -> None:
        """``buf <- sum_r w_r buf_r`` over the WORLD, in place, for every buffer.

        For state that differs on every rank under every strategy, such as BatchNorm running
        statistics (each rank's come from its own local batches). ``weight`` is this rank's
        ``w_r``; the weights must sum to 1 over the world (``1 / P``, or this rank's share of
        the epoch's samples). One ``world`` collective per buffer.
        """
        for buf in buffers:
            _check_buffer(buf)
            buf *= weight
            self._allreduce("world", self.topology.world, buf)

    # -- helpers for the strategies --------------------------------------------------------
    def _check(self, grad, counts) -> list[int]:
        """Validate the buffer and the counts (same values on every rank, so every rank
        raises alike, before any collective)."""
        _check_buffer(grad)
        counts = list(counts)
        if len(counts) != self.topology.size:
            raise ValueError(f"counts has {len(counts)} entries for {self.topology.size} ranks")
        for r, c in enumerate(counts):
            if isinstance(c, bool) or not isinstance(c, Integral) or c < 0:
                raise ValueError(f"counts[{r}] must be an integer >= 0, got {c!r}")
        if sum(counts) == 0:
            raise ValueError("counts are all zero: no rank computed a sample this step")
        return [int(c) for c in counts]

    def _weight(self, counts: list[int], group: Sequence[int]) -> float:
        """This rank's factor before the SUM over ``group`` (world ranks reducing together).

        balanced: ``b_rank / sum_{j in group} b_j`` (0 if the whole group computed nothing);
        uniform: ``1 / len(group)``.
        """
        if self.weighting == "uniform":
            return 1.0 / len(group)
        total = sum(counts[r] for r in group)
        return counts[self.topology.rank] / total if total > 0 else 0.0

    def _collective(self, level: str, comm, array, call, copy_in=True, copy_out=True) -> None:
        """Run ``call(buffer)`` as one counted, timed collective over ``comm``."""
        if comm == MPI.COMM_NULL or comm.Get_size() == 1:
            return  # nothing to exchange with anybody
        start = time.perf_counter()
        with self._buffers.on_host_or_device(array, copy_in, copy_out) as buf:
            call(buf)
        self.comm_seconds += time.perf_counter() - start
        self.counters[level]["calls"] += 1
        self.counters[level]["bytes"] += array.nbytes

    def _allreduce(self, level: str, comm, array) -> None:
        """In-place SUM over ``comm``: every rank ends with ``sum_i array_i``."""
        self._collective(level, comm, array,
                         lambda buf: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def _reduce_to_root(self, level: str, comm, array) -> None:
        """SUM onto local rank 0 of ``comm`` in place; the others' arrays are left unchanged."""
        if comm != MPI.COMM_NULL and comm.Get_rank() == 0:
            self._collective(level, comm, array,
                             lambda buf: comm.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0))
        else:
            self._collective(level, comm, array,
                             lambda buf: comm.Reduce(buf, None, op=MPI.SUM, root=0),
                             copy_out=False)

    def _bcast_from_root(self, level: str, comm, array) -> None:
        """Copy local rank 0's array into everyone's, in place."""
        root = comm != MPI.COMM_NULL and comm.Get_rank() == 0
        self._collective(level, comm, array, lambda buf: comm.Bcast(buf, root=0),
                         copy_in=root, copy_out=not root)

    def _emulate_inter_node(self, seconds: float) -> None:
        """EMULATION: sleep the modelled time of an inter-node collective (see LinkModel)."""
        if seconds > 0:
            time.sleep(seconds)
            self.comm_seconds += seconds
            self.emulated_seconds += seconds


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, Integral) or step < 1:
        raise ValueError(f"step must be the number of optimizer steps done (an integer >= 1), "
                         f"got {step!r}")
    return int(step)


def _check_buffer(array) -> None:
    """The reducers exchange one flat, contiguous 1-D buffer per call."""
    if getattr(array, "ndim", None) != 1 or not array.flags.c_contiguous:
        raise ValueError("the reducer works on one flat, contiguous 1-D buffer; got "
                         f"shape {getattr(array, 'shape', None)}")
