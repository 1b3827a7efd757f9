"""Softmax + cross-entropy, fused."""

from __future__ import annotations

import numpy as np

from mpidl.backend import get_array_module

__all__ = ["SoftmaxCrossEntropy"]


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
