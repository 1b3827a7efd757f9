"""mpidl.predict: the map of every pixel, its accuracy on the labelled pixels equal to the
trained model's test OA, the same map on 1 and 2 ranks, clear errors and no partial output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpidl.app.checkpoint import load_model
from mpidl.data import load_splits
from mpidl.data_tools.hsi import convert_hsi
from mpidl.data_tools.synthetic import make_scene
from mpidl.predict import row_band

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def _run(args, np_=None, timeout=300):
    cmd = [sys.executable, *args]
    if np_ is not None:
        if not Path(MPIEXEC).exists():
            pytest.skip(f"no mpiexec at {MPIEXEC}")
        cmd = [MPIEXEC, "-n", str(np_), "-launcher", "fork", *cmd]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 30 x 26 synthetic scene (10 bands, 3 classes), converted (scene-backed, patch 5) and a
    model trained on it for 2 epochs, saved."""
    d = tmp_path_factory.mktemp("predict")
    scene = make_scene(seed=3, rows=30, cols=26, bands=10, classes=3)
    np.save(d / "cube.npy", scene.cube)
    gt = scene.labels + 1
    gt[::7, ::5] = 0  # a few unlabelled pixels: the map covers them too
    np.save(d / "gt.npy", gt)
    convert_hsi(str(d / "cube.npy"), d / "data.h5", labels=str(d / "gt.npy"), patch=5,
                train_fraction=0.3, seed=1)
    proc = _run(["-m", "mpidl.train", "--data", str(d / "data.h5"), "--epochs", "2", "--lr", "0.01",
                 "--speeds", "1", "--save", str(d / "model.h5"), "--metrics", str(d / "m.jsonl"),
                 "--quiet"])
    assert proc.returncode == 0, proc.stderr
    end = [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()][-1]
    return d, end, gt


def _predict(d, out, np_=None, extra=()):
    return _run(["-m", "mpidl.predict", "--model", str(d / "model.h5"), "--cube", str(d / "cube.npy"),
                 "--data", str(d / "data.h5"), "--out", str(out), *extra], np_=np_)


def test_row_bands_cover_the_rows_once():
    for rows, size in ((10, 3), (3, 4), (95, 4)):
        bands = [row_band(rows, r, size) for r in range(size)]
        assert bands[0][0] == 0 and bands[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(bands, bands[1:]))
        assert max(h - lo for lo, h in bands) - min(h - lo for lo, h in bands) <= 1


def test_map_accuracy_on_test_pixels_is_the_trained_test_oa(trained, tmp_path):
    d, end, gt = trained
    proc = _predict(d, tmp_path / "map.h5")
    assert proc.returncode == 0, proc.stderr
    assert "OA" in proc.stdout and "wrote" in proc.stdout
    with h5py.File(tmp_path / "map.h5", "r") as f:
        pred, truth, split = f["map"][...], f["truth"][...], f["split"][...]
        oa_test, n_test = float(f.attrs["oa_test"]), int(f.attrs["test_pixels"])
        per = f.attrs["class_accuracy_labelled"]
    assert pred.shape == (30, 26) and pred.min() >= 0 and pred.max() < 3  # every pixel classified
    np.testing.assert_array_equal(truth, np.where(gt > 0, gt - 1, -1))
    assert round(oa_test * n_test) == round(end["oa"] * n_test)  # the same count of correct pixels
    # ... and the same predictions, pixel by pixel, as the model on the layout's test samples
    model = load_model(str(d / "model.h5")).eval()
    _, test, _ = load_splits(d / "data.h5")
    x, y = test.read(np.arange(test.num_samples))
    direct = model.forward(x).argmax(axis=1)
    pos = test.positions
    np.testing.assert_array_equal(pred[pos[:, 0], pos[:, 1]], direct)
    assert (split == 2).sum() == test.num_samples and len(per) == 3
    assert (tmp_path / "map.png").stat().st_size > 1000


def test_two_ranks_give_the_same_map(trained, tmp_path):
    d, _, _ = trained
    assert _predict(d, tmp_path / "one.h5", extra=["--no-png"]).returncode == 0
    proc = _predict(d, tmp_path / "two.h5", np_=2, extra=["--no-png", "--batch", "37"])
    assert proc.returncode == 0, proc.stderr
    assert "2 rank(s), rows per rank [15, 15]" in proc.stdout
    with h5py.File(tmp_path / "one.h5") as a, h5py.File(tmp_path / "two.h5") as b:
        np.testing.assert_array_equal(a["map"][...], b["map"][...])
    assert not (tmp_path / "two.png").exists()


@pytest.mark.parametrize("what", ["missing model", "band count", "bad cube path", "missing folder",
                                  "scene shape"])
def test_errors_are_clear_and_leave_no_output(trained, tmp_path, what):
    d, _, _ = trained
    out = tmp_path / "map.h5"
    args = {"--model": str(d / "model.h5"), "--cube": str(d / "cube.npy"), "--data": str(d / "data.h5"),
            "--out": str(out)}
    if what == "missing model":
        args["--model"], message = str(tmp_path / "nope.h5"), "nope.h5: no such file"
    elif what == "band count":
        np.save(tmp_path / "c7.npy", np.load(d / "cube.npy")[:, :, :7])
        args["--cube"], message = str(tmp_path / "c7.npy"), "has 7 bands but the model"
    elif what == "bad cube path":
        args["--cube"], message = str(tmp_path / "missing.mat"), "missing.mat"
    elif what == "missing folder":
        args["--out"], message = str(tmp_path / "no" / "map.h5"), "does not exist"
    else:
        np.save(tmp_path / "small.npy", np.load(d / "cube.npy")[:20])
        args["--cube"], message = str(tmp_path / "small.npy"), "was converted from a 30 x 26 scene"
    before = sorted(os.listdir(tmp_path))
    proc = _run(["-m", "mpidl.predict", *[v for kv in args.items() for v in kv]])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == before  # no map, no figure, no temporary file


# ---------------------------------------------------------------- outputs: read-only, full disk
def test_a_full_disk_is_one_error_naming_out_and_leaves_no_temporary(trained, tmp_path):
    """Before: MPI_Abort and HDF5's raw text ("Unable to synchronously flush file ... buf =
    0x..."), naming the temporary ``.map.h5.*.tmp``."""
    from tmpfs import fill, small_disk

    d, _, _ = trained
    with small_disk(tmp_path / "disk", size="40k") as disk:
        fill(disk, 4096)
        out = disk / "map.h5"
        proc = _predict(d, out, np_=2, extra=["--no-png", "--quiet"])
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr == f"error: cannot write {out}: No space left on device (ENOSPC)\n"
        assert sorted(os.listdir(disk)) == ["filler"]


def test_a_figure_that_does_not_fit_names_the_figure_and_keeps_the_map(trained, tmp_path):
    from tmpfs import fill, small_disk

    d, _, _ = trained
    with small_disk(tmp_path / "disk", size="64k") as disk:
        fill(disk, 16384)  # room for the map (12 KiB), not for the figure
        out = disk / "map.h5"
        proc = _predict(d, out, extra=["--quiet"])
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr == f"error: cannot write {disk / 'map.png'}: No space left on device (ENOSPC)\n"
        assert sorted(os.listdir(disk)) == ["filler", "map.h5"]
        with h5py.File(out) as f:
            assert f["map"].shape == (30, 26)


def test_a_read_only_out_is_refused_before_any_pixel_is_classified(trained, tmp_path, monkeypatch, capsys):
    """Before: every pixel classified, then MPI_Abort with a traceback at the write."""
    import mpidl.predict as predict
    from tmpfs import small_disk

    def classify_rows(*args, **kwargs):
        raise AssertionError("classified before the output was checked")

    monkeypatch.setattr(predict, "classify_rows", classify_rows)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # main() installs the MPI hook
    d, _, _ = trained
    with small_disk(tmp_path / "ro", readonly=True) as disk:
        out = disk / "map.h5"
        code = predict.main(["--model", str(d / "model.h5"), "--cube", str(d / "cube.npy"),
                             "--data", str(d / "data.h5"), "--out", str(out)])
        assert code == 2
        assert capsys.readouterr().err == (f"error: --out {out}: cannot write in {disk}: "
                                           "Read-only file system (EROFS)\n")
        # under mpiexec: the same line, once, from the rank that writes
        proc = _predict(d, out, np_=2)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr == (f"error: --out {out}: cannot write in {disk}: Read-only file system (EROFS) "
                               "(on rank [0])\n")


def test_a_bad_option_is_one_line_from_one_rank(trained):
    d, _, _ = trained
    proc = _predict(d, "map.h5", np_=2, extra=["--bogus"])
    assert proc.returncode == 2
    assert proc.stderr == ("error: unrecognized arguments: --bogus (python -m mpidl.predict --help lists "
                           "the options)\n")


def test_a_checkpoint_given_as_the_model_says_what_it_is(trained, tmp_path):
    d, _, _ = trained
    ckpt = tmp_path / "ck"
    proc = _run(["-m", "mpidl.train", "--data", str(d / "data.h5"), "--epochs", "1", "--speeds", "1",
                 "--checkpoint", str(ckpt), "--quiet"])
    assert proc.returncode == 0, proc.stderr
    proc = _run(["-m", "mpidl.predict", "--model", str(ckpt / "checkpoint.h5"), "--cube", str(d / "cube.npy"),
                 "--data", str(d / "data.h5"), "--out", str(tmp_path / "map.h5")])
    assert proc.returncode == 2
    assert proc.stderr == (f"error: --model {ckpt / 'checkpoint.h5'} is a checkpoint (mpidl.train --checkpoint "
                           "DIR), not a saved model: a run resumes from it with --checkpoint DIR --resume; a "
                           "model file is what mpidl.train --save PATH writes\n")


def test_a_model_held_open_by_a_writer_says_so(trained, tmp_path):
    from mpidl.app.outputs import LOCKED

    d, _, _ = trained
    hold = "import sys, time, h5py\nf = h5py.File(sys.argv[1], 'r+')\nprint('open', flush=True)\ntime.sleep(120)\n"
    writer = subprocess.Popen([sys.executable, "-c", hold, str(d / "model.h5")], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "open\n"
        proc = _predict(d, tmp_path / "map.h5", np_=2)
    finally:
        writer.kill()
        writer.wait()
    assert proc.returncode == 2
    assert proc.stderr == f"error: --model {d / 'model.h5'}: cannot be read: {LOCKED}\n"
