"""Failures after set-up, decided alike on every rank: a checkpoint or final write that fails
(disk full, emulated by a writer that raises ENOSPC) rescues the model; NaN in the data is
named as the cause of a NaN gradient; a resume on other data or options is refused."""

import errno
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpidl.app.checkpoint as ck
from mpidl.app.checkpoint import CheckpointError, load_model
from mpidl.data import ArrayDataset
from mpidl.distributed import NonFiniteGradient
from mpidl.app.trainer import OutputWriteError, Trainer, epoch_permutation
from trainer_harness import make_trainer, speeds_for, tiny_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fault injection
from faults import Fault, inject  # noqa: E402

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()
BASE = ["--batch-size", "8", "--epochs", "2", "--lr", "0.05", "--seed", "3", "--speeds", speeds_for(P)]


def same_error_everywhere(run, kind):
    """``run()`` raises ``kind`` on every rank, with the same message; returns it."""
    try:
        run()
        message = None
    except kind as exc:
        message = str(exc)
    messages = WORLD.allgather(message)
    assert all(m is not None for m in messages) and len(set(messages)) == 1, messages
    return messages[0]


def disk_full_for(monkeypatch, name):
    """Writes of files called ``name`` fail with ENOSPC inside the atomic writer."""
    real = ck.atomic_h5

    @contextmanager
    def writer(path, **kwargs):
        with real(path, **kwargs) as f:
            if os.path.basename(path) == name:
                raise OSError(errno.ENOSPC, "No space left on device")
            yield f

    monkeypatch.setattr(ck, "atomic_h5", writer)


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["checkpoint", "save"])
def test_a_failing_write_rescues_the_model_on_every_rank(mpi_tmp_path, monkeypatch, what):
    out = mpi_tmp_path / "out"
    work = mpi_tmp_path / "work"
    if RANK == 0:
        out.mkdir()
        work.mkdir()
    WORLD.Barrier()
    monkeypatch.chdir(work)
    target = out / ("checkpoint.h5" if what == "checkpoint" else "model.h5")
    disk_full_for(monkeypatch, target.name)
    option = ["--checkpoint", str(out)] if what == "checkpoint" else ["--save", str(target)]
    trainer = make_trainer(WORLD, BASE + option)
    message = same_error_everywhere(trainer.run, OutputWriteError)
    rescued = WORLD.bcast(sorted(work.glob("mpidl-rescued-model.*.h5")) if RANK == 0 else None)
    assert len(rescued) == 1, rescued
    kind = "the checkpoint" if what == "checkpoint" else "the final model"
    assert message == (f"cannot write {kind} to {target}: No space left on device (ENOSPC); the trained "
                       f"model was saved to {rescued[0]} instead (mpidl.app.checkpoint.load_model reads it)"
                       + ("" if P == 1 else " (on rank [0])"))  # rank 0 writes
    np.testing.assert_allclose(load_model(str(rescued[0])).params.data, trainer.params.data, rtol=1e-6)  # float32 on load
    WORLD.Barrier()
    if RANK == 0:
        assert not any(n.endswith(".tmp") for n in os.listdir(out))


@pytest.mark.mpi
def test_nan_at_step_0_from_the_data_says_so():
    data = tiny_dataset()
    x = np.array(data._x)
    bad = int(epoch_permutation(3, 0, data.num_samples)[5])  # in the first global batch
    x[bad, 1, 2, 2] = np.nan
    poisoned = ArrayDataset(x, data.labels, data.class_names)
    trainer = make_trainer(WORLD, BASE, train=poisoned)
    message = same_error_everywhere(trainer.run, NonFiniteGradient)
    assert "at step 0, caused by the data" in message and f"sample {bad} of ArrayDataset" in message
    assert "1 sample(s) of this step's batch" in message
    # The failure bound's thread ended with the run: a process that goes on is not ended later.
    assert trainer.watchdog is None or not trainer.watchdog._thread.is_alive()


@pytest.mark.mpi
def test_a_nan_gradient_without_nan_data_keeps_its_message(monkeypatch):
    monkeypatch.setattr(Trainer, "train_step", Trainer.train_step)  # put back after the test
    inject(Trainer, Fault(P - 1, 2, "nan"))  # what MPIDL_INJECT_FAULT=P-1:2:nan does in faulty_train.py
    trainer = make_trainer(WORLD, BASE)
    message = same_error_everywhere(trainer.run, NonFiniteGradient)
    assert "caused by the data" not in message and "reduced gradient at step 2" in message


@pytest.mark.mpi
def test_resume_checks_data_and_options_at_an_epoch_boundary(mpi_tmp_path):
    folder = str(mpi_tmp_path / "ck")
    first = make_trainer(WORLD, BASE + ["--epochs", "1", "--checkpoint", folder])
    first.run()
    resume = BASE + ["--checkpoint", folder, "--resume"]
    other = tiny_dataset(seed=7)  # the same counts, shapes and classes; other values
    message = same_error_everywhere(make_trainer(WORLD, resume, train=other).resume, CheckpointError)
    assert "was written on other data (fingerprint arrays:" in message
    fewer = tiny_dataset(n=40)
    message = same_error_everywhere(make_trainer(WORLD, resume, train=fewer).resume, CheckpointError)
    assert "train 50 -> 40" in message
    changed = [a if a != "0.05" else "0.1" for a in resume]
    message = same_error_everywhere(make_trainer(WORLD, changed).resume, CheckpointError)
    assert "written with --lr 0.05; this run has --lr 0.1" in message
    trainer = make_trainer(WORLD, resume)  # the same data and options: accepted
    trainer.resume()
    assert trainer.start_epoch == 1


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["flat", "hierarchical", "node"])
def test_the_elastic_wrapper_without_a_failure_trains_as_its_core(mpi_tmp_path, monkeypatch, strategy):
    """--on-failure shrink with ULFM forced on (under any MPI: its guarded calls, the state kept
    before each step or sync, and an agreement per step and sync all run): the same training as
    the core alone, bit for bit, checkpoint included."""
    from mpidl import settings
    from mpidl.distributed.elastic import ElasticDataParallel

    if settings.SETTINGS.ranks_per_node is not None:
        pytest.skip("--on-failure shrink refuses emulated nodes (MPIDL_RANKS_PER_NODE)")
    monkeypatch.setattr(settings, "SETTINGS", settings.Settings.from_environ({"MPIDL_ULFM": "1"}))
    runs = []
    for on_failure in ("restart", "shrink"):
        folder = mpi_tmp_path / on_failure
        trainer = make_trainer(WORLD, BASE + ["--strategy", strategy, "--sync-every", "3", "--on-failure", on_failure,
                                              "--checkpoint", str(folder)])
        runs.append((trainer, trainer.run(), folder / ck.CHECKPOINT_NAME))
    (plain, plain_end, plain_file), (elastic, elastic_end, elastic_file) = runs
    assert isinstance(elastic.dp, ElasticDataParallel) and elastic.dp.on_failure == "shrink"
    assert not isinstance(plain.dp, ElasticDataParallel) and not elastic.dp.shrunk
    # node on several nodes: the state was kept before the syncs; else before the steps
    kept = elastic.dp._sync_snapshots if not elastic.dp.exchange.exact else elastic.dp._step_snapshots
    assert kept.steps, (strategy, elastic.dp.topology.num_nodes)
    np.testing.assert_array_equal(elastic.params.data, plain.params.data)
    assert (elastic_end["step"], elastic_end["oa"], elastic_end["failures"]) == (plain_end["step"], plain_end["oa"], 0)
    if RANK == 0:
        import h5py

        with h5py.File(plain_file, "r") as a, h5py.File(elastic_file, "r") as b:
            np.testing.assert_array_equal(a["params"][...], b["params"][...])
