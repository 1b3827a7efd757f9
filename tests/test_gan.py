"""The conditional GAN application (mpidl/gan.py), on one process: its options are refused
before any MPI work with one-line messages, a short run on the built-in scene writes its
metrics file (and the plot), and the quality numbers tell a good generator from a bad one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpidl.gan import ConditionalGAN, GanConfig, GanConfigError, evaluate, load_spectra, parse_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, match", [
    (["--optimizer", "adabelief"], "--optimizer must be one of sgd, adam, adamw, rmsprop"),
    (["--strategy", "ring"], "--strategy must be one of flat, hierarchical, node"),
    (["--epochs", "0"], "--epochs must be an integer >= 1, got 0"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--beta1", "1.0"], r"--beta1 must be in \[0, 1\)"),
    (["--data", "/nonexistent/samson.h5"], "--data /nonexistent/samson.h5: no such file"),
    (["--emulate-link", "fast"], "--emulate-link"),
    (["--plot", "out.svg"], "--plot must name a .png file"),
    (["--dtype", "float16"], "--dtype must be one of float32, float64"),
])
def test_bad_options_are_refused_with_one_line(argv, match):
    with pytest.raises(GanConfigError, match=match) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


def test_batch_smaller_than_the_world_is_refused():
    with pytest.raises(GanConfigError, match="--batch-size 2 is smaller than the number of ranks 4"):
        parse_config(["--batch-size", "2"], world_size=4)


class _SelfTopology:
    """The one-process topology, built lazily (mpi4py only when the test runs)."""

    @staticmethod
    def make():
        from mpi4py import MPI

        from mpidl.distributed import Topology
        return Topology.from_comm(MPI.COMM_SELF)


@pytest.fixture(scope="module")
def spectra():
    return load_spectra(None)


def test_spectra_of_the_built_in_scene(spectra):
    assert spectra.train_x.shape == (2048, 32) and spectra.num_classes == 4
    assert spectra.train_x.dtype == np.float64 and np.isfinite(spectra.train_x).all()
    # normalized with the training statistics
    np.testing.assert_allclose(spectra.train_x.mean(axis=0), 0, atol=1e-5)


def test_quality_numbers_separate_a_good_generator_from_noise(spectra):
    cfg = GanConfig(hidden=8, noise_dim=4, epochs=1).validate()
    gan = ConditionalGAN(spectra, cfg, _SelfTopology.make())
    means = np.stack([spectra.train_x[spectra.train_y == c].mean(axis=0) for c in range(4)])
    stds = np.stack([spectra.train_x[spectra.train_y == c].std(axis=0) for c in range(4)])
    rng = np.random.default_rng(0)
    # An ideal conditional generator: the class's mean and spread.
    gan.generate = lambda z, y: means[y] + stds[y] * rng.standard_normal((len(y), spectra.bands))
    good = evaluate(gan, 128, seed=0)
    # A generator that ignores its condition: every class gets the same spectra.
    gan.generate = lambda z, y: means[0] + stds[0] * rng.standard_normal((len(y), spectra.bands))
    bad = evaluate(gan, 128, seed=0)
    assert good["gen_accuracy_mlp"] > 0.7 and good["gen_accuracy_ncm"] > 0.7
    assert bad["gen_accuracy_mlp"] < 0.4 and bad["gen_accuracy_ncm"] < 0.4
    assert good["sam_deg"] < 3 * good["sam_floor_deg"] + 0.5 < bad["sam_deg"]
    assert good["rmse"] < bad["rmse"] and good["rmse_z"] < bad["rmse_z"]
    assert good["real_test_accuracy_mlp"] > 0.7


def test_a_short_run_writes_its_metrics_and_plot(tmp_path):
    metrics, plot = tmp_path / "gan.jsonl", tmp_path / "gan.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "mpidl.gan", "--epochs", "2", "--hidden", "16", "--batch-size", "128",
           "--eval-per-class", "32", "--metrics", str(metrics), "--plot", str(plot), "--dtype", "float64"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated spectra classified as their class" in proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "epoch", "epoch", "end"]
    assert records[0]["world_size"] == 1 and records[0]["config"]["strategy"] == "flat"
    assert records[2]["step"] == 2 * 16 and records[2]["d_loss"] > 0 and records[2]["g_loss"] > 0
    end = records[-1]
    for key in ("gen_accuracy_mlp", "gen_accuracy_ncm", "real_test_accuracy_mlp", "sam_deg", "rmse"):
        assert np.isfinite(end[key]), key
    assert 0 <= end["gen_accuracy_mlp"] <= 1 and len(end["per_class"]["sam_deg"]) == 4
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert end["plot"] is None and "matplotlib" in end["plot_note"]
    else:
        assert end["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_option_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "mpidl.gan", "--strategy", "ring"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --strategy must be one of flat, hierarchical, node, got 'ring'"]
