"""The command line end to end: outputs, set-up errors, failures (subprocesses, some under mpiexec)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import launcher
from faults import ENV as FAULT_ENV
from mpidl.app.checkpoint import load_model

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = launcher.default_mpiexec()
FAST = ["--epochs", "1", "--max-steps", "3", "--speeds", "auto"]


def train(args, np_=None, timeout=120, fault=None):
    """Run the command line; ``fault``: the tests' injected fault (tests/faults.py), run by
    tests/faulty_train.py, the command line with it."""
    entry = ["-m", "mpidl.train"] if fault is None else [str(ROOT / "tests" / "faulty_train.py")]
    cmd = [sys.executable, *entry, *args]
    env = dict(os.environ)
    env.pop(FAULT_ENV, None)
    if fault is not None:
        env[FAULT_ENV] = fault
    if np_ is not None:
        if not Path(MPIEXEC).exists():
            pytest.skip(f"no mpiexec at {MPIEXEC}")
        cmd = launcher.mpiexec(np_, cmd, exe=MPIEXEC)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    proc.seconds = time.perf_counter() - start
    return proc


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_serial_run_writes_metrics_and_model(tmp_path):
    metrics, model_path = tmp_path / "m.jsonl", tmp_path / "model.h5"
    proc = train(FAST + ["--metrics", str(metrics), "--save", str(model_path)])
    assert proc.returncode == 0, proc.stderr
    assert "built-in synthetic scene" in proc.stdout and "done:" in proc.stdout
    records = read_jsonl(metrics)
    assert [r["event"] for r in records] == ["start", "epoch", "end"]
    epoch = records[1]
    for key in ("epoch", "step", "loss", "oa", "aa", "kappa", "time_s", "samples_per_s", "strategy",
                "batch_sizes", "speeds", "comp_s", "comm_s", "idle_s", "comm"):
        assert key in epoch, key
    assert epoch["step"] == 3 and records[2]["stopped"] == "max_steps"
    assert set(epoch["comm"]) == {"intra", "inter", "world", "control"}
    model = load_model(str(model_path))
    with h5py.File(model_path) as f:
        assert f.attrs["model"] == "hsicnn"
        for p in model.params:
            np.testing.assert_array_equal(f[p.name][()], model.params[p.name].data)


@pytest.mark.launcher
def test_four_ranks_metrics_have_per_rank_fields(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = train(FAST + ["--metrics", str(metrics), "--speeds", "1,2,3,4"], np_=4)
    assert proc.returncode == 0, proc.stderr
    epoch = read_jsonl(metrics)[1]
    assert epoch["batch_sizes"] == [6, 13, 19, 26]  # 64 split 1:2:3:4 by largest remainder
    assert len(epoch["comp_s"]) == len(epoch["comm_s"]) == len(epoch["idle_s"]) == 4
    assert epoch["comm"]["world"]["calls"] == 3  # one world Allreduce per step
    assert proc.stdout.count("done:") == 1  # rank 0 prints


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "--model 'nope' is not one of"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--epochs", "-1"], "--epochs must be a positive integer"),
        (["--data", "missing.h5"], "--data missing.h5: no such file"),
        (["--model", "resnet8"], "resnet8"),  # 7x7 patches are too small for resnet8
        # a model that cannot take the data's shape: the model, the shape and the fix
        (["--model", "vit", "--model-args", '{"patch": 2}'],
         "vit: sub-patch 2 does not divide the 7x7 pixels of input_shape (32, 7, 7); pass --model-args"),
        (["--model", "mlp", "--model-args", '{"depth": 2}'], "model 'mlp' takes no argument(s) ['depth']"),
        (["--model", "vit", "--model-args", "patch=2"], "--model-args must be a JSON object"),
        (["--sync-every", "x"], "--sync-every: must be an integer >= 1 or 'epoch', got 'x'"),
        # 2048 samples / 64 = 32 steps per epoch: K'=32, and the overlap must stay below it
        (["--strategy", "node", "--sync-every", "epoch", "--sync-overlap", "40"],
         "--sync-overlap: sync_overlap must be an integer in [0, sync_every=32), got 40 (--sync-every epoch is K'=32 here)"),
    ],
)
@pytest.mark.launcher
def test_setup_errors_are_printed_once_and_exit_2(args, message):
    proc = train(args, np_=2)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.count("error") == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("model, extra", [("mlp", []), ("spectral_lstm", ["--model-args", '{"group": 8}']),
                                          ("vit", ["--model-args", '{"dim": 16, "depth": 1, "heads": 2}'])])
def test_sequence_and_attention_models_train_from_the_command_line(tmp_path, model, extra):
    metrics = tmp_path / "m.jsonl"
    proc = train(["--model", model, *extra, *FAST, "--metrics", str(metrics)])
    assert proc.returncode == 0, proc.stderr
    start = read_jsonl(metrics)[0]
    assert start["model"] == model and start["config"]["model_args"] == (extra[1] if extra else None)


def test_cache_trains_the_same_model(tmp_path):
    # --cache changes where a sample comes from after its first read, not its value: two
    # ranks, three epochs (every rank reads again samples it read before), the same model bit
    # for bit. The split is fixed (--speeds 1,1): a measured one may differ between the two
    # runs on a busy machine, and a different split sums the gradient in another order.
    path = tmp_path / "scene.h5"
    made = subprocess.run([sys.executable, "-m", "mpidl.data_tools", "synthetic", "--rows", "24", "--cols", "24",
                           "--bands", "8", "--train-per-class", "24", "--out", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    models = []
    for options in ([], ["--cache"]):
        out = tmp_path / f"model{len(models)}.h5"
        proc = train(["--data", str(path), "--epochs", "3", "--batch-size", "16", "--seed", "1",
                      "--speeds", "1,1", "--quiet", "--save", str(out), *options], np_=2)
        assert proc.returncode == 0, proc.stderr
        models.append(load_model(str(out)).params.data.copy())
    np.testing.assert_array_equal(models[0], models[1])


def test_data_file_without_layout_is_refused(tmp_path):
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f["something"] = np.zeros(3)
    proc = train(["--data", str(bad)])
    assert proc.returncode == 2 and str(bad) in proc.stderr, proc.stderr


@pytest.mark.launcher
def test_batch_smaller_than_world_runs_with_an_empty_share(tmp_path):
    """The trainer's min_local_batch is 0 (an empty share is a zero gradient): B < P runs,
    as an uneven split that leaves a rank out does (issue 31 row 19)."""
    metrics = tmp_path / "m.jsonl"
    proc = train(["--batch-size", "3", "--speeds", "1,1,1,1", "--epochs", "1", "--max-steps", "2",
                  "--metrics", str(metrics)], np_=4, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "batch sizes [1, 1, 1, 0]" in proc.stdout
    assert [r["batch_sizes"] for r in read_jsonl(metrics) if r["event"] == "epoch"] == [[1, 1, 1, 0]]


@pytest.mark.launcher
def test_exception_on_one_rank_ends_the_job_promptly():
    proc = train(["--epochs", "50", "--speeds", "1,1,1,1"], np_=4, fault="1:5")
    assert proc.returncode != 0
    assert "rank 1 failed: InjectedFault" in proc.stderr
    assert proc.stderr.count("rank 1 failed") == 1
    assert proc.seconds < 30  # start-up included; the abort itself takes well under a second


@pytest.mark.launcher
@pytest.mark.parametrize("strategy", ["flat", "node"])
def test_nan_on_one_rank_stops_every_rank(tmp_path, strategy):
    metrics = tmp_path / "m.jsonl"
    proc = train(["--epochs", "2", "--speeds", "1,1,1,1", "--strategy", strategy, "--sync-every", "5",
                  "--ranks-per-node", "2", "--metrics", str(metrics)], np_=4, fault="2:3:nan")
    assert proc.returncode == 1, proc.stderr
    assert "non-finite" in proc.stderr and proc.stderr.count("error:") == 1
    end = read_jsonl(metrics)[-1]
    assert end["event"] == "end" and end["stopped"] == "nan"
    # flat: every rank sees the NaN in the reduced gradient of step 3 and none is applied;
    # node: the poisoned node stops updating, and all agree at the next inter-node sync (step 5)
    assert end["step"] == (3 if strategy == "flat" else 5)  # steps completed


@pytest.mark.launcher
def test_nan_skip_keeps_training(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = train(["--epochs", "1", "--max-steps", "6", "--speeds", "1,1", "--on-nan", "skip",
                  "--metrics", str(metrics)], np_=2, fault="1:2:nan")
    assert proc.returncode == 0, proc.stderr
    assert "step skipped" in proc.stdout
    assert read_jsonl(metrics)[-1]["step"] == 6


def test_quiet_prints_only_the_summary():
    proc = train(["--epochs", "1", "--max-steps", "3", "--speeds", "1", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("done: max_steps after 3 steps")


def test_progress_lines_within_an_epoch():
    proc = train(["--epochs", "1", "--max-steps", "6", "--speeds", "1", "--progress-every", "1e-9"])
    assert proc.returncode == 0, proc.stderr
    assert "  epoch 1 step 2/32" in proc.stdout  # printed at most every --progress-every seconds
    quiet = train(["--epochs", "1", "--max-steps", "6", "--speeds", "1", "--progress-every", "1e-9",
                   "--log-level", "warning"])
    assert "step 2/32" not in quiet.stdout and "done:" in quiet.stdout


@pytest.mark.parametrize("options", [
    ["--intra", "shm"],
    ["--overlap", "--bucket-mb", "0.01", "--strategy", "hierarchical", "--ranks-per-node", "1"],
    ["--strategy", "hierarchical", "--ranks-per-node", "1", "--compress", "bf16"],
    ["--strategy", "node", "--ranks-per-node", "1", "--sync-every", "2", "--sync-overlap"],
])
def test_hiding_options_train_and_log(tmp_path, options):
    metrics = tmp_path / "m.jsonl"
    proc = train(["--epochs", "1", "--max-steps", "4", "--speeds", "1,1", "--metrics", str(metrics),
                  *options], np_=2)
    assert proc.returncode == 0, proc.stderr
    end = read_jsonl(metrics)[-1]
    assert end["event"] == "end" and end["step"] == 4


@pytest.mark.launcher
def test_sync_every_epoch_syncs_once_per_epoch_between_two_nodes(tmp_path):
    """``--sync-every epoch`` on 2 emulated nodes of 2 ranks: K' = the steps of one epoch, so
    one inter-node parameter sync in the epoch, at its end."""
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    metrics = tmp_path / "m.jsonl"
    cmd = launcher.mpiexec(4, [sys.executable, "-m", "mpidl.train", "--strategy", "node", "--sync-every", "epoch",
                               "--epochs", "1", "--speeds", "1,1,1,1", "--metrics", str(metrics)],
                           nodes=2, exe=MPIEXEC)
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "MPIDL_RANKS_PER_NODE")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, epoch, end = read_jsonl(metrics)
    steps = start["steps_per_epoch"]
    assert start["num_nodes"] == 2 and start["config"]["sync_every"] == "epoch"
    assert start["sync_every"] == steps > 1
    assert f"K'={steps}" in proc.stdout and f"{steps} steps/epoch" in proc.stdout
    assert epoch["step"] == end["step"] == steps
    assert epoch["comm"]["inter"]["calls"] == 1  # one sync in the epoch's `steps` steps
