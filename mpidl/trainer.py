"""The training loop: the one place that knows both the layers and MPI.

One global step ``t`` of heterogeneous data parallelism (DESIGN.md):

1. The global batch of step ``t`` is ``perm_e[t*B : (t+1)*B]``, with ``perm_e`` one permutation
   of the training set per epoch, a pure function of ``(seed, epoch)``: the same samples
   whatever the world size and the speeds.
2. Rank ``i`` takes its contiguous slice of ``b_i`` samples (``b`` proportional to the ranks'
   speeds, summing to ``B``; a last, smaller batch is split by the same proportions, possibly
   giving a rank 0 samples) and reads only those.
3. Forward, loss (the local *mean*), backward: the model's flat gradient buffer holds ``g_i``.
4. The reducer exchanges the buffer: with balanced weighting ``g = sum_i (b_i/B) g_i``, the
   exact gradient of the global batch's mean loss.
5. The optimizer updates the flat parameter buffer; the ``node`` strategy may then average
   parameters between nodes (every ``K'`` steps).

Collective decisions. Anything that changes the communication pattern is decided identically
on every rank: the data plan is deterministic; a non-finite *reduced* gradient is seen by every
rank that shares it (MPI returns the same reduction result to all ranks of an allreduce, and
the hierarchical strategy broadcasts it); stop requests (SIGTERM, a node's NaN under the
``node`` strategy) are combined by a small world ``allreduce`` at fixed *control points*
(every :data:`CONTROL_EVERY` steps, at every inter-node sync of the ``node`` strategy, and at
every epoch end), so all ranks stop at the same step.
"""

from __future__ import annotations

import hashlib
import math
import signal
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from mpidl.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    read_checkpoint,
    read_checkpoint_meta,
    remove_stale_node_files,
    save_model,
    write_checkpoint,
    write_node_file,
)
from mpidl.checkpoint import FORMAT_VERSION as CHECKPOINT_FORMAT_VERSION
from mpidl.distributed import balance
from mpidl.distributed.emulation import LinkModel, Slowdown
from mpidl.distributed.reducers import make_reducer
from mpidl.log import MetricsWriter, RankTimingLog
from mpidl.metrics import classification_report, confusion_matrix
from mpidl.nn import SoftmaxCrossEntropy
from mpidl.optim import build_optimizer, make_schedule

CONTROL_EVERY = 10  # steps between stop-request checks for the exact strategies
PROBE_BATCH = 64  # samples per timed forward+backward when measuring speeds
EVAL_BATCH = 512


class NonFiniteGradient(RuntimeError):
    """The reduced gradient holds NaN or Inf and ``--on-nan stop`` is in force."""


class InjectedFault(RuntimeError):
    """Raised by ``--inject-fault RANK:STEP`` (a testing aid)."""


@dataclass
class EpochClock:
    """Per-rank timing of one epoch (seconds)."""

    comp: float = 0.0
    comm: float = 0.0
    step_comp: list = field(default_factory=list)
    loss_sum: float = 0.0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the training set in ``epoch``: identical on every rank and every world size."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def rank_slice(counts, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank`` inside a global batch split as ``counts``."""
    lo = int(sum(counts[:rank]))
    return lo, lo + int(counts[rank])


class Trainer:
    """Runs the epochs of one job. Build it on every rank with the same configuration."""

    def __init__(self, cfg, topo, backend, model, train_set, test_set, printer, data_desc=""):
        self.cfg = cfg
        self.topo = topo
        self.world = topo.world
        self.rank, self.size = topo.rank, topo.size
        self.backend = backend
        self.model = model
        self.params = model.params
        self.train_set = train_set
        self.test_set = test_set
        self.printer = printer
        self.data_desc = data_desc
        self.loss_fn = SoftmaxCrossEntropy()
        self.optimizer = build_optimizer(
            cfg.optimizer, self.params, lr=cfg.lr, momentum=cfg.momentum,
            weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
        )
        self.link = LinkModel(*cfg.link) if cfg.link else None
        self.reducer = make_reducer(
            cfg.strategy, topo, weighting=cfg.weighting, sync_every=cfg.sync_every,
            emulate_link=self.link,
        )
        factor = cfg.slowdown_list[self.rank] if cfg.slowdown_list else 1.0
        self.slowdown = Slowdown(factor)
        n = train_set.num_samples
        # A last, smaller global batch is split by the same proportions (possibly 0 samples on
        # some ranks), unless --drop-last skips it.
        self.steps_per_epoch = n // cfg.batch_size if cfg.drop_last else math.ceil(n / cfg.batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"--drop-last with --batch-size {cfg.batch_size} > {n} training samples leaves no step")
        total = cfg.epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.schedule = make_schedule(cfg.schedule, cfg.lr, self.total_steps, warmup_steps=cfg.warmup_steps)
        self.global_step = 0
        self.start_epoch = 0
        self.start_step_in_epoch = 0
        self.speeds: list[float] = [1.0] * self.size
        self.batch_sizes: list[int] = []
        self.stop_requested = False  # set by the SIGTERM handler
        self.nan_pending = False  # node strategy: this node saw a non-finite gradient
        self.metrics = MetricsWriter(cfg.metrics, self.rank, append=cfg.resume)
        self.timing = RankTimingLog(cfg.timing_dir, self.rank, append=cfg.resume)

    # ------------------------------------------------------------------ set-up
    def install_signal_handler(self) -> None:
        """SIGTERM (what Slurm sends before the time limit): finish the current step, agree
        at the next control point, checkpoint, exit 0.

        The handler only sets a flag: Python runs it between bytecodes, never inside an MPI
        call, so a rank blocked in a collective finishes it first. One rank receiving the
        signal is enough (the control point's ``Allreduce(MAX)`` spreads it). MPICH's
        ``mpiexec`` (hydra) forwards a SIGTERM it receives to every rank; Slurm signals every
        task of the step itself."""

        def on_term(signum, frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, on_term)

    def broadcast_parameters(self) -> None:
        """Every replica starts from rank 0's parameters (as DDP does), whatever the seeds."""
        host = self.backend.to_host(self.params.data).copy()
        self.world.Bcast(host, root=0)
        self.params.data[...] = self.backend.asarray(host)

    def measure_speeds(self) -> list[float]:
        """Relative speeds: equal (``--balance none``), given (``--speeds 1,2,...``) or
        measured (``--speeds auto``: samples/s of timed forward+backward passes of the real
        model on a probe batch, emulated slowdown included), gathered on every rank."""
        cfg = self.cfg
        if cfg.balance == "none":
            return [1.0] * self.size
        if cfg.speed_list is not None:
            return list(cfg.speed_list)
        probe = np.arange(min(PROBE_BATCH, self.train_set.num_samples))

        def step(n: int) -> None:
            self.compute(probe[:n])

        saved = self.model.buffers_host()  # probe passes must not move batch-norm statistics
        local = balance.measure_speed(step, len(probe), repeats=5, warmup=1,
                                      synchronize=self.backend.synchronize)
        if saved:
            self.model.load_buffers_host(saved)
        return [float(s) for s in self.world.allgather(local)]

    def setup(self) -> None:
        """Collective set-up: broadcast parameters, measure speeds, split the batch, resume."""
        self.broadcast_parameters()
        # One untimed pass compiles the Numba kernels (seconds, once per machine thanks to the
        # cache); without it the first timed pass, stretched by an emulated slowdown, would
        # turn compile time into minutes of sleep, and the speed probe would measure the JIT.
        # The node's first rank goes first and writes Numba's on-disk cache; the node's other
        # ranks then load the machine code instead of all compiling the same kernels at once.
        # They wait in a sleeping poll, not in MPI_Barrier, whose busy-wait would take the
        # cores from the compiling rank (default job, 4 ranks on 2 cores, cold cache: 56 s -> 26 s).
        saved = self.model.buffers_host()
        node = self.topo.node
        for first_turn in (True, False):
            if (node.Get_rank() == 0) == first_turn:
                self.compute(np.arange(min(2, self.train_set.num_samples)), emulate=False)
            if first_turn:
                waiting = node.Ibarrier()
                while not waiting.Test():
                    time.sleep(0.005)
        if saved:
            self.model.load_buffers_host(saved)
        self.speeds = self.measure_speeds()
        self.batch_sizes = balance.batch_sizes(self.speeds, self.cfg.batch_size)
        if self.cfg.resume:
            self.resume()

    # ------------------------------------------------------------------ one step
    def compute(self, indices: np.ndarray, emulate: bool = True) -> tuple[float, float]:
        """Forward + backward on this rank's samples; returns (local mean loss, seconds).

        With no samples the gradient is zero: the rank still joins every collective.
        ``emulate=False`` skips the emulated slowdown (for the JIT warm-up)."""
        t0 = time.perf_counter()
        if len(indices) == 0:
            self.params.grad.fill(0)
            loss = 0.0
        else:
            x, y = self.train_set.read(indices)
            logits = self.model.forward(self.backend.asarray(x))
            loss = self.loss_fn.forward(logits, y)  # host labels: checked without a device sync
            self.model.backward(self.loss_fn.backward())
        self.backend.synchronize()
        seconds = time.perf_counter() - t0
        if emulate:
            seconds += self.slowdown.stretch(seconds)  # EMULATION: sleeps (f - 1) * seconds
        return float(loss), seconds

    def train_step(self, indices: np.ndarray, counts, clock: EpochClock) -> bool:
        """One global step on every rank. Returns True when an inter-node sync happened."""
        cfg = self.cfg
        fault_now = cfg.fault is not None and cfg.fault[:2] == (self.rank, self.global_step)
        if fault_now and cfg.fault[2] == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at step {self.global_step} (--inject-fault)")
        self.optimizer.lr = self.schedule(self.global_step)
        loss, seconds = self.compute(indices)
        if fault_now:  # kind "nan": a poisoned local gradient, to test the collective NaN decision
            self.params.grad[0] = float("nan")
        clock.comp += seconds
        clock.step_comp.append(seconds)
        clock.loss_sum += loss * len(indices)
        clock.samples += len(indices)

        t0 = time.perf_counter()
        self.reducer.reduce_gradients(self.params.grad, counts)
        clock.comm += time.perf_counter() - t0

        # One float64 sum instead of an elementwise test: NaN or Inf anywhere makes it
        # non-finite, with no parameter-sized temporary and one device sync on a GPU.
        if bool(self.backend.xp.isfinite(self.params.grad.sum(dtype=np.float64))):
            self.optimizer.step()
        elif cfg.on_nan == "skip":
            self.printer.warning(f"non-finite gradient at step {self.global_step}: step skipped (--on-nan skip)")
        elif cfg.strategy == "node":
            self.nan_pending = True  # decided with the other nodes at the next control point
        else:
            raise NonFiniteGradient(
                f"non-finite (NaN/Inf) reduced gradient at step {self.global_step}; stopping "
                "(--on-nan stop). Lower --lr or use --on-nan skip."
            )

        t0 = time.perf_counter()
        synced = self.reducer.after_step(self.params.data, self.global_step + 1)
        clock.comm += time.perf_counter() - t0
        self.global_step += 1
        if self.cfg.check_replicas and (synced or cfg.strategy != "node"):
            self.check_replicas()
        return synced

    def control_point(self) -> bool:
        """Combine the ranks' stop requests; True (on every rank) if the job must stop now."""
        flags = np.array([self.stop_requested, self.nan_pending], dtype=np.int32)
        self.world.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        if flags[1]:
            raise NonFiniteGradient(
                f"non-finite (NaN/Inf) gradient on some node before step {self.global_step}; "
                "stopping (--on-nan stop)"
            )
        self.stop_requested = bool(flags[0])
        return self.stop_requested

    def check_replicas(self) -> None:
        """Debug (``--check-replicas``): every replica's parameters must be bitwise equal."""
        digest = hashlib.sha1(self.backend.to_host(self.params.data).tobytes()).hexdigest()
        digests = self.world.allgather(digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"replicas diverged at step {self.global_step}: checksums {digests}")

    # ------------------------------------------------------------------ epochs
    def evaluate(self) -> dict:
        """OA, AA and kappa on the test split: each rank scores a contiguous shard, and the
        confusion matrices (which add up) are summed with one Allreduce."""
        self.model.eval()
        n = self.test_set.num_samples
        k = self.model.num_classes
        lo, hi = self.rank * n // self.size, (self.rank + 1) * n // self.size
        cm = np.zeros((k, k), dtype=np.int64)
        for start in range(lo, hi, EVAL_BATCH):
            x, y = self.test_set.read(np.arange(start, min(start + EVAL_BATCH, hi)))
            logits = self.model.forward(self.backend.asarray(x))
            pred = self.backend.to_host(logits.argmax(axis=1))
            cm += confusion_matrix(y, pred, k)
        self.world.Allreduce(MPI.IN_PLACE, cm, op=MPI.SUM)
        self.model.train()
        return classification_report(cm)

    def average_buffers(self) -> None:
        """Batch-norm running statistics are per rank; average them so every replica
        evaluates (and saves) the same model."""
        averaged = self._buffers_averaged_host()
        if averaged:
            self.model.load_buffers_host(averaged)

    def end_epoch(self, epoch: int, clock: EpochClock, stopped: bool) -> dict:
        """Epoch-end collectives: parameter sync, statistics, evaluation, re-balancing."""
        t0 = time.perf_counter()
        if self.cfg.strategy == "node":
            # Skipped when the periodic K' sync has just run at this very step: the replicas
            # are already identical (no sample processed since), so it would only cost traffic.
            if any(self.reducer.node_samples):
                self.reducer.sync_parameters(self.params.data)
            if self.cfg.sync_optimizer_state:
                self.reducer.sync_optimizer_state(self.optimizer.state_buffers())
        clock.comm += time.perf_counter() - t0
        self.average_buffers()
        wall = time.perf_counter() - clock.start
        gathered = self.world.allgather(
            (clock.comp, clock.comm, np.asarray(clock.step_comp), clock.loss_sum, clock.samples)
        )
        comp = [g[0] for g in gathered]
        comm_total = [g[1] for g in gathered]
        # Idle time: in each step a rank waits in the reduction for the slowest rank's compute.
        # idle_i = sum_t (max_j c_jt - c_it); the rest of the time spent in the reducer is
        # communication proper. An estimate (message timing is not separated), labelled so.
        steps = np.stack([g[2] for g in gathered]) if gathered[0][2].size else np.zeros((self.size, 0))
        idle = (steps.max(axis=0, keepdims=True) - steps).sum(axis=1) if steps.size else np.zeros(self.size)
        comm = [max(0.0, c - i) for c, i in zip(comm_total, idle)]
        samples = sum(g[4] for g in gathered)
        loss = sum(g[3] for g in gathered) / max(samples, 1)
        report = self.evaluate()
        record = {
            "event": "epoch", "epoch": epoch + 1, "step": self.global_step, "loss": loss,
            "oa": report["oa"], "aa": report["aa"], "kappa": report["kappa"],
            "lr": float(self.optimizer.lr), "time_s": wall,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "strategy": self.cfg.strategy, "weighting": self.cfg.weighting,
            "batch_sizes": list(self.batch_sizes), "speeds": list(self.speeds),
            "comp_s": comp, "comm_s": comm, "idle_s": [float(i) for i in idle],
            "comm": self.reducer.counters,
        }
        self.metrics.write(record)
        self.timing.write({"event": "epoch", "epoch": epoch + 1, "rank": self.rank, "comp_s": clock.comp,
                           "comm_s": clock.comm, "samples": clock.samples, "step_comp_s": clock.step_comp})
        self.print_epoch(record)
        if self.cfg.rebalance and not stopped:
            self.rebalance(comp, [g[4] for g in gathered])
        return record

    def rebalance(self, comp_seconds, samples) -> None:
        """``--rebalance``: new speeds from this epoch's own compute time per sample (every
        rank has the same gathered numbers, so every rank computes the same split)."""
        new_speeds = balance.rebalance(comp_seconds, samples, self.speeds)
        new_sizes = balance.batch_sizes(new_speeds, self.cfg.batch_size)
        self.speeds = [float(s) for s in new_speeds]
        if new_sizes != self.batch_sizes:
            self.printer.info(f"  rebalance: batch sizes {self.batch_sizes} -> {new_sizes}")
            self.batch_sizes = new_sizes

    def print_epoch(self, r: dict) -> None:
        total = max(r["time_s"], 1e-12)
        comp = max(r["comp_s"])
        self.printer.info(
            f"epoch {r['epoch']:3d}/{self.cfg.epochs}  loss {r['loss']:.4f}  OA {100 * r['oa']:6.2f}%  "
            f"AA {100 * r['aa']:6.2f}%  kappa {r['kappa']:.4f}  {r['samples_per_s']:8.0f} samples/s  "
            f"{r['time_s']:6.2f} s (comp {100 * comp / total:3.0f}%, comm+idle {100 * (1 - comp / total):3.0f}%)"
        )

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self, epoch_done: int, step_in_epoch: int) -> dict:
        """The attributes of ``checkpoint.h5`` (see :mod:`mpidl.checkpoint`)."""
        node_samples = getattr(self.reducer, "node_samples", None)
        return {
            "epoch": epoch_done, "step_in_epoch": step_in_epoch, "global_step": self.global_step,
            "optimizer_step": int(self.optimizer.step_count), "batch_sizes": list(self.batch_sizes),
            "speeds": list(self.speeds), "config": self.cfg.to_dict(), "model": self.model.name,
            "build_args": self.model.build_args, "world_size": self.size,
            "num_nodes": self.topo.num_nodes,
            "node_samples": None if node_samples is None else [int(s) for s in node_samples],
            "num_train_samples": int(self.train_set.num_samples),
            "format_version": CHECKPOINT_FORMAT_VERSION,
        }

    def _buffers_averaged_host(self) -> dict:
        """Host copies of the batch-norm buffers averaged over the replicas (collective when
        the model has buffers); the model's own buffers are left alone."""
        averaged = {}
        for name, value in self.model.buffers_host().items():
            value = np.array(value, dtype=np.float64, copy=True)
            self.world.Allreduce(MPI.IN_PLACE, value, op=MPI.SUM)
            averaged[name] = value / self.size
        return averaged

    def _consensus_parameters_host(self, local) -> np.ndarray:
        """``sum_n v_n theta_n`` with the node weights the next inter-node sync would use,
        computed on a host copy (collective); the replicas keep their own parameters.

        Every rank adds ``v_n / |R_n| theta_i``: the ``|R_n|`` replicas of node ``n`` are equal.
        """
        weights = self.reducer.node_weights()
        part = local * (weights[self.topo.node_id] / self.topo.local_size)
        self.world.Allreduce(MPI.IN_PLACE, part, op=MPI.SUM)
        return part

    def save_checkpoint(self, epoch_done: int, step_in_epoch: int) -> None:
        """Collective: node leaders write per-node state first (when it is node-local),
        then rank 0 atomically replaces ``checkpoint.h5``, then stale node files go; see
        :mod:`mpidl.checkpoint`.

        ``step_in_epoch > 0`` is a stop inside epoch ``epoch_done``: it must be called before
        the epoch-end collectives (which an uninterrupted run would not do at that step), so
        it averages the batch-norm buffers itself, on copies.
        """
        folder = self.cfg.checkpoint
        mid_epoch = step_in_epoch > 0
        multi_node = self.cfg.strategy == "node" and self.topo.num_nodes > 1
        # Between inter-node syncs the nodes' parameters differ; every rank knows every
        # node's sample count, so every rank takes the same branch.
        node_params = multi_node and any(self.reducer.node_samples)
        # The optimizer state is the same everywhere only right after an epoch-end
        # sync with --sync-optimizer-state.
        node_state = multi_node and (mid_epoch or not self.cfg.sync_optimizer_state)
        meta = self.checkpoint_meta(epoch_done, step_in_epoch)
        meta.update(node_state=node_state, node_params=node_params)
        local = np.array(self.backend.to_host(self.params.data), copy=True)
        params = self._consensus_parameters_host(local) if node_params else local
        buffers = self._buffers_averaged_host() if mid_epoch else self.model.buffers_host()
        # Inside an epoch each rank's batch-norm statistics are still its own: keep them all.
        rank_buffers = self.world.gather(self.model.buffers_host(), root=0) if mid_epoch and buffers else None
        state = [np.array(self.backend.to_host(b), copy=True) for b in self.optimizer.state_buffers()]
        with_node_files = node_state or node_params
        if with_node_files and self.topo.is_leader:
            write_node_file(folder, self.topo.node_id, optimizer_state=state if node_state else None,
                            params=local if node_params else None, meta=meta)
        self.world.Barrier()  # every node file exists before checkpoint.h5 names its step
        if self.rank == 0:
            write_checkpoint(folder, params=params, buffers=buffers,
                             optimizer_state=None if node_state else state, meta=meta,
                             rank_buffers=rank_buffers)
        self.world.Barrier()  # checkpoint.h5 names this step before older node files go
        if self.topo.is_leader:
            remove_stale_node_files(folder, self.topo.node_id, self.global_step if with_node_files else None)
        self.printer.info(f"  checkpoint: {folder} (epoch {epoch_done}, step {self.global_step})")

    def resume(self) -> None:
        """Load ``--checkpoint DIR`` (collective). Every rank reads the files, then the ranks
        agree: any rank's failure raises the same :class:`CheckpointError` on every rank
        (before any state is used), so the job can end cleanly."""
        error = None
        try:
            meta = self._load_checkpoint()
        except (CheckpointError, OSError, KeyError, ValueError) as exc:
            error = str(exc) if isinstance(exc, CheckpointError) else f"--resume: {exc}"
        errors = self.world.allgather(error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            failing = [r for r, e in enumerate(errors) if e is not None]
            where = "" if len(failing) == self.size else f" (on ranks {failing})"
            raise CheckpointError(first + where)
        self.printer.info(
            f"resumed from {self.cfg.checkpoint}: epoch {meta['epoch']}, step {self.global_step}"
        )

    def _load_checkpoint(self) -> dict:
        """Read, check and apply this rank's part of the checkpoint; returns its attributes."""
        cfg = self.cfg
        multi_node = cfg.strategy == "node" and self.topo.num_nodes > 1
        meta = read_checkpoint_meta(cfg.checkpoint)
        path = f"{cfg.checkpoint}/{CHECKPOINT_NAME}"
        if meta["build_args"] != self.model.build_args or meta.get("model", self.model.name) != self.model.name:
            raise CheckpointError(
                f"--resume: {path} holds model {meta.get('model')} {meta['build_args']}, "
                f"but this run builds {self.model.name} {self.model.build_args}"
            )
        if (meta.get("node_state") or meta.get("node_params")) and (
                not multi_node or meta.get("num_nodes") != self.topo.num_nodes):
            raise CheckpointError(
                f"--resume: {path} holds per-node state of {meta.get('num_nodes')} nodes "
                f"(--strategy node); this run has strategy {cfg.strategy} on {self.topo.num_nodes} "
                "node(s). Resume with the same strategy and number of nodes."
            )
        if meta["step_in_epoch"] > 0:
            old = meta.get("config", {}).get("batch_size"), meta.get("num_train_samples")
            if old != (cfg.batch_size, self.train_set.num_samples):
                raise CheckpointError(
                    f"--resume: {path} was taken inside an epoch with --batch-size {old[0]} and "
                    f"{old[1]} training samples; this run has --batch-size {cfg.batch_size} and "
                    f"{self.train_set.num_samples}: the rest of the epoch would differ"
                )
        ck = read_checkpoint(cfg.checkpoint, node_id=self.topo.node_id if multi_node else None)
        meta = ck["meta"]
        if ck["params"].shape != (self.params.size,):
            raise CheckpointError(
                f"--resume: {path} has {ck['params'].size} parameters, the model {self.params.size}")
        # Everything is checked before anything is written (load_state_dict_host checks first).
        self.optimizer.load_state_dict_host({"state": ck["optimizer_state"], "step_count": meta["optimizer_step"]})
        self.params.data[...] = self.backend.asarray(ck["params"])
        if ck["rank_buffers"] is not None and len(ck["rank_buffers"]) == self.size:
            self.model.load_buffers_host(ck["rank_buffers"][self.rank])
        elif ck["buffers"]:
            self.model.load_buffers_host(ck["buffers"])
        self.start_epoch, self.start_step_in_epoch = meta["epoch"], meta["step_in_epoch"]
        self.global_step = meta["global_step"]
        if meta["world_size"] == self.size:
            # same split as before the interruption, so the run continues exactly
            self.batch_sizes, self.speeds = list(meta["batch_sizes"]), list(meta["speeds"])
        if (cfg.strategy == "node" and meta.get("node_samples") is not None
                and meta.get("num_nodes") == self.topo.num_nodes):
            # samples since the last inter-node sync: the weights of the next one
            self.reducer.node_samples = [int(s) for s in meta["node_samples"]]
        return meta

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """Train; returns the final record (also written as the metrics ``end`` event)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        stopped = "completed"
        last = None
        epoch = self.start_epoch
        for epoch in range(self.start_epoch, cfg.epochs):
            perm = epoch_permutation(cfg.seed, epoch, self.train_set.num_samples)
            self.train_set.set_epoch(epoch)  # augmentation draws are a function of (seed, epoch, index)
            clock = EpochClock()
            self.reducer.reset_counters()  # the metrics report traffic per epoch
            first = self.start_step_in_epoch if epoch == self.start_epoch else 0
            last_print = time.perf_counter()
            step_in_epoch = first
            for step_in_epoch in range(first, self.steps_per_epoch):
                if self.global_step >= self.total_steps:
                    stopped = "max_steps"
                    break
                batch = perm[step_in_epoch * cfg.batch_size:(step_in_epoch + 1) * cfg.batch_size]
                counts = (self.batch_sizes if len(batch) == cfg.batch_size
                          else balance.split_counts(len(batch), self.batch_sizes))
                lo, hi = rank_slice(counts, self.rank)
                synced = self.train_step(batch[lo:hi], counts, clock)
                at_control = synced if cfg.strategy == "node" else self.global_step % CONTROL_EVERY == 0
                if at_control and self.control_point():
                    stopped = "signal"
                    step_in_epoch += 1
                    break
                if self.rank == 0 and time.perf_counter() - last_print > cfg.progress_every_s:
                    last_print = time.perf_counter()
                    self.printer.info(f"  epoch {epoch + 1} step {step_in_epoch + 1}/{self.steps_per_epoch}")
            else:
                step_in_epoch = self.steps_per_epoch
            if stopped == "completed" and self.control_point():
                stopped = "signal"
            finished_epoch = step_in_epoch >= self.steps_per_epoch
            epochs_done = epoch + 1 if finished_epoch else epoch
            # A stop inside an epoch is checkpointed before the epoch-end collectives (parameter
            # and optimizer-state sync, buffer averaging), which an uninterrupted run would not
            # do at this step: the resumed run then continues exactly.
            saved_mid_epoch = bool(cfg.checkpoint) and stopped != "completed" and not finished_epoch
            if saved_mid_epoch:
                self.save_checkpoint(epochs_done, step_in_epoch)
            if clock.step_comp:
                last = self.end_epoch(epoch, clock, stopped != "completed")
            if cfg.checkpoint and not saved_mid_epoch and (
                    stopped != "completed" or epochs_done % cfg.checkpoint_every == 0 or epochs_done == cfg.epochs):
                self.save_checkpoint(epochs_done, 0)
            if stopped != "completed":
                break
        if last is None:
            last = {"oa": float("nan"), "aa": float("nan"), "kappa": float("nan")}
            last.update({k: v for k, v in self.evaluate().items() if k in ("oa", "aa", "kappa")})
        if cfg.save and self.rank == 0:
            save_model(cfg.save, self.model)
        end = {
            "event": "end", "epochs": last.get("epoch", epoch), "step": self.global_step,
            "oa": last["oa"], "aa": last["aa"], "kappa": last["kappa"],
            "time_s": time.perf_counter() - t_start, "stopped": stopped,
        }
        self.metrics.write(end)
        self.metrics.close()
        self.timing.close()
        return end
