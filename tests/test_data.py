"""mpidl.data and mpidl.data.layout: the layout reader, the datasets, the cache, augmentation, validation errors."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from mpidl.data import (
    ArrayDataset,
    HDF5Dataset,
    apply_dihedral,
    dihedral_codes,
    load_splits,
    open_dataset,
    synthetic_splits,
)
from mpidl.data.layout import LayoutError, LayoutFileNotFoundError, channel_stats, validate_layout, write_layout

C, H, W = 3, 5, 5
NAMES = ["a", "b", "c"]


def make_arrays(n: int, offset: float, seed: int):
    """Samples whose value tells which sample and channel they are: x[i, c] = offset + 10 i + c
    plus a little per-pixel pattern (so rotations and flips are visible)."""
    rng = np.random.default_rng(seed)
    x = (offset + 10.0 * np.arange(n)[:, None, None, None] + np.arange(C)[None, :, None, None]
         + 0.01 * rng.standard_normal((n, C, H, W))).astype(np.float32)
    y = np.arange(n) % len(NAMES)
    return x, y


@pytest.fixture()
def layout(tmp_path):
    """A valid layout file with 40 train and 12 test samples; train and test differ in offset."""
    train = make_arrays(40, 0.0, 1)
    test = make_arrays(12, 1000.0, 2)
    path = tmp_path / "tiny.h5"
    write_layout(path, {"train": train, "test": test}, NAMES, source="unit test", split_seed=3)
    return path, train, test


def edited_copy(src, dst, edit):
    """Copy a layout file and apply ``edit(h5py.File)`` to the copy."""
    with h5py.File(src, "r") as fin, h5py.File(dst, "w") as fout:
        for key in fin:
            fin.copy(key, fout)
        for key, value in fin.attrs.items():
            fout.attrs[key] = value
        edit(fout)
    return dst


# ---------------------------------------------------------------------------------------------
# round trip and statistics
# ---------------------------------------------------------------------------------------------
def test_round_trip_layout_and_metadata(layout):
    path, (x_tr, y_tr), (x_te, y_te) = layout
    meta = validate_layout(path)
    assert meta["class_names"] == NAMES and meta["num_classes"] == 3
    assert meta["bands"] == C and meta["patch_size"] == H and meta["sample_shape"] == (C, H, W)
    assert meta["splits"] == {"train": 40, "test": 12}
    assert meta["source"] == "unit test" and meta["split_seed"] == 3 and meta["layout_version"] == 1
    with h5py.File(path, "r") as f:
        assert f["train/x"].chunks == (1, C, H, W)  # one sample per chunk
        assert f["train/x"].dtype == np.float32 and f["train/y"].dtype == np.int64
        np.testing.assert_array_equal(f["test/x"][...], x_te)
        np.testing.assert_array_equal(f["train/y"][...], y_tr)
    # no temporary file is left next to the result
    assert sorted(os.listdir(path.parent)) == ["tiny.h5"]


def test_statistics_come_from_the_training_split_only(layout):
    path, (x_tr, _), (x_te, _) = layout
    meta = validate_layout(path)
    mean, std = channel_stats(x_tr)
    np.testing.assert_allclose(meta["mean"], mean)
    np.testing.assert_allclose(meta["std"], std)
    np.testing.assert_allclose(mean, x_tr.astype(np.float64).mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(std, x_tr.astype(np.float64).std(axis=(0, 2, 3)))
    train, test, _ = load_splits(path)
    xn, _ = train.read(np.arange(train.num_samples))
    np.testing.assert_allclose(xn.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(xn.std(axis=(0, 2, 3)), 1, atol=1e-4)
    # test samples are normalized with the TRAIN statistics: far from zero here, by design
    xt, _ = test.read(np.arange(test.num_samples))
    np.testing.assert_allclose(xt, (x_te - mean.reshape(1, -1, 1, 1).astype(np.float32))
                               / std.reshape(1, -1, 1, 1).astype(np.float32), rtol=1e-5)


def test_constant_channel_gets_unit_std():
    x = np.ones((4, 2, 3, 3), np.float32)
    x[:, 1] = np.arange(4)[:, None, None]
    mean, std = channel_stats(x)
    assert std[0] == 1.0 and mean[0] == 1.0 and std[1] > 0


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("read_mode", ["runs", "fancy"])
def test_read_returns_requested_order_and_counts_unique_reads(layout, read_mode):
    path, (x_tr, y_tr), _ = layout
    meta = validate_layout(path)
    ds = HDF5Dataset(path, "train", read_mode=read_mode)
    idx = np.array([17, 3, 9, 3, 39, 0])
    x, y = ds.read(idx)
    expected = (x_tr[idx] - meta["mean"].reshape(1, -1, 1, 1)) / meta["std"].reshape(1, -1, 1, 1)
    np.testing.assert_allclose(x, expected.astype(np.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, y_tr[idx])
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert ds.samples_read == 5  # 3 is read once
    raw = HDF5Dataset(path, "train", normalize=False, read_mode=read_mode)
    np.testing.assert_array_equal(raw.read(idx)[0], x_tr[idx])
    ds.close()
    raw.close()


class RecordingArray:
    """Stands in for the h5py dataset and records every sample index that is read."""

    def __init__(self, dset):
        self.dset, self.rows = dset, []
        self.dtype, self.shape = dset.dtype, dset.shape

    def __getitem__(self, sel):
        rows = np.arange(self.shape[0])[sel]
        self.rows.extend(np.atleast_1d(rows).tolist())
        return self.dset[sel]


@pytest.mark.parametrize("read_mode", ["runs", "fancy"])
def test_read_touches_only_the_requested_samples(layout, read_mode):
    path, _, _ = layout
    ds = HDF5Dataset(path, "train", read_mode=read_mode)
    ds._x = RecordingArray(ds._x)
    share = np.array([4, 5, 6, 7, 20, 22, 31])  # a run and scattered indices
    ds.read(np.random.default_rng(0).permutation(share))
    assert sorted(ds._x.rows) == share.tolist()
    assert ds.samples_read == share.size


def test_empty_and_out_of_range_reads(layout):
    path, _, _ = layout
    ds = open_dataset(path)
    x, y = ds.read(np.array([], dtype=np.int64))
    assert x.shape == (0, C, H, W) and y.shape == (0,) and ds.samples_read == 0
    with pytest.raises(IndexError, match="out of range"):
        ds.read(np.array([40]))
    with pytest.raises(ValueError, match="integer"):
        ds.read(np.array([0.5]))


def test_cache_serves_later_reads_from_memory(layout):
    path, _, _ = layout
    plain = open_dataset(path)
    cached = open_dataset(path, cache=True)
    share = np.arange(0, 40, 3)
    order = np.random.default_rng(1).permutation(share)
    np.testing.assert_array_equal(cached.read(order)[0], plain.read(order)[0])
    assert cached.samples_read == share.size
    np.testing.assert_array_equal(cached.read(order[::-1])[0], plain.read(order[::-1])[0])
    assert cached.samples_read == share.size  # the second epoch read nothing from the file
    # a new share: prefetch reads only the samples not cached yet, and forgets the others
    new_share = np.arange(0, 40, 2)
    cached.prefetch(new_share)
    overlap = np.intersect1d(share, new_share).size
    assert cached.samples_read == share.size + new_share.size - overlap
    before = cached.samples_read
    np.testing.assert_array_equal(cached.read(new_share)[0], plain.read(new_share)[0])
    assert cached.samples_read == before
    cached.read(np.array([3]))  # 3 was dropped by prefetch: read again
    assert cached.samples_read == before + 1
    with pytest.raises(ValueError, match="cache=True"):
        plain.prefetch(share)


def test_array_dataset_has_the_same_interface(layout):
    path, (x_tr, y_tr), _ = layout
    meta = validate_layout(path)
    ads = ArrayDataset(x_tr, y_tr, NAMES, mean=meta["mean"], std=meta["std"])
    hds = open_dataset(path)
    idx = np.array([8, 2, 2, 30])
    for name in ("num_samples", "sample_shape", "num_classes", "class_names"):
        assert getattr(ads, name) == getattr(hds, name)
    np.testing.assert_allclose(ads.read(idx)[0], hds.read(idx)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ads.read(idx)[1], hds.read(idx)[1])
    assert ads.samples_read == hds.samples_read == 6  # two reads of 3 distinct samples
    with pytest.raises(ValueError, match="labels must be in"):
        ArrayDataset(x_tr, y_tr + 5, NAMES)


# ---------------------------------------------------------------------------------------------
# augmentation
# ---------------------------------------------------------------------------------------------
def test_dihedral_codes_are_a_pure_function_of_seed_epoch_index():
    idx = np.arange(1000)
    codes = dihedral_codes(7, 3, idx)
    assert codes.min() >= 0 and codes.max() <= 7
    np.testing.assert_array_equal(codes, dihedral_codes(7, 3, idx))
    # independent of which other indices are asked for, and in which order
    np.testing.assert_array_equal(dihedral_codes(7, 3, idx[::-7]), codes[::-7])
    assert np.mean(codes != dihedral_codes(7, 4, idx)) > 0.7  # another epoch: other draws
    assert np.mean(codes != dihedral_codes(8, 3, idx)) > 0.7  # another seed
    counts = np.bincount(codes, minlength=8)
    assert counts.min() > 80  # all 8 symmetries, roughly uniform


def test_apply_dihedral_matches_rot90_and_flip():
    x = np.arange(2 * 2 * 3 * 3, dtype=np.float32).reshape(2, 2, 3, 3)
    for code in range(8):
        out = apply_dihedral(x, np.full(2, code))
        expected = np.rot90(x, code % 4, axes=(2, 3))
        if code >= 4:
            expected = expected[..., ::-1]
        np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="square"):
        apply_dihedral(np.zeros((1, 1, 2, 3)), np.zeros(1, int))


def test_augmentation_is_reproducible_and_independent_of_the_reader(layout):
    path, _, _ = layout
    rank_a = open_dataset(path, augment=True, augment_seed=5)
    rank_b = open_dataset(path, augment=True, augment_seed=5)
    plain = open_dataset(path)
    rank_a.set_epoch(2)
    rank_b.set_epoch(2)
    xa, ya = rank_a.read(np.array([1, 2, 3, 4, 5, 6, 7, 8]))
    xb, yb = rank_b.read(np.array([7, 3]))  # another "rank" reads a subset, in another order
    np.testing.assert_array_equal(xb[0], xa[6])
    np.testing.assert_array_equal(xb[1], xa[2])
    np.testing.assert_array_equal(ya, plain.read(np.arange(1, 9))[1])  # labels never change
    # each augmented sample is a symmetry of the original one
    xp, _ = plain.read(np.arange(1, 9))
    codes = dihedral_codes(5, 2, np.arange(1, 9))
    np.testing.assert_array_equal(xa, apply_dihedral(xp, codes))
    rank_a.set_epoch(3)
    assert not np.array_equal(rank_a.read(np.arange(1, 9))[0], xa)


def test_augmentation_needs_square_samples():
    x = np.zeros((4, 1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="square"):
        ArrayDataset(x, np.array([0, 1, 0, 1]), ["p", "q"], augment=True)


# ---------------------------------------------------------------------------------------------
# validation errors: each names the file and the problem
# ---------------------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    path = tmp_path / "absent.h5"
    with pytest.raises(LayoutFileNotFoundError, match="no such file") as info:
        validate_layout(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)
    with pytest.raises(LayoutError, match="absent.h5"):
        open_dataset(path)


def test_not_an_hdf5_file(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("this is not HDF5\n")
    with pytest.raises(LayoutError, match="not an HDF5 file") as info:
        validate_layout(path)
    assert str(path) in str(info.value)


def test_hdf5_file_without_the_layout(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.zeros(3)
    with pytest.raises(LayoutError, match=r"missing dataset\(s\) train/x, train/y, test/x, test/y"):
        validate_layout(path)


def _del_attr(name):
    def edit(f):
        del f.attrs[name]
    return edit


def _replace(key, value):
    def edit(f):
        del f[key]
        f[key] = value
    return edit


def _set_attr(name, value):
    def edit(f):
        f.attrs[name] = value
    return edit


BAD_EDITS = [
    ("missing attribute", _del_attr("mean"), r"missing root attribute\(s\) mean"),
    ("missing dataset", lambda f: f.__delitem__("test/y"), r"missing dataset\(s\) test/y"),
    ("sample shape", _replace("test/x", np.zeros((12, C, H + 2, W + 2), np.float32)),
     "test/x samples are"),
    ("x / y length", _replace("train/y", np.zeros(39, np.int64)), "has 40 samples but train/y has 39"),
    ("label range", _replace("train/y", np.full(40, 3, np.int64)), r"labels in \[3, 3\]"),
    ("negative label", _replace("test/y", np.full(12, -1, np.int64)), r"labels in \[-1, -1\]"),
    ("x not 4-D", _replace("train/x", np.zeros((40, C * H * W), np.float32)), "must be 4-D"),
    ("float labels", _replace("train/y", np.zeros(40, np.float32)), "integer"),
    ("bands", _set_attr("bands", C + 1), "bands = 4 but samples have 3 channels"),
    ("mean shape", _set_attr("mean", np.zeros(C + 1)), r"mean and std must be \(3,\)"),
    ("zero std", _set_attr("std", np.zeros(C)), "std > 0"),
    ("version", _set_attr("layout_version", 2), "layout_version 2 is not supported"),
    ("one class", _set_attr("class_names", ["only"]), "at least 2 classes"),
]


@pytest.mark.parametrize("what, edit, message", BAD_EDITS, ids=[b[0] for b in BAD_EDITS])
def test_invalid_layouts_are_refused_with_a_clear_message(layout, tmp_path, what, edit, message):
    path, _, _ = layout
    bad = edited_copy(path, tmp_path / "bad.h5", edit)
    with pytest.raises(LayoutError, match=message) as info:
        validate_layout(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(LayoutError):
        open_dataset(bad)


def test_unknown_split(layout):
    path, _, _ = layout
    with pytest.raises(LayoutError, match=r"no split 'val' \(the file has: train, test\)"):
        open_dataset(path, "val")


# ---------------------------------------------------------------------------------------------
# write_layout: refuses bad input and never leaves a partial file
# ---------------------------------------------------------------------------------------------
BAD_WRITES = [
    ("label range", lambda tr, te: ({"train": (tr[0], tr[1] + 1), "test": te}), "outside"),
    ("no test split", lambda tr, te: ({"train": tr}), "'test' split is missing"),
    ("NaN", lambda tr, te: ({"train": (np.full_like(tr[0], np.nan), tr[1]), "test": te}), "NaN"),
    ("shapes", lambda tr, te: ({"train": tr, "test": (te[0][:, :, :3], te[1])}), "samples are"),
    ("y length", lambda tr, te: ({"train": (tr[0], tr[1][:-1]), "test": te}), "to match"),
]


@pytest.mark.parametrize("what, build, message", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_write_layout_refuses_bad_input_without_leaving_a_file(tmp_path, what, build, message):
    train, test = make_arrays(6, 0, 0), make_arrays(3, 0, 1)
    out = tmp_path / "out.h5"
    with pytest.raises(ValueError, match=message) as info:
        write_layout(out, build(train, test), NAMES)
    assert str(out) in str(info.value)
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(layout, monkeypatch):
    path, _, _ = layout
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk on fire"):
        write_layout(path, {"train": make_arrays(4, 0, 0), "test": make_arrays(2, 0, 0)}, NAMES)
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]


def test_write_layout_into_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_layout(tmp_path / "nope" / "x.h5", {"train": make_arrays(4, 0, 0),
                                                   "test": make_arrays(2, 0, 0)}, NAMES)


# ---------------------------------------------------------------------------------------------
# the synthetic default
# ---------------------------------------------------------------------------------------------
def test_synthetic_splits_are_deterministic_and_normalized_with_training_stats():
    train, test, meta = synthetic_splits(seed=0)
    train2, test2, _ = synthetic_splits(seed=0)
    idx = np.arange(0, train.num_samples, 97)
    np.testing.assert_array_equal(train.read(idx)[0], train2.read(idx)[0])
    np.testing.assert_array_equal(test.labels, test2.labels)
    assert train.sample_shape == (32, 7, 7) and train.num_classes == 4
    assert train.num_samples + test.num_samples == 64 * 64
    # 512 per class: 2048 = 32 full batches of 64, no tiny last batch
    assert np.bincount(train.labels).tolist() == [512] * 4
    assert meta["splits"] == {"train": train.num_samples, "test": test.num_samples}
    x, _ = train.read(np.arange(train.num_samples))
    np.testing.assert_allclose(x.mean(axis=(0, 2, 3)), 0, atol=1e-3)
    np.testing.assert_allclose(x.std(axis=(0, 2, 3)), 1, atol=1e-3)
    # every class in both splits, none tiny
    for ds in (train, test):
        assert np.bincount(ds.labels, minlength=4).min() > 0.1 * ds.num_samples
    other, _, _ = synthetic_splits(seed=1)
    assert not np.array_equal(other.read(idx)[0], train.read(idx)[0])


def _lda_accuracy(f_train, y_train, f_test, y_test):
    """Linear discriminant analysis (shared covariance): a simple, deterministic baseline."""
    k = y_train.max() + 1
    mu = np.stack([f_train[y_train == c].mean(0) for c in range(k)])
    r = f_train - mu[y_train]
    cov = r.T @ r / len(r) + 1e-6 * np.eye(f_train.shape[1])
    w = np.linalg.solve(cov, mu.T)
    b = -0.5 * np.sum(mu.T * w, 0)
    return float(np.mean(np.argmax(f_test @ w + b, 1) == y_test))


def test_synthetic_scene_needs_spatial_context():
    """The centre pixel's spectrum alone is not enough; the neighbourhood adds a lot.
    (A patch CNN does better still: see mpidl.data_tools.synthetic.)"""
    train, test, _ = synthetic_splits(seed=0)
    xtr, ytr = train.read(np.arange(train.num_samples))
    xte, yte = test.read(np.arange(test.num_samples))
    centre = _lda_accuracy(xtr[:, :, 3, 3], ytr, xte[:, :, 3, 3], yte)
    local = _lda_accuracy(xtr[:, :, 2:5, 2:5].mean((2, 3)), ytr, xte[:, :, 2:5, 2:5].mean((2, 3)), yte)
    assert 0.6 < centre < 0.9, centre  # not trivially separable from one pixel
    assert local > centre + 0.05, (centre, local)  # spatial context matters
