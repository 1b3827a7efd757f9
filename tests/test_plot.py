# python -m pytest -q tests/test_plot.py
"""mpidl.plot: loading metrics files, drawing the figures, the command line, the errors.

The metrics files are synthetic (two small runs written here), so these tests depend on the
format of the contract, not on the trainer. Drawing needs matplotlib (the `plot` extra);
without it those tests skip, and the loading and error tests still run.
"""

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mpidl.plot import (
    Run,
    _breakdown_names,
    emulation_note,
    load_metrics,
    load_run,
    plot_curves,
    plot_time_breakdown,
)

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (pip install 'mpidl[plot]')",
)


def write_metrics(path, slowdown, batch_sizes, strategy="flat", epochs=3, emulated=True, end=True, clock="wall"):
    """A metrics file as rank 0 writes it: start, one record per epoch, end.

    Each rank's compute time is its batch times its slowdown; idle time is what it waits
    for the slowest rank, as the trainer estimates it.
    """
    ranks = len(batch_sizes)
    records = [{
        "event": "start",
        "config": {"epochs": epochs, "strategy": strategy,
                   "emulate_slowdown": ",".join(map(str, slowdown)) if emulated else None},
        "world_size": ranks, "num_nodes": 2, "node_sizes": [ranks // 2, ranks - ranks // 2],
        "model": "hsicnn", "num_params": 1234, "data": "synthetic",
        "emulation": {"slowdown": slowdown if emulated else None, "clock": clock if emulated else None,
                      "link": [5.0, 10.0] if emulated else None},
    }]
    for epoch in range(1, epochs + 1):
        comp = [0.01 * b * f for b, f in zip(batch_sizes, slowdown)]
        records.append({
            "event": "epoch", "epoch": epoch, "step": 10 * epoch, "loss": 2.0 / epoch,
            "oa": 0.5 + 0.1 * epoch, "aa": 0.5, "kappa": 0.4, "lr": 0.05, "time_s": max(comp) + 0.1,
            "samples_per_s": 500.0, "strategy": strategy, "weighting": "balanced",
            "batch_sizes": batch_sizes, "speeds": [1.0 / f for f in slowdown], "comp_s": comp,
            "comm_s": [0.05] * ranks, "idle_s": [max(comp) - c for c in comp],
            "comm": {level: {"calls": 10, "bytes": 4000} for level in ("intra", "inter", "world")},
        })
    if end:
        records.append({"event": "end", "epochs": epochs, "step": 10 * epochs, "oa": 0.8, "aa": 0.8,
                        "kappa": 0.7, "time_s": 3.0, "stopped": "completed"})
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return Path(path)


@pytest.fixture
def two_runs(tmp_path):
    """Equal batches on unequal ranks (mostly idle fast ranks) and speed-balanced batches."""
    equal = write_metrics(tmp_path / "equal.jsonl", [1, 1, 2, 4], [16, 16, 16, 16])
    balanced = write_metrics(tmp_path / "balanced.jsonl", [1, 1, 2, 4], [23, 23, 12, 6], strategy="node")
    return equal, balanced


def assert_png(path):
    """The file exists, starts with the PNG signature and has a non-empty image header."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # IHDR: the chunk right after the signature
    assert width > 100 and height > 100, f"{path}: {width}x{height}"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mpidl.plot", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------ loading


def test_load_metrics_splits_the_records(two_runs):
    start, epochs, end = load_metrics(two_runs[0])
    assert start["world_size"] == 4 and start["emulation"]["slowdown"] == [1, 1, 2, 4]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    assert end["stopped"] == "completed"


def test_load_metrics_resumed_and_killed_runs(tmp_path):
    """A resumed run appends (the later record of an epoch wins); a killed one has no end
    record and may have a last line cut short: both still load."""
    path = write_metrics(tmp_path / "m.jsonl", [1, 1], [8, 8], epochs=2, end=False)
    rerun = json.loads(path.read_text().splitlines()[2])  # epoch 2 again, after a resume
    rerun["loss"] = 0.125
    with path.open("a") as f:
        f.write(json.dumps({"event": "unknown-future-kind"}) + "\n")
        f.write(json.dumps(rerun) + "\n")
        f.write('{"event": "epoch", "epo')  # killed while writing
    start, epochs, end = load_metrics(path)
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert epochs[1]["loss"] == 0.125
    assert end is None


def test_emulation_note(tmp_path):
    emulated = load_run(write_metrics(tmp_path / "e.jsonl", [1, 1, 2, 4], [4, 4, 4, 4]))
    assert emulation_note(emulated) == "emulated slowdown 1,1,2,4; emulated link 5 us, 10 Gbit/s"
    plain = load_run(write_metrics(tmp_path / "p.jsonl", [1, 1], [4, 4], emulated=False))
    assert emulation_note(plain) is None
    on_cpu = load_run(write_metrics(tmp_path / "c.jsonl", [1, 2], [4, 4], clock="cpu"))
    assert emulation_note(on_cpu) == "emulated slowdown 1,2 (cpu clock); emulated link 5 us, 10 Gbit/s"


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_metrics(missing)


def test_empty_file_is_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl is empty"):
        load_metrics(empty)


def test_file_without_epochs_is_named(tmp_path):
    path = write_metrics(tmp_path / "noepochs.jsonl", [1, 1], [4, 4], epochs=0)
    with pytest.raises(ValueError, match=r"noepochs\.jsonl has no epoch records"):
        load_metrics(path)


def test_bad_line_is_named(tmp_path):
    path = write_metrics(tmp_path / "bad.jsonl", [1, 1], [4, 4])
    lines = path.read_text().splitlines()
    lines[1] = "not json"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2"):
        load_metrics(path)


def test_missing_timing_is_refused(tmp_path):
    path = write_metrics(tmp_path / "old.jsonl", [1, 1], [4, 4])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for record in lines:
        record.pop("idle_s", None)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(ValueError, match="idle_s"):
        plot_time_breakdown(path, tmp_path / "x.png")


# ------------------------------------------------------------------------------ drawing


@needs_matplotlib
def test_plot_functions_write_pngs(two_runs, tmp_path):
    runs = [load_run(two_runs[0], "equal"), load_run(two_runs[1], "balanced")]
    assert_png(plot_curves(runs, tmp_path / "curves.png"))
    assert_png(plot_time_breakdown(runs[1], tmp_path / "breakdown.png"))
    # Paths are accepted as well as loaded runs.
    assert_png(plot_curves(list(two_runs), tmp_path / "curves2.png"))
    assert isinstance(runs[0], Run)


@needs_matplotlib
def test_breakdown_shows_a_subset_of_many_epochs(tmp_path):
    path = write_metrics(tmp_path / "long.jsonl", [1] * 8, [8] * 8, epochs=60, emulated=False)
    assert_png(plot_time_breakdown(path, tmp_path / "long.png"))


@needs_matplotlib
def test_cli_writes_curves_and_one_breakdown_per_run(two_runs, tmp_path):
    out = tmp_path / "figures"  # created by the command
    result = run_cli(*two_runs, "--out", out, "--labels", "equal batches,HDP")
    assert result.returncode == 0, result.stderr
    expected = ["curves.png", "time_breakdown_equal_batches.png", "time_breakdown_HDP.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    for name in expected:
        assert_png(out / name)
        assert str(out / name) in result.stdout


@needs_matplotlib
def test_cli_single_run_has_unsuffixed_breakdown(two_runs, tmp_path):
    result = run_cli(two_runs[0], "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    assert_png(tmp_path / "curves.png")
    assert_png(tmp_path / "time_breakdown.png")


def test_cli_errors_name_the_file(two_runs, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = run_cli(two_runs[0], empty, "--out", tmp_path / "out")
    assert result.returncode == 1
    assert "empty.jsonl is empty" in result.stderr
    assert not (tmp_path / "out").exists(), "nothing is written when an input is bad"

    result = run_cli(tmp_path / "missing.jsonl", "--out", tmp_path / "out")
    assert result.returncode == 1 and "missing.jsonl: no such file" in result.stderr


def test_cli_label_count_must_match(two_runs, tmp_path):
    result = run_cli(*two_runs, "--out", tmp_path, "--labels", "only-one")
    assert result.returncode == 2
    assert "--labels has 1 names for 2 metrics files" in result.stderr


def test_without_matplotlib_the_error_says_how_to_install(two_runs, tmp_path):
    """Hide matplotlib from a fresh interpreter (None in sys.modules makes its import fail)."""
    code = (
        "import sys\n"
        "for name in ('matplotlib', 'matplotlib.figure', 'matplotlib.backends.backend_agg'):\n"
        "    sys.modules[name] = None\n"
        "from mpidl.plot import main\n"
        f"sys.exit(main([{str(two_runs[0])!r}, '--out', {str(tmp_path / 'out')!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "pip install 'mpidl[plot]'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_breakdown_file_names_stay_distinct(two_runs):
    one = load_run(two_runs[0], "a b")
    other = load_run(two_runs[1], "a_b")  # the same once made safe for a file name
    assert _breakdown_names([one]) == ["time_breakdown.png"]
    assert _breakdown_names([one, other]) == ["time_breakdown_0_a_b.png", "time_breakdown_1_a_b.png"]


# ------------------------------------------------------------------------------ unwritable output


@needs_matplotlib
def test_a_read_only_out_is_one_line_and_exit_2(two_runs, tmp_path):
    """Before: a raw traceback from savefig (exit 1)."""
    from tmpfs import small_disk

    with small_disk(tmp_path / "ro", readonly=True) as disk:
        result = run_cli(two_runs[0], "--out", disk)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (f"python -m mpidl.plot: error: --out {disk}: cannot write in this folder: "
                                 "Read-only file system (EROFS)\n")
        result = run_cli(two_runs[0], "--out", disk / "figures")  # a folder it cannot create
        assert result.returncode == 2, result.stderr
        assert result.stderr == (f"python -m mpidl.plot: error: --out {disk / 'figures'}: cannot create the "
                                 f"folder {disk / 'figures'}: Read-only file system (EROFS)\n")


@needs_matplotlib
def test_a_full_disk_names_the_figure_and_leaves_no_temporary(two_runs, tmp_path):
    from tmpfs import fill, small_disk

    with small_disk(tmp_path / "disk", size="64k") as disk:
        fill(disk, 4096)
        result = run_cli(two_runs[0], "--out", disk)
        assert result.returncode == 1, result.stderr
        assert result.stderr == (f"python -m mpidl.plot: error: cannot write {disk / 'curves.png'}: "
                                 "No space left on device (ENOSPC)\n")
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
