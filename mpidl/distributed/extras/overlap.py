"""Gradient exchange overlapped with the backward pass (``overlap=True``), in buckets.

The flat buffer holds the parameters in registration order, and backward makes their
gradients final in the reverse of that order (:meth:`~mpidl.engine.nn.Module.watch_gradients`
reports each module's parameters right after its backward; a residual block runs its
shortcut's backward first so that this holds inside it too), so the parameters ``k .. n-1``
are one contiguous tail of the gradient, final before the ones below. The message is cut
into *buckets* BY PARAMETER, inside residual stages and transformer blocks alike, walking the
parameters from the last to the first (:func:`plan_buckets`): a small first bucket (the
exchange starts after the last few parameters, as DDP's small first bucket), buckets of
about ``bucket_bytes``, and a small last bucket (what is left to send once the backward has
ended). Bucket ``j`` covers ``message[lo_j:hi_j]`` and is complete once the gradients of
parameters ``first_j ..`` are final. The first bucket (the last parameters) also carries
the three slots ``count | stop | nonfinite``, whose values ``local_indices()`` wrote before
backward. The arrival order is checked per step, not assumed: a bucket starts only when
every parameter from its lowest up has been reported (a module reporting out of order only
delays buckets, it never sends a gradient early).

:class:`Overlapped` wraps ANY exchange built of stages (:class:`~mpidl.distributed.exchange.Stage`:
``flat`` one world allreduce, ``hierarchical`` node reduce -> leaders allreduce -> node
bcast, ``node`` one node allreduce) and runs the same stages bucket by bucket::

    a module's backward returned  ->  every bucket whose parameters first_j .. n-1 are all
    (watch_gradients)                 final: scale by c_i (the weight local_indices() wrote
                                      into message[COUNT]) and start its stage 0; Test the
                                      pending ones, start stage s+1 of a bucket whose stage s
                                      completed
    DataParallel.step -> reduce   ->  start the rest, wait for all, then the inner exchange's
                                      reduced(): divide by the summed count (node: count v_n)

Each stage runs on its own duplicate of the stage's communicator, through a channel made by
the inner exchange's ``channel()`` (so it is counted, and EMULATED, like the blocking one),
and every rank starts a stage's buckets in bucket order: MPI requires the non-blocking
collectives of one communicator to be started in the same order on every rank, and the
duplicates keep them apart from the blocking collectives and from the other stages. The
sums are the blocking ones bucket by bucket: the result equals the blocking exchange's up to
the order of additions inside MPI's algorithms (bitwise on 2 ranks).

The first bucket travels from a private copy. ``DataParallel.step`` writes ``c_i`` and the
stop flag into the message's slots again before it calls :meth:`Overlapped.reduce`, while
that bucket may be in flight: MPI forbids touching the buffer of a pending collective (and
a finished one would lose its summed count). The copy costs one bucket's bytes per step.

Which backward belongs to a step. A backward outside a step (the speed probe's, a loop's
own gradient analysis) must start nothing: the other ranks would never match it. The weight
slot tells: ``local_indices()`` writes this rank's weight ``c_i >= 0`` into it, and after
each :meth:`~Overlapped.reduce` (and at construction) this exchange writes ``-1`` there, a
weight no step can have. The hooks start buckets only when the slot holds a weight. A step
whose backward started nothing (no ``local_indices()``) is still exact: :meth:`~Overlapped.reduce`
starts every bucket itself.

Progress. MPICH and Open MPI progress a non-blocking collective only inside MPI calls of
the process (``MPI_Test``/``MPI_Wait``/any other call) unless an asynchronous progress
thread is enabled (MPICH ``MPIR_CVAR_ASYNC_PROGRESS=1``, which needs ``MPI_THREAD_MULTIPLE``;
Open MPI has none for its default ``tuned``/``libnbc`` collectives over TCP/shared memory,
some network transports progress in hardware). mpidl therefore calls ``Test`` on every
pending request each time a module with parameters has finished its backward (the same
report that starts the buckets), which moves the collectives' rounds forward between layers,
inside the blocks too, at a cost of microseconds.

EMULATION: a bucket's inter-node collective goes through the EMULATED link's ``start``,
which books its modelled time on the link's timeline; its request completes when both MPI
and that deadline are done, so the modelled time runs concurrently with the backward.

On a node with more ranks than cores the final wait is a sleeping ``Test`` poll instead of
``MPI_Wait`` (whose busy-wait would take the core from a rank still computing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpidl.distributed.exchange import Stage
from mpidl.distributed.extras import ExchangeWrapper, timed
from mpidl.distributed.extras.shm import POLL_S, self_oversubscribed
from mpidl.distributed.message import COUNT, NONFINITE, SLOTS, STOP, check_message

__all__ = ["Bucket", "plan_buckets", "bucket_bytes", "small_bucket_bytes", "MIN_BUCKETS", "Overlapped", "check_options"]


def check_options(intra: str, host_memory: bool, model=None) -> None:
    """ValueError unless ``overlap`` can run: private replicas (``intra='mpi'``: the shared
    window is reduced in place), host buffers for non-blocking MPI (the CPU backend), and a
    Model whose ``net`` is a Module (its layers' backward tells which gradients are final)."""
    if intra != "mpi":
        raise ValueError("overlap works with intra='mpi' (the shared window is reduced in place)")
    if not host_memory:
        raise ValueError("overlap needs the CPU backend (host buffers for non-blocking MPI)")
    net = getattr(model, "net", None) if model is not None else None
    if model is not None and not hasattr(net, "watch_gradients"):
        raise ValueError("overlap needs a Model whose net is a Module (its layers' backward tells which gradients are final)")


@dataclass(frozen=True)
class Bucket:
    """``message[lo:hi]``, complete when the gradients of parameters ``first ..`` (in
    registration order) are final."""

    lo: int
    hi: int
    first: int


def plan_buckets(sizes: list[int], bucket_bytes: float, itemsize: int, small_bytes: float | None = None) -> list[Bucket]:
    """Buckets in sending order (last parameters first) over a message of
    ``sum(sizes) + SLOTS`` elements; ``sizes``: the parts in registration order (the
    parameters; or any coarser grouping, e.g. top-level layers, with 0 for a part without
    parameters).

    Backward makes the gradients final from the last part to the first (see
    :meth:`~mpidl.engine.nn.Module.watch_gradients`), so the buckets are cut walking the parts
    from the last to the first: the FIRST bucket closes as soon as it holds at least
    ``small_bytes`` (default ``bucket_bytes``), so the first collective starts right after
    the last few parameters' backward; every other bucket once it holds ``bucket_bytes``.
    The LAST bucket (the first parts, final only when the backward ends, so nothing hides
    its exchange) is cut small as well: the shortest prefix of at least ``small_bytes``.
    The first bucket also covers the slots. Parts of size 0 join the bucket of the parts
    before them in the walk; a remainder smaller than ``small_bytes`` between the last cut
    and the last bucket joins the last bucket (both are final only near the backward's end).
    """
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + int(size))
    small = bucket_bytes if small_bytes is None else min(float(small_bytes), float(bucket_bytes))
    # the last bucket: parts 0 .. tail-1, the shortest prefix of at least `small` bytes
    tail = next((k + 1 for k in range(len(sizes)) if offsets[k + 1] * itemsize >= small), len(sizes))
    if tail >= len(sizes):
        return [Bucket(0, offsets[-1] + SLOTS, 0)]  # the whole message is a small one
    buckets: list[Bucket] = []
    hi = offsets[-1] + SLOTS
    for k in range(len(sizes) - 1, tail - 1, -1):
        lo = offsets[k]
        target = small if not buckets else bucket_bytes
        if hi > lo and (hi - lo) * itemsize >= target:
            buckets.append(Bucket(lo, hi, k))
            hi = lo
    if hi > offsets[tail] and (not buckets or (hi - offsets[tail]) * itemsize >= small):
        buckets.append(Bucket(offsets[tail], hi, tail))  # the parts left before the last bucket
        hi = offsets[tail]
    buckets.append(Bucket(0, hi, 0))  # the last bucket (with a remainder under `small`)
    return buckets


#: the fewest buckets a message is cut into where its parameters allow (see :func:`bucket_bytes`)
MIN_BUCKETS = 8


def bucket_bytes(elements: int, itemsize: int, bucket_mb: float) -> float:
    """The bucket size: ``min(bucket_mb MiB, message bytes / MIN_BUCKETS)``.

    ``bucket_mb`` is a cap, as DDP's ``bucket_cap_mb``. A message smaller than the cap would
    otherwise be ONE bucket, complete only when the backward of the first parameter is done,
    i.e. when there is nothing left to overlap it with; with at least ``MIN_BUCKETS`` the
    buckets of the last parameters travel while the first layers compute. Each bucket costs
    one collective's latency more, which is why the count stays small. The first and the
    last bucket are cut smaller still (:func:`small_bucket_bytes`).
    """
    return min(float(bucket_mb) * 2 ** 20, elements * itemsize / MIN_BUCKETS)


def small_bucket_bytes(bucket: float) -> float:
    """The first and the last bucket's size, ``bucket / MIN_BUCKETS``: the first starts the
    exchange right after the last layers' backward (as DDP's small first bucket), the last
    is what is left to send once the backward has ended (exposed whatever the progress)."""
    return bucket / MIN_BUCKETS


class _Pending:
    """One bucket's progress through the stages in one step."""

    __slots__ = ("bucket", "buf", "stage", "request")

    def __init__(self, bucket: Bucket, buf):
        self.bucket = bucket
        self.buf = buf           # what MPI reads and writes: the message's slice, or the copy
        self.stage = -1          # index of the stage started last (-1: not started)
        self.request = None      # the request of that stage, or None once it completed


class _Step:
    """What the hooks started in one step, until :meth:`Overlapped.reduce` completes it."""

    def __init__(self, message, weight: float, slots, pending: list[_Pending], ready_param: int):
        self.message, self.weight, self.slots = message, weight, slots
        self.pending, self.ready_param = pending, ready_param


#: the weight slot after an exchange, until ``local_indices()`` writes the next weight
SPENT = -1.0


def _armed(message) -> bool:
    """True when ``local_indices()`` wrote this rank's weight since the last exchange."""
    return message[COUNT] >= 0


def _disarm(message) -> None:
    message[COUNT] = SPENT


class Overlapped(ExchangeWrapper):
    """``overlap=True``: ``exchange``'s weighted SUM in buckets started from ``model``'s
    backward hooks, waited for in :meth:`reduce` (see the module docstring).

    ``exchange``: any exchange built of stages; ``model``: a Model (its ``params.message``
    is what travels, its ``net``'s modules report their gradients); ``bucket_mb``: the cap.
    One backward per step. Collective construction (it duplicates the stages'
    communicators); :meth:`close` frees them, removes the hooks and closes ``exchange``.
    """

    def __init__(self, exchange, model, bucket_mb: float):
        check_options("mpi", True, model)
        if not getattr(exchange, "stages", None):
            raise ValueError(f"overlap wraps an exchange built of stages (flat, hierarchical, node), "
                             f"not {type(exchange).__name__}")
        super().__init__(exchange)
        self.model, self.params = model, model.params
        sizes = [param.size for param in self.params]  # registration order = message order
        itemsize = self.params.data.itemsize
        bucket = bucket_bytes(sum(sizes), itemsize, bucket_mb)
        self.buckets = plan_buckets(sizes, bucket, itemsize, small_bucket_bytes(bucket))
        # One duplicate per stage, in stage order on every rank (Dup is collective over the
        # stage's communicator; a rank outside one, e.g. a non-leader, has COMM_NULL).
        self._comms = []
        self.stages = []
        for stage in exchange.stages:
            comm = stage.channel.comm
            dup = comm.Dup() if comm != MPI.COMM_NULL else MPI.COMM_NULL
            if dup != MPI.COMM_NULL:
                self._comms.append(dup)
            self.stages.append(Stage(exchange.channel(stage.channel.level, dup), stage.op))
        first = self.buckets[0]
        self._head = np.empty(first.hi - first.lo, dtype=self.params.message.dtype)
        #: final wait: None = MPI_Wait; seconds = a sleeping Test poll (oversubscribed node)
        self.poll_s = POLL_S if self_oversubscribed(exchange.topology.node) else None
        self._step: _Step | None = None
        _disarm(self.params.message)
        # Which parameters (their indices in the message) each module's backward makes final.
        index = {id(param): k for k, param in enumerate(self.params)}
        self._owned = {}
        for module in model.net.watch_gradients(self._gradients_final):
            self._owned[id(module)] = [index[id(param)] for param in module.parameters() if id(param) in index]
        self._final = np.zeros(len(sizes), dtype=bool)  # per parameter: final in this backward

    def describe(self) -> str:
        return self.inner.describe() + f"; overlap in {len(self.buckets)} buckets"

    def started_buckets(self) -> int:
        """Buckets whose exchange has started in this step (for tests and diagnostics)."""
        return 0 if self._step is None else sum(1 for p in self._step.pending if p.stage >= 0)

    # ------------------------------------------------------------------ the hook
    def _gradients_final(self, module) -> None:
        """Called by :meth:`~mpidl.engine.nn.Module.watch_gradients` right after ``module``'s
        backward: its parameters' gradients are final. Start every bucket whose parameters
        are all final (in bucket order), Test the pending ones, start the next stages."""
        if self._step is None:
            message = self.params.message
            if self.group_size <= 1 or not _armed(message):
                return  # nothing to exchange, or a backward outside a step
            self._begin(message)
        with timed(self.traffic):
            step = self._step
            self._final[self._owned[id(module)]] = True
            ready = step.ready_param  # lowest k with parameters k .. n-1 final
            while ready > 0 and self._final[ready - 1]:
                ready -= 1
            step.ready_param = ready
            self._progress()

    # ------------------------------------------------------------------ the step
    def reduce(self, message) -> bool:
        """Start the buckets the hooks did not, wait for all, then the inner exchange's
        ``reduced`` (the division by the summed count); returns whether the gradient is
        finite. ValueError, after completing the collectives every rank started, when
        ``message[COUNT]`` (the weight ``step()`` computed) is not the weight the hooks sent."""
        check_message(message)
        if self.group_size <= 1:
            return self.inner.reduce(message)  # a group of one: nothing to exchange
        if message.size != self.buckets[0].hi:
            raise ValueError(f"overlap planned its buckets for a message of {self.buckets[0].hi} "
                             f"elements, got {message.size}")
        weight = float(message[COUNT])
        with timed(self.traffic):
            if self._step is None:
                self._begin(message)
            step = self._step
            step.ready_param = 0  # whatever the hooks saw, every gradient is final now
            while not self._progress():
                self._wait_one()
            self._end()
        if step.weight != weight or step.message is not message:
            _disarm(message)
            raise ValueError(f"step(): the backward hooks already sent this rank's gradient weighted by "
                             f"{step.weight:g} (written by local_indices()), but step() weighs it by "
                             f"{weight:g}: pass step() the size of the slice local_indices() returned")
        finite = self.inner.reduced(message)
        _disarm(message)  # the hooks wait for the next local_indices()
        return finite

    def close(self) -> None:
        """Remove the hooks, free the duplicates, close the inner exchange."""
        self.model.net.unwatch_gradients()
        for comm in self._comms:
            comm.Free()
        self._comms = []
        self.inner.close()

    # ------------------------------------------------------------------ internals
    def _begin(self, message) -> None:
        """A step starts: the weight and the slots as they are now (``local_indices()``'s)."""
        weight = float(message[COUNT])
        slots = np.array([weight, message[STOP], message[NONFINITE]], dtype=message.dtype)
        pending = [_Pending(b, self._head if k == 0 else message[b.lo:b.hi]) for k, b in enumerate(self.buckets)]
        self._final[:] = False
        self._step = _Step(message, weight, slots, pending, ready_param=len(self._final))

    def _start(self, p: _Pending, stage: int) -> None:
        """Start ``stage`` of bucket ``p`` (stage 0: scale its gradients by the weight first;
        a stage over a communicator of one rank is done at once: its request is None)."""
        step = self._step
        if stage == 0:
            grads = step.message.size - SLOTS
            if step.weight != 1:
                step.message[p.bucket.lo:min(p.bucket.hi, grads)] *= step.weight
            if p.buf is self._head:
                self._head[:grads - p.bucket.lo] = step.message[p.bucket.lo:grads]
                self._head[grads - p.bucket.lo:] = step.slots
        p.stage = stage
        channel, op = self.stages[stage]
        p.request = channel.start(op, p.buf)

    def _progress(self) -> bool:
        """Start what may start and Test until the first request still running, in bucket
        order per stage; True when every bucket has finished its last stage.

        One ``Test`` that finds a request still running has driven MPI's progress engine for
        every pending request of the process (MPICH and Open MPI poll all of them in any MPI
        call); Testing the later ones too would cost a call each (taken from the backward
        on a one-core host) to learn what the next pass learns. So a
        pass Tests up to the first request still running and treats the later ones as
        running (buckets of one communicator complete in the order they started anyway)."""
        step = self._step
        last = len(self.stages) - 1
        all_done = True
        running = False  # a Test of this pass found a request still running

        def done(p: _Pending) -> bool:
            nonlocal running
            if p.request is None:
                return True
            if running or not p.request.Test():
                running = True
                return False
            p.request = None
            return True

        limit = last  # a bucket may start stage s once the bucket before it has started s
        for p in step.pending:
            if p.stage < 0:
                if p.bucket.first < step.ready_param:
                    return False  # neither it nor the later buckets (earlier parameters) are ready
                self._start(p, 0)
            while p.stage < min(last, limit) and done(p):
                self._start(p, p.stage + 1)
            if not (p.stage == last and done(p)):
                all_done = False
            limit = p.stage
        return all_done

    def _wait_one(self) -> None:
        """Block until the oldest pending request has completed (MPI, and an EMULATED link's
        deadline). The first unfinished bucket always has one: its stage is running, or the
        progress just started its next one."""
        for p in self._step.pending:
            if p.request is not None:
                request = p.request
                if self.poll_s is not None:  # oversubscribed node: give the core to the ranks computing
                    mpi = getattr(request, "request", request)  # an EMULATED link's request wraps MPI's
                    while mpi is not None and not mpi.Test():
                        time.sleep(self.poll_s)
                request.Wait()  # (then only an EMULATED deadline is left to sleep, and booked)
                p.request = None
                return

    def _end(self) -> None:
        """Every bucket is summed: the first one's copy goes back into the message, and the
        message holds the sums."""
        step, self._step = self._step, None
        step.message[self.buckets[0].lo:] = self._head
