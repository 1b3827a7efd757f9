"""Checkpoint / resume: an interrupted and resumed run ends where an uninterrupted one does.

float64, a tiny ``hsicnn`` (and ``hsicnn_bn``), uneven speeds 1, 2, ..., P, 50 samples with
a global batch of 8 (7 steps per epoch, the last of 2 samples, so some ranks get none), 2
epochs, SGD with momentum and weight decay, a cosine schedule with warm-up.

The interruption must not change the schedule (the learning rate of every step), so it is
what SIGTERM does: a stop request (``dp.request_stop()``, made here on the LAST rank only
after a chosen step) that travels with the next step's message (exact strategies, and
``node`` on one node), or with the next inter-node sync (``node`` on several nodes), or is
agreed at the epoch end. ``--max-steps`` does shorten the schedule, so the ``--max-steps``
test uses the constant schedule. The reference is the same job run without interruption.
"""

import json
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpidl.app.checkpoint import CHECKPOINT_NAME, CheckpointError
from mpidl.distributed import Topology
from trainer_harness import all_agree, make_trainer, speeds_for

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
BASE = ["--batch-size", "8", "--epochs", "2", "--lr", "0.05", "--schedule", "cosine",
        "--warmup-steps", "2", "--seed", "3", "--speeds", speeds_for(P)]
STEPS_PER_EPOCH = 7
TWO_NODES = (P + 1) // 2 if P > 1 else None  # ranks per node giving 2 nodes (None: 1 rank)


def train(argv, **kwargs):
    trainer = make_trainer(WORLD, argv, **kwargs)
    if trainer.cfg.resume:
        trainer.resume()
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


def checkpoint_contents(folder):
    """(attributes, top-level groups) of the checkpoint file, read on every rank (rank 0
    wrote it before the collectives that follow a checkpoint)."""
    WORLD.Barrier()
    with h5py.File(os.path.join(folder, CHECKPOINT_NAME)) as f:
        return {k: json.loads(v) for k, v in f.attrs.items()}, set(f.keys())


def expected_stop(strategy, num_nodes, stop_after, sync_every):
    """The step after which every rank stops when the last rank asks after ``stop_after``:
    the epoch end if it comes first (agreed by the epoch-end sync), else the next step
    (its message carries the flag) or, for ``node`` on several nodes, the next K' sync."""
    def next_multiple(k, at_least):
        return -(-at_least // k) * k

    epoch_end = next_multiple(STEPS_PER_EPOCH, stop_after)
    if strategy == "node" and num_nodes > 1:
        return min(epoch_end, next_multiple(sync_every, stop_after + 1))
    return min(epoch_end, stop_after + 1)


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

    stop_after = 8 if strategy != "node" else 9  # stops at step 9 / 12 (inside epoch 2)
    first, end = train(argv + ["--checkpoint", folder], model=model, ranks_per_node=ranks_per_node,
                       stop_after=stop_after)
    num_nodes = first.dp.topology.num_nodes
    stop = expected_stop(strategy, num_nodes, stop_after, 4)
    assert all_agree(WORLD, end["stopped"] == "signal" and end["step"] == stop), (end, stop)
    meta, groups = checkpoint_contents(folder)
    assert (meta["distributed"]["steps"], meta["epoch"], meta["step_in_epoch"]) == (
        stop, stop // STEPS_PER_EPOCH, stop % STEPS_PER_EPOCH)
    # node-local optimizer state between nodes, unless it was averaged at the sync just done
    per_node = strategy == "node" and num_nodes > 1 and not (
        "--sync-optimizer-state" in extra and stop % 4 == 0)
    assert ("nodes" in groups) == per_node and ("optimizer" in groups) == (not per_node)

    resumed, end = train(argv + ["--checkpoint", folder, "--resume"], model=model,
                         ranks_per_node=ranks_per_node)
    assert all_agree(WORLD, end["stopped"] == "completed")
    check_same(resumed, reference, f"{strategy} {extra} nodes={num_nodes}")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks_per_node", [None, TWO_NODES], ids=["launcher-nodes", "two-nodes"])
def test_max_steps_between_node_syncs_then_resume(mpi_tmp_path, ranks_per_node):
    """``--max-steps 6`` with ``K' = 4``: the nodes' parameters differ at the stop, so the
    checkpoint holds each node's own parameters too (and its samples since the last sync)."""
    argv = BASE + ["--schedule", "constant", "--strategy", "node", "--sync-every", "4"]
    folder = str(mpi_tmp_path / "ck")
    reference, _ = train(argv, ranks_per_node=ranks_per_node)
    first, end = train(argv + ["--checkpoint", folder, "--max-steps", "6"], ranks_per_node=ranks_per_node)
    assert end["stopped"] == "max_steps" and end["step"] == 6
    meta, groups = checkpoint_contents(folder)
    multi = first.dp.topology.num_nodes > 1
    assert ("nodes" in groups) == multi and meta["step_in_epoch"] == 6
    if multi:
        assert meta["distributed"]["node_samples"] is not None and meta["distributed"]["steps_since_sync"] == 2
    resumed, _ = train(argv + ["--checkpoint", folder, "--resume"], ranks_per_node=ranks_per_node)
    check_same(resumed, reference, f"node, max-steps, nodes={first.dp.topology.num_nodes}")


@pytest.mark.mpi
def test_epochs_then_more_epochs_with_constant_schedule(mpi_tmp_path):
    argv = BASE + ["--schedule", "constant", "--warmup-steps", "0"]
    folder = str(mpi_tmp_path / "ck")
    reference, _ = train(argv)
    train(argv + ["--epochs", "1", "--checkpoint", folder])
    resumed, _ = train(argv + ["--checkpoint", folder, "--resume"])
    check_same(resumed, reference, "epochs 1 then 2")


@pytest.mark.mpi
def test_a_checkpoint_is_one_file(mpi_tmp_path):
    """Per-node state lives in the one file rank 0 renames into place: nothing else is left."""
    folder = str(mpi_tmp_path / "ck")
    trainer, _ = train(BASE + ["--strategy", "node", "--sync-every", "4", "--checkpoint", folder],
                       ranks_per_node=TWO_NODES)
    meta, groups = checkpoint_contents(folder)
    names = sorted(os.listdir(folder))
    multi = trainer.dp.topology.num_nodes > 1
    ok = names == [CHECKPOINT_NAME] and ("nodes" in groups) == multi
    ok = ok and meta["distributed"]["steps"] == 2 * STEPS_PER_EPOCH and meta["epoch"] == 2
    assert all_agree(WORLD, ok), names


def expect_checkpoint_error(argv, match, **kwargs):
    """Every rank must raise the same CheckpointError (never one rank alone)."""
    trainer = make_trainer(WORLD, argv, **kwargs)
    try:
        trainer.resume()
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
def test_missing_node_state_on_one_node(mpi_tmp_path):
    folder = str(mpi_tmp_path / "ck")
    argv = BASE + ["--strategy", "node", "--sync-every", "4", "--checkpoint", folder]
    trainer, _ = train(argv + ["--epochs", "1"], ranks_per_node=TWO_NODES)
    topo = trainer.dp.topology
    # an epoch's end follows a parameter sync: the checkpoint resumes on another strategy
    # (the nodes' optimizer states averaged); the node checkpoint is checked below
    moved = make_trainer(WORLD, BASE + ["--checkpoint", folder, "--resume"])
    moved.resume()
    assert moved.dp.steps == STEPS_PER_EPOCH and moved.start_epoch == 1
    moved.dp.close()
    WORLD.Barrier()
    if RANK == 0:  # the last node's part of the file is lost
        with h5py.File(os.path.join(folder, CHECKPOINT_NAME), "r+") as f:
            del f[f"nodes/{topo.num_nodes - 1}"]
    WORLD.Barrier()
    # the ranks of the other node read fine: still every rank raises, naming the failing ranks
    failing = [r for r, n in enumerate(topo.node_of_rank) if n == topo.num_nodes - 1]
    expect_checkpoint_error(argv + ["--resume"], f"(on rank{'s' if len(failing) > 1 else ''} {failing})",
                            ranks_per_node=TWO_NODES)


@pytest.mark.mpi(min_size=2)
def test_a_node_checkpoint_between_syncs_says_what_would_resume_it(mpi_tmp_path):
    """Written 2 steps after a parameter sync (``--max-steps 6``, ``K' = 4``): the nodes'
    parameters differ, so it resumes only on the same strategy and nodes, and says so."""
    folder = str(mpi_tmp_path / "ck")
    argv = BASE + ["--strategy", "node", "--sync-every", "4", "--checkpoint", folder]
    train(argv + ["--max-steps", "6"], ranks_per_node=TWO_NODES)
    here = Topology.from_comm(WORLD)  # the resuming run's own nodes (real ones in a 2-node stage)
    nodes_here = here.num_nodes
    here.free()
    expect_checkpoint_error(BASE + ["--checkpoint", folder, "--resume"],
                            "written 2 step(s) after the last parameter sync of its 2 nodes (strategy node), "
                            "while their parameters differed, so it continues only with strategy node on 2 "
                            f"node(s) (this run: strategy flat on {nodes_here}); resume it so until an epoch's end "
                            "(the checkpoint there follows a parameter sync), then change the strategy or node count")
