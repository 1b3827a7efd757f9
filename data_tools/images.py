"""A folder of class sub-folders of images -> dataset in the mpidl layout (needs Pillow).

    python -m mpidl.data_tools images --folder scenes/ --size 32 --train-fraction 0.8 --out scenes.h5

``FOLDER/<class name>/<image>``: each sub-folder is a class (classes sorted by name); files
ending in .png, .jpg, .jpeg, .tif, .tiff or .bmp are images, other files are ignored.
Each image is converted to ``--mode`` (RGB: 3 channels, L: 1), resized to
``size x size`` (bilinear) and scaled to [0, 1]: a sample is ``(channels, size, size)``.
An image that cannot be decoded is skipped and counted (``--on-bad-image skip``, the
default) or stops the conversion (``--on-bad-image error``). The split is stratified random.

Pillow is an optional extra: ``pip install 'mpidl[images]'``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import numpy as np

from mpidl.data.layout import write_layout
from mpidl.data_tools.sources import InputError
from mpidl.data_tools.splits import check_split_options, class_table, random_split

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
MODES = {"RGB": 3, "L": 1}


class MissingDependencyError(ImportError):
    """An optional dependency is needed for this converter."""


def _pillow():
    try:
        from PIL import Image  # noqa: PLC0415 - optional extra
    except ImportError as exc:
        raise MissingDependencyError(
            "the images converter needs Pillow, an optional extra: "
            "pip install 'mpidl[images]' (or pip install pillow)") from exc
    return Image


@dataclass
class ImageConversion:
    path: str
    meta: dict
    table: str
    skipped: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [self.table]
        if self.skipped:
            shown = ", ".join(self.skipped[:5]) + (" ..." if len(self.skipped) > 5 else "")
            lines.append(f"skipped {len(self.skipped)} image(s) that could not be decoded: {shown}")
        size = self.meta["patch_size"]
        lines.append(f"wrote {self.path}: {self.meta['splits']['train']} train and "
                     f"{self.meta['splits']['test']} test images of {self.meta['bands']} x "
                     f"{size} x {size}")
        return "\n".join(lines)


def list_images(folder: str) -> tuple[list[str], list[tuple[str, int]]]:
    """``(class_names, [(file, class index), ...])`` of an image folder, both sorted."""
    if not os.path.exists(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    if not os.path.isdir(folder):
        raise InputError(folder, "is not a folder (expected one sub-folder of images per class)")
    classes = sorted(d for d in os.listdir(folder)
                     if not d.startswith(".") and os.path.isdir(os.path.join(folder, d)))
    if len(classes) < 2:
        raise InputError(folder, f"found {len(classes)} class sub-folder(s) {classes}; need at "
                                 f"least 2 (one sub-folder of images per class)")
    files = []
    for k, name in enumerate(classes):
        sub = os.path.join(folder, name)
        for f in sorted(os.listdir(sub)):
            if f.lower().endswith(IMAGE_SUFFIXES) and os.path.isfile(os.path.join(sub, f)):
                files.append((os.path.join(sub, f), k))
    return classes, files


def load_image(path: str, size: int, mode: str = "RGB") -> np.ndarray:
    """One image -> ``(channels, size, size)`` float32 in [0, 1]; raises InputError if it
    cannot be decoded."""
    image_module = _pillow()
    try:
        with image_module.open(path) as im:
            im.load()  # decode now: a truncated file fails here, not later
            im = im.convert(mode).resize((size, size), image_module.BILINEAR)
            arr = np.asarray(im, dtype=np.float32) / 255.0
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's errors for bad files
        raise InputError(path, f"cannot decode image ({exc.__class__.__name__}: {exc})") from exc
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))  # HWC -> CHW


def convert_images(folder: str, out: str | os.PathLike, *, size: int = 32, mode: str = "RGB",
                   train_fraction: float | None = None, train_per_class: int | None = None,
                   seed: int = 0, on_bad_image: str = "skip") -> ImageConversion:
    """Convert an image folder to a layout file (see the module doc); options are checked
    before any image is read and the output is written atomically."""
    if size < 1:
        raise ValueError(f"--size must be positive, got {size}")
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if on_bad_image not in ("skip", "error"):
        raise ValueError(f"--on-bad-image must be skip or error, got {on_bad_image!r}")
    if train_fraction is None and train_per_class is None:
        train_fraction = 0.8
    check_split_options(train_fraction, train_per_class)
    _pillow()  # fail early, before listing thousands of files
    classes, files = list_images(folder)
    samples, labels, skipped = [], [], []
    for path, k in files:
        try:
            samples.append(load_image(path, size, mode))
        except InputError:
            if on_bad_image == "error":
                raise
            skipped.append(os.path.relpath(path, folder))
            continue
        labels.append(k)
    y = np.asarray(labels, dtype=np.int64)
    if y.size == 0:
        raise InputError(folder, f"no decodable images (looked for {', '.join(IMAGE_SUFFIXES)})")
    x = np.stack(samples)
    train_idx, test_idx = random_split(y, classes, seed=seed, train_fraction=train_fraction,
                                       train_per_class=train_per_class)
    splits = {"train": (x[train_idx], y[train_idx]), "test": (x[test_idx], y[test_idx])}
    attrs = {"image_mode": mode, "skipped_images": len(skipped),
             "train_fraction": train_fraction, "train_per_class": train_per_class}
    meta = write_layout(out, splits, classes, source=f"images: {os.path.abspath(folder)}",
                        patch_size=size, split_seed=seed, attrs=attrs)
    table = class_table(classes, y[train_idx], y[test_idx])
    return ImageConversion(os.fspath(out), meta, table, skipped)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--folder", required=True, help="folder with one sub-folder of images per class")
    p.add_argument("--size", type=int, default=32, help="images are resized to SIZE x SIZE (default 32)")
    p.add_argument("--mode", choices=tuple(MODES), default="RGB", help="RGB (3 channels) or L (1)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--train-fraction", type=float, default=None,
                       help="fraction of each class for training, in (0, 1) (default 0.8)")
    group.add_argument("--train-per-class", type=int, default=None,
                       help="number of training images per class")
    p.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    p.add_argument("--on-bad-image", choices=("skip", "error"), default="skip",
                   help="skip (and count) images that cannot be decoded, or stop")
    p.add_argument("--out", required=True, help="output HDF5 file")


def run(args: argparse.Namespace) -> int:
    result = convert_images(args.folder, args.out, size=args.size, mode=args.mode,
                            train_fraction=args.train_fraction,
                            train_per_class=args.train_per_class, seed=args.seed,
                            on_bad_image=args.on_bad_image)
    print(result.report())
    return 0
