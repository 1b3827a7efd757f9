"""Classification metrics built on the confusion matrix.

Evaluation in a data-parallel run is split across ranks, each classifying its own share of
the test set. Accuracies and kappa are not averages of per-rank values, but the confusion
matrix is a plain count, so the per-rank matrices simply add up: one ``MPI.SUM`` Allreduce of
a (K, K) int64 array gives the global matrix, and every metric below is computed from it
exactly as if one process had seen all the samples. (This module imports no MPI; the trainer
does the Allreduce.)

The metrics are the three reported in remote-sensing classification papers: overall accuracy
(OA), average accuracy (AA, the mean per-class recall) and Cohen's kappa.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidl.engine.backend import get_array_module, to_host

__all__ = [
    "confusion_matrix",
    "overall_accuracy",
    "average_accuracy",
    "per_class_recall",
    "cohen_kappa",
    "classification_report",
]


def _check_labels(name: str, labels: Any, num_classes: int):
    if labels.ndim != 1:
        raise ValueError(f"{name} must be 1-D (N,), got shape {labels.shape}")
    if labels.size == 0:
        return
    if labels.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer class labels, got dtype {labels.dtype}")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"{name} has labels in [{low}, {high}], outside [0, {num_classes - 1}] "
            f"for num_classes={num_classes}"
        )


def confusion_matrix(y_true: Any, y_pred: Any, num_classes: int) -> np.ndarray:
    """Count (true class, predicted class) pairs.

    Parameters
    ----------
    y_true : (N,) integer xp array, labels in [0, K)
    y_pred : (N,) integer xp array, labels in [0, K)
    num_classes : int K >= 1

    Returns
    -------
    cm : (K, K) int64 NumPy array on the host; ``cm[i, j]`` = number of samples of true
        class ``i`` predicted as ``j`` (rows true, columns predicted). N = 0 gives zeros, so a
        rank with no test samples still contributes to the Allreduce.

    Notes
    -----
    ``cm[i, j] = #{n : y_true[n] = i and y_pred[n] = j}``, computed as one ``bincount`` of
    ``y_true * K + y_pred`` (on the device when the labels are CuPy arrays).
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be an integer >= 1, got {num_classes!r}")
    K = int(num_classes)
    xp = get_array_module(y_true)
    y_true = xp.asarray(y_true)
    y_pred = xp.asarray(y_pred)
    if y_true.shape != y_pred.shape:
        raise ValueError(f"y_true and y_pred differ in shape: {y_true.shape} vs {y_pred.shape}")
    _check_labels("y_true", y_true, K)
    _check_labels("y_pred", y_pred, K)
    if y_true.size == 0:
        return np.zeros((K, K), dtype=np.int64)
    pair_index = y_true.astype(np.int64) * K + y_pred.astype(np.int64)
    counts = xp.bincount(pair_index, minlength=K * K)
    return to_host(counts).astype(np.int64, copy=False).reshape(K, K)


def _check_cm(cm: Any) -> np.ndarray:
    cm = to_host(cm)
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1]:
        raise ValueError(f"confusion matrix must be square (K, K), got shape {cm.shape}")
    if cm.dtype.kind not in "iu":
        raise ValueError(f"confusion matrix must hold integer counts, got dtype {cm.dtype}")
    if cm.size and cm.min() < 0:
        raise ValueError("confusion matrix has negative counts")
    if cm.sum() == 0:
        raise ValueError("confusion matrix is empty (no samples were counted)")
    return cm.astype(np.int64, copy=False)


def overall_accuracy(cm: Any) -> float:
    """Fraction of all samples classified correctly.

    Parameters
    ----------
    cm : (K, K) integer confusion matrix (rows true, columns predicted)

    Notes
    -----
    ``OA = sum_k cm[k, k] / sum_ij cm[i, j]``, in [0, 1].
    """
    cm = _check_cm(cm)
    return float(np.trace(cm) / cm.sum())


def per_class_recall(cm: Any) -> list[float | None]:
    """Recall of each class: the fraction of its samples predicted as itself.

    Parameters
    ----------
    cm : (K, K) integer confusion matrix (rows true, columns predicted)

    Returns
    -------
    list of K values; ``None`` for a class with no true samples (its recall is undefined;
    None rather than NaN keeps the report valid JSON).

    Notes
    -----
    ``recall_k = cm[k, k] / sum_j cm[k, j]`` for every class k with ``sum_j cm[k, j] > 0``.
    """
    cm = _check_cm(cm)
    support = cm.sum(axis=1)
    return [float(cm[k, k] / support[k]) if support[k] > 0 else None for k in range(cm.shape[0])]


def average_accuracy(cm: Any) -> float:
    """Mean per-class recall over the classes present in ``y_true`` (balanced accuracy).

    Parameters
    ----------
    cm : (K, K) integer confusion matrix (rows true, columns predicted)

    Notes
    -----
    ``AA = (1 / |C|) * sum_{k in C} cm[k, k] / sum_j cm[k, j]``, with ``C`` the classes whose
    row sum is > 0. Unlike OA it weighs every class equally, so a classifier that ignores a
    rare class is penalised.
    """
    recalls = [r for r in per_class_recall(cm) if r is not None]
    return float(sum(recalls) / len(recalls))


def cohen_kappa(cm: Any) -> float:
    """Cohen's kappa: agreement between truth and prediction beyond chance.

    Parameters
    ----------
    cm : (K, K) integer confusion matrix (rows true, columns predicted)

    Notes
    -----
    With ``n = sum_ij cm[i, j]``, row sums ``r_k`` and column sums ``c_k``::

        p_o   = sum_k cm[k, k] / n                 (observed agreement = OA)
        p_e   = sum_k r_k * c_k / n^2              (agreement expected by chance)
        kappa = (p_o - p_e) / (1 - p_e)

    evaluated as ``(n * trace - sum_k r_k c_k) / (n^2 - sum_k r_k c_k)`` in exact integer
    arithmetic. kappa = 1 for perfect prediction, about 0 at chance level, < 0 below it.
    When ``p_e = 1`` (truth and prediction are all the same single class) the ratio is 0/0;
    that case is perfect agreement and is returned as 1.0.
    """
    cm = _check_cm(cm)
    # Python integers: n^2 can exceed int64 on very large test sets.
    n = int(cm.sum())
    trace = int(np.trace(cm))
    chance = sum(int(r) * int(c) for r, c in zip(cm.sum(axis=1), cm.sum(axis=0)))
    denominator = n * n - chance
    if denominator == 0:
        return 1.0
    return (n * trace - chance) / denominator


def classification_report(cm: Any) -> dict[str, Any]:
    """All the metrics of one confusion matrix, JSON-serialisable.

    Parameters
    ----------
    cm : (K, K) integer confusion matrix (rows true, columns predicted)

    Returns
    -------
    dict with ``oa`` (float), ``aa`` (float), ``kappa`` (float), ``per_class_recall``
    (list of K float or None, see :func:`per_class_recall`), ``support`` (list of K int, the
    true samples of each class) and ``num_samples`` (int).
    """
    cm = _check_cm(cm)
    return {
        "oa": overall_accuracy(cm),
        "aa": average_accuracy(cm),
        "kappa": cohen_kappa(cm),
        "per_class_recall": per_class_recall(cm),
        "support": [int(s) for s in cm.sum(axis=1)],
        "num_samples": int(cm.sum()),
    }
