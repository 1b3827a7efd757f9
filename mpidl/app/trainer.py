"""The classification loop, written on the public distributed API (:class:`DataParallel`).

It knows the layers, the data and the metrics; everything that talks MPI is behind ``self.dp``.
One global step ``t`` (docs/design.md):

1. The global batch of step ``t`` is ``perm_e[t*B : (t+1)*B]``, with ``perm_e`` one permutation
   of the training set per epoch, a pure function of ``(seed, epoch)``: the same samples
   whatever the world size and the speeds.
2. ``dp.local_indices`` gives rank ``i`` its contiguous slice of ``b_i`` samples (``b``
   follows the ranks' speeds and sums to ``B``; a last, smaller batch is split by the same
   proportions, possibly giving a rank 0 samples); the rank reads only those.
3. Forward, loss (the local *mean*), backward: the model's flat gradient buffer holds ``g_i``.
4. ``dp.step`` reduces it (balanced weighting: ``g = sum_i (b_i/B) g_i``, the exact gradient
   of the global batch's mean loss), applies the optimizer and, for the ``node`` strategy,
   averages the parameters between nodes every ``K'`` steps.

At an epoch's end ``dp.sync()`` makes the replicas identical (and agrees on pending stop
requests and non-finite gradients), then the test split is evaluated in shards and the epoch
is recorded. Stops are collective by construction: ``dp.should_stop`` turns True on every
rank after the same step.

Lost ranks (``--on-failure shrink``): an epoch is one stretch of
:func:`~mpidl.distributed.elastic.loop.run_surviving`. When ranks are lost, the survivors are
back at the state before some global step with the batch re-split over them, and the epoch
runs again from that step: the survivors compute the lost ranks' samples, none skipped, none
counted twice (each step's loss is kept by its global step). The learning rate follows
``dp.steps``; the epoch-end sync, evaluation and checkpoint run (again) on the survivors.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from mpidl.app.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint, save_checkpoint, save_model
from mpidl.app.config import MIN_LOCAL_BATCH, SYNC_EVERY_EPOCH
from mpidl.distributed import NonFiniteGradient, data_parallel, launch
from mpidl.distributed.build import join_data_parallel
from mpidl.distributed.debug import check_replicas
from mpidl.distributed.elastic.loop import run_surviving
from mpidl.distributed.watchdog import ProgressWatchdog, parse_failure_timeout
from mpidl.app.log import MetricsWriter, RankTimingLog
from mpidl.app.metrics import classification_report, confusion_matrix
from mpidl.app.netstat import WireCounter, per_host
from mpidl.engine.nn import SoftmaxCrossEntropy
from mpidl.engine.optim import build_optimizer, make_schedule
from mpidl.app.outputs import cause, rescue_model

EVAL_BATCH = 512
#: samples the speed probe cycles through (at most the training set)
PROBE_SAMPLES = 64


class OutputWriteError(RuntimeError):
    """A checkpoint or the final model could not be written (disk full, quota, a file system
    gone); raised on every rank alike. The message names the path, the cause and where the
    trained model was rescued to (:func:`mpidl.app.outputs.rescue_model`)."""


#: the options that shape the trajectory of a run whatever the world size: a resumed run
#: must have the checkpoint's (``--epochs`` and ``--max-steps`` may grow, to train longer)
RESUME_OPTIONS = ("seed", "batch_size", "drop_last", "optimizer", "lr", "momentum", "nesterov",
                  "weight_decay", "schedule", "warmup_steps", "augment", "weighting", "dtype")


def data_identity(train_set, test_set) -> dict:
    """What a checkpoint records of its data, compared at every resume: the sample counts,
    the classes and a content fingerprint. A layout file's fingerprint is the one stored at
    conversion (:func:`mpidl.data.layout.fingerprint`); for a file without one, a hash of its
    labels and stored statistics; for in-memory data, a hash of the samples and labels."""
    import hashlib  # noqa: PLC0415

    from mpidl.data.layout import stored_fingerprint  # noqa: PLC0415

    identity = {"train": int(train_set.num_samples), "test": int(test_set.num_samples),
                "classes": list(train_set.class_names)}
    path = getattr(train_set, "path", None)
    stored = stored_fingerprint(path) if path else None
    if stored is None:
        digest = hashlib.sha256()
        for dataset in (train_set, test_set):
            digest.update(np.ascontiguousarray(dataset.labels, dtype="<i8").tobytes())
            if path:
                digest.update(np.asarray(dataset.meta["mean"], "<f8").tobytes())
                digest.update(np.asarray(dataset.meta["std"], "<f8").tobytes())
            elif hasattr(dataset, "_x"):
                digest.update(np.ascontiguousarray(dataset._x, dtype="<f4").tobytes())
        stored = ("labels+stats:" if path else "arrays:") + digest.hexdigest()
    identity["fingerprint"] = stored
    return identity


@dataclass
class EpochTotals:
    """This rank's loss and samples of one epoch, by global step (a step run again after lost
    ranks replaces its entry)."""

    by_step: dict = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)

    def add(self, step: int, loss: float, samples: int) -> None:
        self.by_step[step] = (loss * samples, samples)

    @property
    def loss_sum(self) -> float:
        return sum(loss for loss, _ in self.by_step.values())

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.by_step.values())

    @property
    def steps(self) -> int:
        return len(self.by_step)


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the training set in ``epoch``: identical on every rank and every world size."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def steps_per_epoch(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """Global steps of one epoch: ``ceil(N / B)``, or ``floor(N / B)`` with ``drop_last``."""
    return num_samples // batch_size if drop_last else math.ceil(num_samples / batch_size)


class Trainer:
    """Runs the epochs of one job. Build it on every rank with the same configuration
    (construction is collective: it builds the :class:`DataParallel`).

    ``handle_sigterm=True`` (the command line) installs the SIGTERM handler first, so that a
    signal that arrives while the ranks warm up and measure their speeds is not lost."""

    def __init__(self, cfg, model, train_set, test_set, printer, topology=None, handle_sigterm=False,
                 joining=False):
        self._signalled = False
        if handle_sigterm:
            self.install_signal_handler()
        self.cfg = cfg
        self.model = model
        self.params = model.params
        self.backend = model.backend
        self.train_set = train_set
        self.test_set = test_set
        self.printer = printer
        self.loss_fn = SoftmaxCrossEntropy()
        self.optimizer = build_optimizer(
            cfg.optimizer, self.params, lr=cfg.lr, momentum=cfg.momentum,
            weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
        )
        if test_set.num_samples == 0:
            raise ValueError("the test split is empty (0 samples): there is nothing to evaluate on")
        self.steps_per_epoch = steps_per_epoch(train_set.num_samples, cfg.batch_size, cfg.drop_last)
        if self.steps_per_epoch == 0:
            raise ValueError(f"--drop-last with --batch-size {cfg.batch_size} > "
                             f"{train_set.num_samples} training samples leaves no step")
        total = cfg.epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.schedule = make_schedule(cfg.schedule, cfg.lr, self.total_steps, warmup_steps=cfg.warmup_steps)
        self._probe_samples = np.arange(min(PROBE_SAMPLES, train_set.num_samples))
        #: K' of the node strategy: ``--sync-every``, with ``epoch`` resolved to the steps per epoch
        self.sync_every = self.steps_per_epoch if cfg.sync_every == SYNC_EVERY_EPOCH else cfg.sync_every
        speeds = "equal" if cfg.balance == "none" else (cfg.speed_list or "auto")
        #: whether a host was brought in for a lost one already (--replace-with is used once)
        self.replaced = False
        self.start_epoch = 0
        self.start_step_in_epoch = 0
        if joining:  # started into the running job by grow: its state, and where its loop is
            self.dp, where = join_data_parallel(
                model, self.optimizer, batch_size=cfg.batch_size, strategy=cfg.strategy,
                sync_every=self.sync_every, sync_optimizer_state=cfg.sync_optimizer_state,
                weighting=cfg.weighting, on_nan=cfg.on_nan, emulate_link=cfg.emulate_link)
            self.start_epoch, self.start_step_in_epoch = where["epoch"], where["step_in_epoch"]
            self.replaced = True
        else:
            self.dp = self._data_parallel(model, cfg, speeds, topology)
        if self._signalled:
            self.dp.request_stop()
        self.rank = self.dp.rank
        #: this rank's rank at start-up (``self.rank`` changes when ranks are lost); a joined
        #: rank's is the id the job gave it
        self.startup_rank = self.dp.startup_id if joining else self.dp.rank
        #: failure records (``dp.failures``) already written to the metrics
        self._failures_written = 0
        #: (path, message) of the first failed metrics or timing write on this rank
        self._log_failure = None
        self.metrics = MetricsWriter(cfg.metrics, self.rank, append=cfg.resume or joining)
        self.timing = RankTimingLog(cfg.timing_dir, self.rank, append=cfg.resume or joining)
        #: the failure bound (:mod:`mpidl.distributed.watchdog`; more than one rank only):
        #: started by :meth:`run`, marked after every step, evaluation batch and checkpoint. A
        #: rank that joined a running job (--replace-with) runs without one: its world is not
        #: the job's start-up world the heartbeats are addressed by.
        self.watchdog = None
        if launch.world()[1] > 1 and not joining:
            self.watchdog = ProgressWatchdog.create(parse_failure_timeout(cfg.failure_timeout), launch.allgather,
                                                    self.startup_rank, socket.gethostname())

    def _data_parallel(self, model, cfg, speeds, topology):
        return data_parallel(
            model, self.optimizer, batch_size=cfg.batch_size, topology=topology,
            strategy=cfg.strategy, sync_every=self.sync_every, weighting=cfg.weighting,
            sync_optimizer_state=cfg.sync_optimizer_state, speeds=speeds, probe=self._probe,
            balance_threshold=cfg.balance_threshold, min_local_batch=MIN_LOCAL_BATCH,
            rebalance_every=cfg.rebalance_every if cfg.rebalance else None, on_nan=cfg.on_nan,
            intra=cfg.intra, overlap=cfg.overlap, bucket_mb=cfg.bucket_mb, compress=cfg.compress,
            sync_overlap=cfg.sync_overlap, emulate_slowdown=cfg.slowdown_list or 1.0,
            emulate_clock=cfg.emulate_clock, emulate_link=cfg.emulate_link, on_failure=cfg.on_failure,
        )

    def progress(self, where: str) -> None:
        """A progress mark for the failure bound (:mod:`mpidl.distributed.watchdog`)."""
        if self.watchdog is not None:
            self.watchdog.mark(where)

    @property
    def global_step(self) -> int:
        """Global steps done (restored on resume)."""
        return self.dp.steps

    def install_signal_handler(self) -> None:
        """SIGTERM (what Slurm sends before the time limit) or SIGUSR1: finish the current
        step, stop with every rank after the same step, checkpoint, exit 0.

        The handler only sets a flag (``dp.request_stop``): Python runs it between bytecodes,
        never inside an MPI call. One rank receiving the signal is enough: the flag travels
        with the next step's message. MPICH's ``mpiexec`` (hydra) forwards a SIGTERM it
        receives to every rank; Slurm signals every task of the step itself. Open MPI's
        ``mpiexec`` (prterun) treats SIGTERM as "abort the job" (it kills the ranks about a
        second later and exits 1), but forwards SIGUSR1, which both launchers and ``srun`` pass on:
        that is the signal to send to a launcher (``#SBATCH --signal=B:USR1@120``).

        SIGINT (Ctrl-C) is the same stop request the first time; the handler then gives
        SIGINT back its default action, so that a second one ends this rank at once (the
        kernel's, even inside an MPI call) and the launcher ends the others."""

        def on_term(signum, frame):
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
            if getattr(self, "dp", None) is None:
                self._signalled = True  # still building: passed on once the dp exists
            else:
                self.dp.request_stop()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGUSR1, on_term)
        signal.signal(signal.SIGINT, on_term)

    # ------------------------------------------------------------------ one step
    def compute(self, indices: np.ndarray) -> float:
        """Forward + backward on this rank's samples; returns the local mean loss.

        With no samples the gradient is zero: the rank still joins every collective."""
        if len(indices) == 0:
            self.params.grad.fill(0)
            return 0.0
        x, y = self.train_set.read(indices)
        logits = self.model.forward(self.backend.asarray(x))
        loss = self.loss_fn.forward(logits, y)  # host labels: checked without a device sync
        self.model.backward(self.loss_fn.backward())
        return float(loss)

    def _probe(self, n: int) -> None:
        """One forward + backward on ``n`` training samples (for the speed probe)."""
        self.compute(np.resize(self._probe_samples, n))

    def train_step(self, local: np.ndarray) -> float:
        """One global step on this rank (every rank calls it for every step); returns the
        local mean loss."""
        step = self.dp.steps
        self.optimizer.lr = self.schedule(step)
        loss = self.compute(local)
        try:
            synced = self.dp.step(len(local))
        except NonFiniteGradient as exc:
            raise self._explain_nonfinite(exc, local) from None
        if self.cfg.check_replicas and (self.dp.exchange.exact or synced):
            check_replicas(self.dp)
        self.report_skips(step)
        change = self.dp.split.last_change
        if change is not None:
            self.log(self.metrics, {"event": "rebalance", **change})
            self.printer.info(f"  rebalance after step {change['step']}: batch sizes {change['old']} -> "
                              f"{change['new']} (predicted step {1e3 * change['predicted_old_s']:.3g} -> "
                              f"{1e3 * change['predicted_new_s']:.3g} ms)")
        return loss

    def report_skips(self, step: int | None = None) -> None:
        """Rank 0 warns and records (a metrics ``skip`` event) a step skipped on its node,
        at that ``step``, and one skipped on another node once the ranks agree on it at a
        parameter sync (node strategy; ``step`` None: after :meth:`DataParallel.sync`)."""
        if step is not None and self.dp.last_step_skipped:
            self.printer.warning(f"non-finite gradient at step {step}: step skipped (--on-nan skip)")
            self.log(self.metrics, {"event": "skip", "step": step})
        if self.dp.skip_agreed:
            self.printer.warning(f"non-finite gradient on a node since the previous parameter sync (agreed at "
                                 f"the sync after {self.dp.steps} steps): that node skipped its step (--on-nan skip)")
            self.log(self.metrics, {"event": "skip", "agreed_at_step": self.dp.steps})

    def _explain_nonfinite(self, exc: NonFiniteGradient, local: np.ndarray) -> NonFiniteGradient:
        """Collective (every rank raises at the same step): when the step's samples hold
        NaN or Inf, say that the data are the cause, naming the first such sample."""
        bad = []
        if len(local):
            x, _ = self.train_set.read(local)
            finite = np.isfinite(x.reshape(len(local), -1)).all(axis=1)
            bad = [int(i) for i in np.asarray(local)[~finite]]
        found = sorted(i for part in self.dp.all_gather_object(bad) for i in part)
        if not found:
            return exc
        name = getattr(self.train_set, "name", "the training data")
        return NonFiniteGradient(
            f"non-finite (NaN/Inf) reduced gradient at step {self.dp.steps}, caused by the data: "
            f"{len(found)} sample(s) of this step's batch hold NaN or Inf values, the first is "
            f"sample {found[0]} of {name} (fix or convert the data again; python -m "
            "mpidl.data_tools info FILE finds them all)")

    # ------------------------------------------------------------------ lost ranks
    def ranks_lost(self, lost, epoch: int | None = None, step_in_epoch: int | None = None) -> None:
        """After a shrink (``--on-failure shrink``): the survivors' rank 0 takes over the log
        and the metrics, and says what happened. With ``--replace-with HOST``, the ranks lost
        (a host's) are replaced once, by as many on HOST: :meth:`grow_back`."""
        self.rank = self.dp.rank
        self.printer.rank = self.dp.rank
        if self.watchdog is not None:  # the job went on without them: not named again
            self.watchdog.forget(lost.event.get("lost_ranks", []))
        if self.rank == 0 and self.metrics.file is None and self.cfg.metrics:
            self.metrics = MetricsWriter(self.cfg.metrics, 0, append=True)
        self.printer.warning(f"{lost}")
        if self.cfg.replace_with and not self.replaced and epoch is not None:
            if self.cfg.replace_with in lost.event["emptied_hosts"]:
                # Open MPI fails the new ranks' MPI_Init there and ends the whole job
                self.replaced = True
                self.printer.warning(f"--replace-with {self.cfg.replace_with}: not replaced, that host lost all its "
                                     "ranks in this job and cannot take new ones (docs/failures.md)")
                return
            self.grow_back(len(lost.event["lost_ranks"]), epoch, step_in_epoch)

    def grow_back(self, count: int, epoch: int, step_in_epoch: int) -> None:
        """Start ``count`` ranks on ``--replace-with`` HOST (``python -m mpidl.train`` with this
        command line) and take them into the job (collective): they get the state and the
        loop's position (``epoch``, ``step_in_epoch``: where this stretch runs again from), and
        the global batch is split over every rank again."""
        self.replaced = True
        command = [sys.executable, "-m", "mpidl.train", *sys.argv[1:]]
        # The join takes the new processes' start-up (seconds): the bound counts from here,
        # and a --failure-timeout shorter than the join ends the job (docs/failures.md).
        self.progress("the shrink, before the join")
        event = self.dp.grow(self.cfg.replace_with, count, command,
                             extra={"epoch": epoch, "step_in_epoch": step_in_epoch})
        self.progress("the join")
        self.printer.warning(f"{count} rank(s) joined on {self.cfg.replace_with} in {event['join_s']:.3f} s "
                             f"(spawn {event['spawn_s']:.3f} s); {event['ranks']} rank(s) on {event['hosts']} "
                             f"host(s) go on from step {event['step']} with batch sizes {event['batch_sizes']}")

    def write_failures(self) -> None:
        """The failure records of ``dp.failures`` not written yet (each with ``recovery_s``,
        failure to the next completed step, once that step is done)."""
        failures = getattr(self.dp, "failures", [])
        for record in failures[self._failures_written:]:
            done = record.get("first_step_s" if record["event"] == "join" else "recovery_s")
            if done is None and self.dp.steps <= record["step"]:
                break  # its next step is not done yet
            self.log(self.metrics, record)
            self._failures_written += 1
            if record["event"] == "join":
                if done is not None:
                    self.printer.info(f"  joined: step {record['step'] + 1} done with the new rank(s) "
                                      f"{done:.3f} s after the join was requested")
            elif record.get("recovery_s") is not None:
                self.printer.info(f"  recovered: step {record['step'] + 1} done {record['recovery_s']:.3f} s "
                                  f"after the failure was seen (shrink {record['shrink_s']:.3f} s)")

    # ------------------------------------------------------------------ epochs
    def evaluate(self) -> dict:
        """OA, AA and kappa on the test split: each rank scores a contiguous shard, and the
        confusion matrices (which add up) are summed over the ranks."""
        self.model.eval()
        k = self.model.num_classes
        lo, hi = self.dp.shard(self.test_set.num_samples)
        cm = np.zeros((k, k), dtype=np.int64)
        for start in range(lo, hi, EVAL_BATCH):
            x, y = self.test_set.read(np.arange(start, min(start + EVAL_BATCH, hi)))
            logits = self.model.forward(self.backend.asarray(x))
            cm += confusion_matrix(y, self.backend.to_host(logits.argmax(axis=1)), k)
            self.progress("an evaluation batch")
        self.dp.sum(cm)
        self.model.train()
        return classification_report(cm)

    def end_epoch(self, epoch: int, totals: EpochTotals) -> dict:
        """Epoch-end record (collective): timings, loss, evaluation."""
        wall = time.perf_counter() - totals.start
        timing = self.dp.timings()
        per_rank = self.dp.all_gather_object((totals.loss_sum, totals.samples))
        samples = sum(n for _, n in per_rank)
        report = self.evaluate()
        record = {
            "event": "epoch", "epoch": epoch + 1, "step": self.dp.steps,
            "loss": sum(loss for loss, _ in per_rank) / max(samples, 1),
            "oa": report["oa"], "aa": report["aa"], "kappa": report["kappa"],
            "lr": float(self.optimizer.lr), "time_s": wall,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "strategy": self.cfg.strategy, "weighting": self.cfg.weighting,
            "batch_sizes": list(self.dp.batch_sizes), "samples": [n for _, n in per_rank],
            "speeds": list(self.dp.split.speeds), "costs": [[c.a, c.c] for c in self.dp.split.costs],
            "predicted_step_s": self.dp.split.predicted_step_s,
            "comp_s": timing["comp_s"], "comm_s": timing["comm_s"], "idle_s": timing["idle_s"],
            "comm": self.dp.counters,
            "wire": per_host(self.dp.all_gather_object(self.wire.since())),
        }
        self.write_failures()
        self.log(self.metrics, record)
        r = self.rank
        self.log(self.timing, {"event": "epoch", "epoch": epoch + 1, "rank": r, "comp_s": timing["comp_s"][r],
                           "comm_s": timing["comm_s"][r], "idle_s": timing["idle_s"][r],
                           "samples": totals.samples, "step_comp_s": timing["step_comp_s"]})
        self.print_epoch(record)
        self.stop_on_log_failure()
        return record

    def log(self, writer, record: dict) -> None:
        """``writer.write(record)`` (the metrics or the timing log); a failed write (a full
        disk) is kept for :meth:`stop_on_log_failure`, and that writer writes nothing more."""
        try:
            writer.write(record)
        except OSError as exc:
            if self._log_failure is None:
                self._log_failure = (writer.path, str(exc))

    def stop_on_log_failure(self) -> None:
        """Collective: when a metrics or timing write failed on any rank, every rank stops
        with the same :class:`OutputWriteError`, which names the file, the cause and where
        the trained model is now: ``--save`` (rank 0 writes it now), else a rescue place
        (:func:`mpidl.app.outputs.rescue_model`, as for a failed final write)."""
        failures = [f for f in self.dp.all_gather_object(self._log_failure) if f is not None]
        if not failures:
            return
        path, text = failures[0]
        what = "the metrics" if path == self.cfg.metrics else "the timing log"
        message = None
        if self.rank == 0:
            stopped = f"training stopped after step {self.dp.steps}"
            if self.cfg.save:
                try:
                    save_model(self.cfg.save, self.model)
                    message = (f"cannot write {what} to {path}: {cause(OSError(text))}; {stopped}, the trained "
                               f"model was saved to {self.cfg.save}")
                except OSError as exc:
                    message = (f"cannot write {what} to {path}: {cause(OSError(text))}; {stopped}; "
                               + rescue_model(save_model, self.model, self.cfg.save, exc, "the final model"))
            else:
                message = f"{rescue_model(save_model, self.model, path, OSError(text), what)}; {stopped}"
        raise OutputWriteError(self.dp.all_gather_object(message)[0])

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
        """The loop's attributes of ``checkpoint.h5`` (see :mod:`mpidl.app.checkpoint`)."""
        return {
            "epoch": epoch_done, "step_in_epoch": step_in_epoch, "config": self.cfg.to_dict(),
            "model": self.model.name, "build_args": self.model.build_args,
            "num_train_samples": int(self.train_set.num_samples),
            "data": self.data_identity,
        }

    def save_checkpoint(self, epoch_done: int, step_in_epoch: int) -> None:
        """Collective. ``step_in_epoch > 0`` is a stop inside epoch ``epoch_done``: it is
        saved before the epoch-end sync, which an uninterrupted run would not do at that step,
        so the resumed run continues exactly."""
        folder = self.cfg.checkpoint
        self._agreed_write(lambda: save_checkpoint(folder, self.dp, self.checkpoint_meta(epoch_done, step_in_epoch)),
                           os.path.join(folder, CHECKPOINT_NAME), "the checkpoint")
        self.progress(f"the checkpoint of step {self.dp.steps}")
        self.printer.info(f"  checkpoint: {self.cfg.checkpoint} (epoch {epoch_done}, step {self.dp.steps})")

    def _agreed_write(self, write, path: str, what: str) -> None:
        """Run ``write()`` on every rank (rank 0 writes; the others may take part in a
        gather), then agree: when it failed, rank 0 rescues the model and every rank raises
        the same :class:`OutputWriteError`, so the trained state is never thrown away."""
        problem = None
        try:
            write()
        except OSError as exc:
            problem = rescue_model(save_model, self.model, path, exc, what)
        problem = self.dp.agree_on_error(problem)
        if problem is not None:
            raise OutputWriteError(problem)

    @property
    def data_identity(self) -> dict:
        if getattr(self, "_data_identity", None) is None:
            self._data_identity = data_identity(self.train_set, self.test_set)
        return self._data_identity

    def resume(self) -> None:
        """Continue from ``--checkpoint DIR`` (collective); a bad checkpoint raises the same
        :class:`CheckpointError` on every rank before any state is changed."""
        meta = load_checkpoint(self.cfg.checkpoint, self.dp, self._check_resumable)
        self.start_epoch, self.start_step_in_epoch = meta["epoch"], meta["step_in_epoch"]
        self.printer.info(f"resumed from {self.cfg.checkpoint}: epoch {meta['epoch']}, step {self.dp.steps}")

    def _check_resumable(self, meta: dict, path: str) -> None:
        old_cfg = meta.get("config", {})
        new_cfg = self.cfg.to_dict()
        differ = [k for k in RESUME_OPTIONS if k in old_cfg and old_cfg[k] != new_cfg.get(k)]
        if differ:
            def options(cfg):
                return " ".join(f"--{k.replace('_', '-')} {cfg.get(k)}" for k in differ)
            raise CheckpointError(f"--resume: {path} was written with {options(old_cfg)}; this run "
                                  f"has {options(new_cfg)}: the resumed run would not continue the "
                                  "same training (start a new run in another --checkpoint folder)")
        if meta["build_args"] != self.model.build_args or meta.get("model") != self.model.name:
            raise CheckpointError(
                f"--resume: {path} holds model {meta.get('model')} {meta['build_args']}, "
                f"but this run builds {self.model.name} {self.model.build_args}")
        old_data, new_data = meta.get("data"), self.data_identity
        if old_data is not None and old_data != new_data:
            changed = ", ".join(f"{k} {old_data.get(k)} -> {new_data.get(k)}" for k in new_data
                                if old_data.get(k) != new_data.get(k))
            raise CheckpointError(f"--resume: {path} was written on other data ({changed}); "
                                  "resume with the data it was trained on, or start a new run")
        if meta["step_in_epoch"] > 0:
            old = meta.get("config", {}).get("batch_size"), meta.get("num_train_samples")
            new = self.cfg.batch_size, self.train_set.num_samples
            if old != new:
                raise CheckpointError(
                    f"--resume: {path} was taken inside an epoch with --batch-size {old[0]} and "
                    f"{old[1]} training samples; this run has --batch-size {new[0]} and {new[1]}: "
                    "the rest of the epoch would differ")

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        """Train; returns the final record (also written as the metrics ``end`` event).

        The failure bound's thread runs for the training only: it is stopped however ``run``
        ends, so that a process that goes on after it (a notebook, a test, a loop that caught
        the exception) is not ended later by a bound nobody marks any more."""
        if self.watchdog is not None:
            self.printer.info(self.watchdog.describe())
            self.watchdog.start()
        try:
            return self._train()
        finally:
            if self.watchdog is not None:  # training is over: MPI_Finalize is not bounded here
                self.watchdog.stop()

    def _train(self) -> dict:
        cfg, dp = self.cfg, self.dp
        t_start = time.perf_counter()
        stopped, last, epoch = "completed", None, self.start_epoch
        for epoch in range(self.start_epoch, cfg.epochs):
            first = self.start_step_in_epoch if epoch == self.start_epoch else 0
            epoch_first_step = dp.steps - first  # the global step of this epoch's first batch
            totals = EpochTotals()
            dp.reset_counters()  # the metrics report traffic and time per epoch
            self.wire = WireCounter()  # and the kernel's bytes on the wire (mpidl/app/netstat.py)
            stopped, record = run_surviving(
                dp, lambda step: self.run_epoch(epoch, step - epoch_first_step, totals),
                lambda lost: self.ranks_lost(lost, epoch, lost.step - epoch_first_step))
            last = record or last
            if stopped != "completed":
                break
        if last is None:
            last = {k: v for k, v in self.evaluate().items() if k in ("oa", "aa", "kappa")}
        if cfg.save:
            self._agreed_write(lambda: save_model(cfg.save, self.model) if self.rank == 0 else None,
                               cfg.save, "the final model")
        end = {"event": "end", "epochs": last.get("epoch", epoch), "step": dp.steps, "oa": last["oa"],
               "aa": last["aa"], "kappa": last["kappa"], "time_s": time.perf_counter() - t_start,
               "stopped": stopped}
        self.write_failures()
        end["failures"] = sum(1 for r in getattr(dp, "failures", []) if r["event"] == "failure")
        self.log(self.metrics, end)
        self.stop_on_log_failure()
        self.metrics.close()
        self.timing.close()
        dp.close()  # frees what the exchange holds (the node-shared window); the model stays usable
        return end

    def run_epoch(self, epoch: int, first: int, totals: EpochTotals) -> tuple[str, dict | None]:
        """Steps ``first ..`` of ``epoch``, then the epoch-end sync, evaluation and checkpoint
        (collective); returns why it stopped ("completed", "signal", "max_steps") and the epoch
        record (None when no step was run)."""
        cfg, dp = self.cfg, self.dp
        perm = epoch_permutation(cfg.seed, epoch, self.train_set.num_samples)
        self.train_set.set_epoch(epoch)  # augmentation draws are a function of (seed, epoch, index)
        stopped, last_print = "completed", time.perf_counter()
        step_in_epoch = first
        for step_in_epoch in range(first, self.steps_per_epoch):
            if dp.steps >= self.total_steps:
                stopped = "max_steps"
                break
            batch = perm[step_in_epoch * cfg.batch_size:(step_in_epoch + 1) * cfg.batch_size]
            local = dp.local_indices(batch)
            step = dp.steps
            totals.add(step, self.train_step(local), len(local))
            self.progress(f"step {dp.steps}")
            if dp.should_stop:
                stopped = "signal"
                step_in_epoch += 1
                break
            if time.perf_counter() - last_print > cfg.progress_every_s:
                last_print = time.perf_counter()
                self.printer.info(f"  epoch {epoch + 1} step {step_in_epoch + 1}/{self.steps_per_epoch}")
        else:
            step_in_epoch = self.steps_per_epoch
        finished = step_in_epoch >= self.steps_per_epoch
        epochs_done = epoch + 1 if finished else epoch
        saved = bool(cfg.checkpoint) and stopped != "completed" and not finished
        if saved:
            self.save_checkpoint(epochs_done, step_in_epoch)
        dp.sync()  # replicas identical for evaluation; pending stops and NaNs agreed
        self.progress(f"the epoch-end sync of step {dp.steps}")
        self.report_skips()
        if stopped == "completed" and dp.should_stop:
            stopped = "signal"
        record = self.end_epoch(epoch, totals) if totals.steps else None  # alike: the ranks step together
        if cfg.checkpoint and not saved and (
                stopped != "completed" or epochs_done % cfg.checkpoint_every == 0 or epochs_done == cfg.epochs):
            self.save_checkpoint(epochs_done, 0)
        return stopped, record
