"""Confusion matrix and the metrics built on it (mpidl/app/metrics.py), on hand-computed examples
and against scikit-learn when it is installed (skipped otherwise)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpidl.engine.backend import gpu_unavailable_reason
from mpidl.app.metrics import (
    average_accuracy,
    classification_report,
    cohen_kappa,
    confusion_matrix,
    overall_accuracy,
    per_class_recall,
)

# Four classes; class 3 never occurs in y_true but is predicted once.
Y_TRUE = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
Y_PRED = np.array([0, 0, 1, 1, 2, 2, 2, 2, 0, 3])
# By hand (rows true, columns predicted):
CM = np.array([
    [2, 1, 0, 0],
    [0, 1, 1, 0],
    [1, 0, 3, 1],
    [0, 0, 0, 0],
])
# OA = (2 + 1 + 3) / 10; recalls 2/3, 1/2, 3/5 (class 3 absent); AA = their mean = 53/90;
# rows r = (3, 2, 5, 0), columns c = (3, 2, 4, 1): p_e = (9 + 4 + 20 + 0) / 100 = 0.33,
# kappa = (0.6 - 0.33) / (1 - 0.33) = 27/67.


def test_confusion_matrix_by_hand():
    cm = confusion_matrix(Y_TRUE, Y_PRED, num_classes=4)
    assert cm.dtype == np.int64 and cm.shape == (4, 4)
    np.testing.assert_array_equal(cm, CM)


def test_metrics_by_hand():
    assert overall_accuracy(CM) == pytest.approx(0.6)
    assert per_class_recall(CM) == pytest.approx([2 / 3, 1 / 2, 3 / 5, None])
    assert per_class_recall(CM)[3] is None
    assert average_accuracy(CM) == pytest.approx(53 / 90)
    assert cohen_kappa(CM) == pytest.approx(27 / 67)


def test_classification_report_is_complete_and_json_serialisable():
    report = classification_report(CM)
    assert set(report) == {"oa", "aa", "kappa", "per_class_recall", "support", "num_samples"}
    assert report["oa"] == pytest.approx(0.6)
    assert report["aa"] == pytest.approx(53 / 90)
    assert report["kappa"] == pytest.approx(27 / 67)
    assert report["support"] == [3, 2, 5, 0]
    assert report["num_samples"] == 10
    assert json.loads(json.dumps(report, allow_nan=False))["per_class_recall"][3] is None


def test_per_rank_matrices_sum_to_the_global_one():
    # What the trainer's Allreduce relies on: counts over disjoint shards add up, including
    # a shard with no samples at all (a rank that got none of the test set).
    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 5, size=101)
    y_pred = rng.integers(0, 5, size=101)
    shards = np.split(np.arange(101), [0, 30, 31, 77])  # the first shard is empty
    total = sum(confusion_matrix(y_true[s], y_pred[s], 5) for s in shards)
    np.testing.assert_array_equal(total, confusion_matrix(y_true, y_pred, 5))
    assert total.dtype == np.int64


def test_empty_input_gives_zero_matrix():
    cm = confusion_matrix(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 3)
    np.testing.assert_array_equal(cm, np.zeros((3, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="empty"):
        overall_accuracy(cm)


def test_perfect_prediction():
    y = np.array([0, 1, 2, 2, 1, 0, 2])
    report = classification_report(confusion_matrix(y, y, 3))
    assert report["oa"] == 1.0 and report["aa"] == 1.0 and report["kappa"] == 1.0


def test_single_class_perfect_prediction_has_kappa_one():
    # p_e = 1 makes kappa 0/0; the agreement is perfect, so it is reported as 1.
    y = np.zeros(6, dtype=np.int64)
    cm = confusion_matrix(y, y, 3)
    assert cohen_kappa(cm) == 1.0
    assert average_accuracy(cm) == 1.0  # classes 1 and 2 are absent and do not count


def test_chance_and_worse_than_chance():
    # Predictions independent of the truth: p_o = p_e, kappa = 0 (OA is still 0.5).
    chance = np.array([[25, 25], [25, 25]])
    assert cohen_kappa(chance) == 0.0
    assert overall_accuracy(chance) == 0.5 and average_accuracy(chance) == 0.5
    # Always wrong on two balanced classes: p_o = 0, p_e = 0.5, kappa = -1.
    assert cohen_kappa(np.array([[0, 5], [5, 0]])) == -1.0


def test_always_predicting_the_majority_class():
    # OA looks good, AA and kappa expose it: recalls (1, 0) -> AA 0.5; p_o = p_e = 0.9 -> kappa 0.
    y_true = np.array([0] * 9 + [1])
    cm = confusion_matrix(y_true, np.zeros(10, dtype=np.int64), 2)
    assert overall_accuracy(cm) == pytest.approx(0.9)
    assert average_accuracy(cm) == pytest.approx(0.5)
    assert cohen_kappa(cm) == pytest.approx(0.0, abs=1e-15)


def test_large_counts_do_not_overflow():
    # n^2 exceeds int64 here; kappa is computed with Python integers.
    big = 4_000_000_000
    cm = np.array([[big, 0], [0, big]], dtype=np.int64)
    assert cohen_kappa(cm) == 1.0
    cm[0, 1] = big
    assert cohen_kappa(cm) == pytest.approx(cohen_kappa(np.array([[1, 1], [0, 1]])))


def test_against_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    y_true = rng.integers(0, 6, size=500)
    y_pred = np.where(rng.random(500) < 0.7, y_true, rng.integers(0, 6, size=500))
    cm = confusion_matrix(y_true, y_pred, 6)
    np.testing.assert_array_equal(cm, metrics.confusion_matrix(y_true, y_pred, labels=range(6)))
    assert overall_accuracy(cm) == pytest.approx(metrics.accuracy_score(y_true, y_pred))
    assert average_accuracy(cm) == pytest.approx(metrics.balanced_accuracy_score(y_true, y_pred))
    assert cohen_kappa(cm) == pytest.approx(metrics.cohen_kappa_score(y_true, y_pred))


@pytest.mark.parametrize("y_true,y_pred,num_classes,match", [
    (Y_TRUE, Y_PRED[:-1], 4, "differ in shape"),
    (Y_TRUE, Y_PRED, 3, r"y_pred has labels in \[0, 3\], outside \[0, 2\]"),
    (Y_TRUE - 1, Y_PRED, 4, r"y_true has labels in \[-1, 1\]"),
    (Y_TRUE.astype(float), Y_PRED, 4, "y_true must hold integer class labels"),
    (Y_TRUE.reshape(2, 5), Y_PRED.reshape(2, 5), 4, "must be 1-D"),
    (Y_TRUE, Y_PRED, 0, "num_classes must be an integer >= 1"),
    (Y_TRUE, Y_PRED, 4.0, "num_classes must be an integer >= 1"),
])
def test_confusion_matrix_refuses_bad_input(y_true, y_pred, num_classes, match):
    with pytest.raises(ValueError, match=match):
        confusion_matrix(y_true, y_pred, num_classes)


@pytest.mark.parametrize("cm,match", [
    (np.ones((2, 3), dtype=np.int64), "square"),
    (np.ones((2, 2)), "integer counts"),
    (np.array([[1, -1], [0, 1]]), "negative"),
    (np.zeros((2, 2), dtype=np.int64), "empty"),
])
def test_metrics_refuse_bad_matrices(cm, match):
    for metric in (overall_accuracy, average_accuracy, cohen_kappa, classification_report):
        with pytest.raises(ValueError, match=match):
            metric(cm)


@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason=str(gpu_unavailable_reason()))
def test_confusion_matrix_of_device_arrays():
    import cupy

    cm = confusion_matrix(cupy.asarray(Y_TRUE), cupy.asarray(Y_PRED), 4)
    assert isinstance(cm, np.ndarray) and cm.dtype == np.int64
    np.testing.assert_array_equal(cm, CM)
