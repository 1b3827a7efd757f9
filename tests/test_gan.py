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
    (["--ranks-per-node", "0"], "--ranks-per-node must be an integer >= 1, got 0"),
])
def test_bad_options_are_refused_with_one_line(argv, match):
    with pytest.raises(GanConfigError, match=match) as info:
        parse_config(argv)
    assert "\n" not in str(info.value)


def test_ranks_per_node_from_the_environment_goes_through_mpidl_settings(monkeypatch):
    """MPIDL_RANKS_PER_NODE is read once, by mpidl.settings: a bad value there is refused by
    the options' check, before any MPI work, naming the variable; --ranks-per-node, when
    given, is used instead (the environment is then not consulted). os.environ changed later
    changes nothing, and mpidl/gan.py never reads it."""
    from mpidl import settings

    monkeypatch.setenv("MPIDL_RANKS_PER_NODE", "zero")  # too late: settings were read at import
    assert parse_config([]).ranks_per_node is None
    monkeypatch.setattr(settings, "SETTINGS", settings.Settings.from_environ({"MPIDL_RANKS_PER_NODE": "zero"}))
    with pytest.raises(GanConfigError, match="environment variable MPIDL_RANKS_PER_NODE must be an integer "
                                             ">= 1, got 'zero'"):
        parse_config([])
    assert parse_config(["--ranks-per-node", "2"]).ranks_per_node == 2
    source = (ROOT / "mpidl" / "gan.py").read_text()
    assert "os.environ" not in source and "getenv" not in source


def test_a_bad_ranks_per_node_environment_exits_2_with_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPIDL_RANKS_PER_NODE="zero")
    proc = subprocess.run([sys.executable, "-m", "mpidl.gan", "--epochs", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: environment variable MPIDL_RANKS_PER_NODE must be an integer >= 1, got 'zero'"]


def test_the_docs_excerpt_is_the_code():
    """docs/gan.md shows how the two DataParallels are built: every code line of its excerpt
    (comments aside) is a line of mpidl/gan.py."""
    import re

    excerpt = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "gan.md").read_text(), re.S).group(1)
    code = {line.strip() for line in (ROOT / "mpidl" / "gan.py").read_text().splitlines()}
    lines = [line.strip() for line in excerpt.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(lines) >= 8 and [line for line in lines if line not in code] == []


def test_batch_smaller_than_the_world_is_refused():
    with pytest.raises(GanConfigError, match=r"--batch-size: batch_size 2 is smaller than 1 x 4 ranks: every rank needs at least 1 sample of each global batch \(min_local_batch\)"):
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


# ---------------------------------------------------------------- nothing lost, under mpiexec
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
QUICK = ["--epochs", "10", "--hidden", "8", "--batch-size", "512", "--eval-per-class", "8"]


def gan(args, np_=2, timeout=300):
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    return subprocess.run([MPIEXEC, "-n", str(np_), "-launcher", "fork", sys.executable, "-m", "mpidl.gan",
                           *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_usage_errors_are_printed_once_not_per_rank():
    """Before: argparse's usage and error from every rank (exit 2 per rank)."""
    proc = gan(["--resume"])
    assert proc.returncode == 2
    assert proc.stderr == "error: unrecognized arguments: --resume (python -m mpidl.gan --help lists the options)\n"
    proc = gan(["--help"])
    assert proc.returncode == 0 and proc.stdout.count("usage: python -m mpidl.gan") == 1


@pytest.mark.parametrize("option", ["--plot", "--metrics"])
def test_outputs_are_checked_before_training(tmp_path, option):
    """Before: --plot trained every epoch, then aborted naming the temporary ``g.png.tmpPID``;
    --metrics on a read-only disk ended in MPI_Abort."""
    from tmpfs import small_disk

    name = "g.png" if option == "--plot" else "g.jsonl"
    with small_disk(tmp_path / "ro", readonly=True) as disk:
        proc = gan([*QUICK, option, disk / name])
        assert proc.returncode == 2 and "epoch" not in proc.stdout, proc.stdout + proc.stderr
        assert proc.stderr == (f"error: {option} {disk / name}: cannot write in {disk}: Read-only file system "
                               "(EROFS) (on rank [0])\n")
    proc = gan([*QUICK, option, tmp_path / "missing" / name])
    assert proc.returncode == 2 and "epoch" not in proc.stdout
    assert proc.stderr == (f"error: {option} {tmp_path / 'missing' / name}: folder {tmp_path / 'missing'} "
                           "does not exist (on rank [0])\n")


def test_metrics_on_a_full_disk_stop_every_rank_with_one_line(tmp_path):
    """Before: ``OSError: [Errno 28]`` in a traceback and MPI_Abort."""
    from tmpfs import small_disk

    with small_disk(tmp_path / "disk", size="4k") as disk:
        metrics = disk / "g.jsonl"
        proc = gan([*QUICK, "--metrics", metrics])
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: cannot write {metrics}: No space left on device (ENOSPC) (on rank [0]); training stopped "
            "after epoch "), proc.stderr
        assert lines[0].endswith(" (the file holds the records before it)")
        assert "done:" not in proc.stdout
        records = [json.loads(line) for line in metrics.read_text().splitlines()]  # whole records only
        epoch = int(lines[0].split("after epoch ")[1].split(" ")[0])
        assert [r["event"] for r in records] == ["start"] + ["epoch"] * (epoch - 1)
        assert os.listdir(disk) == ["g.jsonl"]


def test_a_plot_that_does_not_fit_names_the_plot_and_keeps_the_numbers(tmp_path):
    from tmpfs import fill, small_disk

    pytest.importorskip("matplotlib")
    metrics = tmp_path / "g.jsonl"
    with small_disk(tmp_path / "disk", size="16k") as disk:
        fill(disk, 4096)
        plot = disk / "g.png"
        proc = gan([*QUICK, "--metrics", metrics, "--plot", plot])
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr == f"error: cannot write {plot}: No space left on device (ENOSPC)\n"
        assert "done:" in proc.stdout
        assert sorted(os.listdir(disk)) == ["filler"]
    end = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert end["event"] == "end" and end["plot"] is None
    assert end["plot_note"] == f"not written: cannot write {plot}: No space left on device (ENOSPC)"


def test_data_with_nan_is_refused_naming_the_file_and_the_sample(tmp_path):
    """Before: NonFiniteGradient at step 0 through MPI_Abort, no word of the data. The check
    is the trainer's (mpidl.data.layout.check_values), so are its words."""
    import h5py

    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 4, 3, 3)).astype(np.float32)
    y = np.arange(60) % 2
    path = tmp_path / "nan.h5"
    write_layout(path, {"train": (x, y), "test": (x[:10], y[:10])}, ["a", "b"])
    with h5py.File(path, "r+") as f:
        f["train/x"][37, 0, 1, 1] = np.nan
    proc = gan([*QUICK, "--data", path])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"error: --data {path}: train/x holds non-finite values (NaN or Inf): 1 value(s) in "
                           f"1 sample(s), the first at sample 37 (python -m mpidl.data_tools info {path} checks "
                           "a file)\n")
