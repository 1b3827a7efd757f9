"""The scene-backed layout variant: the same samples as the patch file, bit for bit, read by
row chunks; the converter's storage choice; validation; the same training result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpidl.data import HDF5Dataset, SceneDataset, load_splits, open_dataset
from mpidl.data_tools.__main__ import main
from mpidl.data_tools.hsi import choose_storage, convert_hsi
from mpidl.data_tools.synthetic import make_scene
from mpidl.data.layout import (LayoutError, read_split_arrays, scene_channel_stats, validate_layout,
                          write_scene_layout)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One synthetic scene (40 x 36 px, 8 bands) converted twice: scene-backed and patches."""
    folder = tmp_path_factory.mktemp("scene")
    scene = make_scene(seed=2, rows=40, cols=36, bands=8, classes=3)
    np.save(folder / "cube.npy", scene.cube)
    np.save(folder / "gt.npy", scene.labels + 1)  # 0 would be unlabelled
    files = {}
    for storage in ("scene", "patches"):
        files[storage] = folder / f"{storage}.h5"
        convert_hsi(str(folder / "cube.npy"), files[storage], labels=str(folder / "gt.npy"),
                    patch=5, train_fraction=0.3, seed=4, storage=storage)
    return files


def test_metadata_and_statistics_are_identical(pair):
    a, b = validate_layout(pair["scene"]), validate_layout(pair["patches"])
    assert a["kind"] == "scene" and "kind" not in b
    for key in ("class_names", "num_classes", "bands", "patch_size", "sample_shape", "splits",
                "split_seed"):
        assert a[key] == b[key], key
    np.testing.assert_array_equal(a["mean"], b["mean"])  # bit for bit, not just close
    np.testing.assert_array_equal(a["std"], b["std"])
    assert a["scene_shape"] == (40, 36) and a["padded_shape"] == (44, 40, 8)
    assert Path(pair["scene"]).stat().st_size < Path(pair["patches"]).stat().st_size / 5


def test_raw_splits_are_identical(pair):
    for split in ("train", "test"):
        xa, ya, pa = read_split_arrays(pair["scene"], split)
        xb, yb, pb = read_split_arrays(pair["patches"], split)
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(pa, pb)


@pytest.mark.parametrize("row_cache_bytes", [512 * 2**20, 0, 20_000])
def test_samples_are_identical_with_augmentation(pair, row_cache_bytes):
    """Any order, duplicates, several epochs of augmentation, any row-cache size."""
    a = SceneDataset(pair["scene"], "train", augment=True, augment_seed=7,
                     row_cache_bytes=row_cache_bytes)
    b = open_dataset(pair["patches"], "train", augment=True, augment_seed=7)
    assert isinstance(b, HDF5Dataset)
    rng = np.random.default_rng(0)
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        for _ in range(4):
            idx = rng.integers(0, a.num_samples, size=37)
            xa, ya = a.read(idx)
            xb, yb = b.read(idx)
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(ya, yb)
    assert a.samples_read == b.samples_read
    if row_cache_bytes == 20_000:
        assert a._rows_bytes <= 20_000 + 4 * a.row_chunk * 40 * 8 * 4  # bound (+ chunks in use)


def test_load_splits_dispatches_on_the_variant(pair):
    train, test, meta = load_splits(pair["scene"])
    assert isinstance(train, SceneDataset) and isinstance(test, SceneDataset)
    x, _ = test.read(np.arange(test.num_samples))
    _, test_b, _ = load_splits(pair["patches"])
    np.testing.assert_array_equal(x, test_b.read(np.arange(test_b.num_samples))[0])
    with pytest.raises(LayoutError, match="scene-backed"):
        HDF5Dataset(pair["scene"], "train")


def test_a_rank_reads_only_the_rows_its_samples_touch(pair, tmp_path):
    with h5py.File(pair["scene"], "r") as f:
        cube = f["scene/cube"][...]
        splits = {s: (f[f"{s}/pos"][...], f[f"{s}/y"][...]) for s in ("train", "test")}
    small = tmp_path / "chunks4.h5"
    write_scene_layout(small, cube, splits, ["a", "b", "c"], patch_size=5, row_chunk=4)
    ds = SceneDataset(small, "train")
    assert ds.row_chunk == 4
    pos = ds.positions
    top = np.flatnonzero(pos[:, 0] < 6)  # samples centred in the first 6 scene rows
    ds.read(top)
    last_row = pos[top, 0].max() + 4  # sample (r, c) covers padded rows r .. r + patch - 1
    assert ds.rows_read == (last_row // 4 + 1) * 4 and ds.chunks_read == last_row // 4 + 1
    assert ds.rows_read <= 12 < 44
    before = ds.rows_read
    ds.read(top[::-1])  # the same rows again: served by the row cache
    assert ds.rows_read == before
    bottom = np.flatnonzero(pos[:, 0] >= 36)
    ds.read(bottom)  # rows 36.. of the scene: padded rows 36 .. 43, two more chunks
    assert ds.rows_read == before + 8


def test_converter_storage_choice(tmp_path, capsys):
    assert choose_storage("auto", 95, 95, 156, 7, 9025) == "scene"
    assert choose_storage("auto", 1000, 1000, 10, 3, 20) == "patches"  # few labelled pixels
    assert choose_storage("patches", 95, 95, 156, 7, 9025) == "patches"
    scene = make_scene(seed=0, rows=12, cols=10, bands=3, classes=2)
    np.save(tmp_path / "c.npy", scene.cube)
    np.save(tmp_path / "g.npy", scene.labels + 1)
    base = ["hsi", "--cube", str(tmp_path / "c.npy"), "--labels", str(tmp_path / "g.npy"),
            "--patch", "3"]
    assert main(base + ["--out", str(tmp_path / "auto.h5")]) == 0
    assert "storage: scene-backed" in capsys.readouterr().out
    assert validate_layout(tmp_path / "auto.h5")["kind"] == "scene"
    assert main(base + ["--storage", "patches", "--out", str(tmp_path / "p.h5")]) == 0
    assert "kind" not in validate_layout(tmp_path / "p.h5")
    with pytest.raises(ValueError, match="--storage must be one of"):
        convert_hsi(str(tmp_path / "c.npy"), tmp_path / "x.h5", labels=str(tmp_path / "g.npy"),
                    storage="nope")
    assert not (tmp_path / "x.h5").exists()


def test_info_describes_and_verifies_a_scene_file(pair, capsys):
    assert main(["info", str(pair["scene"]), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "scene-backed: padded cube 44 x 40 x 8" in out and "verified" in out


def _edit(path, tmp_path, change):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(Path(path).read_bytes())
    with h5py.File(bad, "r+") as f:
        change(f)
    return bad


def _replace(name, value):
    def change(f):
        del f[name]
        f[name] = value
    return change


@pytest.mark.parametrize("change, message", [
    (lambda f: f.__delitem__("scene/cube"), r"missing dataset\(s\) scene/cube"),
    (lambda f: f.__delitem__("train/pos"), r"missing dataset\(s\) train/pos"),
    (_replace("scene/cube", np.zeros((44, 40), np.float32)), "3-D floating-point"),
    (_replace("scene/cube", np.zeros((43, 40, 8), np.float32)), "padded by 2"),
    (lambda f: f.attrs.__setitem__("pad", 1), "do not match"),
    (lambda f: f["train/pos"].__setitem__(0, [40, 0]), "outside the 40 x 36 scene"),
    (lambda f: f["test/y"].__setitem__(0, 9), "labels in"),
    (lambda f: f.attrs.__setitem__("bands", 7), "bands = 7"),
])
def test_invalid_scene_files_are_refused(pair, tmp_path, change, message):
    with pytest.raises(LayoutError, match=message):
        validate_layout(_edit(pair["scene"], tmp_path, change))


def test_writer_refuses_bad_input_without_leaving_a_file(tmp_path):
    cube = np.zeros((9, 9, 2), np.float32)
    pos, y = np.array([[0, 0], [1, 1]]), np.array([0, 1])
    ok = {"train": (pos, y), "test": (pos, y)}
    with pytest.raises(ValueError, match="outside the 5 x 5 scene"):
        write_scene_layout(tmp_path / "a.h5", cube, {"train": ([[5, 0]], [0]), "test": (pos, y)},
                           ["a", "b"], patch_size=5)
    nan = cube.copy()
    nan[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        write_scene_layout(tmp_path / "a.h5", nan, ok, ["a", "b"], patch_size=5)
    with pytest.raises(ValueError, match="odd"):
        write_scene_layout(tmp_path / "a.h5", cube, ok, ["a", "b"], patch_size=4)
    assert list(tmp_path.iterdir()) == []
    meta = write_scene_layout(tmp_path / "a.h5", cube, ok, ["a", "b"], patch_size=5)
    assert meta["splits"] == {"train": 2, "test": 2}


def test_streaming_statistics_equal_channel_stats_across_blocks():
    """More samples than one statistics block (1024), so the block boundaries matter."""
    from mpidl.data.layout import channel_stats, cut_patches
    rng = np.random.default_rng(1)
    padded = (rng.standard_normal((60, 50, 3)) * 3 + 10).astype(np.float32)
    pos = rng.integers(0, [56, 46], size=(2500, 2))
    m1, s1 = scene_channel_stats(padded, pos, 5)
    m2, s2 = channel_stats(cut_patches(padded, pos, 5))
    np.testing.assert_array_equal(m1, m2)
    np.testing.assert_array_equal(s1, s2)


def _train(data, tmp_path, tag):
    metrics = tmp_path / f"{tag}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "mpidl.train", "--data", str(data), "--epochs", "2",
                           "--augment", "--speeds", "1", "--metrics", str(metrics), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_training_gives_the_same_result_on_both_variants(pair, tmp_path):
    a, b = _train(pair["scene"], tmp_path, "scene"), _train(pair["patches"], tmp_path, "patches")
    ea = [(r["loss"], r["oa"], r["kappa"]) for r in a if r["event"] == "epoch"]
    eb = [(r["loss"], r["oa"], r["kappa"]) for r in b if r["event"] == "epoch"]
    assert len(ea) == 2 and ea == eb  # one process, float32: the same numbers exactly
