"""Node-shared buffers (``intra='shm'``): one copy of the model per node, in an MPI-3 window.

:class:`SharedWindow` wraps the strategy's exchange (flat, hierarchical or node) and moves the
node's parameters, optimizer state and messages into one window; the strategy's own
collectives are replaced by sums in the window (the exchange it wraps keeps its channels,
topology and options).

Layout. On every node one shared-memory window is allocated on the node communicator
(``MPI.Win.Allocate_shared``, all of it by the node's local rank 0, the others asking for 0
bytes, so it is one contiguous segment that every rank maps with ``Win.Shared_query(0)``)::

    window = [ slot_0 | ... | slot_{R-1} | theta | s_1 | ... | s_S | tails (R x 3) | flags (R) | synced (3) ]
              slot_r = [ c_r g_r (P) | c_r | stop_r | nonfinite_r ]    (rank r's message)

``slot_r`` becomes rank r's ``FlatParameters.message`` (its backward writes its gradient
there), ``theta`` the ``FlatParameters.data`` of EVERY rank of the node (the forward pass of
each rank reads it), ``s_k`` the optimizer's state buffers, ``tails[r]`` a copy of rank r's
three slots (the others read the copy, so that rank r may write the sums into its own
message as soon as it has them: ``DataParallel.step`` reads them at once), ``flags`` one
scalar per rank for its finiteness check, ``synced`` the node strategy's sync result. The
node thus holds parameters and optimizer state once instead of ``R`` times, plus the ``R``
gradient slots; each rank keeps only a private optimizer scratch of its slice.

One step, on every rank ``r`` of the node (``[lo_r, hi_r)`` = rank r's ``1/R`` slice of the
``P`` parameters, ``lo_r = r P // R``)::

    slot_r[:P] *= c_r;  tails[r] <- [c_r | stop_r | nonfinite_r]    (one step group per node:
                                                         nonfinite_r = its c_r g_r is not finite)
    ---- barrier 1
    slot_0[lo_r:hi_r] <- sum_k slot_k[lo_r:hi_r]            (k in rank order; its slice only)
    the step group is the node (one node; the node strategy):
      [count, stop, nonfinite] = sum_k tails[k], read by every rank; on to the division.
    the step group is the world, several nodes (flat, hierarchical):
      flags[r] <- 1 if its slice of the sum is not finite else 0
      rank 0: slot_0[P:] <- sum_k tails[k]
      ---- barrier 2
      the leader adds sum(flags) to slot_0's nonfinite slot and runs Allreduce(SUM) of slot_0
      among the leaders, in place in the window (through the leaders' channel: compressed
      with compress='bf16'|'fp16', slowed by an EMULATED link)
      ---- barrier 3
    g[lo_r:hi_r] = slot_0[lo_r:hi_r] / count                (its slice only)
    if the sum is finite everywhere: the optimizer over slice [lo_r, hi_r) of theta, s_k, g
    ---- barrier 4 (after_step); every rank reads the updated theta in its next forward

One node thus needs two barriers per step, several nodes four, and
``g = sum_i c_i g_i / sum_i c_i``, exactly the weighted sum of the exchanges
(:mod:`~mpidl.distributed.exchange`), with the additions in another order (rank order, per
node then over nodes), which changes the result only by rounding. A rank never writes what
another rank reads between two barriers: in each phase rank r writes only its own slot, its
own slice, its own tail and flag (and rank 0 the node's three slots), which is why no lock
is needed.

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

The node strategy (the step group is the node; several nodes). Every step is the node's
sum above; every ``K'`` steps (and at ``synchronize``) the leader averages ``theta`` (and the
state with ``sync_optimizer_state``) among the leaders straight from the window, as
:class:`~mpidl.distributed.node.Node` does (``theta = sum_n v_n theta_n / sum_n v_n``, the same
arithmetic), writes the result into the window and ``[count | stop | nonfinite]`` into
``synced``; one barrier later every rank reads them (no broadcast: there is one copy). The
wrapper keeps ``v_n`` and the steps since the sync itself (the node's per-step sum never
runs through the wrapped exchange).

Writes of the same values. ``DataParallel``'s construction writes rank 0's parameters into
``theta`` from every rank of the node, and a checkpoint's load writes the parameters and the
state from every rank: the same values from every writer, and each rank reads them only
after its own write (the load also ends with a barrier, :meth:`SharedWindow.load_state`).

Counters: the window moves no message, so the node level counts nothing; the leaders'
exchange counts as ``inter``, as in the strategies. ``traffic.seconds`` holds the time in
the window's steps and barriers.

The optimizer must be elementwise (:attr:`mpidl.engine.optim.Optimizer.elementwise`, SGD and the
Adams): a rank updates its slice of the parameters and of the state alone. CPU backends only
(the window is host memory).
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np
from mpi4py import MPI

from mpidl import kernels
from mpidl.distributed.extras import ExchangeWrapper, timed
from mpidl.distributed.message import COUNT, NONFINITE, SLOTS, STOP

__all__ = ["SharedWindow", "check_options", "check_shared_supported", "slice_optimizer", "move_state",
           "POLL_S", "self_oversubscribed"]


def check_elementwise(optimizer) -> None:
    """ValueError unless ``optimizer`` (an optimizer or its class) is elementwise: the one
    rule, checked before any MPI work by :func:`mpidl.distributed.build.check_options`."""
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


#: sleep between the tests of a sleeping barrier or wait (SharedWindow.barrier, overlap's final wait)
POLL_S = 50e-6


def self_oversubscribed(node) -> bool:
    """True when the node's ranks outnumber the cores this process may run on."""
    return node.Get_size() > len(os.sched_getaffinity(0))


class _SliceStepping:
    """The optimizer ``DataParallel`` steps under ``intra='shm'``: :meth:`step` updates this
    rank's slice only (the slice optimizer); everything else is the whole optimizer's
    (``params``: the whole FlatParameters; ``lr``, ``step_count``, ``state_buffers()``,
    ``load_state_dict_host`` ...), so a schedule that sets ``lr`` on the optimizer it built is
    read at every step. After :meth:`SharedWindow.close` it steps the whole optimizer again."""

    def __init__(self, whole, part):
        self._whole, self._part = whole, part

    def __getattr__(self, name):
        if name in ("_whole", "_part"):
            raise AttributeError(name)
        return getattr(self._whole, name)

    @property
    def lr(self) -> float:
        return self._whole.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._whole.lr = value

    @property
    def step_count(self) -> int:
        return self._whole.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._whole.step_count = value

    def step(self) -> None:
        whole, part = self._whole, self._part
        if part is None:  # the window was closed: the parameters are private again
            whole.step()
            return
        part.lr, part.step_count = whole.lr, whole.step_count  # the schedule sets whole.lr
        part.step()
        whole.step_count = part.step_count


class SharedWindow(ExchangeWrapper):
    """``intra='shm'``: ``exchange``'s step in the node's shared window (see the module
    docstring): the weighted sum of the slots, over the world for an exact exchange on
    several nodes; the node strategy's ``K'`` sync in the window; :attr:`optimizer` (what
    ``DataParallel`` must step) updates this rank's slice.

    Collective construction over the world. ``params`` and ``optimizer``'s state are rebound
    onto the window with the values of each node's rank 0; :meth:`close` copies them back to
    private memory (the model and the optimizer stay usable) and frees the window.
    ``poll_s``: the barrier's wait (None: ``MPI_Barrier``, or a sleeping poll of
    :data:`POLL_S` when the node has more ranks than cores).
    """

    def __init__(self, exchange, params, optimizer, poll_s: float | None = None):
        check_shared_supported(params, optimizer)
        super().__init__(exchange)
        topology = exchange.topology
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
        self.node = topology.node
        self.ranks = self.node.Get_size()
        self.local_rank = self.node.Get_rank()
        #: the step group is the node and the nodes average their parameters every K' steps
        #: (the node strategy on several nodes); else the step group is the world
        self.node_syncs = not exchange.exact
        #: the world's step on several nodes: the leaders sum the node sums
        self.inter_nodes = exchange.exact and topology.num_nodes > 1
        #: the leaders' level, made by the exchange (so that compression and an EMULATED
        #: link wrap it as they wrap the exchange's own)
        self.inter = exchange.channel("inter", topology.leaders)
        #: the node strategy's v_n and steps since its last sync (kept here: the node's
        #: per-step sum never runs through the wrapped exchange)
        self.weight_since_sync, self.steps_since_sync = 0.0, 0
        self._scratch = None

        size, width = params.size, params.size + SLOTS
        states = optimizer.state_buffers()
        dtype = np.dtype(params.dtype)
        total = self.ranks * width + size * (1 + len(states)) + self.ranks * (SLOTS + 1) + SLOTS
        self.win = MPI.Win.Allocate_shared(total * dtype.itemsize if self.local_rank == 0 else 0,
                                           dtype.itemsize, comm=self.node)
        memory, _ = self.win.Shared_query(0)
        window = np.ndarray(buffer=memory, dtype=dtype, shape=(total,))
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.window = window
        parts, offset = [], 0
        for length in (self.ranks * width, size, size * len(states), self.ranks * SLOTS, self.ranks, SLOTS):
            parts.append(window[offset:offset + length])
            offset += length
        slots, self.theta, state, tails, self.flags, self.synced = parts
        self.slots = slots.reshape(self.ranks, width)
        self.tails = tails.reshape(self.ranks, SLOTS)
        self.state_views = [state[k * size:(k + 1) * size] for k in range(len(states))]
        self.lo = self.local_rank * size // self.ranks
        self.hi = (self.local_rank + 1) * size // self.ranks
        self.size = size
        self.params, self.whole_optimizer = params, optimizer
        #: bytes of the window (allocated once per node)
        self.nbytes = total * dtype.itemsize
        # Rank 0 copies the (identical) parameters and state in; every rank's own slot gets
        # its current message.
        first = self.local_rank == 0
        params.rebind(self.theta if first else np.empty_like(self.theta), self.slots[self.local_rank])
        move_state(optimizer, self.state_views if first else [np.empty_like(s) for s in self.state_views])
        self.barrier()
        if not first:
            params.rebind(self.theta, self.slots[self.local_rank], copy=False)
            params.message[...] = 0
            move_state(optimizer, self.state_views, copy=False)
        #: what DataParallel steps: the optimizer over this rank's slice (views of theta, the
        #: state and the reduced gradient, its own scratch: an elementwise update of a slice
        #: is that slice of the whole update), the whole optimizer for everything else
        self.optimizer = _SliceStepping(optimizer, slice_optimizer(optimizer, self.lo, self.hi, self.gradient))

    def describe(self) -> str:
        return self.inner.describe() + "; intra shm"

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

    @property
    def gradient(self):
        """The reduced gradient (P,) after :meth:`reduce`; a rank may read only its slice."""
        return self.slots[0, : self.size]

    # ------------------------------------------------------------------ the interface
    def reduce(self, message) -> bool:
        """The step group's weighted gradient sum, divided, in ``slot_0[lo:hi]`` for this
        rank's slice (see the module docstring); ``message`` (this rank's slot) ends with
        ``[sum c | sum stop | sum nonfinite]`` in its slots. Returns whether the sum is finite
        (the same answer on every rank of the group)."""
        if message is not self.params.message:
            raise ValueError("intra='shm' reduces this rank's slot of the window: pass params.message")
        with timed(self.traffic):
            total, stop, nonfinite = self._sum(message)
        if total == 0 and not self.node_syncs:
            raise ValueError("no rank computed a sample this step (every count was 0)")
        if self.node_syncs:
            self.weight_since_sync += total
        return nonfinite == 0

    def _sum(self, own) -> tuple[float, float, float]:
        inter = self.inter_nodes
        alone = self.ranks == 1 and not inter  # one rank scales nothing: the same bits
        weight, stop = float(own[COUNT]), float(own[STOP])
        if weight != 1 and not alone:
            own[:COUNT] *= weight
        # One step group per node: each rank checks its own gradient, so that every decision
        # is known after the first barrier (a sum of finite gradients that overflows is not
        # caught). Several nodes: the slices of the sum are checked below.
        nonfinite = 0.0 if inter or kernels.all_finite(own[:COUNT]) else 1.0
        self.tails[self.local_rank] = (weight, stop, nonfinite)
        self.barrier()  # 1: every slot and tail written
        lo, hi = self.lo, self.hi
        acc = self.slots[0, lo:hi]
        for k in range(1, self.ranks):
            acc += self.slots[k, lo:hi]
        head = self.slots[0]
        if not inter:
            sums = self.tails.sum(axis=0)
        else:
            self.flags[self.local_rank] = 0.0 if kernels.all_finite(acc) else 1.0
            if self.local_rank == 0:
                head[COUNT:] = self.tails.sum(axis=0)
            self.barrier()  # 2: the node sum is complete
            if self.topology.is_leader:
                head[NONFINITE] += self.flags.sum()
                self.inter.allreduce(head)
            self.barrier()  # 3: the world sum is in every node's window
            sums = np.array(head[COUNT:])
        total = float(sums[0])
        if total > 0 and not alone:
            acc /= total
        if self.local_rank != 0 or not inter:
            # This rank's message gets the sums (DataParallel reads its stop slot): no rank
            # reads its slots in this step any more (they read the tails). Rank 0's is slot_0,
            # which holds them already when the leaders summed it (and the others read it).
            own[COUNT:] = sums
        return total, float(sums[1]), float(sums[2])

    def after_step(self, steps, params_data, state_buffers, flags):
        """The barrier after the update (every rank reads the new parameters in its next
        forward), then the node strategy's sync every ``K'`` steps."""
        with timed(self.traffic):
            self.barrier()  # 4
        if not self.node_syncs:
            return self.inner.after_step(steps, params_data, state_buffers, flags)
        self.steps_since_sync += 1
        if steps % self.sync_every != 0:
            return None
        return self._average(flags)

    def synchronize(self, params_data, state_buffers, flags):
        if not self.node_syncs:
            return self.inner.synchronize(params_data, state_buffers, flags)
        if self.steps_since_sync == 0:
            return self.world_flags(flags)
        return self._average(flags)

    def state(self) -> dict:
        if not self.node_syncs:
            return self.inner.state()
        return {"steps_since_sync": self.steps_since_sync, "weight_since_sync": self.weight_since_sync}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state`'s dict. Ends with a node barrier: the caller has just
        written the parameters and the optimizer state into the window from every rank."""
        if self.node_syncs:
            self.steps_since_sync = int(state.get("steps_since_sync", 0))
            self.weight_since_sync = float(state.get("weight_since_sync", 0.0))
        else:
            self.inner.load_state(state)
        self.barrier()

    def _average(self, flags) -> tuple:
        """The node strategy's sync in the window: the leader sends ``[v_n theta_n | v_n s_n
        ... | v_n | stop | nonfinite]`` from the window to the leaders' SUM and writes ``sum /
        sum v_n`` back; the node reads it after one barrier. Returns the world's flag sums."""
        buffers = [self.theta, *self.state_views] if self.sync_optimizer_state else [self.theta]
        size = self.size
        with timed(self.traffic):
            if self.topology.is_leader:
                length = size * len(buffers) + SLOTS
                if self._scratch is None or self._scratch.size != length:
                    self._scratch = np.zeros(length, dtype=self.theta.dtype)
                message = self._scratch
                weight = self.weight_since_sync
                for k, buf in enumerate(buffers):
                    part = message[k * size:(k + 1) * size]
                    part[...] = buf
                    part *= weight
                message[COUNT], message[STOP], message[NONFINITE] = weight, flags[0], flags[1]
                self.inter.allreduce(message)
                if message[COUNT] > 0:
                    for k, buf in enumerate(buffers):
                        buf[...] = message[k * size:(k + 1) * size]
                        buf /= message[COUNT]
                self.synced[...] = message[COUNT:]
            # Every rank reads theta (its next forward) and `synced` after the leader wrote
            # them; `synced` is written again only at the next sync, barriers later.
            self.barrier()
        total, stop, nonfinite = (float(v) for v in self.synced)
        self.weight_since_sync, self.steps_since_sync = 0.0, 0
        if total <= 0:
            raise RuntimeError("node parameter sync: no node computed a sample since the last sync "
                               "(every count was 0); the parameter average is undefined")
        return stop, nonfinite

    # ------------------------------------------------------------------ memory
    def resident_bytes(self) -> dict:
        """What the node holds for the model, by part (bytes): the window's ``slots``,
        ``params``, ``state``, and each rank's private ``scratch`` (summed over the node)."""
        item = self.window.dtype.itemsize
        return {"slots": self.slots.nbytes, "params": self.theta.nbytes,
                "state": sum(s.nbytes for s in self.state_views),
                "scratch": self.ranks * (self.hi - self.lo + 1) * item}

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Copy the parameters, the rank's message and the optimizer state back to private
        memory (the model and the optimizer stay usable) and free the window (collective
        over the node); then close the wrapped exchange."""
        if self.win == MPI.WIN_NULL:
            return
        self.barrier()  # every rank's last writes are in
        self.params.rebind(np.array(self.theta), np.array(self.slots[self.local_rank]), copy=False)
        move_state(self.whole_optimizer, [np.array(s) for s in self.state_views], copy=False)
        self.optimizer._part = None
        self.barrier()  # every rank has copied before the memory goes
        self.slots = self.theta = self.flags = self.tails = self.synced = self.window = None
        self.state_views = []
        self.win.Unlock_all()
        self.win.Free()
        self.inner.close()
