"""Datasets: the HDF5 layout (:mod:`mpidl.data.layout`) read lazily, so that each rank reads only its own share.

Normalization
-------------
A sample is returned as ``(x - mean[c]) / std[c]`` per channel ``c``, with ``mean`` and
``std`` taken from the file, i.e. from the training split, so no test statistic leaks into
training. The statistics run over every value of the training tensor: for channel ``c``,
``mean[c] = sum_{n,h,w} x[n,c,h,w] / (N*H*W)`` and ``std[c]`` is the matching population
standard deviation (a constant channel gets ``std = 1``, so it maps to 0 instead of NaN).

Datasets
--------
:class:`HDF5Dataset` and :class:`ArrayDataset` share one interface (``num_samples``,
``sample_shape``, ``num_classes``, ``class_names``, ``labels``, ``read(indices)``,
``samples_read``, ``set_epoch``); the trainer never needs to know which one it has.
:func:`synthetic_splits` builds the default in-memory dataset of ``python -m mpidl.train``.

Augmentation
------------
Optional random flips and 90-degree rotations (the 8 symmetries of a square, the dihedral
group D4). The symmetry applied to sample ``i`` in epoch ``e`` is a hash of
``(seed, e, i)``: it does not depend on which rank reads the sample, in which batch or in
which order, so a run is reproducible across any number of ranks and any load balance.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from mpidl.data_tools.synthetic import scene_splits
from mpidl.data.layout import LAYOUT_VERSION, SCENE_KIND, LayoutError, channel_stats, cut_patches, validate_layout

READ_MODES = ("runs", "fancy")

__all__ = [
    "ArrayDataset", "HDF5Dataset", "SceneDataset", "open_dataset", "load_splits", "synthetic_splits",
    "dihedral_codes", "apply_dihedral",
]


# --------------------------------------------------------------------------------------------
# Augmentation: the 8 symmetries of a square patch, chosen by a counter-based hash
# --------------------------------------------------------------------------------------------
_U64 = np.uint64


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array (wrapping arithmetic, as the algorithm intends).

    A counter-based hash rather than a stateful generator: the value for one sample does not
    depend on how many other samples were drawn before it.
    """
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def dihedral_codes(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """The symmetry code (0..7) of each sample: a pure function of ``(seed, epoch, index)``.

    Returns ``codes : (n,) int64``. Code ``k`` means: rotate by ``(k % 4) * 90`` degrees, then
    mirror left-right if ``k >= 4``. Code 0 is the identity.
    """
    idx = np.asarray(indices, dtype=np.int64).astype(_U64)
    # Chain the three keys through the hash so that (seed, epoch, index) triples that differ in
    # any one key give unrelated codes. Masking keeps negative seeds well defined.
    h = _splitmix64(np.full(idx.shape, int(seed) & 0xFFFFFFFFFFFFFFFF, dtype=_U64))
    h = _splitmix64(h ^ _U64(int(epoch) & 0xFFFFFFFFFFFFFFFF))
    h = _splitmix64(h ^ idx)
    return (h >> _U64(61)).astype(np.int64)  # the top 3 bits: the best-mixed ones


def apply_dihedral(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Apply symmetry ``codes[n]`` (see :func:`dihedral_codes`) to sample ``x[n]``.

    ``x : (n, C, H, W)`` with ``H == W``; returns a new ``(n, C, H, W)`` array. Rotation is in
    the (H, W) plane, counter-clockwise (``numpy.rot90`` on axes (2, 3)); the mirror reverses W.
    """
    if x.shape[2] != x.shape[3]:
        raise ValueError(f"rotations need square samples, got H x W = {x.shape[2]} x {x.shape[3]}")
    out = np.empty_like(x)
    for code in np.unique(codes):
        sel = np.flatnonzero(codes == code)
        block = np.rot90(x[sel], k=int(code) % 4, axes=(2, 3))
        if code >= 4:
            block = block[..., ::-1]
        out[sel] = block
    return out


# --------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------
class _PatchDataset:
    """The interface shared by :class:`ArrayDataset` and :class:`HDF5Dataset`.

    Subclasses provide ``_load_sorted(unique) -> (n, C, H, W) float32`` (normalized) for a
    sorted array of unique indices; this class adds ordering, the optional cache of this
    rank's share, augmentation, and the ``samples_read`` counter.
    """

    def __init__(self, labels: np.ndarray, sample_shape: Sequence[int], class_names: Sequence[str],
                 *, cache: bool = False, augment: bool = False, augment_seed: int = 0,
                 name: str = "dataset"):
        self._labels = np.ascontiguousarray(labels, dtype=np.int64)
        self.sample_shape: tuple[int, int, int] = tuple(int(s) for s in sample_shape)  # (C, H, W)
        self.class_names: list[str] = [str(c) for c in class_names]
        self.num_classes: int = len(self.class_names)
        self.num_samples: int = int(self._labels.shape[0])
        self.name = name
        if augment and self.sample_shape[1] != self.sample_shape[2]:
            raise ValueError(f"{name}: augmentation (90-degree rotations) needs square samples, "
                             f"got H x W = {self.sample_shape[1]} x {self.sample_shape[2]}")
        self.augment = bool(augment)
        self.augment_seed = int(augment_seed)
        self.epoch = 0
        #: number of samples (x) actually read from storage since creation (or reset_counter)
        self.samples_read = 0
        self.cache = bool(cache)
        # The cache: slot[i] is the row of sample i in _store, or -1 when not cached.
        self._slot = np.full(self.num_samples, -1, dtype=np.int64) if self.cache else None
        self._store = np.empty((0, *self.sample_shape), dtype=np.float32)
        self._stored = 0

    # ---- public interface -------------------------------------------------------------------
    @property
    def labels(self) -> np.ndarray:
        """All labels, ``(num_samples,) int64`` (held in memory; they are a few bytes each)."""
        return self._labels

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose augmentation draws :meth:`read` applies."""
        self.epoch = int(epoch)

    def read(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``indices`` in that order: ``x : (n, C, H, W) float32`` normalized, ``y : (n,) int64``.

        Storage is read once per distinct index, in increasing index order (what HDF5 reads
        fastest); the result is then put back into the order asked for. Duplicates are allowed.
        """
        idx = self._check_indices(indices)
        if idx.size == 0:
            return np.empty((0, *self.sample_shape), np.float32), np.empty((0,), np.int64)
        if self.cache:
            self._ensure_cached(idx)
            x = self._store[self._slot[idx]]
        else:
            unique, inverse = np.unique(idx, return_inverse=True)
            x_unique = self._load_sorted(unique)
            self.samples_read += int(unique.size)
            x = x_unique if unique.size == idx.size and np.array_equal(unique, idx) \
                else x_unique[inverse.reshape(-1)]
        if self.augment:
            x = apply_dihedral(x, dihedral_codes(self.augment_seed, self.epoch, idx))
        return x, self._labels[idx]

    def prefetch(self, indices: Any, drop_others: bool = True) -> None:
        """Cache this epoch's share in memory with ONE sorted read (needs ``cache=True``).

        With ``drop_others`` the cache keeps only ``indices`` afterwards (samples already cached
        are kept, not re-read), so its memory follows the rank's share when re-balancing moves
        it. Without a call to ``prefetch``, a cached dataset still fills itself on first read.
        """
        if not self.cache:
            raise ValueError(f"{self.name}: prefetch() needs a dataset opened with cache=True")
        share = np.unique(self._check_indices(indices))
        old_slots = self._slot[share]
        if not drop_others or (self._stored == share.size and np.all(old_slots >= 0)):
            self._ensure_cached(share)  # (a no-op when the share is exactly what is cached)
            return
        store = np.empty((share.size, *self.sample_shape), dtype=np.float32)
        have = old_slots >= 0
        store[have] = self._store[old_slots[have]]
        missing = share[~have]
        if missing.size:
            store[~have] = self._load_sorted(missing)
            self.samples_read += int(missing.size)
        self._slot.fill(-1)
        self._slot[share] = np.arange(share.size)
        self._store, self._stored = store, int(share.size)

    # ---- helpers ------------------------------------------------------------------------------
    def _check_indices(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.size == 0:
            return np.empty((0,), dtype=np.int64)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(f"{self.name}: indices must be a 1-D integer array, "
                             f"got shape {idx.shape} dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.num_samples:
            raise IndexError(f"{self.name}: index out of range [0, {self.num_samples}): "
                             f"min {lo}, max {hi}")
        return idx

    def _ensure_cached(self, idx: np.ndarray) -> None:
        missing = np.unique(idx[self._slot[idx] < 0])
        if missing.size == 0:
            return
        x_new = self._load_sorted(missing)
        self.samples_read += int(missing.size)
        need = self._stored + missing.size
        if need > self._store.shape[0]:  # grow geometrically: amortized O(1) per sample
            capacity = min(self.num_samples, max(need, 2 * self._store.shape[0]))
            grown = np.empty((capacity, *self.sample_shape), dtype=np.float32)
            grown[: self._stored] = self._store[: self._stored]
            self._store = grown
        self._store[self._stored:need] = x_new
        self._slot[missing] = np.arange(self._stored, need)
        self._stored = need

    def _load_sorted(self, unique: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


class ArrayDataset(_PatchDataset):
    """A dataset over in-memory arrays, with the interface of :class:`HDF5Dataset`.

    Parameters
    ----------
    x : (N, C, H, W) array, converted to float32
    y : (N,) integer array, values in [0, K)
    class_names : K names
    mean, std : optional (C,) statistics; when given, samples are returned as
        ``(x - mean[c]) / std[c]`` (normalized once here, not on every read)
    cache, augment, augment_seed : as in :class:`HDF5Dataset` (a cache over memory only
        costs memory; it exists so tests can exercise the same path)
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, class_names: Sequence[str], *,
                 mean: np.ndarray | None = None, std: np.ndarray | None = None,
                 cache: bool = False, augment: bool = False, augment_seed: int = 0,
                 name: str = "ArrayDataset"):
        x = np.asarray(x)
        y = np.asarray(y)
        if x.ndim != 4:
            raise ValueError(f"{name}: x must be (N, C, H, W), got shape {x.shape}")
        if y.shape != (x.shape[0],):
            raise ValueError(f"{name}: y must be ({x.shape[0]},) to match x, got shape {y.shape}")
        if y.size and (y.min() < 0 or y.max() >= len(class_names)):
            raise ValueError(f"{name}: labels must be in [0, {len(class_names)}), "
                             f"got [{y.min()}, {y.max()}]")
        x = np.array(x, dtype=np.float32, copy=True)  # own the data: callers may reuse theirs
        if mean is not None or std is not None:
            if mean is None or std is None:
                raise ValueError(f"{name}: give both mean and std, or neither")
            x -= np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
            x /= np.asarray(std, np.float32).reshape(1, -1, 1, 1)
        self._x = x
        super().__init__(y, x.shape[1:], class_names, cache=cache, augment=augment,
                         augment_seed=augment_seed, name=name)

    def _load_sorted(self, unique: np.ndarray) -> np.ndarray:
        return self._x[unique]


class HDF5Dataset(_PatchDataset):
    """One split of an HDF5 layout file, read lazily: only the samples asked for are read.

    Each rank opens the file read-only on its own (no parallel HDF5 needed). ``read(indices)``
    reads each distinct index once, in increasing order (sorted unique indices; see the Notes
    for how), normalizes with the file's training statistics, and returns the samples in the
    order asked for. ``samples_read`` counts the samples read from the file; labels (8 bytes
    per sample) are read once, at open.

    Parameters
    ----------
    path : the layout file
    split : 'train', 'test' or 'val'
    normalize : apply ``(x - mean) / std`` with the file's training statistics
    cache : keep every sample read in memory, so later epochs read nothing from the file.
        Use :meth:`prefetch` at the start of an epoch to load the rank's share in one read
        and drop samples that are no longer its share.
    augment, augment_seed : random flips / 90-degree rotations, see :func:`dihedral_codes`
    read_mode : 'runs' (default) or 'fancy', see the Notes

    Notes
    -----
    How the samples are read (``read_mode``). The distinct indices are sorted, then either
    ``'runs'`` (default): one slice read per run of consecutive indices, or ``'fancy'``: one
    h5py fancy-index read of all of them. Both read exactly the requested chunks; they differ
    in overhead: on the Samson layout a fancy read takes about 10x the time of the runs, and
    the cache, after its first epoch, a fraction of it (the timings are in
    ``benchmarks/results/notebook.md``). HDF5 builds a fancy selection point by
    point, which costs far more than moving the data; slicing run by run avoids it, and a
    contiguous share is a single read. The cache is the fastest from the second epoch on (a
    memory gather) and the only option that does not touch the file again, at the cost of
    holding the rank's share in memory (54 MiB for all of Samson's training split). Reading
    is in any case a small part of a training step of the patch CNN (about 1 ms of compute
    per sample), so ``cache`` is off by default; turn it on for many epochs over a file on a
    slow or shared (network) file system.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", *, normalize: bool = True,
                 cache: bool = False, augment: bool = False, augment_seed: int = 0,
                 read_mode: str = "runs"):
        import h5py  # noqa: PLC0415 - a dependency, imported where it is needed

        self.path = str(path)
        meta = validate_layout(self.path)
        if split not in meta["splits"]:
            raise LayoutError(self.path, f"no split {split!r} (the file has: "
                                         f"{', '.join(meta['splits'])})")
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        if meta.get("kind") == SCENE_KIND:
            raise LayoutError(self.path, "a scene-backed layout file: open it with "
                                         "open_dataset or SceneDataset")
        self.read_mode = read_mode
        self.split = split
        self.meta = meta
        self._file = h5py.File(self.path, "r")
        self._x = self._file[f"{split}/x"]
        labels = self._file[f"{split}/y"][...]
        self.normalize = bool(normalize)
        self._mean = np.asarray(meta["mean"], np.float32).reshape(1, -1, 1, 1)
        self._std = np.asarray(meta["std"], np.float32).reshape(1, -1, 1, 1)
        super().__init__(labels, self._x.shape[1:], meta["class_names"], cache=cache,
                         augment=augment, augment_seed=augment_seed,
                         name=f"{self.path}[{split}]")

    def _load_sorted(self, unique: np.ndarray) -> np.ndarray:
        if self.read_mode == "fancy":
            x = self._x[unique]  # one h5py fancy-index read (indices must increase: they do)
        else:
            # One slice per run of consecutive indices: a rank's contiguous share is one read,
            # scattered indices are one cheap single-chunk read each (see the Notes).
            x = np.empty((unique.size, *self.sample_shape), dtype=self._x.dtype)
            breaks = np.flatnonzero(np.diff(unique) != 1) + 1
            starts = np.concatenate(([0], breaks))
            stops = np.concatenate((breaks, [unique.size]))
            for lo, hi in zip(starts.tolist(), stops.tolist()):
                first = int(unique[lo])
                x[lo:hi] = self._x[first:first + (hi - lo)]
        x = np.asarray(x, dtype=np.float32)
        if self.normalize:
            x -= self._mean
            x /= self._std
        return x

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # files left open by a crashed run are closed by h5py anyway
        try:
            self.close()
        except Exception:
            pass


class SceneDataset(_PatchDataset):
    """One split of a SCENE-BACKED layout file (:data:`mpidl.data.layout.SCENE_KIND`): the patches
    are cut from the stored padded cube on read, so they are bit for bit those of the patch
    file of the same conversion (and so, after normalization and augmentation, the samples).

    The cube is chunked in bands of ``row_chunk`` whole rows. ``read(indices)`` reads only the
    row chunks that the asked samples' patches overlap (sample ``i`` at ``(r, c)`` covers padded
    rows ``r .. r + H - 1``), keeps them in a row cache of at most ``row_cache_bytes`` (the
    oldest chunks are dropped first), and cuts the patches from them. So a rank reads only the
    rows its samples touch, and, as long as its rows fit the cache, each of them once per run.
    When the whole cube fits the cache (Samson: 6.1 MiB), the rows go into one cube-shaped
    buffer whose memory pages exist only where rows were read, and the patches of a read are
    cut from it in one vectorized gather; otherwise per band of chunks, oldest chunks dropped.

    Counters: ``samples_read`` (samples cut, as for :class:`HDF5Dataset`), ``chunks_read`` and
    ``rows_read`` (padded rows read from the file). Parameters are those of
    :class:`HDF5Dataset`, plus ``row_cache_bytes`` (default 512 MiB; 0 keeps no rows between
    reads).
    """

    def __init__(self, path: str | os.PathLike, split: str = "train", *, normalize: bool = True,
                 cache: bool = False, augment: bool = False, augment_seed: int = 0,
                 row_cache_bytes: int = 512 * 2**20, meta: dict | None = None):
        import h5py  # noqa: PLC0415

        self.path = str(path)
        meta = validate_layout(self.path) if meta is None else meta
        if meta.get("kind") != SCENE_KIND:
            raise LayoutError(self.path, "not a scene-backed layout file (use HDF5Dataset)")
        if split not in meta["splits"]:
            raise LayoutError(self.path, f"no split {split!r} (the file has: "
                                         f"{', '.join(meta['splits'])})")
        self.split = split
        self.meta = meta
        self._file = h5py.File(self.path, "r")
        self._cube = self._file["scene/cube"]
        self._pos = self._file[f"{split}/pos"][...].astype(np.int64)
        labels = self._file[f"{split}/y"][...]
        self.patch = int(meta["patch_size"])
        self.row_chunk = int(meta["row_chunk"])
        self.row_cache_bytes = int(row_cache_bytes)
        self._rows: dict[int, np.ndarray] = {}  # chunk index -> its padded rows, oldest first
        self._rows_bytes = 0
        self._dense = None  # the whole-cube buffer, when the cube fits row_cache_bytes
        self._loaded = None  # which chunks of it hold rows read from the file
        self.chunks_read = 0
        self.rows_read = 0
        self.normalize = bool(normalize)
        self._mean = np.asarray(meta["mean"], np.float32).reshape(1, -1, 1, 1)
        self._std = np.asarray(meta["std"], np.float32).reshape(1, -1, 1, 1)
        super().__init__(labels, meta["sample_shape"], meta["class_names"], cache=cache,
                         augment=augment, augment_seed=augment_seed,
                         name=f"{self.path}[{split}]")

    @property
    def positions(self) -> np.ndarray:
        """``(num_samples, 2)`` (row, col) of every sample's centre pixel in the scene."""
        return self._pos

    def _chunks(self, first: int, last: int) -> np.ndarray:
        """Padded rows of chunks ``first .. last`` (inclusive), read where not cached."""
        want = range(first, last + 1)
        missing = [k for k in want if k not in self._rows]
        rc, total = self.row_chunk, self._cube.shape[0]
        # Consecutive missing chunks are one slice read each.
        i = 0
        while i < len(missing):
            j = i
            while j + 1 < len(missing) and missing[j + 1] == missing[j] + 1:
                j += 1
            lo, hi = missing[i] * rc, min((missing[j] + 1) * rc, total)
            block = np.asarray(self._cube[lo:hi], dtype=np.float32)
            self.chunks_read += j - i + 1
            self.rows_read += hi - lo
            for k in range(missing[i], missing[j] + 1):
                part = block[(k - missing[i]) * rc:(k - missing[i] + 1) * rc]
                self._rows[k] = part
                self._rows_bytes += part.nbytes
            i = j + 1
        parts = [self._rows[k] for k in want]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def _evict(self, keep: set) -> None:
        for k in list(self._rows):
            if self._rows_bytes <= self.row_cache_bytes:
                break
            if k not in keep:
                self._rows_bytes -= self._rows.pop(k).nbytes

    def _load_dense(self, pos: np.ndarray) -> np.ndarray:
        """The whole-cube path: the row chunks the samples overlap are read into one
        cube-shaped buffer (its pages are only allocated where rows are written) and the
        patches cut from it in one vectorized gather."""
        rc, p = self.row_chunk, self.patch
        if self._dense is None:
            self._dense = np.empty(self._cube.shape, np.float32)
            self._loaded = np.zeros(-(-self._cube.shape[0] // rc), bool)
        first, last = pos[:, 0] // rc, (pos[:, 0] + p - 1) // rc
        need = np.zeros_like(self._loaded)
        for j in range(int((last - first).max()) + 1):
            need[(first + j)[first + j <= last]] = True
        missing = np.flatnonzero(need & ~self._loaded)
        if missing.size:
            breaks = np.flatnonzero(np.diff(missing) != 1) + 1
            total = self._cube.shape[0]
            for run in np.split(missing, breaks):  # one slice read per run of chunks
                lo, hi = int(run[0]) * rc, min((int(run[-1]) + 1) * rc, total)
                self._cube.read_direct(self._dense, np.s_[lo:hi], np.s_[lo:hi])
                self.chunks_read += run.size
                self.rows_read += hi - lo
            self._loaded[missing] = True
        return cut_patches(self._dense, pos, p)

    def _load_sorted(self, unique: np.ndarray) -> np.ndarray:
        pos = self._pos[unique]
        if self._cube.dtype == np.float32 and self._cube.size * 4 <= self.row_cache_bytes:
            x = self._load_dense(pos)
            if self.normalize:
                x -= self._mean
                x /= self._std
            return x
        rc, p = self.row_chunk, self.patch
        first = pos[:, 0] // rc  # the chunk of each patch's top row
        x = np.empty((unique.size, *self.sample_shape), dtype=np.float32)
        # Samples grouped by their first chunk: each group is cut from one band of rows (its
        # chunks, usually one or two), so only the rows the samples touch are read.
        order = np.argsort(first, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(first[order])) + 1)
        used = set()
        for sel in groups:
            k0 = int(first[sel[0]])
            k1 = int((pos[sel, 0].max() + p - 1) // rc)
            rows = self._chunks(k0, k1)
            used.update(range(k0, k1 + 1))
            x[sel] = cut_patches(rows, pos[sel], p, row0=k0 * rc)
            self._evict(used)
        if self.row_cache_bytes <= 0:
            self._rows.clear()
            self._rows_bytes = 0
        if self.normalize:
            x -= self._mean
            x /= self._std
        return x

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def open_dataset(path: str | os.PathLike, split: str = "train", normalize: bool = True,
                 cache: bool = False, augment: bool = False,
                 augment_seed: int = 0) -> HDF5Dataset | SceneDataset:
    """Open one split of a layout file (validated first; :class:`LayoutError` on a bad file):
    a :class:`SceneDataset` for a scene-backed file, else an :class:`HDF5Dataset`. Both give
    the same samples for the same conversion."""
    meta = validate_layout(path)
    if meta.get("kind") == SCENE_KIND:
        return SceneDataset(path, split, normalize=normalize, cache=cache, augment=augment,
                            augment_seed=augment_seed, meta=meta)
    return HDF5Dataset(path, split, normalize=normalize, cache=cache, augment=augment,
                       augment_seed=augment_seed)


def load_splits(path: str | os.PathLike, *, cache: bool = False, augment: bool = False,
                seed: int = 0) -> tuple[HDF5Dataset | SceneDataset, HDF5Dataset | SceneDataset, dict]:
    """``(train, test, meta)`` of a layout file.

    Augmentation (with ``seed``) applies to the training split only; ``meta`` is
    :func:`validate_layout`'s dict plus ``description`` (one line for logs). The test split is
    always cached: every evaluation reads the same shard on each rank, so after the first
    epoch it comes from memory (the shard's size, not the file's).
    """
    train = open_dataset(path, "train", cache=cache, augment=augment, augment_seed=seed)
    test = open_dataset(path, "test", cache=True)
    meta = dict(train.meta)
    meta["description"] = f"{path} ({meta['source']})"
    return train, test, meta


def synthetic_splits(seed: int = 0, *, rows: int = 64, cols: int = 64, bands: int = 32,
                     classes: int = 4, patch: int = 7, train_per_class: int | None = 512,
                     train_fraction: float | None = None, noise: float | None = None,
                     augment: bool = False, augment_seed: int = 0,
                     ) -> tuple[ArrayDataset, ArrayDataset, dict]:
    """The built-in synthetic scene as in-memory ``(train, test, meta)``: the default data.

    Deterministic in every argument. The scene (:func:`mpidl.data_tools.synthetic.make_scene`)
    is split stratified per class (``train_per_class`` samples of each class for training, or
    ``train_fraction`` of each class when that is given instead), and both splits are normalized with the TRAINING split's per-channel mean and std, exactly as a
    layout file would be. ``meta`` has the keys of :func:`validate_layout` (``path`` is None).
    See :mod:`mpidl.data_tools.synthetic` for the scene and what models reach on it.
    """
    if train_fraction is not None:
        train_per_class = None  # an explicit fraction replaces the default count
    scene, split = scene_splits(seed=seed, rows=rows, cols=cols, bands=bands, classes=classes,
                                patch=patch, train_fraction=train_fraction,
                                train_per_class=train_per_class, noise=noise)
    (x_train, y_train), (x_test, y_test) = split["train"][:2], split["test"][:2]
    mean, std = channel_stats(x_train)
    names = scene.class_names
    train = ArrayDataset(x_train, y_train, names, mean=mean, std=std, augment=augment,
                         augment_seed=augment_seed, name="synthetic[train]")
    test = ArrayDataset(x_test, y_test, names, mean=mean, std=std, name="synthetic[test]")
    meta = {
        "path": None,
        "class_names": names,
        "num_classes": len(names),
        "bands": bands,
        "patch_size": patch,
        "sample_shape": train.sample_shape,
        "source": scene.description,
        "description": f"built-in {scene.description}",
        "split_seed": seed,
        "mean": mean,
        "std": std,
        "layout_version": LAYOUT_VERSION,
        "splits": {"train": train.num_samples, "test": test.num_samples},
    }
    return train, test, meta
