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

from mpidl.app.outputs import atomic_h5, cause

LAYOUT_VERSION = 1
REQUIRED_SPLITS = ("train", "test")
OPTIONAL_SPLITS = ("val",)
REQUIRED_ATTRS = ("class_names", "bands", "patch_size", "source", "split_seed", "mean", "std",
                  "layout_version")

__all__ = [
    "LAYOUT_VERSION", "REQUIRED_SPLITS", "OPTIONAL_SPLITS", "REQUIRED_ATTRS", "LayoutError",
    "LayoutFileNotFoundError", "validate_layout", "write_layout", "channel_stats",
    "scan_nonfinite", "nonfinite_problem", "scan_share", "nonfinite_error", "check_values",
    "check_trainable", "fingerprint", "file_fingerprint", "stored_fingerprint",
    "SCENE_KIND", "write_scene_layout", "cut_patches", "scene_channel_stats", "read_split_arrays",
    "scene_row_chunk",
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
        raise LayoutError(path, f"cannot be read: {cause(exc)}") from exc
    with f:
        if _attr_text(f.attrs.get("layout_kind", b"")) == SCENE_KIND:  # the scene-backed variant
            return _validate_scene(path, f)
        missing = [f"{s}/{d}" for s in REQUIRED_SPLITS for d in ("x", "y") if f"{s}/{d}" not in f]
        if missing:
            raise LayoutError(path, f"missing dataset(s) {', '.join(missing)}; not an mpidl layout "
                                    f"file (see mpidl/data/__init__.py)")
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
    with atomic_h5(path, streamed=True) as f:
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
        x = _split_samples(f, split)
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


def scan_share(path: str | os.PathLike, rank: int, size: int) -> dict:
    """``{split: (samples, values, first)}`` of :func:`scan_nonfinite` over rank ``rank``'s
    contiguous share ``[n r / P, n (r + 1) / P)`` of each split, so that ``P`` ranks read the
    file once between them."""
    import h5py  # noqa: PLC0415

    with h5py.File(os.fspath(path), "r") as f:
        counts = {s: f[f"{s}/y"].shape[0] for s in REQUIRED_SPLITS + OPTIONAL_SPLITS if s in f}
    return {split: scan_nonfinite(path, split, n * rank // size, n * (rank + 1) // size)
            for split, n in counts.items()}


def nonfinite_error(path: str | os.PathLike, shares: list) -> str | None:
    """The set-up error (``--data PATH: ...``) for every rank's :func:`scan_share` result, in
    rank order (a string in place of a result is that rank's own error); None when every
    value is finite."""
    failed = [share for share in shares if isinstance(share, str)]
    if failed:
        return failed[0]
    problems = []
    for split in shares[0]:
        parts = [share[split] for share in shares]
        samples, values = sum(p[0] for p in parts), sum(p[1] for p in parts)
        if samples:
            first = min(p[2] for p in parts if p[2] is not None)
            problems.append(nonfinite_problem(split, samples, values, first))
    if not problems:
        return None
    return f"--data {path}: {'; '.join(problems)} (python -m mpidl.data_tools info {path} checks a file)"


def check_values(path: str | os.PathLike, rank: int, size: int, allgather) -> str | None:
    """Collective through ``allgather`` (every rank's value, in rank order, on every rank):
    each rank scans its share of ``path`` for NaN and Inf (:func:`scan_share`); returns the
    same :func:`nonfinite_error` on every rank. The entry points call it once the file is
    known to be a valid layout; ``allgather`` is passed in so that this module needs no MPI."""
    try:
        share = scan_share(path, rank, size)
    except OSError as exc:
        share = f"--data {path}: {cause(exc)}"
    return nonfinite_error(path, allgather(share))


def check_trainable(meta: dict) -> None:
    """The rules a valid layout must also meet to be trained on (beyond
    :func:`validate_layout`'s format): a non-empty test split, which every evaluation reads.
    Raises :class:`LayoutError`. Shared by the trainer, the GAN and ``data_tools info``, so
    that ``info`` accepts exactly what training accepts."""
    if meta["splits"].get("test", 0) == 0:
        raise LayoutError(meta["path"], "the test split is empty (0 samples): there is nothing to "
                                        "evaluate the model on (convert the data with a test split)")


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
            _digest_split(digest, name, _split_samples(f, name), f[f"{name}/y"][...])
    return "sha256:" + digest.hexdigest()


def stored_fingerprint(path: str | os.PathLike) -> str | None:
    """The ``fingerprint`` attribute of a layout file (None for a file written without one)."""
    import h5py  # noqa: PLC0415

    with h5py.File(os.fspath(path), "r") as f:
        value = f.attrs.get("fingerprint")
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _split_samples(f, split: str):
    """``split``'s samples of an open layout file, either variant, sliceable in blocks:
    ``split/x`` of a patch file, the patches cut from the cube of a scene-backed one."""
    if "scene/cube" in f:
        patch = int(np.asarray(f.attrs["patch_size"]).reshape(-1)[0])
        return ScenePatches(f["scene/cube"], f[f"{split}/pos"][...], patch)
    return f[f"{split}/x"]


def _digest_split(digest, name: str, x, y) -> None:
    digest.update(name.encode())
    digest.update(np.asarray(x.shape, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(np.asarray(y), dtype="<i8").tobytes())
    for lo in range(0, x.shape[0], _BLOCK):
        digest.update(np.ascontiguousarray(x[lo:lo + _BLOCK], dtype="<f4").tobytes())


# --------------------------------------------------------------------------------------------
# The scene-backed variant
# --------------------------------------------------------------------------------------------
# A patch file stores every labelled pixel's patch: each pixel of the scene is copied into up
# to H*W patches (49 for 7 x 7). The scene-backed variant stores the padded cube once, plus
# the labelled pixels' positions, and the reader (mpidl.data.SceneDataset) cuts the patches:
#
#     /scene/cube  (R + 2h, C + 2h, bands) float32  the scene padded by h = patch // 2 on each
#                                                   side (the converter's --pad-mode), raw
#                                                   values, chunked in bands of whole rows
#                                                   (row_chunk rows per chunk)
#     /train/y     (N,)   int64                     class index in [0, K)
#     /train/pos   (N, 2) int32                     (row, col) of the centre pixel in the
#                                                   UNPADDED scene (= the patch's top-left
#                                                   corner in the padded cube)
#     /test/y, /test/pos, optional /val/...        the same
#
#     root attributes: those of the patch layout (mean/std of the training PATCHES, exactly
#     as a patch file computes them), plus layout_kind = "scene", scene_shape (R, C),
#     pad (h), row_chunk
#
# Sample i of a split is ``cube[r_i : r_i + H, c_i : c_i + W, :]`` transposed to (bands, H, W):
# bit for bit the patch a patch file stores for the same pixel.
SCENE_KIND = "scene"
#: target bytes of one chunk of the padded cube (a band of whole rows)
SCENE_CHUNK_BYTES = 256 * 1024


def _attr_text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.size == 1:
        return _attr_text(value.reshape(-1)[0])
    return str(value)


def scene_row_chunk(padded_cols: int, bands: int, target_bytes: int = SCENE_CHUNK_BYTES) -> int:
    """Rows per chunk of a padded cube ``(rows, padded_cols, bands)`` float32: about
    ``target_bytes`` per chunk, at least one row."""
    return max(1, int(target_bytes) // max(1, 4 * int(padded_cols) * int(bands)))


def cut_patches(rows: np.ndarray, positions: np.ndarray, patch: int, row0: int = 0) -> np.ndarray:
    """Patches cut from (a band of rows of) a padded cube.

    ``rows : (r, C_pad, bands)`` holds padded rows ``row0 .. row0 + r - 1``; ``positions :
    (n, 2)`` are (row, col) of the centre pixels in the unpadded scene, i.e. the patches'
    top-left corners in the padded cube. Returns ``(n, bands, patch, patch)`` float32, C-ordered:
    ``out[i, b, u, v] = padded[pos_i,0 + u, pos_i,1 + v, b]`` (the same array as
    ``mpidl.data_tools.hsi.extract_patches`` of the unpadded scene).
    """
    positions = np.asarray(positions, dtype=np.int64).reshape(-1, 2)
    windows = np.lib.stride_tricks.sliding_window_view(rows, (patch, patch), axis=(0, 1))
    return np.ascontiguousarray(windows[positions[:, 0] - row0, positions[:, 1]], dtype=np.float32)


def scene_channel_stats(padded: Any, positions: np.ndarray, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`channel_stats` of the patches at ``positions`` without holding them all.

    ``padded`` is the padded cube ``(R + 2h, C + 2h, bands)`` (an array or an h5py dataset).
    The patches are cut ``_BLOCK`` at a time, the blocks :func:`channel_stats` sums over, in the
    same order and with the same float64 operations, so the result is bit for bit that of
    ``channel_stats(extract_patches(...))``: a scene-backed file normalizes exactly as the
    patch file of the same conversion.
    """
    positions = np.asarray(positions, dtype=np.int64).reshape(-1, 2)
    n = positions.shape[0]
    if n == 0:
        raise ValueError("cannot compute statistics of an empty array")

    def block(start):
        pos = positions[start:start + _BLOCK]
        lo, hi = int(pos[:, 0].min()), int(pos[:, 0].max()) + patch
        return cut_patches(np.asarray(padded[lo:hi], dtype=np.float32), pos, patch, lo)

    c = int(padded.shape[2])
    count = n * patch * patch
    total = np.zeros(c, np.float64)
    for start in range(0, n, _BLOCK):
        total += block(start).sum(axis=(0, 2, 3), dtype=np.float64)
    mean = total / count
    sq = np.zeros(c, np.float64)
    for start in range(0, n, _BLOCK):
        d = block(start).astype(np.float64) - mean.reshape(1, -1, 1, 1)
        sq += np.einsum("nchw,nchw->c", d, d)
    std = np.sqrt(sq / count)
    std[std < 1e-12] = 1.0
    return mean, std


class ScenePatches:
    """The patches at ``positions`` of a padded cube, as a read-only array-like of shape
    ``(n, bands, patch, patch)`` whose slices ``[lo:hi]`` are cut on demand (reading only the
    rows they touch): lets the block-wise readers of a patch file (fingerprint, non-finite
    scan) read a scene-backed file unchanged, with the same result for the same samples."""

    def __init__(self, padded: Any, positions: np.ndarray, patch: int):
        self.padded = padded
        self.positions = np.asarray(positions, dtype=np.int64).reshape(-1, 2)
        self.patch = int(patch)
        self.shape = (self.positions.shape[0], int(padded.shape[2]), self.patch, self.patch)

    def __getitem__(self, index: slice) -> np.ndarray:
        pos = self.positions[index]
        if pos.shape[0] == 0:
            return np.empty((0, *self.shape[1:]), np.float32)
        lo, hi = int(pos[:, 0].min()), int(pos[:, 0].max()) + self.patch
        return cut_patches(np.asarray(self.padded[lo:hi], dtype=np.float32), pos, self.patch, lo)


def write_scene_layout(path: str | os.PathLike, padded: np.ndarray,
                       splits: Mapping[str, Sequence[np.ndarray]], class_names: Sequence[str], *,
                       patch_size: int, source: str = "", split_seed: int = 0,
                       attrs: Mapping[str, Any] | None = None, row_chunk: int | None = None) -> dict:
    """Write the scene-backed variant (see the comment above :data:`SCENE_KIND`), atomically.

    Parameters
    ----------
    padded : ``(R + 2h, C + 2h, bands)`` the scene padded by ``h = patch_size // 2``
    splits : ``{'train': (pos, y), 'test': (pos, y), optional 'val': ...}`` with ``pos : (N, 2)``
        the centre pixels' (row, col) in the unpadded scene and ``y : (N,)`` labels in [0, K)
    patch_size : odd patch side ``H = W``
    row_chunk : rows of the padded cube per HDF5 chunk (default :func:`scene_row_chunk`)

    Returns the stored metadata, as :func:`write_layout` does. ``mean``/``std`` are those of
    the training patches (:func:`scene_channel_stats`, equal to a patch file's).
    """
    path = os.fspath(path)

    def fail(problem: str):
        raise ValueError(f"cannot write {path}: {problem}")

    padded = np.asarray(padded)
    if padded.ndim != 3:
        fail(f"the padded cube must be (rows, cols, bands), got shape {padded.shape}")
    patch = int(patch_size)
    if patch < 1 or patch % 2 == 0:
        fail(f"patch_size must be odd and positive, got {patch_size}")
    half = patch // 2
    rows, cols = padded.shape[0] - 2 * half, padded.shape[1] - 2 * half
    if rows < 1 or cols < 1:
        fail(f"a cube of {padded.shape[:2]} padded rows x cols is too small for patch {patch}")
    unknown = sorted(set(splits) - set(REQUIRED_SPLITS) - set(OPTIONAL_SPLITS))
    if unknown:
        fail(f"unknown split(s) {unknown}; use {REQUIRED_SPLITS + OPTIONAL_SPLITS}")
    for name in REQUIRED_SPLITS:
        if name not in splits:
            fail(f"the {name!r} split is missing")
    if len(class_names) < 2:
        fail(f"need at least 2 class names, got {list(class_names)}")
    if not np.all(np.isfinite(padded)):
        fail("the cube contains NaN or infinite values")
    checked = {}
    for name, arrays in splits.items():
        if len(arrays) != 2:
            fail(f"split {name!r} must be (pos, y)")
        pos = np.asarray(arrays[0], dtype=np.int64).reshape(-1, 2) if np.size(arrays[0]) \
            else np.empty((0, 2), np.int64)
        y = np.asarray(arrays[1])
        if y.shape != (pos.shape[0],):
            fail(f"{name}/y must be ({pos.shape[0]},) to match {name}/pos, got shape {y.shape}")
        if y.size and y.dtype.kind not in "iu":
            fail(f"{name}/y must hold integers, got {y.dtype}")
        if y.size and (y.min() < 0 or y.max() >= len(class_names)):
            fail(f"{name}/y has labels in [{y.min()}, {y.max()}], outside [0, {len(class_names)})")
        if pos.size and (pos.min(axis=0) < 0).any() or pos.size and (pos.max(axis=0) >= (rows, cols)).any():
            fail(f"{name}/pos has positions outside the {rows} x {cols} scene")
        checked[name] = (pos.astype(np.int32), y.astype(np.int64))
    if checked["train"][0].shape[0] == 0:
        fail("the train split is empty")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: folder {folder} does not exist")
    cube = np.ascontiguousarray(padded, dtype=np.float32)
    mean, std = scene_channel_stats(cube, checked["train"][0], patch)
    chunk = int(row_chunk) if row_chunk else scene_row_chunk(cube.shape[1], cube.shape[2])
    chunk = max(1, min(chunk, cube.shape[0]))
    meta = {
        "class_names": [str(n) for n in class_names],
        "bands": int(cube.shape[2]),
        "patch_size": patch,
        "source": str(source),
        "split_seed": int(split_seed),
        "mean": mean,
        "std": std,
        "layout_version": LAYOUT_VERSION,
        "fingerprint": fingerprint({name: (ScenePatches(cube, pos, patch), y)
                                    for name, (pos, y) in checked.items()}),
    }

    def fill(f):
        for key, value in (attrs or {}).items():
            if value is not None:
                f.attrs[key] = value
        for key, value in meta.items():
            f.attrs[key] = value
        f.attrs["layout_kind"] = SCENE_KIND
        f.attrs["scene_shape"] = np.array([rows, cols], np.int64)
        f.attrs["pad"] = half
        f.attrs["row_chunk"] = chunk
        f.create_dataset("scene/cube", data=cube, chunks=(chunk, cube.shape[1], cube.shape[2]))
        for name, (pos, y) in checked.items():
            f.create_dataset(f"{name}/pos", data=pos, dtype=np.int32)
            f.create_dataset(f"{name}/y", data=y, dtype=np.int64)

    with atomic_h5(path, streamed=True) as f:
        fill(f)
    meta["splits"] = {name: int(arrs[0].shape[0]) for name, arrs in checked.items()}
    meta["kind"] = SCENE_KIND
    meta["sample_shape"] = (int(cube.shape[2]), patch, patch)
    return meta


def _validate_scene(path: str, f) -> dict:
    """:func:`validate_layout` for a scene-backed file (``f`` open); the same dict, plus
    ``kind`` = 'scene', ``scene_shape`` (R, C), ``padded_shape`` and ``row_chunk``."""
    missing_attrs = [a for a in REQUIRED_ATTRS + ("scene_shape", "pad") if a not in f.attrs]
    if missing_attrs:
        raise LayoutError(path, f"missing root attribute(s) {', '.join(missing_attrs)}")
    version = int(np.asarray(f.attrs["layout_version"]).reshape(-1)[0])
    if version != LAYOUT_VERSION:
        raise LayoutError(path, f"layout_version {version} is not supported (this mpidl reads "
                                f"version {LAYOUT_VERSION})")
    missing = [d for d in ["scene/cube"] + [f"{s}/{k}" for s in REQUIRED_SPLITS for k in ("pos", "y")]
               if d not in f]
    if missing:
        raise LayoutError(path, f"missing dataset(s) {', '.join(missing)} of a scene-backed "
                                f"layout (layout_kind = 'scene')")
    class_names = _decode_names(f.attrs["class_names"])
    num_classes = len(class_names)
    if num_classes < 2:
        raise LayoutError(path, f"class_names must list at least 2 classes, got {class_names}")
    cube = f["scene/cube"]
    if cube.ndim != 3 or cube.dtype.kind != "f":
        raise LayoutError(path, f"scene/cube must be a 3-D floating-point array (rows, cols, "
                                f"bands), got shape {cube.shape} dtype {cube.dtype}")
    patch = int(np.asarray(f.attrs["patch_size"]).reshape(-1)[0])
    half = int(np.asarray(f.attrs["pad"]).reshape(-1)[0])
    if patch < 1 or patch % 2 == 0 or half != patch // 2:
        raise LayoutError(path, f"patch_size {patch} and pad {half} do not match (pad must be "
                                f"patch_size // 2, patch_size odd)")
    rows, cols = (int(v) for v in np.asarray(f.attrs["scene_shape"]).reshape(-1)[:2])
    if cube.shape[:2] != (rows + 2 * half, cols + 2 * half):
        raise LayoutError(path, f"scene/cube is {cube.shape[:2]} but a {rows} x {cols} scene "
                                f"padded by {half} is {(rows + 2 * half, cols + 2 * half)}")
    bands = int(np.asarray(f.attrs["bands"]).reshape(-1)[0])
    if bands != cube.shape[2]:
        raise LayoutError(path, f"attribute bands = {bands} but scene/cube has {cube.shape[2]} bands")
    splits: dict[str, int] = {}
    for split in REQUIRED_SPLITS + OPTIONAL_SPLITS:
        if split not in f:
            continue
        if "pos" not in f[split] or "y" not in f[split]:
            raise LayoutError(path, f"split {split!r} needs both {split}/pos and {split}/y")
        pos, y = f[f"{split}/pos"], f[f"{split}/y"]
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise LayoutError(path, f"{split}/y must be a 1-D integer array, "
                                    f"got shape {y.shape} dtype {y.dtype}")
        if pos.shape != (y.shape[0], 2) or pos.dtype.kind not in "iu":
            raise LayoutError(path, f"{split}/pos must be ({y.shape[0]}, 2) integers, "
                                    f"got shape {pos.shape} dtype {pos.dtype}")
        labels, p = y[...], pos[...]
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise LayoutError(path, f"{split}/y has labels in [{labels.min()}, {labels.max()}] "
                                    f"but there are {num_classes} classes (expected [0, "
                                    f"{num_classes - 1}])")
        if p.size and ((p.min(axis=0) < 0).any() or (p.max(axis=0) >= (rows, cols)).any()):
            raise LayoutError(path, f"{split}/pos has positions outside the {rows} x {cols} scene")
        splits[split] = int(y.shape[0])
    if splits["train"] == 0:
        raise LayoutError(path, "the train split is empty")
    mean = np.asarray(f.attrs["mean"], dtype=np.float64)
    std = np.asarray(f.attrs["std"], dtype=np.float64)
    if mean.shape != (bands,) or std.shape != (bands,):
        raise LayoutError(path, f"mean and std must be ({bands},), got {mean.shape} and {std.shape}")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
        raise LayoutError(path, "mean/std must be finite and std > 0")
    row_chunk = int(np.asarray(f.attrs["row_chunk"]).reshape(-1)[0]) if "row_chunk" in f.attrs \
        else (cube.chunks[0] if cube.chunks else cube.shape[0])
    return {
        "path": path,
        "class_names": class_names,
        "num_classes": num_classes,
        "bands": bands,
        "patch_size": patch,
        "sample_shape": (bands, patch, patch),
        "source": _attr_text(f.attrs["source"]),
        "split_seed": int(np.asarray(f.attrs["split_seed"]).reshape(-1)[0]),
        "mean": mean,
        "std": std,
        "layout_version": version,
        "splits": splits,
        "kind": SCENE_KIND,
        "scene_shape": (rows, cols),
        "padded_shape": tuple(int(s) for s in cube.shape),
        "row_chunk": row_chunk,
    }


def read_split_arrays(path: str | os.PathLike, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(x, y, pos)`` of one split with RAW values, whichever variant the file is: ``x :
    (N, C, H, W)`` float32 (cut from the cube for a scene-backed file), ``y : (N,)``,
    ``pos : (N, 2)`` or None. Reads the whole split into memory (for tools and tests)."""
    import h5py  # noqa: PLC0415

    meta = validate_layout(path)
    if split not in meta["splits"]:
        raise LayoutError(str(path), f"no split {split!r}")
    with h5py.File(path, "r") as f:
        y = f[f"{split}/y"][...]
        pos = f[f"{split}/pos"][...] if "pos" in f[split] else None
        if meta.get("kind") == SCENE_KIND:
            x = cut_patches(f["scene/cube"][...].astype(np.float32, copy=False), pos,
                            meta["patch_size"]) if y.size else \
                np.empty((0, *meta["sample_shape"]), np.float32)
        else:
            x = f[f"{split}/x"][...]
    return x, y, pos
