"""Checkpoint files: atomic writes, one file with the per-node parts, clear errors, one-rank resume.

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

import launcher

import mpidl.app.checkpoint as ck
from mpidl.engine.backend import get_backend
from mpidl.app.config import parse_config
from mpidl.data import ArrayDataset
from mpidl.distributed.topology import Topology
from mpidl.app.log import Printer
from mpidl.engine.models import build_model
from mpidl.app.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = launcher.default_mpiexec()
META = {"epoch": 1, "step_in_epoch": 0, "build_args": {"name": "x"}, "model": "x"}


class SavedState:
    """Stands in for a DataParallel on rank 0: :func:`save_fake` saves its fixed ``state`` as
    :func:`mpidl.distributed.checkpoint.state_dict` would return it."""

    rank = 0

    def __init__(self, value, steps=7, nodes=None):
        self.state = {
            "strategy": "node" if nodes else "flat", "weighting": "balanced", "world_size": 2,
            "num_nodes": len(nodes) if nodes else 1, "steps": steps, "steps_since_sync": 0,
            "costs": [[0.0, 1.0], [0.0, 1.0]], "batch_sizes": [4, 4], "params": np.full(5, value),
            "optimizer": {"step_count": steps, "state": None if nodes else [np.full(5, -value)]},
            "nodes": nodes, "buffers": {"bn.mean": np.ones(2)},
            "rank_buffers": [{"bn.mean": np.full(2, 10.0 + r)} for r in range(2)],
        }



def save_fake(folder, fake: SavedState, meta: dict) -> str:
    """``ck.save_checkpoint`` of a :class:`SavedState`: the file format alone, with the state
    ``mpidl.distributed.checkpoint.state_dict`` gathers replaced by the fake's."""
    real = ck.state_dict
    ck.state_dict = lambda dp: dp.state
    try:
        return ck.save_checkpoint(str(folder), fake, meta)
    finally:
        ck.state_dict = real


def write_simple(folder, value, steps=7, nodes=None):
    return save_fake(folder, SavedState(value, steps, nodes), META)


def read(folder, node_id=0, rank=0, world_size=2):
    return ck.read_checkpoint(str(folder), node_id=node_id, rank=rank, world_size=world_size)


def leftovers(folder):
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


# ---------------------------------------------------------------- atomic writes
def test_write_and_read_round_trip(tmp_path):
    write_simple(tmp_path, 1.5)
    state, meta = read(tmp_path, rank=1)
    np.testing.assert_array_equal(state["params"], np.full(5, 1.5))
    np.testing.assert_array_equal(state["optimizer"]["state"][0], np.full(5, -1.5))
    assert state["buffers"].keys() == {"bn.mean"} and state["nodes"] is None
    assert state["rank_buffers"][0] is None and state["rank_buffers"][1]["bn.mean"][0] == 11.0
    assert state["steps"] == 7 and meta["build_args"] == {"name": "x"}
    assert meta["distributed"]["optimizer_step"] == 7 and meta["format_version"] == ck.FORMAT_VERSION
    assert read(tmp_path, world_size=3)[0]["rank_buffers"] is None  # another world: the average only
    assert leftovers(tmp_path) == []


def test_failure_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    write_simple(tmp_path, 1.0)
    before = (tmp_path / ck.CHECKPOINT_NAME).read_bytes()

    def fail_after_first_dataset(group, state):  # params and buffers are already in the new file
        group.create_dataset("state0", data=np.asarray(state[0]))
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(ck, "_write_state", fail_after_first_dataset)
    with pytest.raises(OSError, match="simulated"):
        write_simple(tmp_path, 2.0, steps=9)
    assert (tmp_path / ck.CHECKPOINT_NAME).read_bytes() == before
    assert leftovers(tmp_path) == []  # the temporary file is removed
    np.testing.assert_array_equal(read(tmp_path)[0]["params"], np.full(5, 1.0))


KILLED_WRITER = """
import sys, time
import numpy as np
import mpidl.app.checkpoint as ck
sys.path.insert(0, sys.argv[2])
from test_checkpoint import META, SavedState, save_fake
def slow(group, state):
    group.create_dataset("state0", data=np.asarray(state[0]))
    group.file.flush()
    print("writing", flush=True)
    time.sleep(60)
ck._write_state = slow
save_fake(sys.argv[1], SavedState(2.0, steps=9), META)
"""


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path):
    """A writer killed outright (SIGKILL, a node failure) can leave only a stray temporary
    file; ``checkpoint.h5`` stays the old, readable one."""
    write_simple(tmp_path, 1.0)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    state, _ = read(tmp_path)
    np.testing.assert_array_equal(state["params"], np.full(5, 1.0))
    assert state["steps"] == 7
    assert len(leftovers(tmp_path)) == 1  # the killed writer's temporary file, never read
    # the next start in this folder (the command line's set-up check) removes exactly it
    from mpidl.app.outputs import check_output_folder

    stray = leftovers(tmp_path)
    removed = check_output_folder("--checkpoint", str(tmp_path), [ck.CHECKPOINT_NAME])
    assert [os.path.basename(p) for p in removed] == stray and leftovers(tmp_path) == []


# ---------------------------------------------------------------- per-node parts
def test_each_node_reads_its_own_part(tmp_path):
    nodes = [{"params": np.full(5, 3.0 + k), "state": [np.full(5, 10.0 + k)], "samples": 100 + k}
             for k in range(2)]
    write_simple(tmp_path, 2.0, nodes=nodes)
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME) as f:
        assert set(f["nodes"]) == {"0", "1"} and "optimizer" not in f
    state, meta = read(tmp_path, node_id=1)
    mine = state["nodes"][1]
    assert state["nodes"][0] == {} and mine["samples"] == 101
    np.testing.assert_array_equal(mine["params"], np.full(5, 4.0))
    np.testing.assert_array_equal(mine["state"][0], np.full(5, 11.0))
    np.testing.assert_array_equal(state["params"], np.full(5, 2.0))  # the consensus, too
    assert meta["distributed"]["node_samples"] == [100, 101]
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME, "r+") as f:
        del f["nodes/1"]
    with pytest.raises(ck.CheckpointError, match="is not a readable mpidl checkpoint"):
        read(tmp_path, node_id=1)


# ---------------------------------------------------------------- errors
def test_missing_and_corrupt_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(ck.CheckpointError, match=f"no checkpoint at {tmp_path}/checkpoint.h5"):
        read(tmp_path)
    (tmp_path / ck.CHECKPOINT_NAME).write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(ck.CheckpointError, match="is not a readable mpidl checkpoint"):
        read(tmp_path)
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME, "w") as f:  # HDF5, but not a checkpoint
        f["params"] = np.zeros(3)
    with pytest.raises(ck.CheckpointError, match="checkpoint format None"):
        ck.read_checkpoint_meta(str(tmp_path))
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME, "w") as f:  # a checkpoint of another format
        f.attrs["format_version"] = json.dumps(1)
    with pytest.raises(ck.CheckpointError, match="format 1; this mpidl reads format 2"):
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
    trainer = Trainer(cfg, model, train, test, Printer(0, quiet=True),
                      topology=Topology.from_comm(MPI.COMM_SELF))
    if stop_after is not None:
        step = trainer.train_step

        def train_step(*args):
            loss = step(*args)
            if trainer.global_step == stop_after:
                trainer.dp.request_stop()
            return loss

        trainer.train_step = train_step
    if cfg.resume:
        trainer.resume()
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
        _, end = train_serial(argv + folder, stop_after=15)  # stops after the next step, inside epoch 3
        assert end["stopped"] == "signal" and end["step"] == 16
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
    cmd = launcher.mpiexec(np_, [sys.executable, "-m", "mpidl.train", *args], exe=MPIEXEC)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.perf_counter() - start
    return proc


def foreign_checkpoint(folder):
    """A readable checkpoint of a different model (a hsicnn with other widths)."""
    save_fake(folder, SavedState(0.0), {
        "epoch": 1, "step_in_epoch": 0, "model": "hsicnn",
        "build_args": {"channels": [2, 2], "hidden": 4, "dropout": 0.0}})


@pytest.mark.parametrize("case, message", [
    ("missing", "--resume: no checkpoint at"),
    ("corrupt", "is not a readable mpidl checkpoint"),
    ("other-model", "holds model hsicnn {'channels': [2, 2]"),
    ("truncated", "is not a readable mpidl checkpoint: the file is truncated"),
    ("saved-model", "is a saved model (mpidl.train --save), not a checkpoint"),
])
@pytest.mark.launcher
def test_bad_resume_ends_cleanly_with_exit_2(tmp_path, case, message):
    if case == "corrupt":
        (tmp_path / ck.CHECKPOINT_NAME).write_bytes(b"\x89HDF\r\n" + b"\0" * 100)
    elif case == "other-model":
        foreign_checkpoint(tmp_path)
    elif case == "truncated":
        truncated_checkpoint(tmp_path)
    elif case == "saved-model":
        ck.save_model(str(tmp_path / ck.CHECKPOINT_NAME), build_model("hsicnn", (5, 5, 5), 3, channels=(4, 4), hidden=8))
    proc = launch(["--epochs", "1", "--speeds", "1,1", "--checkpoint", str(tmp_path), "--resume"])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("error") == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Abort" not in proc.stderr, proc.stderr


def truncated_checkpoint(folder):
    """A checkpoint cut at half its length, as a copy that did not finish leaves it."""
    path = folder / ck.CHECKPOINT_NAME
    write_simple(folder, 1.0)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path, len(data) // 2, len(data)


def test_a_truncated_checkpoint_is_one_clear_message(tmp_path):
    """Before: "not a readable mpidl checkpoint (--resume: ... not a readable mpidl checkpoint
    (Unable to synchronously open file (truncated file: eof = ...)))"."""
    path, kept, whole = truncated_checkpoint(tmp_path)
    with pytest.raises(ck.CheckpointError) as info:
        read(tmp_path)
    assert str(info.value) == (f"--resume: {path} is not a readable mpidl checkpoint: the file is truncated: "
                               f"{kept} of its {whole} bytes (a copy or a write was cut short)")


def test_a_saved_model_given_as_a_checkpoint_says_what_it_is_and_how_to_use_it(tmp_path):
    """Before: "has unreadable attributes (Expecting value: line 1 column 1 (char 0))"."""
    path = tmp_path / ck.CHECKPOINT_NAME
    model = build_model("hsicnn", (5, 5, 5), 3, channels=(4, 4), hidden=8)
    ck.save_model(str(path), model)
    with pytest.raises(ck.CheckpointError) as info:
        read(tmp_path)
    assert str(info.value) == (
        f"--resume: {path} is a saved model (mpidl.train --save), not a checkpoint: it holds the weights only, "
        "not the optimizer state and the place in the training that --resume needs; python -m mpidl.predict "
        f"--model {path} (or mpidl.app.checkpoint.load_model) reads it, and a run resumes from the --checkpoint DIR "
        "it wrote")
    # ... and the other way round
    write_simple(tmp_path, 1.0)
    with pytest.raises(ValueError, match=f"^{path} is a checkpoint \\(mpidl.train --checkpoint DIR\\), not a saved "
                                         "model: a run resumes from it with --checkpoint DIR --resume"):
        ck.load_model(str(path))


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_files_are_written_with_the_users_umask(tmp_path, umask):
    """Before: models, checkpoints and maps 0600 (mkstemp's mode), layout files and figures
    0644: every file mpidl writes now goes through one writer that gives ``0666 & ~umask``."""
    from mpidl.data.layout import write_layout
    from mpidl.app.outputs import atomic_file, atomic_h5

    previous = os.umask(umask)
    try:
        ck.save_model(str(tmp_path / "model.h5"), build_model("hsicnn", (5, 5, 5), 3, channels=(4, 4), hidden=8))
        write_simple(tmp_path, 1.0)
        with atomic_h5(str(tmp_path / "map.h5")) as f:  # predict's map
            f["map"] = np.zeros((3, 3), np.int16)
        with atomic_file(str(tmp_path / "figure.png")) as tmp:  # every PNG (plot, predict, gan)
            Path(tmp).write_bytes(b"\x89PNG")
        x = np.zeros((4, 1, 3, 3), np.float32)
        write_layout(tmp_path / "layout.h5", {"train": (x, np.arange(4) % 2), "test": (x, np.arange(4) % 2)},
                     ["a", "b"])
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(["model.h5", ck.CHECKPOINT_NAME, "map.h5", "figure.png", "layout.h5"],
                                  0o666 & ~umask)


def test_checkpoint_meta_is_json(tmp_path):
    """Attributes are JSON text: readable from any HDF5 tool, not only mpidl."""
    write_simple(tmp_path, 1.0)
    with h5py.File(tmp_path / ck.CHECKPOINT_NAME) as f:
        assert json.loads(f.attrs["distributed"])["steps"] == 7
