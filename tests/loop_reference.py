"""Direct nested-loop NumPy definitions of the layers, for tests on tiny shapes only.

Each function is the textbook formula written as loops, with no vectorization tricks, so
that the vectorized kernels and layers can be checked against something obviously right.
"""

from __future__ import annotations

import numpy as np


def out_size(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def im2col_loops(x, kh, kw, stride, pad):
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = out_size(h_, kh, stride, pad), out_size(w_, kw, stride, pad)
    cols = np.zeros((c_ * kh * kw, n_ * oh_ * ow_), dtype=x.dtype)
    for c in range(c_):
        for i in range(kh):
            for j in range(kw):
                for n in range(n_):
                    for oh in range(oh_):
                        for ow in range(ow_):
                            h, w = oh * stride + i - pad, ow * stride + j - pad
                            if 0 <= h < h_ and 0 <= w < w_:
                                cols[(c * kh + i) * kw + j, (n * oh_ + oh) * ow_ + ow] = x[n, c, h, w]
    return cols


def conv2d_loops(x, weight, bias, stride, pad):
    """``y[n, f, oh, ow] = b[f] + sum_{c,i,j} W[f, c, i, j] x[n, c, oh*s + i - p, ow*s + j - p]``."""
    n_, c_, h_, w_ = x.shape
    f_, _, kh, kw = weight.shape
    oh_, ow_ = out_size(h_, kh, stride, pad), out_size(w_, kw, stride, pad)
    y = np.zeros((n_, f_, oh_, ow_), dtype=np.float64)
    for n in range(n_):
        for f in range(f_):
            for oh in range(oh_):
                for ow in range(ow_):
                    total = 0.0 if bias is None else float(bias[f])
                    for c in range(c_):
                        for i in range(kh):
                            for j in range(kw):
                                h, w = oh * stride + i - pad, ow * stride + j - pad
                                if 0 <= h < h_ and 0 <= w < w_:
                                    total += float(weight[f, c, i, j]) * float(x[n, c, h, w])
                    y[n, f, oh, ow] = total
    return y


def conv2d_backward_loops(x, weight, dy, stride, pad):
    """``(dx, dW, db)`` of the convolution, each by its own defining sum."""
    n_, c_, h_, w_ = x.shape
    f_, _, kh, kw = weight.shape
    _, _, oh_, ow_ = dy.shape
    dx = np.zeros(x.shape)
    dw = np.zeros(weight.shape)
    db = dy.sum(axis=(0, 2, 3)).astype(np.float64)
    for n in range(n_):
        for f in range(f_):
            for oh in range(oh_):
                for ow in range(ow_):
                    g = float(dy[n, f, oh, ow])
                    for c in range(c_):
                        for i in range(kh):
                            for j in range(kw):
                                h, w = oh * stride + i - pad, ow * stride + j - pad
                                if 0 <= h < h_ and 0 <= w < w_:
                                    dw[f, c, i, j] += g * float(x[n, c, h, w])
                                    dx[n, c, h, w] += g * float(weight[f, c, i, j])
    return dx, dw, db


def maxpool_loops(x, k, stride, pad):
    """``(y, argmax)``; the first maximum in row-major window order wins."""
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = out_size(h_, k, stride, pad), out_size(w_, k, stride, pad)
    y = np.zeros((n_, c_, oh_, ow_), dtype=x.dtype)
    argmax = np.zeros((n_, c_, oh_, ow_), dtype=np.int32)
    for n in range(n_):
        for c in range(c_):
            for oh in range(oh_):
                for ow in range(ow_):
                    best, where = -np.inf, -1
                    for i in range(k):
                        for j in range(k):
                            h, w = oh * stride + i - pad, ow * stride + j - pad
                            if 0 <= h < h_ and 0 <= w < w_ and (where < 0 or x[n, c, h, w] > best):
                                best, where = x[n, c, h, w], h * w_ + w
                    y[n, c, oh, ow], argmax[n, c, oh, ow] = best, where
    return y, argmax


def maxpool_backward_loops(dy, argmax, x_shape):
    n_, c_, h_, w_ = x_shape
    dx = np.zeros(x_shape, dtype=np.float64)
    for n, c, oh, ow in np.ndindex(*dy.shape):
        index = argmax[n, c, oh, ow]
        dx[n, c, index // w_, index % w_] += dy[n, c, oh, ow]
    return dx


def avgpool_loops(x, k, stride, pad):
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = out_size(h_, k, stride, pad), out_size(w_, k, stride, pad)
    y = np.zeros((n_, c_, oh_, ow_), dtype=np.float64)
    for n, c, oh, ow in np.ndindex(*y.shape):
        total = 0.0
        for i in range(k):
            for j in range(k):
                h, w = oh * stride + i - pad, ow * stride + j - pad
                if 0 <= h < h_ and 0 <= w < w_:
                    total += float(x[n, c, h, w])
        y[n, c, oh, ow] = total / (k * k)
    return y


def avgpool_backward_loops(dy, x_shape, k, stride, pad):
    n_, c_, h_, w_ = x_shape
    dx = np.zeros(x_shape, dtype=np.float64)
    for n, c, oh, ow in np.ndindex(*dy.shape):
        for i in range(k):
            for j in range(k):
                h, w = oh * stride + i - pad, ow * stride + j - pad
                if 0 <= h < h_ and 0 <= w < w_:
                    dx[n, c, h, w] += float(dy[n, c, oh, ow]) / (k * k)
    return dx


def linear_loops(x, weight, bias):
    n_, d_ = x.shape
    k_ = weight.shape[0]
    y = np.zeros((n_, k_))
    for n in range(n_):
        for k in range(k_):
            y[n, k] = sum(float(x[n, d]) * float(weight[k, d]) for d in range(d_)) + (0.0 if bias is None else float(bias[k]))
    return y


def softmax_cross_entropy_loops(logits, labels):
    """``(mean loss, dlogits)`` computed row by row with ``math``-style scalar code."""
    import math

    n_, k_ = logits.shape
    loss = 0.0
    grad = np.zeros((n_, k_))
    for n in range(n_):
        row = [float(v) for v in logits[n]]
        top = max(row)
        denominator = sum(math.exp(v - top) for v in row)
        for k in range(k_):
            p = math.exp(row[k] - top) / denominator
            grad[n, k] = (p - (1.0 if k == labels[n] else 0.0)) / n_
        loss -= (row[labels[n]] - top - math.log(denominator)) / n_
    return loss, grad
