"""Batch normalization (+ ReLU) as Numba CPU kernels: the same functions as
:mod:`mpidl.kernels.batchnorm_reference` (math there), in one parallel loop over the channels
each way.

The NumPy layer makes about ten passes per direction with a temporary array each (centered,
squared, xhat, scaled, shifted; the ReLU's mask and product). Here forward reads ``x`` twice
for the statistics (mean, then centered squares) and once more to write ``y`` with the
ReLU applied; backward reads ``dy, x, y`` once for ``dbeta, dgamma`` and once to write ``dx``;
nothing else is allocated. One ``prange`` iteration per channel does all of that channel's
passes (each channel owns its statistics and its planes of the output, so no two threads
write the same element): one parallel region per call instead of one per pass, and a
channel's planes (``N*H*W`` values: 256 KiB for resnet8's 16 channels at 32x32 and batch 64)
are read again from the core's cache, not from memory. The sums are float64, with
reassociation allowed (``fastmath={"reassoc"}``) so the loops vectorize; the element-wise
passes are written ``a*x + b`` per channel. The kernels take ``(N, C, H*W)`` views, so each
innermost loop runs over one contiguous ``(n, c)`` row of ``H*W`` elements, which LLVM
vectorizes (nested loops over ``h`` and ``w`` of a 4-D array have short inner loops, the
shorter the smaller the image, and run slower).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["batchnorm_forward", "batchnorm_backward"]

_SUM = {"reassoc", "contract"}


# The two helpers are inlined into the parallel kernels and compiled with their flags.
@njit(inline="always")
def _channel_statistics(x, c):
    """``(mean, var)`` of channel ``c`` of ``x : (N, C, H*W)`` (float64 sums, two passes)."""
    n_size, _, hw_size = x.shape
    count = n_size * hw_size
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
    return mu, squares / count


@njit(inline="always")
def _channel_affine(x, c, scale, shift, relu, y):
    """``y[:, c] = relu?(scale * x[:, c] + shift)`` in ``x``'s dtype."""
    n_size, _, hw_size = x.shape
    a = x.dtype.type(scale)
    b = x.dtype.type(shift)
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
def _forward(x, gamma, beta, eps, relu, batch_stats, mean, var, y):
    """Per channel: the batch statistics (when ``batch_stats``; else ``mean, var`` are given),
    ``scale = gamma / sqrt(var + eps)``, ``shift = beta - mean * scale``, then ``y``."""
    for c in prange(x.shape[1]):
        if batch_stats:
            mean[c], var[c] = _channel_statistics(x, c)
        scale = np.float64(gamma[c]) / np.sqrt(var[c] + eps)
        shift = np.float64(beta[c]) - mean[c] * scale
        _channel_affine(x, c, scale, shift, relu, y)


@njit(parallel=True, cache=True, fastmath=_SUM)
def _backward(dy, x, y, gamma, mean, var, eps, relu, batch_stats, dgamma, dbeta, dx):
    """Per channel, with ``g`` = ``dy`` through the ReLU's mask and ``M = N*H*W``:
    ``dbeta = sum(g)``, ``dgamma = sum(g * (x - mean)) * inv_std``, then
    ``dx = a*g + b*x + c0`` with ``a = gamma * inv_std`` and, for batch statistics,
    ``b = -a * inv_std * dgamma / M``, ``c0 = -a * dbeta / M - b * mean`` (else 0, 0)."""
    n_size, c_size, hw_size = x.shape
    count = n_size * hw_size
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
        inv_std = 1.0 / np.sqrt(var[c] + eps)
        dbeta[c] = sg
        dgamma[c] = sgx * inv_std
        scale = np.float64(gamma[c]) * inv_std
        if batch_stats:
            b = -scale * inv_std * dgamma[c] / count
            c0 = -scale * sg / count - b * mu
        else:
            b, c0 = 0.0, 0.0
        ac = dx.dtype.type(scale)
        bc = dx.dtype.type(b)
        cc = dx.dtype.type(c0)
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
    else:
        mean, var = (np.asarray(s, dtype=np.float64) for s in stats)
    y = np.empty_like(x)
    _forward(_rows(x), gamma.astype(np.float64), beta.astype(np.float64), float(eps), bool(relu),
             stats is None, mean, var, _rows(y))
    return y, mean, var


def batchnorm_backward(dy, x, y, gamma, mean, var, eps: float, relu: bool = False, batch_stats: bool = True):
    dy, x = _contiguous(dy), _contiguous(x)
    y = _contiguous(y) if relu else x  # not read without the ReLU
    c = x.shape[1]
    dgamma, dbeta = np.empty(c), np.empty(c)
    dx = np.empty_like(dy)
    _backward(_rows(dy), _rows(x), _rows(y), gamma.astype(np.float64), np.asarray(mean, dtype=np.float64),
              np.asarray(var, dtype=np.float64), float(eps), bool(relu), bool(batch_stats), dgamma, dbeta, _rows(dx))
    return dx, dgamma, dbeta
