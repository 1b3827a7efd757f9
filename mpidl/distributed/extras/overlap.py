"""Gradient exchange overlapped with the backward pass (``overlap=True``), in buckets.

The flat buffer holds the parameters in registration order, so the parameters of the
top-level layers ``k .. L-1`` of a :class:`~mpidl.engine.nn.Sequential` are one contiguous tail
of the gradient. Backward computes them first. The message is cut into *buckets* of about
``bucket_bytes``, walking the layers from the last to the first (:func:`plan_buckets`);
bucket ``j`` covers ``message[lo_j:hi_j]`` and is complete once layer ``first_j`` (its
lowest) has finished its backward. The first bucket (the last layers) also carries the three
slots ``count | stop | nonfinite``, whose values are known before backward starts.

Per step (:class:`OverlappedExchange`)::

    Sequential.backward_hook(k)   ->  every bucket with first_j >= k: scale by c_i, start
                                      its non-blocking SUM; Test the pending ones (progress)
    DataParallel.step             ->  start the rest, wait for all, divide by the summed count

``flat``: one ``Iallreduce`` per bucket on a duplicate of the world communicator.
``hierarchical``: per bucket ``Ireduce`` (node) -> ``Iallreduce`` (leaders) -> ``Ibcast``
(node), each stage on its own duplicate communicator and started in bucket order on every
rank (non-blocking collectives on one communicator must be started in the same order by all
its ranks); a stage starts when the bucket's previous stage has completed, found by the
``Test`` calls of the hooks and of the final wait.

The sums are the blocking ones bucket by bucket (the result equals ``overlap=False`` up to
the order of additions inside MPI's algorithms).

Progress. MPICH and Open MPI progress a non-blocking collective only inside MPI calls of
the process (``MPI_Test``/``MPI_Wait``/any other call) unless an asynchronous progress
thread is enabled (MPICH ``MPIR_CVAR_ASYNC_PROGRESS=1``, which needs ``MPI_THREAD_MULTIPLE``;
Open MPI has none for its default ``tuned``/``libnbc`` collectives over TCP/shared memory,
some network transports progress in hardware). mpidl therefore calls ``MPI.Request.Test``
on every pending request from the backward hooks: the top-level Sequential's (once per
top-level layer: it also starts the buckets that became ready) and every nested
Sequential's (:meth:`OverlappedExchange.poll`, between the layers inside a block), which
moves the collectives' rounds forward between layers at a cost of microseconds.

EMULATION: the inter-node time of every bucket is booked on a
:class:`~mpidl.distributed.emulation.LinkTimeline` when its inter-node collective starts
(flat: the world ring ``2 (P-1) (alpha + n / (P beta))``; hierarchical: the leaders' ring
over ``L`` nodes), so it runs concurrently with the rest of the backward; a bucket counts as
complete when both MPI and its deadline are done.

On a node with more ranks than cores the final wait is a sleeping ``Test`` poll instead of
``MPI_Wait`` (whose busy-wait would take the core from a rank still computing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from mpidl import kernels
from mpidl.distributed.emulation import LinkTimeline
from mpidl.distributed.message import COUNT, NONFINITE, SLOTS, STOP
Variant = object  # TODO(redesign): rewrite as an exchange wrapper
from mpidl.distributed.extras.shm import POLL_S, self_oversubscribed

__all__ = ["Bucket", "plan_buckets", "bucket_bytes", "MIN_BUCKETS", "OverlappedExchange", "Overlapped",
           "OVERLAP_STRATEGIES"]

OVERLAP_STRATEGIES = ("flat", "hierarchical")


def check_options(intra: str, host_memory: bool, model=None) -> None:
    """ValueError unless ``overlap`` can run: private replicas (``intra='mpi'``: the shared
    window is reduced in place), host buffers for non-blocking MPI (the CPU backend), and a
    Model whose ``net`` is a Sequential (its backward hook starts the buckets)."""
    if intra != "mpi":
        raise ValueError("overlap works with intra='mpi' (the shared window is reduced in place)")
    if not host_memory:
        raise ValueError("overlap needs the CPU backend (host buffers for non-blocking MPI)")
    net = getattr(model, "net", None) if model is not None else None
    if model is not None and (net is None or not hasattr(net, "backward_hook")):
        raise ValueError("overlap needs a Model whose net is a Sequential (its backward hook starts the buckets)")


@dataclass(frozen=True)
class Bucket:
    """``message[lo:hi]``, complete when layer ``first`` has finished its backward."""

    lo: int
    hi: int
    first: int


def plan_buckets(layer_sizes: list[int], bucket_bytes: float, itemsize: int) -> list[Bucket]:
    """Buckets in sending order (last layers first) over a message of
    ``sum(layer_sizes) + SLOTS`` elements.

    Walking the layers from the last to the first, a bucket closes as soon as it holds at
    least ``bucket_bytes`` of gradients; whatever is left when layer 0 is reached is the last
    bucket. The first bucket also covers the slots. Layers without parameters join the
    bucket of the layers before them in the walk.
    """
    offsets = [0]
    for size in layer_sizes:
        offsets.append(offsets[-1] + int(size))
    buckets: list[Bucket] = []
    hi = offsets[-1] + SLOTS
    for k in range(len(layer_sizes) - 1, -1, -1):
        lo = offsets[k]
        if hi > lo and (k == 0 or (hi - lo) * itemsize >= bucket_bytes):
            buckets.append(Bucket(lo, hi, k))
            hi = lo
    return buckets


#: the fewest buckets a message is cut into where its layers allow (see :func:`bucket_bytes`)
MIN_BUCKETS = 8


def bucket_bytes(elements: int, itemsize: int, bucket_mb: float) -> float:
    """The bucket size: ``min(bucket_mb MiB, message bytes / MIN_BUCKETS)``.

    ``bucket_mb`` is a cap, as DDP's ``bucket_cap_mb``. A message smaller than the cap would
    otherwise be ONE bucket, complete only when the backward of layer 0 is done, i.e. when
    there is nothing left to overlap it with; with at least ``MIN_BUCKETS`` the buckets of
    the last layers travel while the first layers compute, and only the last bucket (about
    ``1 / MIN_BUCKETS`` of the message) is exposed. Each bucket costs one collective's
    latency more, which is why the count stays small.
    """
    return min(float(bucket_mb) * 2 ** 20, elements * itemsize / MIN_BUCKETS)


class _Pending:
    """One bucket's progress through its stages."""

    __slots__ = ("bucket", "stage", "request", "deadline")

    def __init__(self, bucket):
        self.bucket = bucket
        self.stage = -1          # index of the stage started last (-1: not started)
        self.request = None      # the MPI request of that stage, or None when it is done
        self.deadline = 0.0      # EMULATED end of the bucket's inter-node transfer


class OverlappedExchange:
    """The bucketed, non-blocking weighted SUM of one rank's message (see the module doc).

    ``reducer`` : the flat or hierarchical reducer (its counters, weighting, link model);
    ``message`` : the rank's flat message; ``buckets`` : from :func:`plan_buckets`.
    Collective construction (it duplicates communicators); :meth:`close` frees them.
    """

    def __init__(self, reducer, message, buckets: list[Bucket]):
        self.reducer = reducer
        self.message = message
        self.buckets = list(buckets)
        topo = reducer.topology
        self.topology = topo
        self.hierarchical = reducer.name == "hierarchical"
        self.timeline = LinkTimeline()
        self._comms = []
        if self.hierarchical:
            node_reduce, node_bcast = topo.node.Dup(), topo.node.Dup()
            leaders = topo.leaders.Dup() if topo.is_leader else MPI.COMM_NULL
            self._comms = [node_reduce, node_bcast, leaders]
            #: (level, comm) of the stages; a comm of one rank (or COMM_NULL) is skipped
            self.stages = [("intra", node_reduce), ("inter", leaders), ("intra", node_bcast)]
        else:
            world = topo.world.Dup()
            self._comms = [world]
            self.stages = [("world", world)]
        self._pending: list[_Pending] | None = None
        #: final wait: None = MPI_Wait; seconds = a sleeping Test poll (oversubscribed node)
        self.poll_s = POLL_S if self_oversubscribed(topo.node) else None
        self.weight = 1
        self.count = None

    # ------------------------------------------------------------------ per step
    @property
    def active(self) -> bool:
        """True between :meth:`begin` and :meth:`finish`."""
        return self._pending is not None

    def begin(self, count, stop: float) -> None:
        """A new step: this rank computed ``count`` samples; ``stop`` its stop request."""
        self.count = count
        self.weight = self.reducer.weight(count)
        self.message[COUNT] = self.weight
        self.message[STOP] = stop
        self.message[NONFINITE] = 0.0
        self._pending = [_Pending(b) for b in self.buckets]
        self._ready_layer = len(self.buckets) and self.buckets[0].first + 1  # none ready yet

    def ready(self, layer: int) -> None:
        """Layers ``layer .. L-1`` have their final gradients (the backward hook)."""
        start = time.perf_counter()
        self._ready_layer = layer
        self._progress(ready_layer=layer)
        self.reducer.comm_seconds += time.perf_counter() - start

    def poll(self, _layer: int = 0) -> None:
        """Test the pending requests and start the stages that may start (no bucket becomes
        ready): installed as the backward hook of the nested Sequentials, so that progress
        is made between the layers inside a block too."""
        if self._pending is not None:
            start = time.perf_counter()
            self._progress(ready_layer=self._ready_layer)
            self.reducer.comm_seconds += time.perf_counter() - start

    def finish(self) -> float:
        """Start what is left, wait for every bucket, divide by the summed count; returns it."""
        start = time.perf_counter()
        while not self._progress(ready_layer=0):
            # Nothing left to compute: wait in MPI for the oldest unfinished request (or the
            # EMULATED link), then go round again to start the next stages.
            self._wait_one()
        self._pending = None
        total = float(self.message[COUNT])
        if total > 0:
            self.message[:COUNT] /= total
        self.reducer.comm_seconds += time.perf_counter() - start
        return total

    # ------------------------------------------------------------------ internals
    def _live(self, stage: int) -> bool:
        comm = self.stages[stage][1]
        return comm != MPI.COMM_NULL and comm.Get_size() > 1

    def _start(self, p: _Pending, stage: int) -> None:
        """Start ``stage`` of bucket ``p`` (or mark it done at once when it moves nothing)."""
        if stage == 0 and self.weight != 1:
            self.message[p.bucket.lo:min(p.bucket.hi, self.message.size + COUNT)] *= self.weight
        p.stage = stage
        p.request = None
        if not self._live(stage):
            return
        level, comm = self.stages[stage]
        buf = self.message[p.bucket.lo:p.bucket.hi]
        if not self.hierarchical:
            p.request = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            link = self.reducer.emulate_link
            if link is not None and self.topology.num_nodes > 1:
                p.deadline = self.timeline.start(link.allreduce_seconds(buf.nbytes, self.topology.size))
        elif stage == 0:
            root = comm.Get_rank() == 0
            p.request = (comm.Ireduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0) if root
                         else comm.Ireduce(buf, None, op=MPI.SUM, root=0))
        elif stage == 1:
            p.request = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            link = self.reducer.emulate_link
            if link is not None:
                p.deadline = self.timeline.start(link.allreduce_seconds(buf.nbytes, self.topology.num_nodes))
        else:
            p.request = comm.Ibcast(buf, root=0)
        self.reducer.counters[level]["calls"] += 1
        self.reducer.counters[level]["bytes"] += buf.nbytes

    def _stage_done(self, p: _Pending) -> bool:
        if p.request is not None:
            if not p.request.Test():
                return False
            p.request = None
        return p.deadline <= 0 or self.timeline.done(p.deadline)

    def _progress(self, ready_layer: int) -> bool:
        """Test every started stage and start the next ones, in bucket order per stage;
        True when every bucket has finished its last stage."""
        last = len(self.stages) - 1
        all_done = True
        limit = last  # a bucket may start stage s once the bucket before it has started s
        for p in self._pending:
            if p.stage < 0:
                if p.bucket.first < ready_layer:
                    return False  # neither it nor the later buckets (earlier layers) are ready
                self._start(p, 0)
            while p.stage < min(last, limit) and self._stage_done(p):
                self._start(p, p.stage + 1)
            if not (p.stage == last and self._stage_done(p)):
                all_done = False
            limit = p.stage
        return all_done

    def _wait_one(self) -> None:
        """Block until the oldest unfinished stage has completed (MPI, then the link)."""
        for p in self._pending:
            if p.request is not None:
                if self.poll_s is None:
                    p.request.Wait()
                else:  # oversubscribed node: give the core to the ranks still computing
                    while not p.request.Test():
                        time.sleep(self.poll_s)
                p.request = None
                return
            if p.deadline > 0 and not self.timeline.done(p.deadline):
                slept = self.timeline.wait(p.deadline)
                self.reducer.emulated_seconds += slept
                return

    def communicators(self) -> list:
        """The communicators it duplicated (to revoke after a lost rank)."""
        return list(self._comms)

    def close(self) -> None:
        for comm in self._comms:
            if comm != MPI.COMM_NULL:
                comm.Free()
        self._comms = []


class Overlapped(Variant):
    """``overlap=True``: the strategy's weighted SUM in buckets started from the model's
    backward hooks (:class:`OverlappedExchange`), waited for in :meth:`reduce`.

    The hook takes this rank's sample count from :meth:`begin` (``local_indices``), so a step
    is ``begin``, then ONE backward, then :meth:`reduce`. Collective construction."""

    def __init__(self, reducer, model, bucket_mb: float):
        self.check_model(model)
        super().__init__(reducer)
        params = model.params
        layers = [sum(p.size for _, p in layer.named_parameters()) for layer in model.net.layers]
        self.buckets = plan_buckets(layers, bucket_bytes(sum(layers), params.data.itemsize, bucket_mb),
                                    params.data.itemsize)
        self.engine = OverlappedExchange(reducer, params.message, self.buckets)
        self.model = model
        self._step = None  # (count, stop_requested) from begin, until reduce
        model.net.backward_hook = self._backward_hook
        for module in model.net.modules():
            if module is not model.net and hasattr(module, "backward_hook"):
                module.backward_hook = self.engine.poll  # progress inside the blocks

    @staticmethod
    def check_model(model) -> None:
        """The buckets follow the layers of a Sequential, whose backward hook starts them."""
        net = getattr(model, "net", None)
        if net is None or not hasattr(net, "backward_hook"):
            raise ValueError("overlap needs a Model whose net is a Sequential (its backward hook "
                             "starts the buckets)")

    def describe(self) -> str:
        return self.reducer.describe() + f"; overlap in {len(self.buckets)} buckets"

    def communicators(self) -> list:
        return self.reducer.communicators() + self.engine.communicators()

    def begin(self, count, stop_requested) -> None:
        self._step = (count, stop_requested)

    def _backward_hook(self, layer: int) -> None:
        """Installed as ``model.net.backward_hook``: start the buckets whose layers are done."""
        if not self.engine.active:
            if self._step is None:
                return  # a backward outside a step (begin not called): nothing starts
            count, stop_requested = self._step
            self.engine.begin(count, 1.0 if stop_requested() else 0.0)
        self.engine.ready(layer)

    def started_buckets(self) -> int:
        """Buckets whose exchange has started in this step (for tests and diagnostics)."""
        return 0 if self.engine._pending is None else sum(1 for p in self.engine._pending if p.stage >= 0)

    def reduce(self, message, count, stop) -> tuple[bool, float]:
        """Wait for the buckets the hooks started (start the others first)."""
        self._step = None
        engine = self.engine
        if not engine.active:
            engine.begin(count, 1.0 if stop else 0.0)
        elif engine.count != count:
            engine.finish()  # complete the collectives every rank has started
            raise ValueError(f"step({count}): the backward hook already sent this rank's gradient "
                             f"weighted by {engine.count} samples (the size of local_indices())")
        if engine.finish() == 0:
            raise ValueError("no rank computed a sample this step (every count was 0)")
        return kernels.all_finite(message[:COUNT]), float(message[STOP])

    def close(self) -> None:
        for module in self.model.net.modules():
            if hasattr(module, "backward_hook"):
                module.backward_hook = None
        self.engine.close()
        self.reducer.close()
