"""Checkpoint / resume: an interrupted and resumed run ends where an uninterrupted one does.

float64, a tiny ``hsicnn`` (and ``hsicnn_bn``), uneven speeds 1, 2, ..., P, 50 samples with
a global batch of 8 (7 steps per epoch, the last of 2 samples, so some ranks get none), 2
epochs, SGD with momentum and weight decay, a cosine schedule with warm-up.

The interruption must not change the schedule (the learning rate of every step), so it is
what SIGTERM does: a stop request (``trainer.stop_requested = True``, set here on the LAST
rank only after a chosen step) that the ranks agree on at the next control point (every
``CONTROL_EVERY`` = 10 steps for the exact strategies, at the inter-node syncs for ``node``,
at epoch ends). ``--max-steps`` does shorten the schedule, so the ``--max-steps`` test uses
the constant schedule. The reference is the same job run without interruption.
"""

import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpidl.backend import get_backend
from mpidl.checkpoint import CHECKPOINT_NAME, CheckpointError
from mpidl.config import parse_config
from mpidl.distributed.topology import Topology
from mpidl.log import Printer
from mpidl.models import build_model
from mpidl.trainer import Trainer
from trainer_harness import all_agree, speeds_for, tiny_dataset

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
BASE = ["--batch-size", "8", "--epochs", "2", "--lr", "0.05", "--schedule", "cosine",
        "--warmup-steps", "2", "--seed", "3", "--speeds", speeds_for(P)]
STEPS_PER_EPOCH = 7
TWO_NODES = (P + 1) // 2 if P > 1 else None  # ranks per node giving 2 nodes (None: 1 rank)


def make_trainer(argv, *, model="hsicnn", ranks_per_node=None, stop_after=None):
    """A trainer on WORLD with the harness's tiny data and model; ``stop_after=k`` makes the
    last rank request a stop (as SIGTERM does) once ``k`` global steps are done."""
    cfg = parse_config(list(argv) + ["--model", model, "--dtype", "float64", "--quiet"], world_size=P)
    cfg.ranks_per_node = ranks_per_node
    topo = Topology.from_comm(WORLD, ranks_per_node=ranks_per_node)
    backend = get_backend("cpu", "float64")
    train, test = tiny_dataset(), tiny_dataset(n=20, seed=1)
    net = build_model(cfg.model, train.sample_shape, train.num_classes, backend=backend,
                      seed=cfg.seed, channels=(4, 4), hidden=8)
    trainer = Trainer(cfg, topo, backend, net, train, test, Printer(RANK, quiet=True))
    if stop_after is not None:
        step = trainer.train_step

        def train_step(*args, **kwargs):
            synced = step(*args, **kwargs)
            if trainer.global_step == stop_after and RANK == P - 1:
                trainer.stop_requested = True
            return synced

        trainer.train_step = train_step
    return trainer


def train(argv, **kwargs):
    trainer = make_trainer(argv, **kwargs)
    trainer.setup()
    end = trainer.run()
    return trainer, end


def state(trainer):
    """Parameters, then the batch-norm buffers, as one float64 vector."""
    parts = [trainer.params.data] + [np.ravel(v) for _, v in sorted(trainer.model.buffers_host().items())]
    return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts])


def rel_diff(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def check_same(resumed, reference, what):
    """Bitwise on one rank, within 1e-12 relative otherwise; every rank asserts together."""
    diff = rel_diff(state(resumed), state(reference))
    tol = 0.0 if P == 1 else 1e-12
    assert all_agree(WORLD, diff <= tol), f"{what}: relative difference {diff:.3e} (P={P})"
    assert all_agree(WORLD, resumed.global_step == reference.global_step)


def checkpoint_meta(folder):
    """Every rank reads the attributes (the file is complete: save_checkpoint ends in a barrier)."""
    import json

    with h5py.File(os.path.join(folder, CHECKPOINT_NAME)) as f:
        return {k: json.loads(v) for k, v in f.attrs.items()}, "optimizer" in f


def expected_stop(strategy, num_nodes, stop_after, sync_every):
    """The global step of the first control point at or after ``stop_after``: an epoch end,
    or every 10 steps (exact strategies), or an inter-node sync (``node`` on > 1 node)."""
    def next_multiple(k):
        return -(-stop_after // k) * k

    epoch_end = next_multiple(STEPS_PER_EPOCH)
    if strategy == "node":
        return epoch_end if num_nodes == 1 else min(epoch_end, next_multiple(sync_every))
    return min(epoch_end, next_multiple(10))


CASES = [
    pytest.param("flat", [], None, "hsicnn", id="flat"),
    pytest.param("flat", ["--optimizer", "adam", "--lr", "0.01"], None, "hsicnn", id="flat-adam"),
    pytest.param("flat", [], None, "hsicnn_bn", id="flat-batchnorm"),
    pytest.param("hierarchical", [], None, "hsicnn", id="hierarchical"),
    pytest.param("node", ["--sync-every", "4"], None, "hsicnn", id="node-launcher-nodes"),
    pytest.param("node", ["--sync-every", "4"], TWO_NODES, "hsicnn", id="node-two-nodes"),
    pytest.param("node", ["--sync-every", "4", "--sync-optimizer-state"], TWO_NODES, "hsicnn",
                 id="node-two-nodes-sync-optimizer-state"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy, extra, ranks_per_node, model", CASES)
def test_stop_request_then_resume_equals_uninterrupted(mpi_tmp_path, strategy, extra, ranks_per_node, model):
    argv = BASE + ["--strategy", strategy] + extra
    folder = str(mpi_tmp_path / "ck")
    reference, ref_end = train(argv, model=model, ranks_per_node=ranks_per_node)
    assert ref_end["stopped"] == "completed" and ref_end["step"] == 2 * STEPS_PER_EPOCH

    stop_after = 8 if strategy != "node" else 9  # stops at step 10 / 12 (inside epoch 2)
    first, end = train(argv + ["--checkpoint", folder], model=model, ranks_per_node=ranks_per_node,
                       stop_after=stop_after)
    num_nodes = first.topo.num_nodes
    stop = expected_stop(strategy, num_nodes, stop_after, 4)
    assert all_agree(WORLD, end["stopped"] == "signal" and end["step"] == stop), (end, stop)
    meta, global_state = checkpoint_meta(folder)
    assert (meta["global_step"], meta["epoch"], meta["step_in_epoch"]) == (
        stop, stop // STEPS_PER_EPOCH, stop % STEPS_PER_EPOCH)
    per_node = strategy == "node" and num_nodes > 1
    assert meta["node_state"] == per_node and global_state == (not per_node)

    resumed, end = train(argv + ["--checkpoint", folder, "--resume"], model=model,
                         ranks_per_node=ranks_per_node)
    assert all_agree(WORLD, end["stopped"] == "completed")
    check_same(resumed, reference, f"{strategy} {extra} nodes={num_nodes}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks_per_node", [None, TWO_NODES], ids=["launcher-nodes", "two-nodes"])
def test_max_steps_between_node_syncs_then_resume(mpi_tmp_path, ranks_per_node):
    """``--max-steps 6`` with ``K' = 4``: the nodes' parameters differ at the stop, so each
    node's file holds its own parameters too (and the samples since the last sync)."""
    argv = BASE + ["--schedule", "constant", "--strategy", "node", "--sync-every", "4"]
    folder = str(mpi_tmp_path / "ck")
    reference, _ = train(argv, ranks_per_node=ranks_per_node)
    first, end = train(argv + ["--checkpoint", folder, "--max-steps", "6"], ranks_per_node=ranks_per_node)
    assert end["stopped"] == "max_steps" and end["step"] == 6
    meta, _ = checkpoint_meta(folder)
    assert meta["node_params"] == (first.topo.num_nodes > 1) and meta["step_in_epoch"] == 6
    resumed, _ = train(argv + ["--checkpoint", folder, "--resume"], ranks_per_node=ranks_per_node)
    check_same(resumed, reference, f"node, max-steps, nodes={first.topo.num_nodes}")


@pytest.mark.mpi
def test_epochs_then_more_epochs_with_constant_schedule(mpi_tmp_path):
    argv = BASE + ["--schedule", "constant", "--warmup-steps", "0"]
    folder = str(mpi_tmp_path / "ck")
    reference, _ = train(argv)
    train(argv + ["--epochs", "1", "--checkpoint", folder])
    resumed, _ = train(argv + ["--checkpoint", folder, "--resume"])
    check_same(resumed, reference, "epochs 1 then 2")


@pytest.mark.mpi
def test_node_files_written_first_and_stale_ones_removed(mpi_tmp_path):
    """Per-node optimizer files: one per node, named by the step checkpoint.h5 names; older
    ones are gone after the next checkpoint."""
    folder = str(mpi_tmp_path / "ck")
    trainer, _ = train(BASE + ["--strategy", "node", "--sync-every", "4", "--checkpoint", folder],
                       ranks_per_node=TWO_NODES)
    WORLD.Barrier()  # the leaders remove stale files after the last barrier of save_checkpoint
    meta, global_state = checkpoint_meta(folder)
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    if trainer.topo.num_nodes > 1:
        expected = sorted([CHECKPOINT_NAME] + [f"optimizer-node{k}-step{meta['global_step']}.h5"
                                               for k in range(trainer.topo.num_nodes)])
        ok = names == expected and not global_state
    else:
        ok = names == [CHECKPOINT_NAME] and global_state
    ok = ok and meta["global_step"] == 2 * STEPS_PER_EPOCH and meta["epoch"] == 2
    assert all_agree(WORLD, ok), names


def expect_checkpoint_error(argv, match, **kwargs):
    """Every rank must raise the same CheckpointError (never one rank alone)."""
    trainer = make_trainer(argv, **kwargs)
    try:
        trainer.setup()
        message = None
    except CheckpointError as exc:
        message = str(exc)
    messages = WORLD.allgather(message)
    assert all(m is not None and match in m for m in messages) and len(set(messages)) == 1, messages


@pytest.mark.mpi
def test_resume_errors_are_raised_on_every_rank(mpi_tmp_path):
    folder = str(mpi_tmp_path / "ck")
    expect_checkpoint_error(BASE + ["--checkpoint", folder, "--resume"], "no checkpoint at")
    train(BASE + ["--epochs", "1", "--checkpoint", folder])
    expect_checkpoint_error(BASE + ["--checkpoint", folder, "--resume"], "holds model hsicnn", model="hsicnn_bn")
    if RANK == 0:  # overwrite the file's start: HDF5 can no longer open it
        with open(os.path.join(folder, CHECKPOINT_NAME), "r+b") as f:
            f.write(b"garbage!" * 8)
    WORLD.Barrier()
    expect_checkpoint_error(BASE + ["--checkpoint", folder, "--resume"], "not a readable mpidl checkpoint")


@pytest.mark.mpi(min_size=2)
def test_missing_node_file_on_one_node(mpi_tmp_path):
    folder = str(mpi_tmp_path / "ck")
    argv = BASE + ["--strategy", "node", "--sync-every", "4", "--checkpoint", folder]
    trainer, _ = train(argv + ["--epochs", "1"], ranks_per_node=TWO_NODES)
    meta, _ = checkpoint_meta(folder)
    if RANK == P - 1:
        os.remove(os.path.join(folder, f"optimizer-node{trainer.topo.num_nodes - 1}-step{meta['global_step']}.h5"))
    WORLD.Barrier()
    # the ranks of the other node read fine: still every rank raises, naming the failing ranks
    failing = [r for r, n in enumerate(trainer.topo.node_of_rank) if n == trainer.topo.num_nodes - 1]
    expect_checkpoint_error(argv + ["--resume"], f"(on ranks {failing})", ranks_per_node=TWO_NODES)
    # a per-node checkpoint cannot be resumed with another strategy
    expect_checkpoint_error(BASE + ["--checkpoint", folder, "--resume"], "per-node state of 2 nodes")
