"""Hyperspectral cube + ground truth -> patch dataset in the mpidl layout.

    python -m mpidl.data_tools hsi --cube Samson.mat --abundances _EndSamson.mat \\
        --patch 7 --train-fraction 0.2 --out samson.h5

Inputs
------
cube
    ``(rows, cols, bands)``, or a ``(bands, pixels)`` matrix (``(pixels, bands)`` is also
    recognised) with the image size from ``--rows/--cols`` or from the variables
    ``nRow``/``nCol`` of the same file. Pixels of a matrix are numbered column by column
    (MATLAB/Fortran order, ``--pixel-order F``, the default): pixel ``p`` lies at row
    ``p % rows``, column ``p // rows``. ``--pixel-order C`` numbers them row by row.
ground truth, one of
    ``--labels FILE[:KEY]``: a class map ``(rows, cols)`` (or a pixel vector), 0 = unlabelled,
    each other value a class (renumbered 0..K-1 in increasing order);
    ``--abundances FILE[:KEY]``: ``(endmembers, pixels)``, ``(pixels, endmembers)`` or
    ``(rows, cols, endmembers)``; a pixel's class is its dominant endmember
    ``argmax_k A[k, p]``, and pixels whose largest abundance is below ``--min-abundance`` are
    left unlabelled. Class names come from ``--class-names``, else from a ``cood`` variable
    (the benchmark files' endmember names), else ``class<id>`` / ``endmember<k>``.

Samples
-------
One sample per labelled pixel: the ``patch x patch`` window centred on it, all bands,
``(bands, patch, patch)``, with the scene padded by ``patch // 2`` pixels (``--pad-mode``
reflect | constant (zeros) | edge) so border pixels get full patches.

Storage (``--storage``)
-----------------------
``patches`` stores every sample (each pixel copied into up to ``patch^2`` patches);
``scene`` stores the padded cube once plus the labelled pixels' positions and labels, and the
reader cuts the patches (:func:`mpidl.data.layout.write_scene_layout`, the same samples bit for
bit); ``auto`` (the default) writes whichever is smaller, i.e. ``scene`` unless few pixels
are labelled.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mpidl.data.layout import write_layout, write_scene_layout
from mpidl.data_tools.sources import ArrayFile, InputError, clean_name, parse_source
from mpidl.data_tools.splits import block_split, check_split_options, class_table, random_split

PAD_MODES = ("reflect", "constant", "edge")
#: --storage: 'auto' writes the smaller of the two layout variants (see choose_storage)
STORAGES = ("auto", "scene", "patches")


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------
def check_patch(patch: int) -> None:
    if int(patch) != patch or patch < 1 or patch % 2 == 0:
        raise ValueError(f"--patch must be an odd positive size (the patch is centred on its "
                         f"pixel), got {patch}")


def pixels_to_image(matrix: np.ndarray, rows: int, cols: int, order: str = "F") -> np.ndarray:
    """``(pixels, d)`` -> ``(rows, cols, d)``.

    Notes
    -----
    Order ``'F'`` (MATLAB): pixel ``p`` at ``(p % rows, p // rows)``. Order ``'C'``: pixel
    ``p`` at ``(p // cols, p % cols)``.
    """
    d = matrix.shape[1]
    if order == "F":
        return matrix.reshape(cols, rows, d).transpose(1, 0, 2)
    if order == "C":
        return matrix.reshape(rows, cols, d)
    raise ValueError(f"--pixel-order must be F or C, got {order!r}")


def extract_patches(cube: np.ndarray, positions: np.ndarray, patch: int,
                    pad_mode: str = "reflect") -> np.ndarray:
    """Patches centred on ``positions``: ``cube : (rows, cols, bands)``, ``positions : (n, 2)``
    (row, col) -> ``(n, bands, patch, patch)`` float32 (NCHW).

    Notes
    -----
    ``out[i, b, u, v] = padded[r_i + u, c_i + v, b]`` where ``padded`` is the cube padded by
    ``patch // 2`` on each side with ``pad_mode``; i.e. the pixel ``(r_i, c_i)`` sits at the
    patch centre ``(patch // 2, patch // 2)``.
    """
    check_patch(patch)
    if pad_mode not in PAD_MODES:
        raise ValueError(f"--pad-mode must be one of {', '.join(PAD_MODES)}, got {pad_mode!r}")
    half = patch // 2
    padded = np.pad(cube, ((half, half), (half, half), (0, 0)), mode=pad_mode)
    # windows[r, c] is the (bands, patch, patch) patch centred on pixel (r, c): a strided view,
    # so only the selected patches are copied.
    windows = np.lib.stride_tricks.sliding_window_view(padded, (patch, patch), axis=(0, 1))
    positions = np.asarray(positions, dtype=np.int64).reshape(-1, 2)
    return np.ascontiguousarray(windows[positions[:, 0], positions[:, 1]], dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def _size_from_file(source: ArrayFile, names: Sequence[str]) -> int | None:
    for name in names:
        if source.has(name):
            value = np.asarray(source.load(name)).reshape(-1)
            if value.size == 1:
                return int(value[0])
    return None


def load_cube(spec: str, rows: int | None = None, cols: int | None = None,
              pixel_order: str = "F") -> tuple[np.ndarray, str]:
    """The cube as ``(rows, cols, bands)`` float32, and a description ``FILE:KEY``."""
    path, key = parse_source(spec)
    source = ArrayFile(path)
    key = source.pick(key, (2, 3), "cube")
    data = np.asarray(source.load(key))
    if data.dtype.kind not in "biuf":
        raise InputError(path, f"variable {key!r} is not numeric ({data.dtype})")
    if data.ndim == 3:
        cube = data
    elif data.ndim == 2:
        rows = rows or _size_from_file(source, ("nRow", "nrow", "rows"))
        cols = cols or _size_from_file(source, ("nCol", "ncol", "cols"))
        if rows is None or cols is None:
            raise InputError(path, f"variable {key!r} is a {data.shape[0]} x {data.shape[1]} "
                                   f"matrix; give the image size with --rows and --cols (no "
                                   f"nRow/nCol in the file)")
        pixels = rows * cols
        if data.shape[1] == pixels:
            matrix = data.T  # (bands, pixels): the usual unmixing layout
        elif data.shape[0] == pixels:
            matrix = data
        else:
            raise InputError(path, f"variable {key!r} is {data.shape[0]} x {data.shape[1]} but "
                                   f"the image is {rows} x {cols} = {pixels} pixels")
        cube = pixels_to_image(matrix, rows, cols, pixel_order)
    else:
        raise InputError(path, f"variable {key!r} has shape {data.shape}; expected "
                               f"(rows, cols, bands) or (bands, pixels)")
    cube = np.asarray(cube, dtype=np.float32)
    if not np.all(np.isfinite(cube)):
        raise InputError(path, f"variable {key!r} contains NaN or infinite values")
    return cube, f"{path}:{key}"


@dataclass
class GroundTruth:
    labels: np.ndarray  # (rows, cols) int64: class 0..K-1, or -1 = unlabelled
    class_names: list[str]
    description: str
    notes: list[str] = field(default_factory=list)


def _size_mismatch(path: str, key: str, shape: tuple, rows: int, cols: int,
                   cube_desc: str) -> InputError:
    return InputError(path, f"ground truth {key!r} has shape {shape} but the cube {cube_desc} is "
                            f"{rows} x {cols} pixels")


def _class_map_image(data: np.ndarray, path: str, key: str, rows: int, cols: int, order: str,
                     cube_desc: str) -> np.ndarray:
    """A class map ``(rows, cols)`` or a pixel vector ``(pixels,)`` -> ``(rows, cols)``."""
    if data.shape == (rows, cols):
        return data
    if data.size == rows * cols and (data.ndim == 1 or 1 in data.shape):
        return pixels_to_image(data.reshape(-1, 1), rows, cols, order)[:, :, 0]
    raise _size_mismatch(path, key, data.shape, rows, cols, cube_desc)


def _abundance_image(data: np.ndarray, path: str, key: str, rows: int, cols: int, order: str,
                     cube_desc: str) -> np.ndarray:
    """``(K, pixels)``, ``(pixels, K)`` or ``(rows, cols, K)`` -> ``(rows, cols, K)``."""
    pixels = rows * cols
    if data.ndim == 3 and data.shape[:2] == (rows, cols):
        return data
    if data.ndim == 2 and data.shape[1] == pixels:
        return pixels_to_image(data.T, rows, cols, order)
    if data.ndim == 2 and data.shape[0] == pixels:
        return pixels_to_image(data, rows, cols, order)
    raise _size_mismatch(path, key, data.shape, rows, cols, cube_desc)


def load_labels(spec: str, rows: int, cols: int, pixel_order: str, cube_desc: str,
                class_names: Sequence[str] | None = None) -> GroundTruth:
    """A class map: 0 = unlabelled, other values are classes (renumbered in increasing order)."""
    path, key = parse_source(spec)
    source = ArrayFile(path)
    key = source.pick(key, (1, 2), "class map")
    data = np.asarray(source.load(key))
    if data.dtype.kind not in "biuf" or not np.all(np.isfinite(data)) \
            or np.any(data != np.round(data)) or np.any(data < 0):
        raise InputError(path, f"class map {key!r} must hold non-negative integers "
                               f"(0 = unlabelled)")
    image = _class_map_image(data, path, key, rows, cols, pixel_order, cube_desc).astype(np.int64)
    ids = np.unique(image[image > 0])
    if ids.size < 2:
        raise InputError(path, f"class map {key!r} has {ids.size} class(es); need at least 2")
    if class_names is not None and len(class_names) != ids.size:
        raise ValueError(f"--class-names lists {len(class_names)} names but {path}:{key} has "
                         f"{ids.size} classes (ids {ids.tolist()})")
    names = list(class_names) if class_names is not None else [f"class{i}" for i in ids]
    labels = np.full(image.shape, -1, np.int64)
    labels[image > 0] = np.searchsorted(ids, image[image > 0])
    return GroundTruth(labels, names, f"{path}:{key}")


def load_abundances(spec: str, rows: int, cols: int, pixel_order: str, cube_desc: str,
                    min_abundance: float | None = None,
                    class_names: Sequence[str] | None = None) -> GroundTruth:
    """Abundances -> class map: ``class(p) = argmax_k A[k, p]``, unlabelled where
    ``max_k A[k, p] < min_abundance``."""
    path, key = parse_source(spec)
    source = ArrayFile(path)
    key = source.pick(key, (2, 3), "abundance matrix")
    data = np.asarray(source.load(key))
    if data.dtype.kind not in "biuf":
        raise InputError(path, f"abundance variable {key!r} is not numeric ({data.dtype})")
    image = _abundance_image(data.astype(np.float64), path, key, rows, cols, pixel_order, cube_desc)
    k = image.shape[2]
    if k < 2:
        raise InputError(path, f"abundance variable {key!r} has {k} endmember(s); need at least 2")
    notes = []
    if class_names is not None:
        if len(class_names) != k:
            raise ValueError(f"--class-names lists {len(class_names)} names but {path}:{key} has "
                             f"{k} endmembers")
        names = list(class_names)
    elif source.has("cood") and source.variables["cood"].kind in ("text", "cell"):
        names = [clean_name(n) for n in source.load("cood")]
        if len(names) != k:
            notes.append(f"ignored 'cood' ({len(names)} names for {k} endmembers)")
            names = [f"endmember{i + 1}" for i in range(k)]
    else:
        names = [f"endmember{i + 1}" for i in range(k)]
    labels = np.argmax(image, axis=2).astype(np.int64)
    if min_abundance is not None:
        weak = image.max(axis=2) < min_abundance
        labels[weak] = -1
        notes.append(f"{int(weak.sum())} pixel(s) below --min-abundance {min_abundance} "
                     f"left unlabelled")
    return GroundTruth(labels, names, f"{path}:{key}", notes)


# --------------------------------------------------------------------------------------------
# The conversion
# --------------------------------------------------------------------------------------------
@dataclass
class ConversionResult:
    path: str
    meta: dict
    table: str
    notes: list[str]

    def report(self) -> str:
        shape = " x ".join(map(str, self.meta["sample_shape"]))
        lines = [*self.notes, self.table,
                 f"wrote {self.path}: {self.meta['splits']['train']} train and "
                 f"{self.meta['splits']['test']} test samples of {shape} (bands x patch x patch)"]
        return "\n".join(lines)


def convert_hsi(cube: str, out: str | os.PathLike, *, labels: str | None = None,
                abundances: str | None = None, min_abundance: float | None = None,
                class_names: Sequence[str] | None = None, rows: int | None = None,
                cols: int | None = None, pixel_order: str = "F", patch: int = 7,
                pad_mode: str = "reflect", train_fraction: float | None = None,
                train_per_class: int | None = None, split: str = "random",
                block_size: int | None = None, seed: int = 0,
                storage: str = "auto") -> ConversionResult:
    """Convert a cube and its ground truth to a layout file at ``out`` (see the module doc).

    Every option is checked before any file is read, and the output is written atomically,
    so an error never leaves a file behind.
    """
    # ---- options first: cheap, and nothing is read or written when they are wrong ----
    check_patch(patch)
    if pad_mode not in PAD_MODES:
        raise ValueError(f"--pad-mode must be one of {', '.join(PAD_MODES)}, got {pad_mode!r}")
    if (labels is None) == (abundances is None):
        raise ValueError("give exactly one ground truth: --labels or --abundances")
    if min_abundance is not None and not 0.0 <= min_abundance <= 1.0:
        raise ValueError(f"--min-abundance must be in [0, 1], got {min_abundance}")
    if min_abundance is not None and abundances is None:
        raise ValueError("--min-abundance applies to --abundances only")
    if train_fraction is None and train_per_class is None:
        train_fraction = 0.2
    check_split_options(train_fraction, train_per_class)
    if split not in ("random", "blocks"):
        raise ValueError(f"--split must be random or blocks, got {split!r}")
    if storage not in STORAGES:
        raise ValueError(f"--storage must be one of {', '.join(STORAGES)}, got {storage!r}")
    if pixel_order not in ("F", "C"):
        raise ValueError(f"--pixel-order must be F or C, got {pixel_order!r}")
    for name, value in (("--rows", rows), ("--cols", cols)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if block_size is None:
        block_size = max(8, 2 * patch)

    # ---- inputs ----
    data, cube_desc = load_cube(cube, rows, cols, pixel_order)
    n_rows, n_cols = data.shape[:2]
    if labels is not None:
        truth = load_labels(labels, n_rows, n_cols, pixel_order, cube_desc, class_names)
    else:
        truth = load_abundances(abundances, n_rows, n_cols, pixel_order, cube_desc,
                                min_abundance, class_names)
    notes = list(truth.notes)

    # ---- split and patches ----
    positions = np.argwhere(truth.labels >= 0)  # (n, 2) row-major order of labelled pixels
    y_all = truth.labels[positions[:, 0], positions[:, 1]]
    names = truth.class_names
    if split == "random":
        train_idx, test_idx = random_split(y_all, names, seed=seed, train_fraction=train_fraction,
                                           train_per_class=train_per_class)
    else:
        train_idx, test_idx = block_split(y_all, positions, names, block_size=block_size, seed=seed,
                                          train_fraction=train_fraction,
                                          train_per_class=train_per_class)
    attrs = {
        "cube": cube_desc, "ground_truth": truth.description,
        "ground_truth_kind": "labels" if labels is not None else "abundances",
        "scene_shape": np.array([n_rows, n_cols], np.int64), "pixel_order": pixel_order,
        "pad_mode": pad_mode, "split_mode": split,
        "train_fraction": train_fraction, "train_per_class": train_per_class,
        "block_size": int(block_size) if split == "blocks" else None,
    }
    source_text = f"hsi: {cube_desc} + {truth.description}"
    kind = choose_storage(storage, n_rows, n_cols, data.shape[2], patch, positions.shape[0])
    if kind == "scene":
        half = patch // 2
        padded = np.pad(data, ((half, half), (half, half), (0, 0)), mode=pad_mode)
        meta = write_scene_layout(out, padded, {name: (positions[idx], y_all[idx]) for name, idx
                                                in (("train", train_idx), ("test", test_idx))},
                                  names, patch_size=patch, source=source_text, split_seed=seed,
                                  attrs=attrs)
        notes.append(f"storage: scene-backed ({storage_note(n_rows, n_cols, data.shape[2], patch, positions.shape[0])})")
    else:
        splits = {}
        for name, idx in (("train", train_idx), ("test", test_idx)):
            pos = positions[idx]
            splits[name] = (extract_patches(data, pos, patch, pad_mode), y_all[idx], pos)
        meta = write_layout(out, splits, names, source=source_text,
                            patch_size=patch, split_seed=seed, attrs=attrs)
        meta["sample_shape"] = splits["train"][0].shape[1:]
        if storage == "auto":
            notes.append(f"storage: patches ({storage_note(n_rows, n_cols, data.shape[2], patch, positions.shape[0])})")
    table = class_table(names, y_all[train_idx], y_all[test_idx])
    return ConversionResult(os.fspath(out), meta, table, notes)


def storage_bytes(rows: int, cols: int, bands: int, patch: int, samples: int) -> dict:
    """Bytes of the samples of each storage variant: ``patches`` = N * bands * patch^2 * 4,
    ``scene`` = (rows + 2h)(cols + 2h) * bands * 4 with h = patch // 2 (float32; labels and
    positions, the same few bytes per sample in both, left out)."""
    half = patch // 2
    return {"patches": int(samples) * bands * patch * patch * 4,
            "scene": (rows + 2 * half) * (cols + 2 * half) * bands * 4}


def storage_note(rows: int, cols: int, bands: int, patch: int, samples: int) -> str:
    size = storage_bytes(rows, cols, bands, patch, samples)
    return (f"samples take {size['scene'] / 2**20:.1f} MiB as a padded cube, "
            f"{size['patches'] / 2**20:.1f} MiB as patches")


def choose_storage(storage: str, rows: int, cols: int, bands: int, patch: int, samples: int) -> str:
    """``'scene'`` or ``'patches'``: ``storage`` itself, or for ``'auto'`` the smaller one
    (:func:`storage_bytes`; a tie goes to patches, which need no cutting on read)."""
    if storage != "auto":
        return storage
    size = storage_bytes(rows, cols, bands, patch, samples)
    return "scene" if size["scene"] < size["patches"] else "patches"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def add_split_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--train-fraction", type=float, default=None,
                       help="fraction of each class used for training, in (0, 1) (default 0.2)")
    group.add_argument("--train-per-class", type=int, default=None,
                       help="number of training samples per class")
    p.add_argument("--seed", type=int, default=0, help="split seed (default 0)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cube", required=True, metavar="FILE[:KEY]",
                   help="hyperspectral cube (.mat v5/v7.3, .npy, .npz)")
    truth = p.add_mutually_exclusive_group(required=True)
    truth.add_argument("--labels", metavar="FILE[:KEY]", help="class map, 0 = unlabelled")
    truth.add_argument("--abundances", metavar="FILE[:KEY]",
                       help="abundance matrix; class = dominant endmember")
    p.add_argument("--min-abundance", type=float, default=None,
                   help="leave pixels whose largest abundance is below this unlabelled")
    p.add_argument("--class-names", default=None, help="comma-separated class names")
    p.add_argument("--rows", type=int, default=None, help="image rows of a (bands, pixels) cube")
    p.add_argument("--cols", type=int, default=None, help="image columns of a (bands, pixels) cube")
    p.add_argument("--pixel-order", choices=("F", "C"), default="F",
                   help="pixel numbering of a matrix: F = column by column (MATLAB, default)")
    p.add_argument("--patch", type=int, default=7, help="odd patch size (default 7)")
    p.add_argument("--pad-mode", choices=PAD_MODES, default="reflect",
                   help="border padding of the scene (default reflect)")
    add_split_arguments(p)
    p.add_argument("--split", choices=("random", "blocks"), default="random",
                   help="random pixels, or spatially disjoint blocks")
    p.add_argument("--block-size", type=int, default=None,
                   help="block side in pixels for --split blocks (default max(8, 2*patch))")
    p.add_argument("--storage", choices=STORAGES, default="auto",
                   help="scene: store the padded cube once and cut patches on read; patches: "
                        "store every patch; auto: the smaller of the two (default auto)")
    p.add_argument("--out", required=True, help="output HDF5 file")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.class_names.split(",")] if args.class_names else None
    result = convert_hsi(args.cube, args.out, labels=args.labels, abundances=args.abundances,
                         min_abundance=args.min_abundance, class_names=names, rows=args.rows,
                         cols=args.cols, pixel_order=args.pixel_order, patch=args.patch,
                         pad_mode=args.pad_mode, train_fraction=args.train_fraction,
                         train_per_class=args.train_per_class, split=args.split,
                         block_size=args.block_size, seed=args.seed, storage=args.storage)
    print(result.report())
    return 0
