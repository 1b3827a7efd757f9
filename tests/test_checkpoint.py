"""Checkpoint files: atomic writes, the per-node file rule, clear errors, one-rank resume.

Serial: the trainer runs on ``MPI.COMM_SELF``; the command-line error tests launch
``mpiexec -n 2`` subprocesses. The multi-rank equivalence tests are in tests/mpi/test_resume.py,
the SIGTERM tests in tests/test_signals.py.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpidl.checkpoint as ck
from mpidl.backend import get_backend
from mpidl.config import parse_config
from mpidl.data import ArrayDataset
from mpidl.distributed.topology import Topology
from mpidl.log import Printer
from mpidl.models import build_model
from mpidl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def meta_for(step=7, **extra):
    meta = {"epoch": 1, "step_in_epoch": 0, "global_step": step, "optimizer_step": step,
            "build_args": {"name": "x"}, "num_nodes": 2}
    meta.update(extra)
    return meta


def write_simple(folder, value, step=7, **extra):
    return ck.write_checkpoint(str(folder), params=np.full(5, value), buffers={"bn.mean": np.ones(2)},
                               optimizer_state=[np.full(5, -value)], meta=meta_for(step, **extra))


def leftovers(folder):
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


# ---------------------------------------------------------------- atomic writes
def test_write_and_read_round_trip(tmp_path):
    write_simple(tmp_path, 1.5)
    out = ck.read_checkpoint(str(tmp_path))
    np.testing.assert_array_equal(out["params"], np.full(5, 1.5))
    np.testing.assert_array_equal(out["optimizer_state"][0], np.full(5, -1.5))
    assert out["buffers"].keys() == {"bn.mean"} and out["rank_buffers"] is None
    assert out["meta"]["global_step"] == 7 and out["meta"]["build_args"] == {"name": "x"}
    assert leftovers(tmp_path) == []


def test_failure_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    write_simple(tmp_path, 1.0)
    before = (tmp_path / ck.CHECKPOINT_NAME).read_bytes()

    def fail_after_first_dataset(f, state):  # params and buffers are already in the new file
        f.create_dataset("optimizer/state0", data=np.asarray(state[0]))
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(ck, "_write_state", fail_after_first_dataset)
    with pytest.raises(OSError, match="simulated"):
        write_simple(tmp_path, 2.0, step=9)
    assert (tmp_path / ck.CHECKPOINT_NAME).read_bytes() == before
    assert leftovers(tmp_path) == []  # the temporary file is removed
    np.testing.assert_array_equal(ck.read_checkpoint(str(tmp_path))["params"], np.full(5, 1.0))


KILLED_WRITER = """
import sys, time
import numpy as np
import mpidl.checkpoint as ck
def slow(f, state):
    f.create_dataset("optimizer/state0", data=np.asarray(state[0]))
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
ck._write_state = slow
ck.write_checkpoint(sys.argv[1], params=np.full(5, 2.0), buffers={}, optimizer_state=[np.zeros(5)],
                    meta={"epoch": 2, "step_in_epoch": 0, "global_step": 9, "optimizer_step": 9,
                          "build_args": {"name": "x"}})
"""


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path):
    """A writer killed outright (SIGKILL, a node failure) can leave only a stray temporary
    file; ``checkpoint.h5`` stays the old, readable one."""
    write_simple(tmp_path, 1.0)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    out = ck.read_checkpoint(str(tmp_path))
    np.testing.assert_array_equal(out["params"], np.full(5, 1.0))
    assert out["meta"]["global_step"] == 7
    assert len(leftovers(tmp_path)) == 1  # the killed writer's temporary file, never read


# ---------------------------------------------------------------- per-node files
def test_per_node_state_is_read_from_the_node_file(tmp_path):
    meta = meta_for(node_state=True, node_params=False)
    for node in (0, 1):
        ck.write_node_file(str(tmp_path), node, optimizer_state=[np.full(5, 10.0 + node)], params=None, meta=meta)
    ck.write_checkpoint(str(tmp_path), params=np.ones(5), buffers={}, optimizer_state=None, meta=meta)
    assert ck.read_checkpoint(str(tmp_path), node_id=1)["optimizer_state"][0][0] == 11.0
    with pytest.raises(ck.CheckpointError, match="per-node state of 2 nodes"):
        ck.read_checkpoint(str(tmp_path))
    os.remove(tmp_path / ck.node_optimizer_name(1, 7))
    with pytest.raises(ck.CheckpointError, match="missing per-node state .*optimizer-node1-step7.h5"):
        ck.read_checkpoint(str(tmp_path), node_id=1)


def test_node_params_between_syncs_are_the_nodes_own(tmp_path):
    meta = meta_for(node_state=True, node_params=True)
    ck.write_node_file(str(tmp_path), 0, optimizer_state=[np.zeros(5)], params=np.full(5, 3.0), meta=meta)
    ck.write_checkpoint(str(tmp_path), params=np.full(5, 2.0), buffers={}, optimizer_state=None, meta=meta)
    np.testing.assert_array_equal(ck.read_checkpoint(str(tmp_path), node_id=0)["params"], np.full(5, 3.0))


def test_remove_stale_node_files_keeps_the_named_step_and_other_nodes(tmp_path):
    names = ["optimizer-node0-step7.h5", "optimizer-node0-step14.h5", "optimizer-node1-step7.h5",
             "optimizer-node10-step7.h5", ck.CHECKPOINT_NAME]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    ck.remove_stale_node_files(str(tmp_path), 0, 14)
    assert sorted(os.listdir(tmp_path)) == sorted(set(names) - {"optimizer-node0-step7.h5"})
    ck.remove_stale_node_files(str(tmp_path), 1, None)  # this checkpoint has no node files
    assert "optimizer-node1-step7.h5" not in os.listdir(tmp_path)
    assert "optimizer-node10-step7.h5" in os.listdir(tmp_path)


# ---------------------------------------------------------------- errors
def test_missing_and_corrupt_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(ck.CheckpointError, match=f"no checkpoint at {tmp_path}/checkpoint.h5"):
        ck.read_checkpoint(str(tmp_path))
    (tmp_path / ck.CHECKPOINT_NAME).write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(ck.CheckpointError, match="is not a readable mpidl checkpoint"):
        ck.read_checkpoint(str(tmp_path))
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME, "w") as f:  # HDF5, but not a checkpoint
        f["params"] = np.zeros(3)
    with pytest.raises(ck.CheckpointError, match="is not a readable mpidl checkpoint"):
        ck.read_checkpoint_meta(str(tmp_path))


# ---------------------------------------------------------------- one-rank resume, bitwise
def tiny(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5, 5, 5)).astype(np.float32)
    return ArrayDataset(x, rng.integers(0, 3, n), ["a", "b", "c"])


def train_serial(argv, stop_after=None):
    """One rank on COMM_SELF; ``stop_after=k`` requests a stop (as SIGTERM does) after step k."""
    cfg = parse_config(argv + ["--batch-size", "8", "--lr", "0.05", "--seed", "3", "--dtype", "float64",
                               "--speeds", "1", "--quiet"])
    backend = get_backend("cpu", "float64")
    train, test = tiny(50, 0), tiny(20, 1)
    model = build_model(cfg.model, train.sample_shape, 3, backend=backend, seed=3, channels=(4, 4), hidden=8)
    trainer = Trainer(cfg, Topology.from_comm(MPI.COMM_SELF), backend, model, train, test,
                      Printer(0, quiet=True))
    if stop_after is not None:
        step = trainer.train_step

        def train_step(*args):
            synced = step(*args)
            if trainer.global_step == stop_after:
                trainer.stop_requested = True
            return synced

        trainer.train_step = train_step
    trainer.setup()
    end = trainer.run()
    return trainer, end


@pytest.mark.parametrize("how", ["stop-request", "max-steps", "epochs"])
def test_one_rank_interrupted_and_resumed_is_bitwise_identical(tmp_path, how):
    """float64, one rank: ``(epoch, step_in_epoch)``, parameters, momentum, step count and the
    schedule position all continue exactly. ``--max-steps`` and a shorter ``--epochs`` change
    the schedule's length, so those two cases use the constant schedule."""
    schedule = ["--schedule", "cosine", "--warmup-steps", "3"] if how == "stop-request" else ["--schedule", "constant"]
    argv = ["--epochs", "3"] + schedule
    reference, _ = train_serial(argv)
    folder = ["--checkpoint", str(tmp_path)]
    if how == "stop-request":
        _, end = train_serial(argv + folder, stop_after=15)  # control point at step 20, inside epoch 3
        assert end["stopped"] == "signal" and end["step"] == 20
    elif how == "max-steps":
        _, end = train_serial(argv + folder + ["--max-steps", "9"])
        assert end["stopped"] == "max_steps" and end["step"] == 9
    else:
        _, end = train_serial(["--epochs", "1"] + schedule + folder)
        assert end["stopped"] == "completed" and end["step"] == 7
    meta = ck.read_checkpoint_meta(str(tmp_path))
    assert (meta["epoch"], meta["step_in_epoch"]) == divmod(end["step"], 7)
    resumed, end = train_serial(argv + folder + ["--resume"])
    assert end["stopped"] == "completed" and end["step"] == 21
    assert resumed.params.data.tobytes() == reference.params.data.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in
               zip(resumed.optimizer.state_buffers(), reference.optimizer.state_buffers()))


# ---------------------------------------------------------------- the command line
def launch(args, np_=2, timeout=120):
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    cmd = [MPIEXEC, "-n", str(np_), "-launcher", "fork", sys.executable, "-m", "mpidl.train", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.perf_counter() - start
    return proc


def foreign_checkpoint(folder):
    """A readable checkpoint of a different model (a hsicnn with other widths)."""
    ck.write_checkpoint(str(folder), params=np.zeros(10), buffers={}, optimizer_state=[np.zeros(10)],
                        meta={"epoch": 1, "step_in_epoch": 0, "global_step": 3, "optimizer_step": 3,
                              "model": "hsicnn", "world_size": 2, "batch_sizes": [32, 32], "speeds": [1, 1],
                              "build_args": {"channels": [2, 2], "hidden": 4, "dropout": 0.0}})


@pytest.mark.parametrize("case, message", [
    ("missing", "--resume: no checkpoint at"),
    ("corrupt", "is not a readable mpidl checkpoint"),
    ("other-model", "holds model hsicnn {'channels': [2, 2]"),
])
def test_bad_resume_ends_cleanly_with_exit_2(tmp_path, case, message):
    if case == "corrupt":
        (tmp_path / ck.CHECKPOINT_NAME).write_bytes(b"\x89HDF\r\n" + b"\0" * 100)
    elif case == "other-model":
        foreign_checkpoint(tmp_path)
    proc = launch(["--epochs", "1", "--speeds", "1,1", "--checkpoint", str(tmp_path), "--resume"])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("error") == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Abort" not in proc.stderr, proc.stderr


def test_checkpoint_meta_is_json(tmp_path):
    """Attributes are JSON text: readable from any HDF5 tool, not only mpidl."""
    write_simple(tmp_path, 1.0)
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME) as f:
        assert json.loads(f.attrs["global_step"]) == 7
