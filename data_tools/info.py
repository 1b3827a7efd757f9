"""Print what a layout file holds, and validate it.

    python -m mpidl.data_tools info samson.h5 [--verify]

Prints the sample shape, the splits, the class balance per split, the stored training
statistics and the converter's attributes. An invalid file prints ``error: FILE: problem``
and exits with code 1; so do NaN or Inf sample values (every split is read in blocks, and the
message names the split, how many values and samples, and the first such sample), and so
does anything else ``mpidl.train`` refuses in a data file (an empty test split:
:func:`mpidl.data.layout.check_trainable`, the same check and words).
``--verify`` also checks that the stored mean/std are the training split's statistics (they
must be: the reader normalizes with them) and that the stored content ``fingerprint``
matches the file's contents.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from mpidl.data.layout import REQUIRED_ATTRS, LayoutError, check_trainable, validate_layout
from mpidl.data.layout import SCENE_KIND, channel_stats, file_fingerprint, nonfinite_problem, scan_nonfinite
from mpidl.data.layout import scene_channel_stats


def _fmt_range(values: np.ndarray) -> str:
    return f"[{values.min():.4g} .. {values.max():.4g}] over {values.size} channels"


def describe(path: str, verify: bool = False) -> str:
    """The report printed by ``info`` (raises :class:`~mpidl.data.layout.LayoutError` if invalid)."""
    import h5py  # noqa: PLC0415

    meta = validate_layout(path)
    problems = []
    for split in meta["splits"]:
        samples, values, first = scan_nonfinite(path, split)
        if samples:
            problems.append(nonfinite_problem(split, samples, values, first))
    if problems:
        raise LayoutError(path, "; ".join(problems))
    check_trainable(meta)  # what training refuses, info refuses with the same words
    names = meta["class_names"]
    k = len(names)
    lines = [f"file         {path} ({os.path.getsize(path) / 2**20:.1f} MiB), layout version "
             f"{meta['layout_version']}",
             f"source       {meta['source']}"]
    scene = meta.get("kind") == SCENE_KIND
    with h5py.File(path, "r") as f:
        if scene:
            cube = f["scene/cube"]
            lines.append(f"storage      scene-backed: padded cube {' x '.join(map(str, cube.shape))} "
                         f"(rows x cols x bands), {cube.dtype}, chunks of {meta['row_chunk']} rows; "
                         f"patches cut on read")
            lines.append(f"samples      {' x '.join(map(str, meta['sample_shape']))} (C x H x W), "
                         f"patch_size {meta['patch_size']}")
        else:
            x = f["train/x"]
            lines.append(f"samples      {' x '.join(map(str, meta['sample_shape']))} (C x H x W), "
                         f"{x.dtype}, chunks {x.chunks}, patch_size {meta['patch_size']}")
        lines.append(f"split seed   {meta['split_seed']}")
        counts = {s: np.bincount(f[f"{s}/y"][...], minlength=k) for s in meta["splits"]}
        width = max(5, *(len(n) for n in names))
        header = f"{'class':<{width}}" + "".join(f"  {s:>7}" for s in counts)
        lines += ["", header]
        for i, name in enumerate(names):
            lines.append(f"{name:<{width}}" + "".join(f"  {c[i]:>7d}" for c in counts.values()))
        lines.append(f"{'total':<{width}}" + "".join(f"  {c.sum():>7d}" for c in counts.values()))
        lines.append("")
        lines.append(f"train mean   {_fmt_range(meta['mean'])}")
        lines.append(f"train std    {_fmt_range(meta['std'])}")
        extra = {key: f.attrs[key] for key in f.attrs if key not in REQUIRED_ATTRS}
        key_width = max([12, *(len(key) for key in extra)])
        for key, value in sorted(extra.items()):
            value = value.decode() if isinstance(value, bytes) else value
            lines.append(f"{key:<{key_width}} {value}")
        if verify:
            if scene:
                mean, std = scene_channel_stats(f["scene/cube"], f["train/pos"][...],
                                                meta["patch_size"])
            else:
                mean, std = channel_stats(f["train/x"][...])
            dev = max(np.max(np.abs(mean - meta["mean"]) / meta["std"]),
                      np.max(np.abs(std / meta["std"] - 1)))
            if dev > 1e-4:
                raise LayoutError(path, f"stored mean/std are not the training split's statistics "
                                        f"(relative deviation {dev:.3g})")
            lines.append(f"verified     stored mean/std match the training split "
                         f"(relative deviation {dev:.1e})")
            stored = f.attrs.get("fingerprint")
            if stored is not None:
                stored = stored.decode() if isinstance(stored, bytes) else str(stored)
                actual = file_fingerprint(path)
                if actual != stored:
                    raise LayoutError(path, f"the stored fingerprint {stored} is not the contents' "
                                            f"({actual}): the file was changed after conversion")
                lines.append("verified     the stored fingerprint matches the contents")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="an HDF5 file in the mpidl layout")
    p.add_argument("--verify", action="store_true",
                   help="also recompute the training statistics and compare")


def run(args: argparse.Namespace) -> int:
    print(describe(args.file, verify=args.verify))
    return 0
