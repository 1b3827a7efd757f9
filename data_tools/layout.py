"""Writing the mpidl HDF5 layout (the format itself is documented in :mod:`mpidl.data`).

:func:`write_layout` checks everything first, computes the per-channel statistics on the
training split only, writes the file under a temporary name in the destination folder,
fsyncs it and renames it into place with ``os.replace`` (atomic on POSIX). Bad input
therefore never leaves a partial file, and a reader never sees a half-written one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np

from mpidl.data import LAYOUT_VERSION, OPTIONAL_SPLITS, REQUIRED_SPLITS

#: samples per slice when computing statistics and writing (bounds the float64 temporaries)
_BLOCK = 1024


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    }
    # The temporary file lives in the destination folder so that os.replace is a rename
    # within one file system (atomic), never a copy.
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
    try:
        with h5py.File(tmp, "w") as f:
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
        # Flush the bytes to the disk before the rename makes them visible under `path`:
        # after a crash, `path` is then either the old file or the complete new one.
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable (best effort: not every file system allows it)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    meta["splits"] = {name: int(arrs[0].shape[0]) for name, arrs in checked.items()}
    return meta
