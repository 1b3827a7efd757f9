"""Train/test splits: stratified per class, at random or by spatially disjoint blocks.

Both functions take the labels of the labelled samples (``labels : (n,)`` in ``[0, K)``) and
return ``(train_idx, test_idx)``, index arrays into those samples, each shuffled with the
seed (so a contiguous slice of a written split is a random sample of it). Every class must
end with at least one training and one test sample; otherwise a ValueError names the class.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def check_split_options(train_fraction: float | None, train_per_class: int | None) -> None:
    """Refuse bad split options before any file is read."""
    if train_fraction is not None and train_per_class is not None:
        raise ValueError("give either --train-fraction or --train-per-class, not both")
    if train_fraction is not None and not 0.0 < float(train_fraction) < 1.0:
        raise ValueError(f"--train-fraction must be in (0, 1), got {train_fraction}")
    if train_per_class is not None and int(train_per_class) < 1:
        raise ValueError(f"--train-per-class must be at least 1, got {train_per_class}")


def train_counts(class_sizes: Sequence[int], class_names: Sequence[str],
                 train_fraction: float | None = None, train_per_class: int | None = None
                 ) -> np.ndarray:
    """How many samples of each class go to training.

    Notes
    -----
    With a fraction ``f``: ``n_train[k] = floor(f * n[k] + 1/2)`` (round half up), clipped to
    ``[1, n[k] - 1]`` so both splits see every class. With a per-class count ``m``:
    ``n_train[k] = m``, which needs ``n[k] >= m + 1``.
    """
    check_split_options(train_fraction, train_per_class)
    if train_fraction is None and train_per_class is None:
        raise ValueError("give --train-fraction or --train-per-class")
    counts = []
    for name, size in zip(class_names, class_sizes):
        size = int(size)
        if train_per_class is not None:
            if size < train_per_class + 1:
                raise ValueError(f"class {name!r} has {size} labelled sample(s); "
                                 f"--train-per-class {train_per_class} needs at least "
                                 f"{train_per_class + 1} (one left for the test split)")
            counts.append(int(train_per_class))
        else:
            if size < 2:
                raise ValueError(f"class {name!r} has {size} labelled sample(s); the split needs "
                                 f"at least 2 (one for training, one for testing)")
            counts.append(min(max(math.floor(train_fraction * size + 0.5), 1), size - 1))
    return np.asarray(counts, dtype=np.int64)


def random_split(labels: np.ndarray, class_names: Sequence[str], *, seed: int = 0,
                 train_fraction: float | None = None, train_per_class: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Stratified random split: per class, a random ``n_train[k]`` of its samples train."""
    labels = np.asarray(labels)
    sizes = np.bincount(labels, minlength=len(class_names))
    n_train = train_counts(sizes, class_names, train_fraction, train_per_class)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for k in range(len(class_names)):
        members = rng.permutation(np.flatnonzero(labels == k))
        train.append(members[: n_train[k]])
        test.append(members[n_train[k]:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def block_split(labels: np.ndarray, positions: np.ndarray, class_names: Sequence[str], *,
                block_size: int, seed: int = 0, train_fraction: float | None = None,
                train_per_class: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split by spatially disjoint square blocks: every block is wholly train or wholly test.

    ``positions : (n, 2)`` (row, col) of each sample. The scene is tiled into
    ``block_size x block_size`` blocks; blocks are visited in a random order and a block goes
    to training while its majority class still has fewer training samples than the target of
    :func:`train_counts`. Whole blocks make the achieved fractions approximate (the printed
    class table shows them). Patches near a block edge still see pixels of the neighbouring
    block, as unlabelled context; only labels are kept apart.
    """
    if block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {block_size}")
    labels = np.asarray(labels)
    positions = np.asarray(positions)
    k_classes = len(class_names)
    sizes = np.bincount(labels, minlength=k_classes)
    target = train_counts(sizes, class_names, train_fraction, train_per_class)
    block_rc = positions // block_size
    _, block_of = np.unique(block_rc, axis=0, return_inverse=True)
    block_of = block_of.reshape(-1)
    num_blocks = int(block_of.max()) + 1
    # counts[b, k] = samples of class k in block b
    counts = np.zeros((num_blocks, k_classes), np.int64)
    np.add.at(counts, (block_of, labels), 1)
    rng = np.random.default_rng(seed)
    in_train = np.zeros(num_blocks, bool)
    have = np.zeros(k_classes, np.int64)
    for b in rng.permutation(num_blocks):
        major = int(np.argmax(counts[b]))
        if have[major] < target[major]:
            in_train[b] = True
            have += counts[b]
    train_mask = in_train[block_of]
    for k, name in enumerate(class_names):
        n_tr = int(np.sum(train_mask & (labels == k)))
        if n_tr == 0 or n_tr == sizes[k]:
            where = "training" if n_tr == 0 else "test"
            raise ValueError(f"class {name!r}: blocks of {block_size} x {block_size} pixels leave "
                             f"no {where} samples ({sizes[k]} samples in all); use a smaller "
                             f"--block-size or --split random")
    return rng.permutation(np.flatnonzero(train_mask)), rng.permutation(np.flatnonzero(~train_mask))


def class_table(class_names: Sequence[str], y_train: np.ndarray, y_test: np.ndarray) -> str:
    """The class table printed by the converters: name, train, test (and totals)."""
    k = len(class_names)
    tr = np.bincount(y_train, minlength=k)
    te = np.bincount(y_test, minlength=k)
    width = max(5, *(len(n) for n in class_names))
    lines = [f"{'class':<{width}}  {'train':>7}  {'test':>7}"]
    lines += [f"{n:<{width}}  {a:>7d}  {b:>7d}" for n, a, b in zip(class_names, tr, te)]
    lines.append(f"{'total':<{width}}  {tr.sum():>7d}  {te.sum():>7d}")
    return "\n".join(lines)
