"""``DataParallel``: the distributed step as a library, the one object a training loop needs.

A loop of any shape (a classifier, a GAN's two models, a custom loss) uses it like this::

    dp = DataParallel(model, optimizer, batch_size=64, strategy="node", sync_every=50)
    for batch in global_batches:              # the SAME global batch indices on every rank
        local = dp.local_indices(batch)       # this rank's contiguous slice (HDP split)
        loss = loss_fn.forward(model.forward(x[local]), y[local])   # the local MEAN loss
        model.backward(loss_fn.backward())    # fills model.params.grad
        dp.step(len(local))                   # reduce with the right weights, update, K' sync
        if dp.should_stop:                    # SIGTERM on any rank, agreed by every rank
            break
    dp.sync()                                 # all replicas identical: evaluate, save

What one ``step`` does, on every rank (``g_i`` the local mean gradient of ``b_i`` samples):

1. this rank's compute time since ``local_indices`` is recorded (stretched by an EMULATED
   slowdown, if any), for the metrics and for re-balancing;
2. the reducer exchanges the rank's message ``[c_i g_i | c_i | stop | nonfinite]``
   (``c_i = b_i`` balanced, ``1`` uniform), so that afterwards ``g = sum_i c_i g_i / sum_i c_i``
   over the ranks that reduce together (:mod:`mpidl.distributed.reducer_base`);
3. the optimizer applies ``g`` unless it is non-finite;
4. the ``node`` strategy averages the parameters between nodes when ``K'`` steps are done.

Collective decisions. Whatever changes the communication (stop on a signal, a non-finite
gradient) is decided identically on every rank, with no message of its own: a rank's stop
request and its node's non-finite gradient travel in the ``stop`` / ``nonfinite`` slots of the
messages that flow anyway. With an exact strategy (and ``node`` on one node) every step's
reduction spans the world, so ``should_stop`` turns True on every rank after the same step,
and a non-finite reduced gradient (seen alike by every rank) raises :class:`NonFiniteGradient`
on every rank at once. Under ``node`` on several nodes a node's flags are combined with the
others' at the next parameter sync (every ``K'`` steps, and :meth:`sync`). :meth:`any`,
:meth:`all` and :meth:`sync` are explicit control points that also carry them.

Several objects may share one :class:`~mpidl.distributed.topology.Topology` (a GAN's
generator and discriminator): each has its own reducer, counters and message, and the ranks
call their collectives in the same order because every rank runs the same loop.
"""

from __future__ import annotations

import hashlib
import time
from numbers import Real
from typing import Callable, Sequence

import numpy as np

from mpidl.backend import to_host
from mpidl.distributed import balance
from mpidl.distributed import probe as speed_probe
from mpidl.distributed.elastic import (IN_STEP, IN_SYNC, OUTSIDE, REDO_AFTER_STEP, REDO_SYNCHRONIZE,
                                      ShrinkOnFailure)
from mpidl.distributed.emulation import LinkModel, compute_clock
from mpidl.distributed.exchange import BUCKET_MB, INTRA, build_exchange
from mpidl.distributed.checkpoint_state import CheckpointState
from mpidl.distributed.hdp import HeterogeneousSplit, check_split_fits, check_split_options
from mpidl.distributed.launch import first_error
from mpidl.distributed.message import SLOTS
from mpidl.distributed.recovery import ON_FAILURE, RanksLost, RecoveryError
from mpidl.distributed.topology import Topology

ON_NAN = ("stop", "skip")
#: default minimum predicted gain (a fraction of the step) for an uneven split or a re-split
BALANCE_THRESHOLD = 0.05
#: default samples every rank computes at least in a full global batch (``min_local_batch``):
#: a loop written for DataParallel never sees an empty local batch of a full global batch
MIN_LOCAL_BATCH = 1

__all__ = ["DataParallel", "NonFiniteGradient", "ON_NAN", "INTRA", "ON_FAILURE", "RanksLost", "RecoveryError"]


class NonFiniteGradient(RuntimeError):
    """The reduced gradient holds NaN or Inf and ``on_nan="stop"`` is in force; raised on
    every rank at the same step."""


class DataParallel(HeterogeneousSplit, CheckpointState, ShrinkOnFailure):
    """Data-parallel training of one model over the ranks of a topology.

    Parameters
    ----------
    model : Model or FlatParameters
        What is trained. A :class:`~mpidl.models.Model` also brings its batch-norm buffers,
        which :meth:`sync` averages over the replicas and checkpoints carry.
    optimizer : an :mod:`mpidl.optim` optimizer over ``model.params``
        :meth:`step` calls its ``step()``; its state buffers are averaged by the node
        strategy's syncs when ``sync_optimizer_state``.
    batch_size : int
        ``B``, the GLOBAL batch: :meth:`local_indices` splits it over the ranks.
    topology : Topology, default ``Topology()`` of ``MPI.COMM_WORLD`` (collective)
    strategy, weighting, sync_every, intra, overlap, bucket_mb, compress, sync_overlap
        The exchange, built by :func:`~mpidl.distributed.exchange.build_exchange` (whose
        table says what works with what): ``strategy`` 'flat' | 'hierarchical' | 'node'
        (``sync_every`` = K'); ``weighting`` 'balanced' (``c_i = b_i``) | 'uniform' (``c_i =
        1``); ``intra`` 'mpi' | 'shm' (the node-shared window, :mod:`~mpidl.distributed.shm`:
        call :meth:`close` or use ``with``); ``overlap`` buckets of ``bucket_mb`` MiB started
        by the backward hook (:mod:`~mpidl.distributed.overlap`: call :meth:`local_indices`,
        then ONE backward, then :meth:`step`); ``compress`` 'none' | 'bf16' | 'fp16' for the
        inter-node level (:mod:`~mpidl.distributed.compress`); ``sync_overlap`` steps between
        the start of the node strategy's parameter sync and its application (0 blocks).
    speeds : 'equal' | 'auto' | sequence of P positive numbers
        How ``B`` is split (:mod:`~mpidl.distributed.hdp`): equally; by a cost model ``t_i(b)
        = a_i + c_i b`` of every rank fitted from timed ``probe`` passes, the split minimizing
        the slowest rank's step, kept equal unless it is predicted to be more than
        ``balance_threshold`` faster; or in proportion to the given speeds (``t_i(b) = b / s_i``).
    probe : callable(n), optional
        One forward + backward pass of the real model on ``n`` samples, no communication.
        Needed for ``speeds='auto'``; when given it also runs once untimed on every rank first
        (the Numba JIT compiles then, one rank per node writing the on-disk cache), so the
        first timed step measures the model and not the compiler.
    balance_threshold : float in [0, 1)
        The predicted gain (a fraction of the step time) an uneven split must bring over the
        equal one, and a re-split over the current one (hysteresis).
    min_local_batch : int >= 0
        Samples every rank gets at least of a full global batch (default 1). 0 lets the split
        be the cost model's min-max optimum, which may leave out a rank whose fixed cost alone
        exceeds the others' step (it still joins every exchange with weight 0); the loop must
        then handle an empty local batch (zero gradient, then :meth:`step`).
    rebalance_every : int, optional
        Every ``rebalance_every`` steps, re-fit the cost models from the ranks' own steps and
        re-split when the predicted gain is confirmed (:meth:`rebalance`; collective).
    sync_optimizer_state : bool
        ``node``: average the optimizer state at each parameter sync too.
    on_nan : 'stop' | 'skip'
        A non-finite reduced gradient: raise :class:`NonFiniteGradient` on every rank
        (``node`` on several nodes: at the next sync), or skip that update.
    check_replicas : bool
        Debug: compare a checksum of every replica's parameters whenever they must agree.
    on_failure : 'restart' | 'shrink'
        A lost rank (process killed, host gone): end the job (``restart`` from the
        checkpoint), or let the survivors shrink the world, go back to the state before the
        step every survivor agrees on, re-split ``B`` over themselves and raise
        :class:`~mpidl.distributed.recovery.RanksLost` (:mod:`~mpidl.distributed.elastic`;
        the loop then runs the global batch of step ``dp.steps`` again). ``shrink`` needs an
        MPI with ULFM (Open MPI 5 under ``mpiexec --with-ft ulfm``); without one it falls back
        to ``restart`` and :attr:`failure_note` says why. It keeps two copies of the
        parameters and optimizer state, and refuses ``intra='shm'``, ``overlap``,
        ``compress``, ``sync_overlap`` and emulated nodes. After a shrink, end the process
        with :meth:`leave`.
    emulate_slowdown, emulate_clock, emulate_link
        EMULATION (:mod:`~mpidl.distributed.emulation`): this rank's compute lasts
        ``emulate_slowdown`` times longer (one factor, or one per rank) on the 'wall' or 'cpu'
        clock; every inter-node collective also sleeps the alpha-beta time of
        ``emulate_link`` (a LinkModel or 'LATENCY_US,GBIT_S').

    Construction is collective: it broadcasts rank 0's parameters (and buffers) to every
    replica, warms up and measures with ``probe``, and splits ``B``. Bad arguments raise
    ValueError on every rank alike before any collective.
    """

    def __init__(self, model, optimizer, *, batch_size: int, topology: Topology | None = None,
                 strategy: str = "flat", sync_every: int = 50, weighting: str = "balanced",
                 speeds: str | Sequence[float] = "equal", probe: Callable[[int], None] | None = None,
                 balance_threshold: float = BALANCE_THRESHOLD, min_local_batch: int = MIN_LOCAL_BATCH,
                 rebalance_every: int | None = None,
                 sync_optimizer_state: bool = False, on_nan: str = "stop",
                 check_replicas: bool = False, emulate_slowdown: float | Sequence[float] = 1.0,
                 emulate_clock: str = "wall",
                 emulate_link: LinkModel | str | None = None, intra: str = "mpi",
                 overlap: bool = False, bucket_mb: float = BUCKET_MB, compress: str = "none",
                 sync_overlap: int = 0, on_failure: str = "restart"):
        params = getattr(model, "params", model)
        message = getattr(params, "message", None)
        if message is None or getattr(params, "data", None) is None:
            raise ValueError("DataParallel needs a Model or a FlatParameters (flat data, grad "
                             f"and message buffers); got {type(model).__name__}")
        if message.size != params.data.size + SLOTS:
            raise ValueError(f"params.message must hold the {params.data.size} gradients and "
                             f"{SLOTS} slots, got {message.size} elements")
        if getattr(optimizer, "params", None) is not params:
            raise ValueError("the optimizer must be built on the same parameters as the model "
                             "(e.g. SGD(model.params, ...))")
        if on_nan not in ON_NAN:
            raise ValueError(f"on_nan must be one of {', '.join(ON_NAN)}, got {on_nan!r}")
        check_split_options(batch_size, speeds, probe, balance_threshold, min_local_batch, rebalance_every)
        exchange_options = dict(strategy=strategy, weighting=weighting, sync_every=sync_every,
                                emulate_link=emulate_link, intra=intra, overlap=overlap,
                                bucket_mb=bucket_mb, compress=compress, sync_overlap=sync_overlap)
        build_exchange(model, params, optimizer, None, check_only=True, **exchange_options)
        self._check_on_failure(on_failure, topology, exchange_options)
        self._exchange_options = exchange_options
        self.model = model if params is not model else None
        self.params = params
        self.optimizer = optimizer
        self.batch_size = int(batch_size)
        self.balance_threshold = float(balance_threshold)
        self.min_local_batch = int(min_local_batch)
        self.rebalance_every = rebalance_every
        self.on_nan = on_nan
        self.sync_optimizer_state = bool(sync_optimizer_state)
        self.check_replicas = bool(check_replicas)
        self.topology = topology if topology is not None else Topology.from_comm()
        topo = self.topology
        check_split_fits(self.batch_size, self.min_local_batch, topo.size)
        factors = [emulate_slowdown] * topo.size if isinstance(emulate_slowdown, Real) else list(emulate_slowdown)
        if len(factors) != topo.size:
            raise ValueError(f"emulate_slowdown has {len(factors)} factors for {topo.size} ranks")
        self._backend = getattr(params, "backend", None)
        #: this rank's compute clock (EMULATED slow when its factor is not 1)
        self.clock = compute_clock(factors[topo.rank], emulate_clock,
                                   self._backend.synchronize if self._backend is not None else None)
        self.strategy = strategy
        self.weighting = weighting
        given = None if isinstance(speeds, str) else balance.check_speeds(speeds, topo.size)
        # ---- collective set-up
        self._broadcast_initial_state()
        #: what every step calls: the strategy and its variants (mpidl.distributed.exchange)
        self.exchange = self._build_exchange(topo)
        self.exchange.set_reference(params.data, self._synced_state())
        if probe is not None:
            speed_probe.warm_up(self, probe)
        self._first_split(speeds, given, probe)
        #: the last re-split: {"step", "old", "new", "predicted_old_s", "predicted_new_s", "costs",
        #: "noise"} or None
        self.last_rebalance: dict | None = None
        #: optimizer steps done through this object
        self.steps = 0
        self.should_stop = False
        self.last_step_skipped = False
        #: the last step() or sync() agreed that some node skipped a step with a non-finite
        #: gradient since the previous sync (node strategy, on_nan='skip': the flags travel
        #: with the syncs, so a rank hears of another node's skip there)
        self.skip_agreed = False
        self._pending_stop = False
        self._pending_nonfinite = False
        self._local_count: int | None = None
        self._closed = False
        self._start_on_failure(on_failure)
        self.reset_counters()
        self.clock.start()

    def _build_exchange(self, topology: Topology):
        """The exchange of this object's options over ``topology`` (collective)."""
        return build_exchange(self.model if self.model is not None else self.params, self.params,
                              self.optimizer, topology, **self._exchange_options)

    # ------------------------------------------------------------------ who is where
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    @property
    def exact(self) -> bool:
        """True when every replica holds the same parameters after every step."""
        return self.exchange.exact

    @property
    def reducer(self):
        """The strategy inside the exchange (its counters, its node-sync state)."""
        return self.exchange.reducer

    def describe(self) -> str:
        """One line for the log: world, nodes, strategy, weighting and variants."""
        topo = self.topology
        return (f"{topo.size} rank(s) on {topo.num_nodes} node(s) {topo.node_sizes}; "
                f"{self.exchange.describe()}")

    # ------------------------------------------------------------------ the split (HDP)
    def local_indices(self, global_batch) -> np.ndarray:
        """This rank's contiguous slice of ``global_batch`` (the same indices on every rank):
        ``global_batch[lo:hi]`` with ``hi - lo = split(len(global_batch))[rank]``.

        Also starts this rank's compute clock for the step."""
        batch = np.asarray(global_batch)
        counts = self.split(len(batch))
        lo = sum(counts[: self.rank])
        self._local_count = counts[self.rank]
        self.exchange.begin(self._local_count, lambda: self._pending_stop)
        self.clock.start()
        return batch[lo: lo + counts[self.rank]]

    # ------------------------------------------------------------------ the step
    def request_stop(self) -> None:
        """Ask for a collective stop (safe in a signal handler: it only sets a flag). Every
        rank's :attr:`should_stop` turns True after the same step, at the next exchange that
        spans the world."""
        self._pending_stop = True

    def step(self, local_count: int | None = None) -> bool:
        """Reduce the gradient with the right weights, apply the optimizer, and do the node
        strategy's parameter sync when due; returns True when the replicas were synchronised
        across nodes at this step.

        ``local_count`` : the samples this rank computed ``params.grad`` on (its local mean);
        default: the size of the slice :meth:`local_indices` returned. A rank with 0 samples
        passes a zeroed gradient and still calls ``step``.
        """
        count = self._local_count if local_count is None else local_count
        if count is None:
            raise ValueError("step(): give local_count, or take the slice with local_indices() first")
        self._local_count = None
        seconds = self.clock.stop()
        self._step_compute.append(seconds)
        self._recent.append((int(count), seconds))

        t0 = time.perf_counter()
        self._keep_step_state()
        finite, stop = self._guarded(IN_STEP, lambda: self.exchange.reduce(self.params.message, count,
                                                                            self._pending_stop),
                                     self._step_group)
        if stop > 0:
            if self.exchange.step_is_global:
                self.should_stop = True
            else:
                self._pending_stop = True  # the node agrees now; the world at the next sync
        self.last_step_skipped = not finite
        self.skip_agreed = False
        self.exchange.update(self.optimizer, finite)
        if not finite and self.on_nan == "stop" and self.exchange.step_is_global:
            self._wait_seconds += time.perf_counter() - t0
            raise NonFiniteGradient(
                f"non-finite (NaN/Inf) reduced gradient at step {self.steps}; stopping "
                "(on_nan='stop'; 'skip' skips such steps instead)")
        if not finite and not self.exchange.step_is_global:
            self._pending_nonfinite = True  # the other nodes hear of it at the next sync
        self.steps += 1
        due = self.exchange.sync_due(self.steps)
        if due:
            self._keep_sync_state(REDO_AFTER_STEP)
        result = self._guarded(IN_SYNC if due else OUTSIDE, lambda: self.exchange.after_step(
            self.params.data, self._synced_state(), self._flags(), self.steps),
            self._world if due else None)
        if result is not None:
            self._agree(result)
        if self.check_replicas and (self.exact or result is not None):
            self._compare_replicas()
        self.last_rebalance = None
        if self.rebalance_every is not None and self.steps % self.rebalance_every == 0:
            self.rebalance()
        self._wait_seconds += time.perf_counter() - t0
        self._step_completed()
        self.clock.start()
        return result is not None

    def close(self) -> None:
        """Free what this object holds beyond the model (collective over the node under
        intra='shm': the parameters and optimizer state are copied back to private memory
        and the window is freed; an overlapped node sync in flight is applied; duplicated
        communicators are freed). The model and optimizer stay usable, this object does not;
        a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.exchange.finish_pending(self.params.data, self._synced_state())
        self.exchange.close()

    def __enter__(self) -> "DataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sync(self) -> None:
        """Make every replica identical now (collective): the node strategy's parameter
        average (and optimizer state with ``sync_optimizer_state``) when any step was taken
        since the last one, and the batch-norm buffers averaged over the world. Also a
        control point: pending stop requests and non-finite gradients are agreed here."""
        t0 = time.perf_counter()
        self.skip_agreed = False
        if self.exchange.steps_since_sync > 0:
            self._keep_sync_state(REDO_SYNCHRONIZE)
        self._agree(self._guarded(IN_SYNC, lambda: self.exchange.synchronize(
            self.params.data, self._synced_state(), self._flags()), self._world))
        self._average_buffers()
        if self.check_replicas:
            self._compare_replicas()
        self._wait_seconds += time.perf_counter() - t0
        self.clock.start()

    def consensus(self) -> np.ndarray:
        """A host copy of the parameters every replica agrees on (collective): the replicas'
        own for exact strategies; the node-weighted average for ``node`` between syncs. The
        replicas are left as they are."""
        return np.array(to_host(self._guarded(OUTSIDE, lambda: self.exchange.consensus(self.params.data))),
                        copy=True)

    # ------------------------------------------------------------------ decisions, small collectives
    def any(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on some rank (collective control point;
        pending stop requests and non-finite gradients are agreed too)."""
        return self._decide(flag, op="any")

    def all(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on every rank (collective control point)."""
        return self._decide(flag, op="all")

    def sum(self, array: np.ndarray) -> np.ndarray:
        """World SUM of a host array, in place on every rank (e.g. confusion matrices)."""
        array = np.ascontiguousarray(array)
        self._guarded(OUTSIDE, lambda: self.exchange.allreduce("control", self.topology.world, array))
        return array

    def agree_on_error(self, error: str | None) -> str | None:
        """Every rank's ``error`` (or None) -> the first one, naming the ranks that had it,
        the same on every rank (:func:`~mpidl.distributed.launch.first_error`; collective)."""
        return first_error(self.all_gather_object(error))

    def all_gather_object(self, value) -> list:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        self.exchange.counters["control"]["calls"] += 1
        return self._guarded(OUTSIDE, lambda: self.topology.world.allgather(value))

    # ------------------------------------------------------------------ counters and timers
    def reset_counters(self) -> None:
        """Start a new period for :attr:`counters` and :meth:`timings` (e.g. every epoch)."""
        self.exchange.reset_counters()
        self._step_compute: list[float] = []
        self._wait_seconds = 0.0

    @property
    def counters(self) -> dict:
        """``{level: {"calls", "bytes"}}`` of this rank since :meth:`reset_counters`."""
        return self.exchange.counters

    def timings(self) -> dict:
        """Per-rank seconds since :meth:`reset_counters` (collective; lists indexed by rank).

        ``comp_s``: compute, from :meth:`local_indices` (or the previous step) to :meth:`step`,
        EMULATED slowdown included. ``idle_s``: the part of a rank's time in the step's
        collectives spent waiting for slower ranks' compute, estimated as
        ``idle_i = sum_t (max_j c_jt - c_it)`` over the period's steps ``t``. ``comm_s``: the
        rest of its time in the distributed step (collectives, syncs, GPU staging, EMULATED
        link time): ``comm_i = max(0, wait_i - idle_i)``. ``steps``: the period's steps.
        """
        gathered = self.all_gather_object((sum(self._step_compute), self._wait_seconds,
                                   np.asarray(self._step_compute)))
        comp = [g[0] for g in gathered]
        lengths = {g[2].size for g in gathered}
        if len(lengths) == 1 and lengths != {0}:
            steps = np.stack([g[2] for g in gathered])
            idle = (steps.max(axis=0, keepdims=True) - steps).sum(axis=1)
        else:  # no step in the period, or ranks that did not step together
            idle = np.zeros(self.size)
        comm = [max(0.0, g[1] - i) for g, i in zip(gathered, idle)]
        return {"comp_s": comp, "comm_s": comm, "idle_s": [float(i) for i in idle],
                "steps": len(self._step_compute), "step_comp_s": list(self._step_compute)}

    # ------------------------------------------------------------------ internals
    def _flags(self) -> tuple[float, float]:
        return float(self._pending_stop), float(self._pending_nonfinite)

    def _synced_state(self) -> list:
        return self.optimizer.state_buffers() if self.sync_optimizer_state else []

    def _agree(self, sums) -> None:
        """Apply world-wide flag sums (the same on every rank)."""
        stop, nonfinite = sums
        self._pending_stop = self._pending_stop and stop == 0
        self._pending_nonfinite = False
        if stop > 0:
            self.should_stop = True
        if nonfinite > 0 and self.on_nan == "skip":
            self.skip_agreed = True
        if nonfinite > 0 and self.on_nan == "stop":
            raise NonFiniteGradient(
                f"non-finite (NaN/Inf) gradient on some node before step {self.steps}; stopping "
                "(on_nan='stop')")

    def _decide(self, flag: bool, op: str) -> bool:
        buf = np.array([float(bool(flag)), float(self._pending_stop), float(self._pending_nonfinite)])
        self._guarded(OUTSIDE, lambda: self.exchange.allreduce("control", self.topology.world, buf))
        self._agree((buf[1], buf[2]))
        return bool(buf[0] > 0) if op == "any" else bool(buf[0] == self.size)

    def _broadcast_initial_state(self) -> None:
        """Every replica starts from rank 0's parameters and buffers (as DDP does)."""
        world = self.topology.world
        if world.Get_size() == 1:
            return
        host = np.array(to_host(self.params.data), copy=True)
        world.Bcast(host, root=0)
        self.params.data[...] = self._backend.asarray(host) if self._backend else host
        buffers = self.buffers_host()
        if buffers:
            self.model.load_buffers_host(world.bcast(buffers, root=0))

    def buffers_host(self) -> dict:
        """Host copies of the model's buffers (batch-norm statistics); ``{}`` without a Model."""
        if self.model is None:
            return {}
        return self.model.buffers_host()

    def _average_buffers(self) -> None:
        """Batch-norm running statistics are each rank's own; the world average makes every
        replica evaluate (and save) the same model. One collective for all of them."""
        buffers = self.buffers_host()
        if not buffers or self.size == 1:
            return
        names = sorted(buffers)
        flat = np.concatenate([np.asarray(buffers[n], np.float64).ravel() for n in names])
        self._guarded(OUTSIDE, lambda: self.exchange.allreduce("world", self.topology.world, flat))
        flat /= self.size
        averaged, offset = {}, 0
        for n in names:
            shape = np.shape(buffers[n])
            size = int(np.prod(shape))
            averaged[n] = flat[offset:offset + size].reshape(shape)
            offset += size
        self.model.load_buffers_host(averaged)

    def _compare_replicas(self) -> None:
        digest = hashlib.sha1(np.ascontiguousarray(to_host(self.params.data)).tobytes()).hexdigest()
        digests = self.all_gather_object(digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"replicas diverged at step {self.steps}: checksums {digests}")

