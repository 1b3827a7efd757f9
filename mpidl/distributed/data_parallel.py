"""``DataParallel``: the distributed step, the one object a training loop needs.

A loop of any shape (a classifier, a GAN's two models, a custom loss) uses it like this::

    dp = DataParallel(model, optimizer, batch_size=64, exchange=Node(Topology(), sync_every=50))
    for batch in global_batches:              # the SAME global batch indices on every rank
        local = dp.local_indices(batch)       # this rank's contiguous slice (the split)
        loss = loss_fn.forward(model.forward(x[local]), y[local])   # the local MEAN loss
        model.backward(loss_fn.backward())    # fills model.params.grad
        dp.step()                             # weighted reduce, update, the exchange's K' sync
        if dp.should_stop:                    # SIGTERM on any rank, agreed by every rank
            break
    dp.sync()                                 # all replicas identical: evaluate, save

It composes three parts, each passed in: the **exchange** (how gradients travel:
:class:`~mpidl.distributed.flat.Flat`, :class:`~mpidl.distributed.hierarchical.Hierarchical`,
:class:`~mpidl.distributed.node.Node`, or anything with their interface), the **split** (how
the global batch is shared: :mod:`mpidl.distributed.split`) and the **clock** (this rank's
compute time). :func:`mpidl.distributed.build.data_parallel` assembles them from options.

One step on rank ``i`` (``g_i`` the local mean gradient of its ``b_i`` samples)::

    c_i = b_i (balanced) or 1 (uniform)          the weight: the balanced-gradient idea
    exchange.reduce([g_i | c_i | stop_i | 0])    -> g = sum_i c_i g_i / sum_i c_i, in place
    optimizer.step() if g is finite              the same answer on every rank of the group
    exchange.after_step(...)                     node: the parameter average every K' steps
    split.after_step(...)                        HDP: maybe re-split (measured split)

Collective decisions take no message of their own: a stop request travels in the ``stop``
slot of the step's message. With an exact exchange every step spans the world, so
:attr:`should_stop` turns True on every rank after the same step, and a non-finite gradient is
seen alike by every rank. Under ``node`` on several nodes a node's flags reach the others at
the next parameter sync (every ``K'`` steps, and :meth:`sync`).
"""

from __future__ import annotations

import numpy as np

from mpidl.engine.backend import get_array_module, to_host
from mpidl.distributed.clock import ComputeClock
from mpidl.distributed.exchange import reset_slots
from mpidl.distributed.launch import first_error
from mpidl.distributed.message import COUNT, SLOTS, STOP
from mpidl.distributed.split import FixedSplit

ON_NAN = ("stop", "skip")
WEIGHTINGS = ("balanced", "uniform")

__all__ = ["DataParallel", "NonFiniteGradient", "ON_NAN", "WEIGHTINGS"]


class NonFiniteGradient(RuntimeError):
    """The reduced gradient holds NaN or Inf and ``on_nan='stop'``; raised on every rank at the
    same step (``node`` on several nodes: at the next sync)."""


class DataParallel:
    """Data-parallel training of one model over the ranks of ``exchange.topology``.

    Parameters
    ----------
    model : Model or FlatParameters
        What is trained. A :class:`~mpidl.engine.models.Model` also brings its batch-norm
        buffers, which :meth:`sync` averages over the replicas.
    optimizer : an :mod:`mpidl.engine.optim` optimizer over ``model.params``
    batch_size : int
        ``B``, the GLOBAL batch that :meth:`local_indices` splits.
    exchange : Exchange, default ``Flat(Topology())`` (collective)
    split : Split, default the equal split of ``B``
    weighting : 'balanced' | 'uniform'
        ``c_i = b_i`` (the exact gradient of the global batch) or ``c_i = 1`` (the naive
        ``1/P`` average, the papers' baseline).
    on_nan : 'stop' | 'skip'
        A non-finite reduced gradient raises :class:`NonFiniteGradient` on every rank, or
        that update is skipped.
    clock : ComputeClock, optional
        Times this rank's compute from :meth:`local_indices` to :meth:`step`.

    Construction is collective: every replica starts from rank 0's parameters and buffers.
    """

    def __init__(self, model, optimizer, *, batch_size: int, exchange=None, split=None,
                 weighting: str = "balanced", on_nan: str = "stop", clock: ComputeClock | None = None):
        params = getattr(model, "params", model)
        if getattr(params, "message", None) is None or params.message.size != params.data.size + SLOTS:
            raise ValueError("DataParallel needs a Model or a FlatParameters (flat data, grad and message "
                             f"buffers); got {type(model).__name__}")
        if getattr(optimizer, "params", None) is not params:
            raise ValueError("the optimizer must be built on the same parameters as the model "
                             "(e.g. SGD(model.params, ...))")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
        if on_nan not in ON_NAN:
            raise ValueError(f"on_nan must be one of {', '.join(ON_NAN)}, got {on_nan!r}")
        if exchange is None:
            from mpidl.distributed.flat import Flat  # noqa: PLC0415
            from mpidl.distributed.topology import Topology  # noqa: PLC0415

            exchange = Flat(Topology.from_comm())
        self.model = model if params is not model else None
        self.params, self.optimizer, self.batch_size = params, optimizer, batch_size
        self.exchange = exchange
        self.split = split if split is not None else FixedSplit(batch_size, exchange.topology.size)
        if self.split.batch_size != batch_size:
            raise ValueError(f"the split is of a global batch of {self.split.batch_size}, not {batch_size}")
        if len(self.split.batch_sizes) != exchange.topology.size:
            raise ValueError(f"the split shares the batch among {len(self.split.batch_sizes)} ranks, the "
                             f"exchange's topology has {exchange.topology.size}")
        self.weighting, self.on_nan = weighting, on_nan
        self.clock = clock if clock is not None else ComputeClock()
        #: optimizer steps done through this object
        self.steps = 0
        self.should_stop = False
        #: the last step's reduced gradient was not finite and its update was skipped
        self.last_step_skipped = False
        #: the last step() or sync() agreed that some node skipped a step since the last sync
        self.skip_agreed = False
        self._stop_requested = self._nonfinite_pending = False
        self._local_count: int | None = None
        #: this rank's own work per step outside the compute clock (the optimizer update, the
        #: loop between steps): seconds so far, and when the current stretch of it began
        self._outside_s = 0.0
        self._outside_mark: float | None = None
        self._broadcast_initial_state()
        self.reset_counters()

    @property
    def topology(self):
        return self.exchange.topology

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    @property
    def batch_sizes(self) -> list[int]:
        return self.split.batch_sizes

    # ------------------------------------------------------------------ the step
    def local_indices(self, global_batch) -> np.ndarray:
        """This rank's contiguous slice of ``global_batch`` (the same indices on every rank),
        ``global_batch[lo:lo + b_rank]`` with ``b = split.counts(len(global_batch))``. Also
        starts this rank's compute clock and writes its weight into the message (an
        overlapped exchange sends parts of it during the backward)."""
        batch = np.asarray(global_batch)
        counts = self.split.counts(len(batch))
        lo = sum(counts[: self.rank])
        self._local_count = counts[self.rank]
        self.params.message[COUNT] = self._weight(self._local_count)
        reset_slots(self.params.message, self._stop_requested)
        if self._outside_mark is not None:  # the loop's own time since the last step
            self._outside_s += self.clock.now() - self._outside_mark
            self._outside_mark = None
        self.clock.start()
        return batch[lo: lo + self._local_count]

    def step(self, local_count: int | None = None) -> bool:
        """Reduce the gradient with the right weights, apply the optimizer, and let the exchange
        and the split act after the step; returns True when the replicas were synchronised
        across nodes at this step (collective).

        ``local_count``: the samples this rank computed ``params.grad`` on (its local mean);
        default, the size of the slice :meth:`local_indices` returned. A rank with 0 samples
        passes a zeroed gradient and still calls ``step``."""
        count = self._local_count if local_count is None else local_count
        if count is None:
            raise ValueError("step(): give local_count, or take the slice with local_indices() first")
        weight = self._weight(count)  # a bad count is refused before anything is recorded
        self._local_count = None
        seconds = self.clock.stop()
        # the step's critical path on this rank: the previous update and loop, then the compute
        outside, self._outside_s = self._outside_s, 0.0
        self.split.observe(count, seconds, outside)
        self._compute_s.append(seconds)
        message = self.params.message
        message[COUNT] = weight
        message[STOP] = float(self._stop_requested)
        finite = self.exchange.reduce(message)                  # g = sum c_i g_i / sum c_i
        if message[STOP] > 0:
            self._stop_requested = True                         # the group agrees now...
            self.should_stop = self.should_stop or self.exchange.exact   # ...the world if exact
        self.last_step_skipped, self.skip_agreed = not finite, False
        if finite:
            update_start = self.clock.now()
            self.optimizer.step()
            self._outside_s = self.clock.now() - update_start
        elif not self.exchange.exact:
            self._nonfinite_pending = True                      # the other nodes hear at the sync
        elif self.on_nan == "stop":
            raise NonFiniteGradient(f"non-finite (NaN/Inf) reduced gradient at step {self.steps}; "
                                    "stopping (on_nan='stop'; 'skip' skips such steps instead)")
        self.steps += 1
        agreed = self.exchange.after_step(self.steps, self.params.data, self.optimizer.state_buffers(),
                                          self._flags())
        if agreed is not None:
            self._agree(agreed)
        self.split.after_step(self.steps)
        self._outside_mark = self.clock.now()
        self.clock.start()
        return agreed is not None

    def request_stop(self) -> None:
        """Ask for a collective stop (safe in a signal handler: it only sets a flag). Every
        rank's :attr:`should_stop` turns True after the same step."""
        self._stop_requested = True

    def sync(self) -> None:
        """Make every replica identical now (collective): the exchange's parameter average
        when it has one, and the batch-norm buffers averaged over the world. Also a control
        point: pending stop requests and non-finite gradients are agreed here."""
        self.skip_agreed = False
        self._agree(self.exchange.synchronize(self.params.data, self.optimizer.state_buffers(),
                                              self._flags()))
        self._average_buffers()
        self._outside_mark = None  # what follows a sync (evaluation, checkpoint) is no step's work
        self.clock.start()

    def _weight(self, count) -> int:
        if isinstance(count, bool) or not float(count).is_integer() or count < 0:
            raise ValueError(f"local_count must be an integer >= 0 (samples this step), got {count!r}")
        return int(count) if self.weighting == "balanced" else 1

    def _flags(self) -> tuple[float, float]:
        return float(self._stop_requested), float(self._nonfinite_pending)

    def _agree(self, sums) -> None:
        """Apply world-wide flag sums (the same on every rank)."""
        stop, nonfinite = sums
        self._nonfinite_pending = False
        if stop > 0:
            self.should_stop = self._stop_requested = True
        if nonfinite > 0 and self.on_nan == "skip":
            self.skip_agreed = True
        if nonfinite > 0 and self.on_nan == "stop":
            raise NonFiniteGradient(f"non-finite (NaN/Inf) gradient on some node before step {self.steps}; "
                                    "stopping (on_nan='stop')")

    # ------------------------------------------------------------------ small collectives
    def any(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on some rank (a control point: pending stop
        requests and non-finite gradients are agreed too)."""
        return self._decide(flag) > 0

    def all(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on every rank (a control point)."""
        return self._decide(flag) == self.size

    def _decide(self, flag: bool) -> float:
        buf = np.array([float(bool(flag)), *self._flags()])
        self.exchange.control.allreduce(buf)
        self._agree((buf[1], buf[2]))
        return buf[0]

    def sum(self, array: np.ndarray) -> np.ndarray:
        """World SUM of a host array, in place on every rank (e.g. confusion matrices)."""
        array = np.ascontiguousarray(array)
        self.exchange.control.allreduce(array)
        return array

    def all_gather_object(self, value) -> list:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        self.exchange.traffic.add("control", 0)
        return self.topology.world.allgather(value)

    def agree_on_error(self, error: str | None) -> str | None:
        """Every rank's ``error`` (or None) -> the first one, naming the ranks that had it."""
        return first_error(self.all_gather_object(error))

    def shard(self, n: int) -> tuple[int, int]:
        """``[lo, hi)`` of this rank's equal share of ``n`` items (e.g. the test set)."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    # ------------------------------------------------------------------ counters and timers
    def reset_counters(self) -> None:
        """Start a new period for :attr:`counters` and :meth:`timings` (e.g. every epoch)."""
        self.exchange.traffic.reset()
        self._compute_s: list[float] = []

    @property
    def counters(self) -> dict:
        """``{level: {"calls", "bytes"}}`` of this rank since :meth:`reset_counters`."""
        return self.exchange.traffic.counts

    def timings(self) -> dict:
        """Per-rank seconds since :meth:`reset_counters` (collective; lists indexed by rank):
        ``comp_s`` compute (:meth:`local_indices` to :meth:`step`); ``idle_s`` the time spent
        waiting for slower ranks, ``sum_t (max_j c_jt - c_it)`` over the period's steps ``t``;
        ``comm_s`` the rest of the time in collectives, ``max(0, wait_i - idle_i)``."""
        own = np.asarray(self._compute_s)
        gathered = self.all_gather_object((own.sum(), self.exchange.traffic.seconds, own))
        if len({g[2].size for g in gathered}) == 1 and own.size:
            steps = np.stack([g[2] for g in gathered])
            idle = (steps.max(axis=0, keepdims=True) - steps).sum(axis=1)
        else:  # no step in the period, or ranks that did not step together
            idle = np.zeros(self.size)
        return {"comp_s": [float(g[0]) for g in gathered],
                "comm_s": [max(0.0, g[1] - i) for g, i in zip(gathered, idle)],
                "idle_s": [float(i) for i in idle], "steps": int(own.size), "step_comp_s": list(self._compute_s)}

    # ------------------------------------------------------------------ replicas
    def buffers_host(self) -> dict:
        """Host copies of the model's buffers (batch-norm statistics); ``{}`` without a Model."""
        return {} if self.model is None else self.model.buffers_host()

    def _broadcast_initial_state(self) -> None:
        """Every replica starts from rank 0's parameters and buffers (as DDP does)."""
        world = self.topology.world
        if world.Get_size() == 1:
            return
        host = np.array(to_host(self.params.data), copy=True)
        world.Bcast(host, root=0)
        self.params.data[...] = get_array_module(self.params.data).asarray(host)
        buffers = self.buffers_host()
        if buffers:
            self.model.load_buffers_host(world.bcast(buffers, root=0))

    def _average_buffers(self) -> None:
        """Batch-norm running statistics are each rank's own; their world average makes every
        replica evaluate (and save) the same model. One collective for all of them."""
        buffers = self.buffers_host()
        if not buffers or self.size == 1:
            return
        names = sorted(buffers)
        flat = np.concatenate([np.asarray(buffers[n], np.float64).ravel() for n in names])
        self.exchange.control.allreduce(flat)
        flat /= self.size
        averaged, offset = {}, 0
        for n in names:
            shape = np.shape(buffers[n])
            averaged[n] = flat[offset:offset + int(np.prod(shape))].reshape(shape)
            offset += int(np.prod(shape))
        self.model.load_buffers_host(averaged)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Free what the exchange holds (collective); the model and optimizer stay usable."""
        self.exchange.close()

    def __enter__(self) -> "DataParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
