"""The mpidl HDF5 layout: the format, its validation and its (atomic) writer, in one module.

The HDF5 layout (version 1)
---------------------------
One file holds every split of one dataset::

    /train/x    (N, C, H, W) float32   samples (patches or images), raw values, NCHW
    /train/y    (N,)         int64     class index in [0, K)
    /train/pos  (N, 2)       int32     optional: (row, col) of a patch's centre pixel in the scene
    /test/x, /test/y, /test/pos        same, for the test split
    /val/x, /val/y, /val/pos           optional validation split

    root attributes
      class_names     K strings
      bands           C
      patch_size      H (== W for patches; the image size for image datasets)
      source          where the data came from (free text)
      split_seed      the seed of the train/test split
      mean, std       (C,) float64, per-channel statistics of the TRAINING split only
      layout_version  1
      fingerprint     optional: "sha256:..." of the splits' contents (see fingerprint()),
                      written at conversion; a resumed run compares it with its checkpoint's

``x`` is chunked one sample per chunk (``chunks=(1, C, H, W)``), so reading sample ``i``
touches exactly one chunk and a rank that reads only its share reads only those chunks.
Files are written by :func:`write_layout` (atomically: temporary name, fsync, rename) and
checked by :func:`validate_layout`; :mod:`mpidl.data` reads them.

Writing
-------
:func:`write_layout` checks everything first, computes the per-channel statistics on the
training split only, writes the file under a temporary name in the destination folder,
fsyncs it and renames it into place with ``os.replace`` (atomic on POSIX). Bad input
therefore never leaves a partial file, and a reader never sees a half-written one.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, Sequence

import numpy as np

from mpidl.outputs import atomic_h5

LAYOUT_VERSION = 1
REQUIRED_SPLITS = ("train", "test")
OPTIONAL_SPLITS = ("val",)
REQUIRED_ATTRS = ("class_names", "bands", "patch_size", "source", "split_seed", "mean", "std",
                  "layout_version")

__all__ = [
    "LAYOUT_VERSION", "REQUIRED_SPLITS", "OPTIONAL_SPLITS", "REQUIRED_ATTRS", "LayoutError",
    "LayoutFileNotFoundError", "validate_layout", "write_layout", "channel_stats",
    "scan_nonfinite", "nonfinite_problem", "fingerprint", "file_fingerprint", "stored_fingerprint",
]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class LayoutError(ValueError):
    """A file that is not a valid mpidl HDF5 layout. The message names the file and the problem.

    Attributes: ``path`` (str) and ``problem`` (str, the message without the file name).
    """

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class LayoutFileNotFoundError(LayoutError, FileNotFoundError):
    """The layout file does not exist (both a :class:`LayoutError` and a FileNotFoundError)."""


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _decode_names(value: Any) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in np.atleast_1d(value)]


def validate_layout(path: str | os.PathLike) -> dict:
    """Check that ``path`` is a valid layout file; return its metadata.

    Raises :class:`LayoutError` (a ValueError) naming the file and the problem: a missing file
    (:class:`LayoutFileNotFoundError`, also a FileNotFoundError), a file that is not HDF5,
    missing datasets or attributes, an unknown layout version, inconsistent shapes or dtypes,
    labels out of ``[0, K)``, or non-positive ``std``.

    Returns a dict: ``path, class_names, num_classes, bands, patch_size, sample_shape (C,H,W),
    source, split_seed, mean (C,), std (C,), layout_version, splits {name: N}``.
    Labels are read in full (N int64 per split) to check their range; samples are not read.
    """
    import h5py  # noqa: PLC0415

    path = str(path)
    if not os.path.exists(path):
        raise LayoutFileNotFoundError(path, "no such file")
    if os.path.isdir(path):
        raise LayoutError(path, "is a directory, not an HDF5 layout file")
    if not h5py.is_hdf5(path):
        raise LayoutError(path, "not an HDF5 file (expected the mpidl layout: train/x, train/y, "
                                "test/x, test/y and root attributes)")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise LayoutError(path, f"cannot be opened as HDF5 ({exc})") from exc
    with f:
        missing = [f"{s}/{d}" for s in REQUIRED_SPLITS for d in ("x", "y") if f"{s}/{d}" not in f]
        if missing:
            raise LayoutError(path, f"missing dataset(s) {', '.join(missing)}; not an mpidl layout "
                                    f"file (see mpidl/data.py)")
        missing_attrs = [a for a in REQUIRED_ATTRS if a not in f.attrs]
        if missing_attrs:
            raise LayoutError(path, f"missing root attribute(s) {', '.join(missing_attrs)}")
        version = int(np.asarray(f.attrs["layout_version"]).reshape(-1)[0])
        if version != LAYOUT_VERSION:
            raise LayoutError(path, f"layout_version {version} is not supported (this mpidl reads "
                                    f"version {LAYOUT_VERSION})")
        class_names = _decode_names(f.attrs["class_names"])
        num_classes = len(class_names)
        if num_classes < 2:
            raise LayoutError(path, f"class_names must list at least 2 classes, got {class_names}")
        splits: dict[str, int] = {}
        sample_shape = None
        for split in REQUIRED_SPLITS + OPTIONAL_SPLITS:
            if split not in f:
                continue
            if "x" not in f[split] or "y" not in f[split]:
                raise LayoutError(path, f"split {split!r} needs both {split}/x and {split}/y")
            x, y = f[f"{split}/x"], f[f"{split}/y"]
            if x.ndim != 4:
                raise LayoutError(path, f"{split}/x must be 4-D (N, C, H, W), got shape {x.shape}")
            if x.dtype.kind != "f":
                raise LayoutError(path, f"{split}/x must be floating point, got {x.dtype}")
            if y.ndim != 1 or y.dtype.kind not in "iu":
                raise LayoutError(path, f"{split}/y must be a 1-D integer array, "
                                        f"got shape {y.shape} dtype {y.dtype}")
            if y.shape[0] != x.shape[0]:
                raise LayoutError(path, f"{split}/x has {x.shape[0]} samples but {split}/y has "
                                        f"{y.shape[0]} labels")
            if sample_shape is None:
                sample_shape = tuple(int(s) for s in x.shape[1:])
            elif tuple(x.shape[1:]) != sample_shape:
                raise LayoutError(path, f"{split}/x samples are {tuple(x.shape[1:])} but train/x "
                                        f"samples are {sample_shape}")
            if "pos" in f[split] and f[f"{split}/pos"].shape != (x.shape[0], 2):
                raise LayoutError(path, f"{split}/pos must be ({x.shape[0]}, 2), "
                                        f"got {f[f'{split}/pos'].shape}")
            labels = y[...]
            if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
                raise LayoutError(path, f"{split}/y has labels in [{labels.min()}, {labels.max()}] "
                                        f"but there are {num_classes} classes (expected [0, "
                                        f"{num_classes - 1}])")
            splits[split] = int(x.shape[0])
        if splits["train"] == 0:
            raise LayoutError(path, "the train split is empty")
        bands = int(np.asarray(f.attrs["bands"]).reshape(-1)[0])
        if bands != sample_shape[0]:
            raise LayoutError(path, f"attribute bands = {bands} but samples have "
                                    f"{sample_shape[0]} channels")
        mean = np.asarray(f.attrs["mean"], dtype=np.float64)
        std = np.asarray(f.attrs["std"], dtype=np.float64)
        if mean.shape != (bands,) or std.shape != (bands,):
            raise LayoutError(path, f"mean and std must be ({bands},), got {mean.shape} and "
                                    f"{std.shape}")
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
            raise LayoutError(path, "mean/std must be finite and std > 0")
        patch = np.asarray(f.attrs["patch_size"]).reshape(-1)
        source = f.attrs["source"]
        return {
            "path": path,
            "class_names": class_names,
            "num_classes": num_classes,
            "bands": bands,
            "patch_size": int(patch[0]) if patch.size == 1 else tuple(int(p) for p in patch),
            "sample_shape": sample_shape,
            "source": source.decode() if isinstance(source, bytes) else str(source),
            "split_seed": int(np.asarray(f.attrs["split_seed"]).reshape(-1)[0]),
            "mean": mean,
            "std": std,
            "layout_version": version,
            "splits": splits,
        }



# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
#: samples per slice when computing statistics and writing (bounds the float64 temporaries)
_BLOCK = 1024


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and population std of ``x : (N, C, H, W)``, both ``(C,) float64``.

    Notes
    -----
    Two passes in float64 (mean first, then the mean squared deviation) rather than
    ``E[x^2] - E[x]^2``, which cancels catastrophically for data far from zero:
    ``mean[c] = sum_{n,h,w} x[n,c,h,w] / (N*H*W)``,
    ``std[c] = sqrt(sum_{n,h,w} (x[n,c,h,w] - mean[c])^2 / (N*H*W))``.
    A constant channel (``std < 1e-12``) gets ``std = 1``: it then normalizes to 0, not NaN.
    """
    n, c = x.shape[:2]
    count = n * int(np.prod(x.shape[2:]))
    if count == 0:
        raise ValueError("cannot compute statistics of an empty array")
    total = np.zeros(c, np.float64)
    for start in range(0, n, _BLOCK):
        total += x[start:start + _BLOCK].sum(axis=(0, 2, 3), dtype=np.float64)
    mean = total / count
    sq = np.zeros(c, np.float64)
    for start in range(0, n, _BLOCK):
        d = x[start:start + _BLOCK].astype(np.float64) - mean.reshape(1, -1, 1, 1)
        sq += np.einsum("nchw,nchw->c", d, d)
    std = np.sqrt(sq / count)
    std[std < 1e-12] = 1.0
    return mean, std


def _check_splits(path: str, splits: Mapping[str, Sequence[np.ndarray]],
                  class_names: Sequence[str]) -> dict[str, tuple]:
    """Validate and normalize the arrays; raise ValueError naming ``path`` and the problem."""
    def fail(problem: str):
        raise ValueError(f"cannot write {path}: {problem}")

    unknown = sorted(set(splits) - set(REQUIRED_SPLITS) - set(OPTIONAL_SPLITS))
    if unknown:
        fail(f"unknown split(s) {unknown}; use {REQUIRED_SPLITS + OPTIONAL_SPLITS}")
    for name in REQUIRED_SPLITS:
        if name not in splits:
            fail(f"the {name!r} split is missing")
    if len(class_names) < 2:
        fail(f"need at least 2 class names, got {list(class_names)}")
    out: dict[str, tuple] = {}
    sample_shape = None
    for name, arrays in splits.items():
        if len(arrays) not in (2, 3):
            fail(f"split {name!r} must be (x, y) or (x, y, pos)")
        x, y = np.asarray(arrays[0]), np.asarray(arrays[1])
        pos = None if len(arrays) == 2 or arrays[2] is None else np.asarray(arrays[2])
        if x.ndim != 4:
            fail(f"{name}/x must be (N, C, H, W), got shape {x.shape}")
        if y.shape != (x.shape[0],):
            fail(f"{name}/y must be ({x.shape[0]},) to match {name}/x, got shape {y.shape}")
        if y.size and y.dtype.kind not in "iu":
            fail(f"{name}/y must hold integers, got {y.dtype}")
        if sample_shape is None:
            sample_shape = x.shape[1:]
        elif x.shape[1:] != sample_shape:
            fail(f"{name}/x samples are {x.shape[1:]} but others are {sample_shape}")
        if y.size and (y.min() < 0 or y.max() >= len(class_names)):
            fail(f"{name}/y has labels in [{y.min()}, {y.max()}], outside [0, {len(class_names)})")
        if not np.all(np.isfinite(x)):
            fail(f"{name}/x contains NaN or infinite values")
        if pos is not None and pos.shape != (x.shape[0], 2):
            fail(f"{name}/pos must be ({x.shape[0]}, 2), got {pos.shape}")
        out[name] = (x, y.astype(np.int64), pos)
    if out["train"][0].shape[0] == 0:
        fail("the train split is empty")
    return out


def write_layout(path: str | os.PathLike, splits: Mapping[str, Sequence[np.ndarray]],
                 class_names: Sequence[str], *, source: str = "", patch_size: int | None = None,
                 split_seed: int = 0, attrs: Mapping[str, Any] | None = None) -> dict:
    """Write ``splits`` to ``path`` in the mpidl layout, atomically; return the stored metadata.

    Parameters
    ----------
    path : the output file (its folder must exist)
    splits : ``{'train': (x, y[, pos]), 'test': (x, y[, pos]), optional 'val': ...}`` with
        ``x : (N, C, H, W)`` raw values (stored as float32), ``y : (N,)`` integer labels in
        ``[0, K)``, ``pos : (N, 2)`` optional (row, col) of each patch's centre
    class_names : K names
    source, split_seed : stored as root attributes
    patch_size : stored as ``patch_size`` (default: H)
    attrs : further root attributes (e.g. the converter's options), stored as given; None
        values are left out

    Notes
    -----
    ``mean``/``std`` come from the training split only (:func:`channel_stats`). ``x`` is
    chunked ``(1, C, H, W)``: one sample per chunk, so a rank reading its share touches only
    its own chunks. No compression: reads are the hot path and the data are float noise.
    """
    import h5py  # noqa: PLC0415

    path = os.fspath(path)
    checked = _check_splits(path, splits, class_names)  # before touching the disk
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot write {path}: is a directory (give a file name)")
    mean, std = channel_stats(checked["train"][0])
    c, h, w = checked["train"][0].shape[1:]
    meta = {
        "class_names": [str(n) for n in class_names],
        "bands": int(c),
        "patch_size": int(h if patch_size is None else patch_size),
        "source": str(source),
        "split_seed": int(split_seed),
        "mean": mean,
        "std": std,
        "layout_version": LAYOUT_VERSION,
        "fingerprint": fingerprint({name: arrays[:2] for name, arrays in checked.items()}),
    }
    # Written under a temporary name in the destination folder (a rename within one file
    # system: atomic), fsynced, then renamed; a failed write names `path`, never the temporary.
    with atomic_h5(path, permissions=True) as f:
        for key, value in meta.items():
            f.attrs[key] = value
        for key, value in (attrs or {}).items():
            if value is not None:  # HDF5 has no null attribute: an absent one means "not set"
                f.attrs[key] = value
        for name, (x, y, pos) in checked.items():
            n = x.shape[0]
            dx = f.create_dataset(f"{name}/x", shape=x.shape, dtype=np.float32,
                                  chunks=(1, c, h, w) if n else None)
            for start in range(0, n, _BLOCK):
                dx[start:start + _BLOCK] = x[start:start + _BLOCK].astype(np.float32)
            f.create_dataset(f"{name}/y", data=y, dtype=np.int64)
            if pos is not None:
                f.create_dataset(f"{name}/pos", data=pos, dtype=np.int32)
    meta["splits"] = {name: int(arrs[0].shape[0]) for name, arrs in checked.items()}
    return meta


# --------------------------------------------------------------------------------------------
# Values: non-finite samples, and the content fingerprint
# --------------------------------------------------------------------------------------------
def scan_nonfinite(path: str | os.PathLike, split: str, start: int = 0, stop: int | None = None,
                   block: int = _BLOCK) -> tuple[int, int, int | None]:
    """Count the non-finite values (NaN, +-Inf) of ``split/x`` over samples ``[start, stop)``,
    reading ``block`` samples at a time (a large file is never loaded whole).

    Returns ``(samples, values, first)``: the samples that hold at least one non-finite
    value, the non-finite values in all, and the index of the first such sample (None when
    there is none).
    """
    import h5py  # noqa: PLC0415

    samples = values = 0
    first = None
    with h5py.File(os.fspath(path), "r") as f:
        x = f[f"{split}/x"]
        stop = x.shape[0] if stop is None else min(stop, x.shape[0])
        for lo in range(start, stop, block):
            chunk = x[lo:min(lo + block, stop)]
            finite = np.isfinite(chunk)
            if finite.all():
                continue
            bad = ~finite.reshape(chunk.shape[0], -1)
            per_sample = bad.sum(axis=1)
            hit = np.flatnonzero(per_sample)
            samples += int(hit.size)
            values += int(per_sample.sum())
            if first is None:
                first = lo + int(hit[0])
    return samples, values, first


def nonfinite_problem(split: str, samples: int, values: int, first: int) -> str:
    """The words for non-finite values found by :func:`scan_nonfinite`."""
    return (f"{split}/x holds non-finite values (NaN or Inf): {values} value(s) in {samples} "
            f"sample(s), the first at sample {first}")


def fingerprint(splits: Mapping[str, Sequence[np.ndarray]]) -> str:
    """A content fingerprint of ``{split: (x, y)}``: SHA-256 over, split by split in name
    order, the name, the shape of ``x``, ``y`` as little-endian int64 and ``x`` as
    little-endian float32. Stored by :func:`write_layout` as the root attribute
    ``fingerprint``; :func:`file_fingerprint` recomputes it from a file."""
    digest = hashlib.sha256()
    for name in sorted(splits):
        x, y = splits[name][0], splits[name][1]
        _digest_split(digest, name, x, y)
    return "sha256:" + digest.hexdigest()


def file_fingerprint(path: str | os.PathLike) -> str:
    """:func:`fingerprint` of a layout file's splits, read ``_BLOCK`` samples at a time."""
    import h5py  # noqa: PLC0415

    digest = hashlib.sha256()
    with h5py.File(os.fspath(path), "r") as f:
        for name in sorted(s for s in REQUIRED_SPLITS + OPTIONAL_SPLITS if s in f):
            _digest_split(digest, name, f[f"{name}/x"], f[f"{name}/y"][...])
    return "sha256:" + digest.hexdigest()


def stored_fingerprint(path: str | os.PathLike) -> str | None:
    """The ``fingerprint`` attribute of a layout file (None for a file written without one)."""
    import h5py  # noqa: PLC0415

    with h5py.File(os.fspath(path), "r") as f:
        value = f.attrs.get("fingerprint")
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _digest_split(digest, name: str, x, y) -> None:
    digest.update(name.encode())
    digest.update(np.asarray(x.shape, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(np.asarray(y), dtype="<i8").tobytes())
    for lo in range(0, x.shape[0], _BLOCK):
        digest.update(np.ascontiguousarray(x[lo:lo + _BLOCK], dtype="<f4").tobytes())
