"""Node-shared buffers (``intra='shm'``): one copy of the model per node, in an MPI-3 window.

Layout. On every node one shared-memory window is allocated on the node communicator
(``MPI.Win.Allocate_shared``, all of it by the node's local rank 0, the others asking for 0
bytes, so it is one contiguous segment that every rank maps with ``Win.Shared_query(0)``)::

    window = [ slot_0 | slot_1 | ... | slot_{R-1} | theta | s_1 | ... | s_S | flags (R) ]
              slot_r = [ c_r g_r (P) | c_r | stop_r | nonfinite_r ]    (rank r's message)

``slot_r`` becomes rank r's ``FlatParameters.message`` (its backward writes its gradient
there), ``theta`` the ``FlatParameters.data`` of EVERY rank of the node (the forward pass of
each rank reads it), ``s_k`` the optimizer's state buffers, and ``flags`` one scalar per rank
for its finiteness check. The node thus holds parameters and optimizer state once instead of
``R`` times, plus the ``R`` gradient slots; each rank keeps only a private optimizer scratch
of its slice.

One step, on every rank ``r`` of the node (``[lo_r, hi_r)`` = rank r's ``1/R`` slice of the
``P`` parameters, ``lo_r = r P // R``)::

    slot_r <- [c_r g_r | c_r | stop_r | nonfinite_r]        (the rank's own slot; one node:
                                                             nonfinite_r = its g_r is not finite)
    ---- barrier 1
    slot_0[lo_r:hi_r] <- sum_k slot_k[lo_r:hi_r]            (k in rank order; its slice only)
    one node (and the node strategy's every step): [count, stop, nonfinite] = sum_k slot_k[P:],
      read by every rank; on to the division.
    several nodes, exact strategies:
      flags[r] <- 1 if its slice of the sum is not finite else 0
      rank 0: slot_0[P:] <- sum_k slot_k[P:]
      ---- barrier 2
      the leader adds sum(flags) to slot_0's nonfinite slot and runs Allreduce(SUM) of slot_0
      among the leaders, in place in the window (the compressed exchange with
      compress='bf16'|'fp16')
      ---- barrier 3
    g[lo_r:hi_r] = slot_0[lo_r:hi_r] / count                (its slice only)
    if the sum is finite everywhere: the optimizer over slice [lo_r, hi_r) of theta, s_k, g
    ---- barrier 4; every rank reads the updated theta in its next forward

One node thus needs two barriers per step, several nodes four, and
``g = sum_i c_i g_i / sum_i c_i``, exactly the weighted sum of the reducers
(:mod:`~mpidl.distributed.reducer_base`), with the additions in another order (rank order,
per node then over nodes), which changes the result only by rounding. A rank never writes
what another rank reads between two barriers: in each phase rank r writes only its own slot,
its own slice, its own flag (and rank 0 the node's three slots), which is why no lock is
needed.

Memory model. MPI-3 shared windows under the *unified* memory model (what MPICH and Open
MPI give on one node) make a store visible to the other processes once the writer has
issued a memory barrier and the reader has synchronized with it. The window is opened once
for passive-target access by every rank (``Win.Lock_all(MODE_NOCHECK)``: no lock is ever
taken, the epoch only permits the load/store accesses), and every barrier above is
``Win.Sync(); Barrier(node); Win.Sync()``: the first ``Win.Sync`` is the writer's memory
barrier (its stores reach the window), the ``Barrier`` orders the processes, the second
``Win.Sync`` is the reader's (no load is served from before the barrier). On a node with
more ranks than cores the ``Barrier`` is an ``Ibarrier`` completed by a sleeping ``Test``
poll, the same ordering without the busy-wait. This is the
pattern the MPI standard gives for load/store communication in a shared window (MPI-4.0
section 12.7, example 12.21).

Strategies. ``flat`` and ``hierarchical`` on one node are barrier 1, 2, 4; on several nodes
both become "sum in the window, leaders' allreduce of the node sums reading the window"
(``flat`` cannot hand the world allreduce the window: each rank's buffer would be the
node's), the emulated link charges the leaders' ring. ``node`` reduces inside the node every
step; every ``K'`` steps the leader averages ``theta`` and the state among the leaders
straight from the window and writes the result there, and one barrier later every rank reads
it (no broadcast: there is one copy).

Counters: the window moves no message, so the node level counts nothing; the leaders'
exchange counts as ``inter`` as in the reducers.

The optimizer must be elementwise (:attr:`mpidl.engine.optim.Optimizer.elementwise`, SGD and the
Adams): a rank updates its slice of the parameters and of the state alone. CPU backends only
(the window is host memory).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time

import numpy as np
from mpi4py import MPI

from mpidl import kernels
from mpidl.distributed.message import COUNT, NONFINITE, SLOTS, STOP
Variant = object  # TODO(redesign): rewrite as an exchange wrapper

__all__ = ["SharedNode", "SharedExchange", "check_shared_supported"]


def check_elementwise(optimizer) -> None:
    """ValueError unless ``optimizer`` (an optimizer or its class) is elementwise: the one
    rule, checked before any MPI work by :func:`mpidl.distributed.exchange.check_options`."""
    if not getattr(optimizer, "elementwise", False):
        name = optimizer.__name__ if isinstance(optimizer, type) else type(optimizer).__name__
        raise ValueError(f"intra='shm' needs an elementwise optimizer (sgd, adam, adamw): each rank "
                         f"updates its slice of the shared parameters alone; "
                         f"{name} is not elementwise, use intra='mpi'")


def check_options(host_memory: bool, optimizer=None) -> None:
    """ValueError unless the window can hold this model: host memory (the CPU backend) and an
    elementwise optimizer (each rank updates its slice alone)."""
    if not host_memory:
        raise ValueError("intra='shm' shares host memory: it needs the CPU backend")
    if optimizer is not None:
        check_elementwise(optimizer)


def check_shared_supported(params, optimizer) -> None:
    """ValueError (the same on every rank) when ``intra='shm'`` cannot hold this model."""
    check_elementwise(optimizer)
    if not isinstance(params.data, np.ndarray):
        raise ValueError("intra='shm' shares host memory: it needs the CPU backend "
                         f"(the parameters are a {type(params.data).__module__} array); use intra='mpi'")


class _Slice:
    """``[lo, hi)`` of the node's parameters and reduced gradient (views), what a rank's
    slice optimizer updates."""

    def __init__(self, data, grad):
        self.data, self.grad, self.size = data, grad, data.size


def move_state(optimizer, buffers: list, copy: bool = True) -> None:
    """Point the optimizer's state buffers (:meth:`~mpidl.engine.optim.Optimizer.named_state`
    order) at ``buffers`` (e.g. the window), copying the values in first with ``copy``."""
    named = optimizer.named_state()
    if len(buffers) != len(named):
        raise ValueError(f"{optimizer.name} has {len(named)} state buffers, got {len(buffers)}")
    for (key, old), new in zip(named, buffers):
        if getattr(optimizer, key, None) is not old:
            raise ValueError(f"{type(optimizer).__name__}: state {key!r} is not the attribute of that name")
        if copy and new.shape != old.shape:
            raise ValueError(f"state {key!r}: got {new.shape}, expected {old.shape}")
    for (key, old), new in zip(named, buffers):
        if copy:
            new[...] = old
        setattr(optimizer, key, new)


def slice_optimizer(optimizer, lo: int, hi: int, gradient):
    """A copy of an elementwise ``optimizer`` that updates ``[lo, hi)`` of its parameters and
    state (views) from ``gradient[lo:hi]``, with its own scratch. Before each
    ``step()`` set its ``lr`` and ``step_count`` to the whole optimizer's."""
    check_elementwise(optimizer)
    if not 0 <= lo <= hi <= optimizer.params.data.size:
        raise ValueError(f"slice [{lo}, {hi}) is not inside [0, {optimizer.params.data.size}]")
    part = copy.copy(optimizer)
    part.params = _Slice(optimizer.params.data[lo:hi], gradient[lo:hi])
    move_state(part, [s[lo:hi] for s in optimizer.state_buffers()], copy=False)
    return part


#: sleep between the tests of a sleeping barrier (see SharedNode.barrier)
POLL_S = 50e-6


def self_oversubscribed(node) -> bool:
    """True when the node's ranks outnumber the cores this process may run on."""
    return node.Get_size() > len(os.sched_getaffinity(0))


class SharedNode:
    """The node's shared window and the step on it (see the module docstring).

    Collective over ``topology.node`` (construction, :meth:`reduce`, :meth:`update`,
    :meth:`close`). On construction ``params`` and the optimizer's state are rebound onto
    the window, with the values of the node's rank 0 (every replica holds the same values at
    that point); :meth:`close` copies them back to private memory and frees the window.
    """

    def __init__(self, params, optimizer, topology, poll_s: float | None = None):
        check_shared_supported(params, optimizer)
        #: barrier wait: None = MPI_Barrier; seconds = a sleeping Ibarrier/Test poll
        #: (default: the poll when the node has more ranks than cores)
        if poll_s is None and self_oversubscribed(topology.node):
            poll_s = POLL_S
        self.poll_s = poll_s
        # The node communicator may be an emulated grouping (ranks_per_node): it must still
        # share memory. Every rank of the world agrees before any window is allocated.
        physical = topology.node.Split_type(MPI.COMM_TYPE_SHARED)
        shares = physical.Get_size() == topology.node.Get_size()
        physical.Free()
        if not topology.world.allreduce(shares, op=MPI.LAND):
            raise ValueError("intra='shm': some node's ranks do not share memory (an emulated "
                             "--ranks-per-node grouping spans hosts); use intra='mpi'")
        self.topology = topology
        self.node = topology.node
        self.ranks = self.node.Get_size()
        self.local_rank = self.node.Get_rank()
        size = params.size
        width = size + SLOTS
        states = optimizer.state_buffers()
        dtype = np.dtype(params.dtype)
        total = self.ranks * width + size * (1 + len(states)) + self.ranks
        self.win = MPI.Win.Allocate_shared(total * dtype.itemsize if self.local_rank == 0 else 0,
                                           dtype.itemsize, comm=self.node)
        memory, _ = self.win.Shared_query(0)
        window = np.ndarray(buffer=memory, dtype=dtype, shape=(total,))
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.window = window
        self.slots = window[: self.ranks * width].reshape(self.ranks, width)
        offset = self.ranks * width
        self.theta = window[offset: offset + size]
        offset += size
        self.state = [window[offset + k * size: offset + (k + 1) * size] for k in range(len(states))]
        offset += size * len(states)
        self.flags = window[offset: offset + self.ranks]
        self.lo = self.local_rank * size // self.ranks
        self.hi = (self.local_rank + 1) * size // self.ranks
        self.size = size
        self.params = params
        self.optimizer = optimizer
        #: bytes of the window (allocated once per node)
        self.nbytes = total * dtype.itemsize
        # Rank 0 copies the (identical) parameters and state in; every rank's own slot gets
        # its current message.
        first = self.local_rank == 0
        params.rebind(self.theta if first else np.empty_like(self.theta), self.slots[self.local_rank])
        move_state(optimizer, self.state if first else [np.empty_like(s) for s in self.state])
        self.barrier()
        if not first:
            params.rebind(self.theta, self.slots[self.local_rank], copy=False)
            params.message[...] = 0
            move_state(optimizer, self.state, copy=False)
        #: the optimizer over this rank's slice: views of theta, the state and the reduced
        #: gradient, its own scratch (an elementwise update of a slice is that slice of the
        #: whole update)
        self.slice_optimizer = slice_optimizer(optimizer, self.lo, self.hi, self.gradient)

    # ------------------------------------------------------------------ synchronization
    def barrier(self) -> None:
        """``Win.Sync(); Barrier(node); Win.Sync()``: every store before it on any rank of the
        node is visible to every load after it (see the module docstring)."""
        self.win.Sync()
        if self.poll_s is None:
            self.node.Barrier()
        else:
            # A sleeping poll: a rank that arrives early gives its core to the ranks still
            # working instead of spinning in MPI_Barrier (what matters when the node's cores
            # are oversubscribed); costs up to poll_s of latency per barrier.
            request = self.node.Ibarrier()
            while not request.Test():
                time.sleep(self.poll_s)
        self.win.Sync()

    # ------------------------------------------------------------------ the step
    def reduce(self, weight: int, stop: float, reducer=None, inter: bool = False) -> tuple[float, float, float]:
        """The node's (and with ``inter`` the world's) weighted gradient sum, divided, in
        ``slot_0[lo:hi]`` for this rank's slice; returns ``(total count, stop sum,
        nonfinite sum)`` (the same on every rank of the group that reduced).

        The rank's gradient must be in its slot (``params.message``), unscaled. ``inter``:
        the leaders also sum the node sums among themselves through ``reducer``'s counted
        ``allreduce('inter', ...)`` (and its emulated link)."""
        own = self.slots[self.local_rank]
        alone = self.ranks == 1 and not inter  # one rank scales nothing: the same bits
        if weight != 1 and not alone:
            own[:COUNT] *= weight
        own[COUNT] = weight
        own[STOP] = stop
        # One node: each rank checks its own gradient, so that every decision is known after
        # the first barrier (a sum of finite gradients that overflows is not caught).
        own[NONFINITE] = 0.0 if inter or kernels.all_finite(own[:COUNT]) else 1.0
        self.barrier()  # 1: every slot written
        lo, hi = self.lo, self.hi
        acc = self.slots[0, lo:hi]
        for k in range(1, self.ranks):
            acc += self.slots[k, lo:hi]
        if not inter:
            total, stop_sum, nonfinite = (float(v) for v in self.slots[:, COUNT:].sum(axis=0))
            if total > 0 and not alone:
                acc /= total
            return total, stop_sum, nonfinite
        self.flags[self.local_rank] = 0.0 if kernels.all_finite(acc) else 1.0
        if self.local_rank == 0:
            self.slots[0, COUNT:] = self.slots[:, COUNT:].sum(axis=0)
        self.barrier()  # 2: the node sum is complete
        head = self.slots[0]
        if self.topology.is_leader:
            head[NONFINITE] += self.flags.sum()
            reducer.inter_sum(head)
        self.barrier()  # 3: the world sum is in every node's window
        nonfinite = float(head[NONFINITE])
        total = float(head[COUNT])
        if total > 0 and not alone:
            head[lo:hi] /= total
        return total, float(head[STOP]), nonfinite

    @property
    def gradient(self):
        """The reduced gradient (P,) after :meth:`reduce`; a rank may read only its slice."""
        return self.slots[0, : self.size]

    def update(self, apply: bool = True) -> None:
        """The optimizer on this rank's slice (when ``apply``), then the barrier after which
        every rank may read the new parameters."""
        if apply:
            part, whole = self.slice_optimizer, self.optimizer
            part.lr, part.step_count = whole.lr, whole.step_count  # the schedule sets whole.lr
            part.step()
            whole.step_count = part.step_count
        self.barrier()  # 4

    # ------------------------------------------------------------------ memory
    def resident_bytes(self) -> dict:
        """What the node holds for the model, by part (bytes): the window's ``slots``,
        ``params``, ``state``, and each rank's private ``scratch`` (summed over the node)."""
        item = self.window.dtype.itemsize
        return {"slots": self.slots.nbytes, "params": self.theta.nbytes,
                "state": sum(s.nbytes for s in self.state),
                "scratch": self.ranks * (self.hi - self.lo + 1) * item}

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Copy the parameters, the rank's message and the optimizer state back to private
        memory (the model stays usable) and free the window (collective over the node)."""
        if self.win == MPI.WIN_NULL:
            return
        self.barrier()
        self.params.rebind(np.array(self.theta), np.array(self.slots[self.local_rank]), copy=False)
        move_state(self.optimizer, [np.array(s) for s in self.state], copy=False)
        self.barrier()
        self.slots = self.theta = self.flags = self.window = None
        self.state = []
        self.win.Unlock_all()
        self.win.Free()


class SharedExchange(Variant):
    """``intra='shm'``: the strategy's step through the node's :class:`SharedNode` (the
    weighted sum in the window, over the world for the exact strategies on several nodes;
    the optimizer on this rank's slice). Collective construction over the node."""

    check = staticmethod(check_shared_supported)

    def __init__(self, reducer, params, optimizer):
        super().__init__(reducer)
        self.shared = SharedNode(params, optimizer, reducer.topology)
        reducer.attach_shared(self.shared)

    def describe(self) -> str:
        return self.reducer.describe() + "; intra shm"

    def reduce(self, message, count, stop) -> tuple[bool, float]:
        reducer = self.reducer
        inter = reducer.step_is_global and reducer.topology.num_nodes > 1
        total, stop_sum, nonfinite = self.shared.reduce(reducer.weight(count), 1.0 if stop else 0.0,
                                                        reducer, inter=inter)
        if reducer.step_is_global and total == 0:
            raise ValueError("no rank computed a sample this step (every count was 0)")
        reducer.add_samples(total)
        return nonfinite == 0, stop_sum

    def update(self, optimizer, finite: bool) -> None:
        self.shared.update(apply=finite)

    @contextlib.contextmanager
    def writing_parameters(self):
        # The ranks of a node write the same values into its one copy; none may still be
        # reading it, and none reads it before all have written.
        self.shared.barrier()
        yield
        self.shared.barrier()

    def close(self) -> None:
        """Copy the parameters and state back to private memory and free the window."""
        self.shared.close()
        self.shared = None
        self.reducer.attach_shared(None)
        self.reducer.close()
