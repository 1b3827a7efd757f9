"""Batch normalization (+ ReLU) as Numba CPU kernels: the same functions as
:mod:`mpidl.kernels.batchnorm_reference` (math there), in two passes over the data each way.

The NumPy layer makes about ten passes per direction with a temporary array each (centered,
squared, xhat, scaled, shifted; the ReLU's mask and product). Here forward reads ``x`` twice
for the statistics (mean, then centered squares) and once more to write ``y`` with the
ReLU applied; backward reads ``dy, x, y`` once for ``dbeta, dgamma`` and once to write ``dx``;
nothing else is allocated. One ``prange`` iteration per channel (each owns its statistics and
its planes of the output, so no two threads write the same element); the sums are float64,
with reassociation allowed (``fastmath={"reassoc"}``) so the loops vectorize; the element-wise
passes are written ``a*x + b`` per channel.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["batchnorm_forward", "batchnorm_backward"]

_SUM = {"reassoc", "contract"}


@njit(parallel=True, cache=True, fastmath=_SUM)
def _statistics(x, mean, var):
    n_size, c_size, h_size, w_size = x.shape
    count = n_size * h_size * w_size
    for c in prange(c_size):
        total = 0.0
        for n in range(n_size):
            for h in range(h_size):
                for w in range(w_size):
                    total += np.float64(x[n, c, h, w])
        mu = total / count
        squares = 0.0
        for n in range(n_size):
            for h in range(h_size):
                for w in range(w_size):
                    d = np.float64(x[n, c, h, w]) - mu
                    squares += d * d
        mean[c] = mu
        var[c] = squares / count


@njit(parallel=True, cache=True, fastmath={"contract"})
def _affine(x, scale, shift, relu, y):
    n_size, c_size, h_size, w_size = x.shape
    for c in prange(c_size):
        a = x.dtype.type(scale[c])
        b = x.dtype.type(shift[c])
        for n in range(n_size):
            for h in range(h_size):
                for w in range(w_size):
                    v = a * x[n, c, h, w] + b
                    if relu and v < 0:
                        v = 0
                    y[n, c, h, w] = v


@njit(parallel=True, cache=True, fastmath=_SUM)
def _gradient_sums(dy, x, y, mean, relu, dgamma_raw, dbeta):
    """``dbeta = sum(g)``, ``dgamma_raw = sum(g * (x - mean))`` per channel."""
    n_size, c_size, h_size, w_size = x.shape
    for c in prange(c_size):
        mu = mean[c]
        sg = 0.0
        sgx = 0.0
        for n in range(n_size):
            for h in range(h_size):
                for w in range(w_size):
                    g = np.float64(dy[n, c, h, w])
                    if relu and not y[n, c, h, w] > 0:
                        g = 0.0
                    sg += g
                    sgx += g * (np.float64(x[n, c, h, w]) - mu)
        dbeta[c] = sg
        dgamma_raw[c] = sgx


@njit(parallel=True, cache=True, fastmath={"contract"})
def _input_gradient(dy, x, y, relu, a, b, c0, dx):
    """``dx = a*g + b*x + c0`` per channel (``g`` = ``dy`` through the ReLU's mask)."""
    n_size, c_size, h_size, w_size = x.shape
    for c in prange(c_size):
        ac = dx.dtype.type(a[c])
        bc = dx.dtype.type(b[c])
        cc = dx.dtype.type(c0[c])
        for n in range(n_size):
            for h in range(h_size):
                for w in range(w_size):
                    g = dy[n, c, h, w]
                    if relu and not y[n, c, h, w] > 0:
                        g = 0
                    dx[n, c, h, w] = ac * g + bc * x[n, c, h, w] + cc


def _contiguous(a):
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def batchnorm_forward(x, gamma, beta, eps: float, relu: bool = False, stats=None):
    x = _contiguous(x)
    c = x.shape[1]
    if stats is None:
        mean, var = np.empty(c), np.empty(c)
        _statistics(x, mean, var)
    else:
        mean, var = (np.asarray(s, dtype=np.float64) for s in stats)
    scale = gamma.astype(np.float64) / np.sqrt(var + eps)
    shift = beta.astype(np.float64) - mean * scale
    y = np.empty_like(x)
    _affine(x, scale, shift, bool(relu), y)
    return y, mean, var


def batchnorm_backward(dy, x, y, gamma, mean, var, eps: float, relu: bool = False, batch_stats: bool = True):
    dy, x = _contiguous(dy), _contiguous(x)
    y = _contiguous(y) if relu else x  # not read without the ReLU
    c = x.shape[1]
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = np.asarray(mean, dtype=np.float64)
    inv_std = 1.0 / np.sqrt(np.asarray(var, dtype=np.float64) + eps)
    dgamma_raw, dbeta = np.empty(c), np.empty(c)
    _gradient_sums(dy, x, y, mean, bool(relu), dgamma_raw, dbeta)
    dgamma = dgamma_raw * inv_std
    scale = gamma.astype(np.float64) * inv_std
    if batch_stats:
        # dx = scale*(g - dbeta/M - (x - mean)*inv_std*dgamma/M) = a*g + b*x + c0
        b = -scale * inv_std * dgamma / count
        c0 = -scale * dbeta / count - b * mean
    else:
        b, c0 = np.zeros(c), np.zeros(c)
    dx = np.empty_like(dy)
    _input_gradient(dy, x, y, bool(relu), scale, b, c0, dx)
    return dx, dgamma, dbeta
