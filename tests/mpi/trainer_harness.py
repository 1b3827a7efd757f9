"""Build and run a :class:`mpidl.app.trainer.Trainer` on any communicator, for the MPI tests.

The same function runs the distributed job (``comm=MPI.COMM_WORLD``) and its single-rank
reference (``comm=MPI.COMM_SELF``), so the two differ only in the world they see.

Fault injection is the tests' (``tests/faults.py``; the product knows nothing of it): a
``MPIDL_INJECT_FAULT`` in the environment when :func:`make_trainer` runs (``monkeypatch.setenv``)
is injected into that trainer's steps.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: faults.py

from faults import fault_from_environment, inject  # noqa: E402

from mpidl.engine.backend import get_backend
from mpidl.app.config import parse_config
from mpidl.data import ArrayDataset
from mpidl.distributed.topology import Topology
from mpidl.app.log import Printer
from mpidl.engine.models import build_model
from mpidl.app.trainer import Trainer


def tiny_dataset(n: int = 50, seed: int = 0, shape=(5, 5, 5), classes: int = 3) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.integers(0, classes, n)
    return ArrayDataset(x, y, [f"c{k}" for k in range(classes)])


#: narrow widths of every model for the tiny (5, 5, 5) samples
TINY_WIDTHS = {
    "hsicnn": dict(channels=(4, 4), hidden=8),
    "hsicnn_bn": dict(channels=(4, 4), hidden=8),
    "mlp": dict(hidden=(8,)),
    "spectral_lstm": dict(group=2, hidden=4),
    "vit": dict(patch=1, dim=4, depth=1, heads=2, mlp_dim=6),
}


def make_trainer(comm, argv, *, ranks_per_node=None, train=None, test=None, dtype="float64",
                 model=None, stop_after=None, sleep_per_sample=0.0) -> Trainer:
    """A trainer on ``comm`` with the options ``argv`` and the tiny data and model;
    ``stop_after=k`` makes the last rank request a stop (as SIGTERM does) once ``k`` global
    steps are done; ``sleep_per_sample`` adds that many seconds per local sample to every
    training step's compute (a cost the jitter of a loaded machine cannot blur: the tiny
    model's steps take about a millisecond)."""
    size = comm.Get_size()
    extra = ["--model", model] if model else []
    cfg = parse_config(list(argv) + extra + ["--dtype", dtype, "--quiet"], world_size=size)
    if ranks_per_node is not None:
        cfg.ranks_per_node = ranks_per_node
    train = train if train is not None else tiny_dataset()
    test = test if test is not None else tiny_dataset(n=20, seed=1)
    topo = Topology.from_comm(comm, ranks_per_node=cfg.ranks_per_node)
    net = build_model(cfg.model, train.sample_shape, train.num_classes,
                      backend=get_backend("cpu", dtype), seed=cfg.seed, **TINY_WIDTHS[cfg.model])
    faults = fault_from_environment(size)
    cls = Trainer
    if faults is not None:  # a subclass: the injection stays with this trainer
        cls = type("FaultyTrainer", (Trainer,), {})
        inject(cls, faults)
    trainer = cls(cfg, net, train, test, Printer(comm.Get_rank(), quiet=True), topology=topo)
    if sleep_per_sample:
        compute = trainer.compute

        def slow_compute(indices):
            loss = compute(indices)
            time.sleep(sleep_per_sample * len(indices))
            return loss

        trainer.compute = slow_compute
    if stop_after is not None:
        step = trainer.train_step

        def train_step(*args, **kwargs):
            loss = step(*args, **kwargs)
            if trainer.global_step == stop_after and comm.Get_rank() == size - 1:
                trainer.dp.request_stop()
            return loss

        trainer.train_step = train_step
    return trainer


def run(comm, argv, **kwargs):
    """Train with the command-line options ``argv`` on ``comm``; return (trainer, end record)."""
    trainer = make_trainer(comm, argv, **kwargs)
    if trainer.cfg.resume:
        trainer.resume()
    end = trainer.run()
    return trainer, end


def speeds_for(size: int) -> str:
    """Uneven speeds 1, 2, ..., P."""
    return ",".join(str(i + 1) for i in range(size))


def all_agree(comm, ok: bool) -> bool:
    """True on every rank iff ``ok`` is True on every rank (assert after this, never before)."""
    return bool(comm.allreduce(bool(ok), op=MPI.LAND))
