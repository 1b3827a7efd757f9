"""Losses: softmax + cross-entropy (fused), binary cross-entropy with logits, mean squared error.

Each is an object with ``forward(prediction, target) -> float`` (the MEAN loss) and
``backward() -> dL/dprediction``, the contract the training loops use."""

from __future__ import annotations

import numpy as np

from mpidl.engine.backend import get_array_module

__all__ = ["SoftmaxCrossEntropy", "BCEWithLogits", "MSELoss"]


class SoftmaxCrossEntropy:
    """Mean cross-entropy of the softmax of ``logits`` against integer ``labels``.

    Shapes
    ------
    logits : (N, K) floats; labels : (N,) integers in ``[0, K)`` -> loss : Python float

    Notes
    -----
    With ``m_n = max_k z[n, k]`` (subtracted so that ``exp`` never overflows),
    ``log p[n, k] = z[n, k] - m_n - log(sum_j exp(z[n, j] - m_n))`` and
    ``L = -(1/N) * sum_n log p[n, labels[n]]``.
    Fusing the two makes the gradient simple and stable: ``dL/dz = (p - onehot(labels)) / N``,
    the gradient of the local MEAN loss (the reducer weighs ranks by their sample counts).
    Saved for backward: ``p`` and ``labels``.
    """

    def __init__(self) -> None:
        self._probs = None
        self._labels = None

    def forward(self, logits, labels) -> float:
        xp = get_array_module(logits)
        if logits.ndim != 2 or logits.shape[0] < 1:
            raise ValueError(f"logits must be (N, K) with N >= 1, got {tuple(logits.shape)}")
        n, k = logits.shape
        if not hasattr(labels, "shape"):  # a list or tuple of ints
            labels = np.asarray(labels)
        if labels.shape != (n,) or labels.dtype.kind not in "iu":
            raise ValueError(f"labels must be integers of shape ({n},), got {labels.dtype} {tuple(labels.shape)}")
        # Range check on the host when the labels are there (the trainer passes host labels):
        # on device labels it would cost two GPU->host synchronisations per step.
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= k:
            raise ValueError(f"labels must lie in [0, {k}), got values in [{low}, {high}]")
        labels = xp.asarray(labels)

        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        rows = xp.arange(n)
        loss = -log_probs[rows, labels].mean()
        self._probs, self._labels = xp.exp(log_probs), labels
        return float(loss)

    def backward(self):
        """``dL/dlogits : (N, K) = (softmax(logits) - onehot(labels)) / N``."""
        if self._probs is None:
            raise RuntimeError("SoftmaxCrossEntropy.backward called before forward")
        xp = get_array_module(self._probs)
        n = self._probs.shape[0]
        dlogits = self._probs.copy()
        dlogits[xp.arange(n), self._labels] -= 1
        dlogits /= n
        return dlogits

    __call__ = forward


def _check_pair(name: str, prediction, target):
    """Same shape, floating, at least one element; the target moved to the prediction's xp."""
    xp = get_array_module(prediction)
    if prediction.dtype.kind != "f" or prediction.size < 1:
        raise ValueError(f"{name}: the prediction must be a non-empty float array, got "
                         f"{prediction.dtype} {tuple(prediction.shape)}")
    if not hasattr(target, "shape"):
        target = np.asarray(target, dtype=prediction.dtype)
    if tuple(target.shape) != tuple(prediction.shape):
        raise ValueError(f"{name}: target of shape {tuple(target.shape)} does not match the "
                         f"prediction's {tuple(prediction.shape)}")
    return xp, xp.asarray(target, dtype=prediction.dtype)


class BCEWithLogits:
    """Mean binary cross-entropy of ``sigmoid(z)`` against targets ``y`` in [0, 1], from the
    logits ``z`` (like ``torch.nn.BCEWithLogitsLoss`` with ``reduction='mean'``).

    Shapes
    ------
    logits : any shape, M elements; targets : the same shape -> loss : Python float

    Notes
    -----
    Per element, ``l = -(y log s + (1 - y) log(1 - s))`` with ``s = sigmoid(z)``, written in
    the form that never overflows nor takes the log of 0::

        l = max(z, 0) - z * y + log(1 + exp(-|z|))

    (``log1p`` of a number in (0, 1]). ``L = (1/M) sum l`` and ``dL/dz = (s - y) / M``, with
    ``s`` computed from ``e = exp(-|z|)`` as ``1 / (1 + e)`` for ``z >= 0`` and
    ``e / (1 + e)`` otherwise. Saved for backward: ``s`` and ``y``.
    """

    def __init__(self) -> None:
        self._sigmoid = None
        self._target = None

    def forward(self, logits, targets) -> float:
        xp, y = _check_pair("BCEWithLogits", logits, targets)
        e = xp.exp(-xp.abs(logits))
        loss = xp.maximum(logits, 0) - logits * y + xp.log1p(e)
        self._sigmoid = xp.where(logits >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(logits.dtype, copy=False)
        self._target = y
        return float(loss.mean())

    def backward(self):
        """``dL/dz = (sigmoid(z) - y) / M``, the shape of the logits."""
        if self._sigmoid is None:
            raise RuntimeError("BCEWithLogits.backward called before forward")
        return (self._sigmoid - self._target) / self._sigmoid.size

    __call__ = forward


class MSELoss:
    """Mean squared error (like ``torch.nn.MSELoss`` with ``reduction='mean'``).

    Shapes
    ------
    prediction : any shape, M elements; target : the same shape -> loss : Python float

    Notes
    -----
    ``L = (1/M) sum (x - y)^2`` and ``dL/dx = 2 (x - y) / M``. Saved for backward: ``x - y``.
    """

    def __init__(self) -> None:
        self._diff = None

    def forward(self, prediction, target) -> float:
        xp, y = _check_pair("MSELoss", prediction, target)
        self._diff = prediction - y
        return float((self._diff * self._diff).mean())

    def backward(self):
        """``dL/dx = 2 (x - y) / M``."""
        if self._diff is None:
            raise RuntimeError("MSELoss.backward called before forward")
        return self._diff * (2.0 / self._diff.size)

    __call__ = forward
