"""What every gradient reducer shares: the message, the weights, counted collectives, GPU staging.

A reducer turns each rank's local MEAN gradient ``g_i`` (computed on ``b_i`` samples) into the
gradient the optimizer applies. It works in place on the rank's *message*, one flat buffer::

    message = [ g_i (P scalars) | count | stop | nonfinite ]       (FlatParameters.message)

Weighting. A rank multiplies its gradient by its weight count ``c_i`` and writes ``c_i`` into
the ``count`` slot; after a SUM over the ranks that reduce together (the world for the exact
strategies, the node for the node-based one), the gradient is divided by the summed count:

* ``balanced``: ``c_i = b_i``, so ``g = sum_i b_i g_i / sum_j b_j = sum_i (b_i / B) g_i``, exactly
  the gradient of the mean loss over all the samples of the step, whatever the local batch
  sizes;
* ``uniform``:  ``c_i = 1``, so ``g = sum_i g_i / n`` over the ``n`` ranks -- the naive
  baseline, which is wrong (biased towards small batches) when the local batch sizes differ.

The weights need no message of their own, and no rank needs to know the others' batch sizes.
The ``stop`` and ``nonfinite`` slots are summed the same way: a value > 0 after the SUM means
that some rank of the group asked for it. That is how collective decisions (stop on a signal,
a node's non-finite gradient) reach every rank with the gradient or parameter traffic that
flows anyway (see :class:`~mpidl.distributed.DataParallel`). A group of one rank exchanges
nothing and scales nothing, so one process computes bit for bit what a plain loop computes.

Counted collectives, per level:

* ``'intra'``  node communicator  (within a node),
* ``'inter'``  leaders communicator (between nodes; leaders only),
* ``'world'``  world communicator (the flat strategy; batch-norm buffer averaging),
* ``'control'`` world communicator, for decisions and the loop's own small collectives
  (flags exchanged outside the gradient and parameter messages, metrics, evaluation).

``counters[level]['calls']`` is the number of collective calls this rank made on that level
and ``counters[level]['bytes']`` the sum of the ``nbytes`` of the buffer this rank handed to
each of them (what this rank contributes, not what crosses the wire: a ring allreduce of ``n``
bytes among ``L`` ranks sends ``2 (L-1) n / L`` per rank). A collective over a communicator of
one rank moves nothing and is skipped, uncounted.
"""

from __future__ import annotations

import contextlib
import os
import time
from numbers import Real

import numpy as np
from mpi4py import MPI

from mpidl import kernels
from mpidl.backend import get_array_module, is_device_array, to_host
from mpidl.distributed.compress import Compressor, check_compression
from mpidl.distributed.message import COUNT, NONFINITE, SLOTS, STOP, check_message  # noqa: F401
from mpidl.distributed.emulation import LinkModel, parse_link
from mpidl.distributed.topology import Topology

LEVELS = ("intra", "inter", "world", "control")
WEIGHTINGS = ("balanced", "uniform")
CUDA_AWARE_ENV = "MPIDL_CUDA_AWARE_MPI"


class OptionError(ValueError):
    """A bad exchange option; :attr:`option` names the keyword argument that broke the rule."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def check_weighting(weighting) -> str:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    return weighting


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
    """Base class of the strategies, and the exchange interface every variant composes.

    Per training step :class:`~mpidl.distributed.DataParallel` calls, in order, whatever the
    strategy (flat, hierarchical, node) and the variant wrapped around it
    (:mod:`~mpidl.distributed.exchange`: overlapped buckets, the node-shared window)::

        exchange.begin(count, stop_requested)          # local_indices(): a step starts
        finite, stop = exchange.reduce(message, count, stop)   # after backward
        exchange.update(optimizer, finite)             # the optimizer (unless not finite)
        exchange.after_step(params.data, state, flags, steps_done)   # node: the K' sync

    and outside the step :meth:`synchronize`, :meth:`consensus`, :meth:`finish_pending`,
    :meth:`set_reference`, :meth:`pending_samples` / :meth:`restore` (checkpoints),
    :meth:`allreduce` (the loop's own counted collectives), :meth:`reset_counters` and
    :meth:`close`. A strategy implements :meth:`reduce_gradients` (and the node strategy the
    syncs); the defaults here are those of an exact strategy.

    Attributes a caller reads:

    ``exact``
        True when every replica holds the same parameters after every step (flat,
        hierarchical); False for the node strategy, whose nodes differ between syncs.
    ``step_is_global``
        True when the per-step reduction spans the whole world, so that the ``stop`` and
        ``nonfinite`` slots of the reduced message are world-wide decisions.
    ``steps_since_sync``
        Optimizer steps since the last parameter sync (0 for the exact strategies).
    ``compressor``
        The :class:`~mpidl.distributed.compress.Compressor` of the leaders' level, or None.
    """

    name = "base"
    #: steps between the start of an overlapped parameter sync and its application
    sync_overlap = 0

    def __init__(self, topology: Topology, weighting: str = "balanced",
                 emulate_link: LinkModel | str | None = None, compress: str = "none"):
        check_weighting(weighting)
        if isinstance(emulate_link, str):
            emulate_link = parse_link(emulate_link)
        if emulate_link is not None and not isinstance(emulate_link, LinkModel):
            raise ValueError(f"emulate_link must be a LinkModel, a 'LATENCY_US,GBIT_S' string "
                             f"or None, got {emulate_link!r}")
        self.topology = topology
        self.weighting = weighting
        self.emulate_link = emulate_link
        self.compressor = None if check_compression(compress) == "none" else Compressor(compress)
        self.steps_since_sync = 0
        self.shared = None
        self._buffers = _MPIBuffers()
        self.reset_counters()

    @property
    def reducer(self) -> "Reducer":
        """The strategy itself (a :class:`Variant` answers with the strategy it wraps)."""
        return self

    @property
    def exact(self) -> bool:
        return True

    @property
    def step_is_global(self) -> bool:
        return True

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
        """The strategy and its variants, for the log."""
        text = f"strategy {self.name} ({self.weighting} weighting{self._details()})"
        if self.compressor is not None:
            text += f"; inter-node {self.compressor.kind}"
        if self.emulate_link is not None:
            text += f"; {self.emulate_link.describe()}"
        return text

    def _details(self) -> str:
        return ""

    # -- the per-step interface ------------------------------------------------------------
    def begin(self, count: int, stop_requested) -> None:
        """A step starts: this rank will compute ``count`` samples; ``stop_requested()`` says
        whether it asks for a stop. Nothing to do for a blocking exchange."""

    def reduce(self, message, count: int, stop: bool) -> tuple[bool, float]:
        """Reduce this rank's message (its local mean gradient, unscaled) in place; returns
        ``(finite, stop sum)``: whether the reduced gradient is finite, and the sum of the
        ``stop`` requests of the ranks that reduced together."""
        message[STOP] = 1.0 if stop else 0.0
        message[NONFINITE] = 0.0
        self.reduce_gradients(message, count)
        grad = message[:COUNT]
        xp = get_array_module(message)
        if xp is np:
            return kernels.all_finite(grad), float(message[STOP])
        # On a device: one float64 sum instead of an elementwise test (NaN or Inf anywhere
        # makes it non-finite, no parameter-sized temporary) and one device read for both.
        checks = to_host(xp.stack([grad.sum(dtype=np.float64), message[STOP].astype(np.float64)]))
        return bool(np.isfinite(checks[0])), float(checks[1])

    def update(self, optimizer, finite: bool) -> None:
        """Apply the optimizer to the reduced gradient, unless it is not finite."""
        if finite:
            optimizer.step()

    def reduce_gradients(self, message, count: int) -> None:
        """Replace this rank's local mean gradient ``message[:-3]`` by the reduced one, in place.

        ``count`` = the samples this rank computed this step (0 allowed: the rank passes a
        zeroed gradient and still joins every collective). On return the ``count`` slot holds
        the group's summed weight count, and ``stop`` / ``nonfinite`` the group's sums of what
        the ranks wrote there.
        """
        raise NotImplementedError

    def add_samples(self, total: float) -> None:
        """The samples a per-step reduction summed (the node strategy counts them between
        syncs; the others need nothing)."""

    def after_step(self, params_data, state_buffers, flags, steps_done: int) -> tuple | None:
        """Called after every optimizer step with the number of steps done so far; returns
        the world-wide ``(stop, nonfinite)`` sums when it synchronised the replicas (the node
        strategy's every ``K'`` steps), else None. ``flags`` are this rank's pending ones."""
        return None

    def synchronize(self, params_data, state_buffers, flags) -> tuple:
        """Make all replicas identical now and return the world-wide ``(stop, nonfinite)``
        sums of ``flags`` (collective). The exact strategies' replicas already are: they
        only exchange the flags."""
        return self._world_flags(flags)

    def finish_pending(self, params_data, state_buffers) -> tuple | None:
        """Apply a parameter sync still in flight (collective); its flag sums, or None."""
        return None

    def consensus(self, params_data):
        """The parameters every replica agrees on (a copy; collective): the replicas' own for
        the exact strategies."""
        return params_data.copy()

    def set_reference(self, params_data, state_buffers=()) -> None:
        """The parameters (and state) every node starts from, after the broadcast or a
        restore: the compressed node syncs send the changes from them."""

    def writing_parameters(self):
        """A context around writing new values into the parameters on every rank (a restore):
        nothing for private replicas; the shared window's barriers."""
        return contextlib.nullcontext()

    def pending_samples(self) -> int:
        """Samples of this rank's node since the last parameter sync (node strategy), else 0."""
        return 0

    def restore(self, steps_since_sync: int, samples: int) -> None:
        """Restore :attr:`steps_since_sync` and :meth:`pending_samples` from a checkpoint."""

    def attach_shared(self, shared) -> None:
        """The node's :class:`~mpidl.distributed.shm.SharedNode` (or None): the node strategy's
        syncs then work in the window."""
        self.shared = shared

    def close(self) -> None:
        """Free what the reducer holds beyond its counters (duplicated communicators)."""

    def communicators(self) -> list:
        """Every communicator this exchange may be blocked in (the topology's node and
        leaders, and any it duplicated), so that a survivor of a lost rank can revoke them all
        (:func:`~mpidl.distributed.recovery.shrink`); ``MPI.COMM_NULL`` entries are allowed."""
        return [self.topology.node, self.topology.leaders]

    def sync_due(self, steps_done: int) -> bool:
        """Whether :meth:`after_step` with ``steps_done`` synchronises the replicas across nodes
        (the node strategy every ``K'`` steps); never for the exact strategies."""
        return False

    # -- helpers for the strategies --------------------------------------------------------
    def weight(self, count) -> int:
        """``c_i``: the samples of this rank (balanced) or 1 (uniform)."""
        if isinstance(count, bool) or not isinstance(count, Real) or count < 0 \
                or not float(count).is_integer():
            raise ValueError(f"count must be an integer >= 0 (samples this step), got {count!r}")
        return int(count) if self.weighting == "balanced" else 1

    def _weighted_sum(self, level: str, comm, message, count: int, reduce) -> float:
        """``message <- [sum_i c_i g_i / sum_i c_i | sum c | sum stop | sum nonfinite]`` over
        ``comm``, with ``reduce(level, comm, message)`` doing the SUM (in place on every rank
        that needs the result). Returns the summed count.

        A communicator of one rank is left alone: no scaling, no division, the same bits.
        """
        grad = message[:COUNT]
        if comm == MPI.COMM_NULL or comm.Get_size() == 1:
            message[COUNT] = self.weight(count)
            return float(message[COUNT])
        weight = self.weight(count)
        if weight != 1:
            grad *= weight
        message[COUNT] = weight
        reduce(level, comm, message)
        total = float(message[COUNT])
        if total > 0:
            grad /= total
        return total

    def _world_flags(self, flags) -> tuple:
        """World SUM of this rank's ``(stop, nonfinite)`` (one small counted collective)."""
        buf = np.asarray(flags, dtype=np.float64).copy()
        self.allreduce("control", self.topology.world, buf)
        return float(buf[0]), float(buf[1])

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

    def allreduce(self, level: str, comm, array) -> None:
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

    def inter_sum(self, message, key: str = "gradient") -> None:
        """The leaders' SUM of ``message`` in place (leaders only): one ``Allreduce``, or,
        with a compressor, the compressed ``Allgather`` and a local sum with error feedback
        under ``key`` (:mod:`~mpidl.distributed.compress`); EMULATED link time included."""
        comm = self.topology.leaders
        if comm == MPI.COMM_NULL or comm.Get_size() == 1:
            return
        nodes = comm.Get_size()
        if self.compressor is None:
            self.allreduce("inter", comm, message)
            seconds = self.emulate_link.allreduce_seconds(message.nbytes, nodes) if self.emulate_link else 0.0
        else:
            packed = self.compressor.packed(message, key)
            gathered = np.empty((nodes, packed.size), dtype=packed.dtype)
            self._collective("inter", comm, packed, lambda buf: comm.Allgather(buf, gathered))
            self.compressor.unpack_sum(gathered, message)
            seconds = self.emulate_link.allgather_seconds(packed.nbytes, nodes) if self.emulate_link else 0.0
        self._emulate_inter_node(seconds)

    def _emulate_inter_node(self, seconds: float) -> None:
        """EMULATION: sleep the modelled time of an inter-node collective (see LinkModel)."""
        if seconds > 0:
            time.sleep(seconds)
            self.comm_seconds += seconds
            self.emulated_seconds += seconds


class Variant:
    """An exchange around a strategy (overlapped buckets, the node-shared window): the same
    interface as :class:`Reducer`, each call passed to the strategy unless the variant
    overrides it. ``counters`` and the timers are the strategy's."""

    def __init__(self, reducer: Reducer):
        self.reducer = reducer

    name = property(lambda self: self.reducer.name)
    weighting = property(lambda self: self.reducer.weighting)
    topology = property(lambda self: self.reducer.topology)
    exact = property(lambda self: self.reducer.exact)
    step_is_global = property(lambda self: self.reducer.step_is_global)
    steps_since_sync = property(lambda self: self.reducer.steps_since_sync)
    sync_overlap = property(lambda self: self.reducer.sync_overlap)
    compressor = property(lambda self: self.reducer.compressor)
    counters = property(lambda self: self.reducer.counters)
    comm_seconds = property(lambda self: self.reducer.comm_seconds)
    emulated_seconds = property(lambda self: self.reducer.emulated_seconds)

    def reset_counters(self) -> None:
        self.reducer.reset_counters()

    def describe(self) -> str:
        return self.reducer.describe()

    def begin(self, count, stop_requested) -> None:
        self.reducer.begin(count, stop_requested)

    def reduce(self, message, count, stop) -> tuple[bool, float]:
        return self.reducer.reduce(message, count, stop)

    def update(self, optimizer, finite: bool) -> None:
        self.reducer.update(optimizer, finite)

    def after_step(self, params_data, state_buffers, flags, steps_done: int):
        return self.reducer.after_step(params_data, state_buffers, flags, steps_done)

    def synchronize(self, params_data, state_buffers, flags) -> tuple:
        return self.reducer.synchronize(params_data, state_buffers, flags)

    def finish_pending(self, params_data, state_buffers):
        return self.reducer.finish_pending(params_data, state_buffers)

    def consensus(self, params_data):
        return self.reducer.consensus(params_data)

    def set_reference(self, params_data, state_buffers=()) -> None:
        self.reducer.set_reference(params_data, state_buffers)

    def writing_parameters(self):
        return self.reducer.writing_parameters()

    def pending_samples(self) -> int:
        return self.reducer.pending_samples()

    def restore(self, steps_since_sync: int, samples: int) -> None:
        self.reducer.restore(steps_since_sync, samples)

    def allreduce(self, level: str, comm, array) -> None:
        self.reducer.allreduce(level, comm, array)

    def close(self) -> None:
        self.reducer.close()

    def communicators(self) -> list:
        return self.reducer.communicators()

    def sync_due(self, steps_done: int) -> bool:
        return self.reducer.sync_due(steps_done)
