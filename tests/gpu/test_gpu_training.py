"""``python -m mpidl.train --device gpu`` end to end, against the same run on the CPU.

Five float64 training steps of the default model on the built-in synthetic scene, three ways:
1 rank on the CPU (the reference), 1 rank on the GPU, and 2 ranks on the GPU under ``mpiexec``
(both ranks on one GPU when there is only one: ``select_device`` wraps around). Every run must
exit 0 and reach the CPU's loss (to 1e-9), its final parameters (to 1e-9 of each tensor's
largest value) and its test accuracy (within 2 of the ~2000 test samples, in case a
near-tie flips). With ``--balance none`` the 2 ranks split each batch of 64 as 32 + 32 and the
balanced gradient makes the result the 1-rank result up to rounding.

The three runs start together and are awaited together (the GPU ones spend most of their
time compiling kernels), so the module costs about one run's time. Skipped, with the reason,
without CuPy or a CUDA device; ``MPIDL_GPU_TESTS_ON_CPU=1`` runs it with ``--device cpu``
everywhere (a check of this test code, see conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpidl.engine.backend import gpu_unavailable_reason

_ON_CPU = os.environ.get("MPIDL_GPU_TESTS_ON_CPU", "").strip() == "1"
_REASON = None if _ON_CPU else gpu_unavailable_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from mpidl.engine.backend import get_backend  # noqa: E402
from mpidl.app.checkpoint import load_model  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
DEVICE = "cpu" if _ON_CPU else "gpu"
STEPS = 5
COMMON = ["--epochs", "1", "--max-steps", str(STEPS), "--dtype", "float64", "--balance", "none",
          "--seed", "0", "--quiet"]
TIMEOUT_S = 150
LOSS_RTOL = 1e-9
PARAM_TOL = 1e-9
OA_ATOL = 1e-3  # 2 samples of the ~2000 in the test split


def _command(device: str, ranks: int | None, outdir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "mpidl.train", *COMMON, "--device", device,
           "--metrics", str(outdir / "metrics.jsonl"), "--save", str(outdir / "model.h5")]
    if ranks is not None:
        cmd = [MPIEXEC, "-n", str(ranks), "-launcher", "fork", *cmd]
    return cmd


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the three runs at once, wait for all; name -> dict(returncode, output, metrics,
    params), or name -> str (why that run could not be made)."""
    plan = {"cpu-1": ("cpu", None), f"{DEVICE}-1": (DEVICE, None), f"{DEVICE}-2": (DEVICE, 2)}
    started = {}
    results: dict = {}
    for name, (device, ranks) in plan.items():
        if ranks is not None and not Path(MPIEXEC).exists():
            results[name] = f"no mpiexec at {MPIEXEC} (set MPIEXEC)"
            continue
        outdir = tmp_path_factory.mktemp(name)
        log = open(outdir / "output.txt", "w+")
        proc = subprocess.Popen(_command(device, ranks, outdir), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        started[name] = (proc, outdir, log)
    deadline = time.perf_counter() + TIMEOUT_S
    for name, (proc, outdir, log) in started.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
        metrics_path, model_path = outdir / "metrics.jsonl", outdir / "model.h5"
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        params = None
        if model_path.exists():
            params = load_model(str(model_path), backend=get_backend("cpu", "float64")).params.state_dict_host()
        results[name] = {"returncode": proc.returncode, "output": output, "metrics": metrics, "params": params}
    return results


def _finished(runs, name: str) -> dict:
    run = runs[name]
    if isinstance(run, str):
        pytest.skip(run)
    assert run["returncode"] == 0, f"{name} exited with {run['returncode']}:\n{run['output'][-4000:]}"
    events = [record["event"] for record in run["metrics"]]
    assert events == ["start", "epoch", "end"], f"{name}: metrics events {events}\n{run['output'][-2000:]}"
    assert run["metrics"][-1]["step"] == STEPS and run["metrics"][-1]["stopped"] == "max_steps"
    return run


def _assert_same_training(run: dict, reference: dict) -> None:
    _, epoch, end = run["metrics"]
    ref_epoch, ref_end = reference["metrics"][1], reference["metrics"][2]
    assert abs(epoch["loss"] - ref_epoch["loss"]) <= LOSS_RTOL * abs(ref_epoch["loss"]), (
        f"mean training loss {epoch['loss']!r}, CPU {ref_epoch['loss']!r}"
    )
    assert abs(end["oa"] - ref_end["oa"]) <= OA_ATOL, f"test OA {end['oa']}, CPU {ref_end['oa']}"
    assert run["params"].keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        scale = max(float(np.abs(expected).max()), 1e-30)
        error = float(np.abs(run["params"][name] - expected).max()) / scale
        assert error <= PARAM_TOL, f"parameter {name} after {STEPS} steps differs from the CPU's by {error:.3g}"


def test_cpu_reference_run(runs):
    run = _finished(runs, "cpu-1")
    assert run["metrics"][0]["config"]["device"] == "cpu"


def test_one_rank_on_the_gpu_matches_the_cpu(runs):
    run = _finished(runs, f"{DEVICE}-1")
    start = run["metrics"][0]
    assert start["config"]["device"] == DEVICE and start["world_size"] == 1
    _assert_same_training(run, _finished(runs, "cpu-1"))


def test_two_ranks_on_the_gpu_match_the_cpu(runs):
    run = _finished(runs, f"{DEVICE}-2")
    start, epoch, _ = run["metrics"]
    assert start["config"]["device"] == DEVICE and start["world_size"] == 2
    assert epoch["batch_sizes"] == [32, 32]
    # the gradients really were exchanged (staged through pinned host memory on the GPU)
    assert epoch["comm"]["world"]["calls"] >= STEPS
    _assert_same_training(run, _finished(runs, "cpu-1"))
