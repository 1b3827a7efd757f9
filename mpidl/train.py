"""The command line: ``mpiexec -n N python -m mpidl.train [options]``.

Thin on purpose: parse and validate the configuration (:mod:`mpidl.config`), load the data,
build the model, hand everything to :class:`mpidl.trainer.Trainer`. With no ``--data`` it
trains on the built-in synthetic hyperspectral scene. ``python -m mpidl.train --help`` lists
every option.

Failure policy
--------------
*Set-up errors* (a bad option, a missing or malformed data file, a model that cannot take the
data's shape) are found before training starts. Every rank runs the same checks, and the
ranks then agree (:func:`mpidl.distributed.launch.agree_on_error`), so even an error seen by
one rank only (say, a file missing on one node) ends every rank cleanly: rank 0 prints
``error: ...`` once and all exit with code 2.

*Errors during training* may happen on one rank while the others wait inside a collective:
:func:`mpidl.distributed.launch.abort_on_uncaught_exception` prints ``mpidl: rank R failed:
...`` with the traceback and ends the whole job with ``MPI_Abort``.
"""

from __future__ import annotations

import os
import sys


def _limit_threads_per_rank() -> int:
    """Give each rank its share of the cores for BLAS and Numba: without this, 4 ranks on a
    2-core machine each start 2 BLAS and 2 Numba threads and spend their time switching.
    Must run before NumPy is imported; an explicit user setting wins. Returns this rank's
    index on its node (its local rank), which also picks its GPU."""
    from mpi4py import MPI  # mpi4py does not import numpy

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    local_size, local_rank = node.Get_size(), node.Get_rank()
    node.Free()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    threads = str(max(1, cores // local_size))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    # Numba's parallel kernels run on OpenMP, whose idle workers busy-wait after each parallel
    # region and so starve OpenBLAS's threads on the same cores: measured here, one rank on
    # 2 cores ran 4.6x slower (1.40 s vs 0.30 s per epoch of the default job). Passive
    # waiting makes the workers sleep.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Likewise OpenBLAS's own workers spin after each GEMM (about 0.1 s by default), holding a
    # core while im2col / col2im / pooling run between the GEMMs; the smallest timeout lets
    # them sleep at once (one rank on 2 cores: 0.30-0.40 s -> 0.26 s per epoch).
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    return local_rank


def main(argv=None) -> int:
    local_rank = _limit_threads_per_rank()
    from mpidl.checkpoint import CheckpointError
    from mpidl.config import ConfigError, parse_config
    from mpidl.distributed import NonFiniteGradient, Topology
    from mpidl.distributed.launch import abort_on_uncaught_exception, agree_on_error, world
    from mpidl.log import Printer

    rank, size = world()
    # An unexpected exception anywhere (a bug, not a bad input) must not leave ranks hanging.
    sys.excepthook = abort_on_uncaught_exception

    # ---- set-up: every rank validates the same things, then the ranks agree
    error = None
    setup = None
    try:
        cfg = parse_config(argv, world_size=size)
        setup = _build(cfg, local_rank)
    except (ConfigError, ValueError, OSError, KeyError, RuntimeError) as exc:
        error = f"{exc}"
    error = agree_on_error(error)
    if error is not None:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

    backend, model, train_set, test_set, data_desc = setup
    topo = Topology.from_comm(ranks_per_node=cfg.ranks_per_node)
    printer = Printer(rank, cfg.log_level, cfg.quiet)

    from mpidl.trainer import Trainer

    trainer = Trainer(cfg, model, train_set, test_set, printer, topology=topo, handle_sigterm=True)
    if cfg.resume:
        try:
            trainer.resume()
        except CheckpointError as exc:
            # A missing, corrupt or mismatched checkpoint: the ranks agreed first, so every
            # rank is here with the same message.
            if rank == 0:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    _print_header(printer, cfg, model, train_set, data_desc, trainer)
    trainer.metrics.write(_start_record(cfg, topo, model, data_desc))
    try:
        end = trainer.run()
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
    return 0


def _build(cfg, local_rank: int = 0):
    """Load data and build the model; raises a readable error for anything wrong."""
    from mpidl import data
    from mpidl.backend import get_backend
    from mpidl.models import build_model
    from mpidl.optim import make_schedule

    backend = get_backend(cfg.device, cfg.dtype)
    # One GPU per rank of a node (local_rank % GPUs), before anything is allocated on it.
    backend.select_device(local_rank)
    if cfg.data is None:
        train_set, test_set, meta = data.synthetic_splits(seed=0, augment=cfg.augment, augment_seed=cfg.seed)
        desc = f"built-in synthetic scene ({meta['source']})"
    else:
        train_set, test_set, meta = data.load_splits(cfg.data, augment=cfg.augment, seed=cfg.seed)
        desc = meta["description"]
    # A model that cannot take the data's shape raises a ValueError naming both, here,
    # before any collective.
    model = build_model(cfg.model, train_set.sample_shape, train_set.num_classes,
                        backend=backend, seed=cfg.seed, **cfg.model_kwargs)
    # The schedule's length depends on the data size; check it now, before any collective.
    from mpidl.trainer import steps_per_epoch  # noqa: PLC0415

    n = train_set.num_samples
    per_epoch = steps_per_epoch(n, cfg.batch_size, cfg.drop_last)
    if per_epoch == 0:
        raise ValueError(f"--drop-last with --batch-size {cfg.batch_size} > {n} training samples leaves no step")
    steps = cfg.epochs * per_epoch
    make_schedule(cfg.schedule, cfg.lr, min(steps, cfg.max_steps or steps), warmup_steps=cfg.warmup_steps)
    return backend, model, train_set, test_set, desc


def _print_header(printer, cfg, model, train_set, desc, trainer) -> None:
    dp = trainer.dp
    printer.info(f"mpidl: {dp.describe()}")
    printer.info(f"data: {desc}: {train_set.num_samples} train / {trainer.test_set.num_samples} test samples of "
                 f"shape {tuple(train_set.sample_shape)}, {train_set.num_classes} classes")
    printer.info(f"model: {model.name}, {model.params.size} parameters ({cfg.dtype}, {cfg.device}); "
                 f"optimizer {cfg.optimizer} lr {cfg.lr} ({cfg.schedule}); global batch {cfg.batch_size}, "
                 f"{trainer.steps_per_epoch} steps/epoch")
    printer.info(dp.describe_split())
    if cfg.slowdown_list:
        printer.info(f"EMULATION: compute slowdown per rank {cfg.slowdown_list}")
    if cfg.link:
        printer.info(f"EMULATION: inter-node link {cfg.link[0]} us latency, {cfg.link[1]} Gbit/s")


def _start_record(cfg, topo, model, desc) -> dict:
    return {
        "event": "start", "config": cfg.to_dict(), "world_size": topo.size,
        "num_nodes": topo.num_nodes, "node_sizes": list(topo.node_sizes), "model": model.name,
        "num_params": int(model.params.size), "data": desc,
        "emulation": {"slowdown": cfg.slowdown_list, "link": list(cfg.link) if cfg.link else None},
    }


if __name__ == "__main__":
    sys.exit(main())
