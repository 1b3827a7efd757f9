"""The command line: ``mpiexec -n N python -m mpidl.train [options]``.

Thin on purpose: parse and validate the configuration (:mod:`mpidl.app.config`), load the data,
build the model, hand everything to :class:`mpidl.app.trainer.Trainer`. With no ``--data`` it
trains on the built-in synthetic hyperspectral scene. ``python -m mpidl.train --help`` lists
every option.

Failure policy
--------------
*Set-up errors* (a bad option, argparse's own errors included; a missing or malformed data
file, non-finite values in it, an empty test split; a model that cannot take the data's
shape; an output path that cannot be written; a checkpoint that does not match the run) are
found before training starts. Every rank runs the same checks, and the
ranks then agree (:func:`mpidl.distributed.launch.agree_on_error`), so even an error seen by
one rank only (say, a file missing on one node) ends every rank cleanly: rank 0 prints
``error: ...`` once and all exit with code 2.

*Output paths* are checked on the ranks that will write them (``--save``, ``--checkpoint`` and
``--metrics`` on rank 0, ``--timing-dir`` on every rank) by creating and removing a temporary
file beside the target, as the atomic writer will (:mod:`mpidl.app.outputs`); the temporaries an
interrupted write left there are removed at the same time. A write that still fails later
(disk full) stops the job with exit code 1 and an ``error:`` line that names the path, the
cause and the place the trained model was rescued to.

*Errors during training* may happen on one rank while the others wait inside a collective:
:func:`mpidl.distributed.launch.abort_on_uncaught_exception` prints ``mpidl: rank R failed:
...`` with the traceback and ends the whole job with ``MPI_Abort``.
"""

from __future__ import annotations

import contextlib
import io
import sys


def main(argv=None) -> int:
    from mpidl.app.cli import start_process

    start_process()  # before MPI starts: OMPI_MCA_osc, the thread policy
    from mpidl.app.checkpoint import CheckpointError
    from mpidl.app.config import ConfigError, parse_config
    from mpidl.distributed import NonFiniteGradient, Topology
    from mpidl.distributed.launch import (abort_on_uncaught_exception, agree_on_error, allgather,
                                          failure_file_for, machine_rank_and_size, report_failures_to,
                                          world)
    from mpidl.app.log import Printer

    from mpidl.distributed.elastic.recovery import check_grow_support, is_joiner

    rank, size = world()
    # started into a running job by its --replace-with (grow back): the job has the state, the
    # outputs and the log; this process only builds its model and data and joins
    joining = is_joiner()
    # An unexpected exception anywhere (a bug, not a bad input) must not leave ranks hanging:
    # from the first collective on (a rank lost at start-up fails it on the others).
    sys.excepthook = abort_on_uncaught_exception
    # The rank among the ranks on this machine picks the GPU.
    local_rank, _ = machine_rank_and_size()

    # ---- set-up: every rank validates the same things, then the ranks agree
    error = None
    setup = None
    removed = []
    try:
        # --help is printed by rank 0 only (every rank then exits 0)
        with contextlib.nullcontext() if rank == 0 else contextlib.redirect_stdout(io.StringIO()):
            cfg = parse_config(argv, world_size=size)
        removed = [] if joining else check_outputs(cfg, rank)
        if cfg.replace_with:
            check_grow_support()
        setup = _build(cfg, local_rank)
    except (ConfigError, ValueError, OSError, KeyError, RuntimeError) as exc:
        error = f"{exc}"
    error = agree_on_error(error)
    if error is None and cfg.data is not None:
        # the values, once the file is known to be valid: each rank scans its share
        from mpidl.data.layout import check_values

        error = check_values(cfg.data, rank, size, allgather)
    if error is not None:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

    backend, model, train_set, test_set, data_desc = setup
    topo = None if joining else Topology.from_comm(ranks_per_node=cfg.ranks_per_node)
    printer = Printer(1 if joining else rank, cfg.log_level, cfg.quiet)  # a joiner is never rank 0
    if cfg.metrics:  # a failing rank's report is kept beside the metrics too
        report_failures_to(failure_file_for(cfg.metrics))
    if removed:
        printer.info(f"removed {len(removed)} temporary file(s) left by an interrupted write: "
                     f"{', '.join(removed)}")

    from mpidl.app.trainer import OutputWriteError, Trainer

    trainer = Trainer(cfg, model, train_set, test_set, printer, topology=topo, handle_sigterm=True,
                      joining=joining)
    printer.rank = trainer.rank
    if cfg.resume and not joining:
        try:
            trainer.resume()
        except CheckpointError as exc:
            # A missing, corrupt or mismatched checkpoint: the ranks agreed first, so every
            # rank is here with the same message.
            if rank == 0:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    if not joining:
        _print_header(printer, cfg, model, train_set, data_desc, trainer)
        trainer.metrics.write(_start_record(cfg, topo, model, data_desc, trainer))
    try:
        end = trainer.run()
    except OutputWriteError as exc:
        # agreed by every rank; the trained model is already rescued (the message says where)
        with contextlib.suppress(OSError):
            trainer.metrics.write({"event": "end", "step": trainer.global_step, "stopped": "write_error",
                                   "error": str(exc)})
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except NonFiniteGradient as exc:
        # Decided collectively (every rank sees the same reduced gradient, or the flag was
        # agreed at a sync), so every rank is here: a clean stop, no Abort needed.
        trainer.metrics.write({"event": "end", "step": trainer.global_step, "stopped": "nan",
                               "error": str(exc)})
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    printer.summary(
        f"done: {end['stopped']} after {end['step']} steps in {end['time_s']:.1f} s; "
        f"test OA {100 * end['oa']:.2f}%  AA {100 * end['aa']:.2f}%  kappa {end['kappa']:.4f}"
    )
    if getattr(trainer.dp, "shrunk", False):
        trainer.dp.leave(0)  # MPI_Finalize may wait for the lost ranks (docs/failures.md)
    return 0


def check_outputs(cfg, rank: int) -> list[str]:
    """Check every output path on the ranks that will write it (raises
    :class:`mpidl.app.outputs.OutputError`, agreed with the other set-up errors); returns the
    stale temporaries of earlier, interrupted writes that were removed."""
    from mpidl.app.checkpoint import CHECKPOINT_NAME
    from mpidl.app.outputs import check_output_file, check_output_folder

    removed = []
    if rank == 0:
        if cfg.save:
            removed += check_output_file("--save", cfg.save)
        if cfg.checkpoint:
            removed += check_output_folder("--checkpoint", cfg.checkpoint, [CHECKPOINT_NAME])
        if cfg.metrics:
            removed += check_output_file("--metrics", cfg.metrics)
    if cfg.timing_dir:
        removed += check_output_folder("--timing-dir", cfg.timing_dir, [f"rank{rank}.jsonl"])
    return removed


def _build(cfg, local_rank: int = 0):
    """Load data and build the model; raises a readable error for anything wrong."""
    from mpidl import data
    from mpidl.engine.backend import get_backend
    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_schedule

    backend = get_backend(cfg.device, cfg.dtype)
    # One GPU per rank of a node (local_rank % GPUs), before anything is allocated on it.
    backend.select_device(local_rank)
    if cfg.data is None:
        train_set, test_set, meta = data.synthetic_splits(seed=0, augment=cfg.augment, augment_seed=cfg.seed)
        desc = f"built-in synthetic scene ({meta['source']})"
    else:
        train_set, test_set, meta = data.load_splits(cfg.data, cache=cfg.cache, augment=cfg.augment, seed=cfg.seed)
        desc = meta["description"]
        from mpidl.data.layout import LayoutError, check_trainable

        try:
            check_trainable(meta)
        except LayoutError as exc:
            raise ValueError(f"--data {cfg.data}: {exc.problem}") from None
    # A model that cannot take the data's shape raises a ValueError naming both, here,
    # before any collective.
    model = build_model(cfg.model, train_set.sample_shape, train_set.num_classes,
                        backend=backend, seed=cfg.seed, **cfg.model_kwargs)
    # The schedule's length depends on the data size; check it now, before any collective.
    from mpidl.app.trainer import steps_per_epoch  # noqa: PLC0415

    n = train_set.num_samples
    per_epoch = steps_per_epoch(n, cfg.batch_size, cfg.drop_last)
    if per_epoch == 0:
        raise ValueError(f"--drop-last with --batch-size {cfg.batch_size} > {n} training samples leaves no step")
    cfg.check_sync_every_epoch(per_epoch)  # K' of --sync-every epoch against the exchange's rules
    steps = cfg.epochs * per_epoch
    make_schedule(cfg.schedule, cfg.lr, min(steps, cfg.max_steps or steps), warmup_steps=cfg.warmup_steps)
    return backend, model, train_set, test_set, desc


def _print_header(printer, cfg, model, train_set, desc, trainer) -> None:
    dp, topo = trainer.dp, trainer.dp.topology
    printer.info(f"mpidl: {topo.size} rank(s) on {topo.num_nodes} node(s) {topo.node_sizes}; "
                 f"{dp.exchange.describe()}; {cfg.weighting} weighting")
    printer.info(f"data: {desc}: {train_set.num_samples} train / {trainer.test_set.num_samples} test samples of "
                 f"shape {tuple(train_set.sample_shape)}, {train_set.num_classes} classes")
    printer.info(f"model: {model.name}, {model.params.size} parameters ({cfg.dtype}, {cfg.device}); "
                 f"optimizer {cfg.optimizer} lr {cfg.lr} ({cfg.schedule}); global batch {cfg.batch_size}, "
                 f"{trainer.steps_per_epoch} steps/epoch")
    printer.info(dp.split.describe())
    note = getattr(dp, "failure_note", None)
    if note:
        (printer.info if dp.on_failure == "shrink" else printer.warning)(note)
    if cfg.slowdown_list:
        printer.info(f"EMULATION: compute slowdown per rank {cfg.slowdown_list} "
                     f"(multiplying each compute's {cfg.emulate_clock} time)")
    if cfg.link:
        printer.info(f"EMULATION: inter-node link {cfg.link[0]} us latency, {cfg.link[1]} Gbit/s")


def _start_record(cfg, topo, model, desc, trainer) -> dict:
    return {
        "event": "start", "config": cfg.to_dict(), "world_size": topo.size,
        # K' as used (``--sync-every epoch`` resolved) and the steps it may be resolved to
        "sync_every": trainer.sync_every, "steps_per_epoch": trainer.steps_per_epoch,
        "num_nodes": topo.num_nodes, "node_sizes": list(topo.node_sizes), "model": model.name,
        "num_params": int(model.params.size), "data": desc,
        "emulation": {"slowdown": cfg.slowdown_list, "clock": cfg.emulate_clock if cfg.slowdown_list else None,
                      "link": list(cfg.link) if cfg.link else None},
    }


if __name__ == "__main__":
    sys.exit(main())
