"""Batch normalization (+ ReLU) as Numba CPU kernels: the same functions as
:mod:`mpidl.kernels.batchnorm_reference` (math there), in two passes over the data each way.

The NumPy layer makes about ten passes per direction with a temporary array each (centered,
squared, xhat, scaled, shifted; the ReLU's mask and product). Here forward reads ``x`` twice
for the statistics (mean, then centered squares) and once more to write ``y`` with the
ReLU applied; backward reads ``dy, x, y`` once for ``dbeta, dgamma`` and once to write ``dx``;
nothing else is allocated. One ``prange`` iteration per channel (each owns its statistics and
its planes of the output, so no two threads write the same element); the sums are float64,
with reassociation allowed (``fastmath={"reassoc"}``) so the loops vectorize; the element-wise
passes are written ``a*x + b`` per channel. The kernels take ``(N, C, H*W)`` views, so each
innermost loop runs over one contiguous ``(n, c)`` row of ``H*W`` elements, which LLVM
vectorizes (loops over ``h`` and ``w`` of a 4-D array were 1.4-2.5x slower at 32x32 down to 8x8).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["batchnorm_forward", "batchnorm_backward"]

_SUM = {"reassoc", "contract"}


@njit(parallel=True, cache=True, fastmath=_SUM)
def _statistics(x, mean, var):
    # x : (N, C, H*W), each (n, c) row contiguous
    n_size, c_size, hw_size = x.shape
    count = n_size * hw_size
    for c in prange(c_size):
        total = 0.0
        for n in range(n_size):
            row = x[n, c]
            for i in range(hw_size):
                total += np.float64(row[i])
        mu = total / count
        squares = 0.0
        for n in range(n_size):
            row = x[n, c]
            for i in range(hw_size):
                d = np.float64(row[i]) - mu
                squares += d * d
        mean[c] = mu
        var[c] = squares / count


@njit(parallel=True, cache=True, fastmath={"contract"})
def _affine(x, scale, shift, relu, y):
    n_size, c_size, hw_size = x.shape
    for c in prange(c_size):
        a = x.dtype.type(scale[c])
        b = x.dtype.type(shift[c])
        zero = x.dtype.type(0)
        for n in range(n_size):
            src, dst = x[n, c], y[n, c]
            if relu:
                for i in range(hw_size):
                    v = a * src[i] + b
                    dst[i] = zero if v < 0 else v  # a NaN passes, as in the reference
            else:
                for i in range(hw_size):
                    dst[i] = a * src[i] + b


@njit(parallel=True, cache=True, fastmath=_SUM)
def _gradient_sums(dy, x, y, mean, relu, dgamma_raw, dbeta):
    """``dbeta = sum(g)``, ``dgamma_raw = sum(g * (x - mean))`` per channel."""
    n_size, c_size, hw_size = x.shape
    for c in prange(c_size):
        mu = mean[c]
        sg = 0.0
        sgx = 0.0
        for n in range(n_size):
            grad, src, out = dy[n, c], x[n, c], y[n, c]
            for i in range(hw_size):
                g = np.float64(grad[i])
                if relu and not out[i] > 0:
                    g = 0.0
                sg += g
                sgx += g * (np.float64(src[i]) - mu)
        dbeta[c] = sg
        dgamma_raw[c] = sgx


@njit(parallel=True, cache=True, fastmath={"contract"})
def _input_gradient(dy, x, y, relu, a, b, c0, dx):
    """``dx = a*g + b*x + c0`` per channel (``g`` = ``dy`` through the ReLU's mask)."""
    n_size, c_size, hw_size = x.shape
    for c in prange(c_size):
        ac = dx.dtype.type(a[c])
        bc = dx.dtype.type(b[c])
        cc = dx.dtype.type(c0[c])
        zero = dx.dtype.type(0)
        for n in range(n_size):
            grad, src, out, dst = dy[n, c], x[n, c], y[n, c], dx[n, c]
            for i in range(hw_size):
                g = grad[i] if not relu or out[i] > 0 else zero
                dst[i] = ac * g + bc * src[i] + cc


def _contiguous(a):
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _rows(a):
    """``(N, C, H, W)`` -> the ``(N, C, H*W)`` view the kernels loop over (contiguous rows)."""
    n, c, h, w = a.shape
    return a.reshape(n, c, h * w)


def batchnorm_forward(x, gamma, beta, eps: float, relu: bool = False, stats=None):
    x = _contiguous(x)
    c = x.shape[1]
    if stats is None:
        mean, var = np.empty(c), np.empty(c)
        _statistics(_rows(x), mean, var)
    else:
        mean, var = (np.asarray(s, dtype=np.float64) for s in stats)
    scale = gamma.astype(np.float64) / np.sqrt(var + eps)
    shift = beta.astype(np.float64) - mean * scale
    y = np.empty_like(x)
    _affine(_rows(x), scale, shift, bool(relu), _rows(y))
    return y, mean, var


def batchnorm_backward(dy, x, y, gamma, mean, var, eps: float, relu: bool = False, batch_stats: bool = True):
    dy, x = _contiguous(dy), _contiguous(x)
    y = _contiguous(y) if relu else x  # not read without the ReLU
    c = x.shape[1]
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = np.asarray(mean, dtype=np.float64)
    inv_std = 1.0 / np.sqrt(np.asarray(var, dtype=np.float64) + eps)
    dgamma_raw, dbeta = np.empty(c), np.empty(c)
    _gradient_sums(_rows(dy), _rows(x), _rows(y), mean, bool(relu), dgamma_raw, dbeta)
    dgamma = dgamma_raw * inv_std
    scale = gamma.astype(np.float64) * inv_std
    if batch_stats:
        # dx = scale*(g - dbeta/M - (x - mean)*inv_std*dgamma/M) = a*g + b*x + c0
        b = -scale * inv_std * dgamma / count
        c0 = -scale * dbeta / count - b * mean
    else:
        b, c0 = np.zeros(c), np.zeros(c)
    dx = np.empty_like(dy)
    _input_gradient(_rows(dy), _rows(x), _rows(y), bool(relu), scale, b, c0, _rows(dx))
    return dx, dgamma, dbeta
