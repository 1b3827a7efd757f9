"""The element-wise and row-wise pieces of the transformer layers: GELU, layer normalization
and the softmax of attention, forward and backward. This is the reference (vectorized ``xp``
code, NumPy or CuPy), the definition the Numba kernels (:mod:`mpidl.kernels.transformer_cpu`)
are tested against, and the path for CuPy arrays.

GELU (exact, erf form), any shape::

    forward:   Phi(x) = (1 + erf(x / sqrt(2))) / 2,   y = x * Phi(x)
    backward:  phi(x) = exp(-x^2 / 2) / sqrt(2 pi),   dx = dy * (Phi(x) + x * phi(x))

Forward returns ``Phi(x)`` (``cdf``) with ``y``: backward then needs no erf, only an exp.
(The float32 Numba kernel evaluates ``Phi`` through a fit of ``erfc`` accurate to 1.7e-7
relative; see :mod:`mpidl.kernels.transformer_cpu`.)

Layer normalization of each row of ``D`` values (the last axis; ``x : (..., D)``, ``gamma,
beta : (D,)``), statistics in float64 by two passes (the mean, then the centred squares)::

    forward:   mu = mean(x),  r = 1 / sqrt(mean((x - mu)^2) + eps),  xhat = (x - mu) * r,
               y = gamma * xhat + beta
    backward:  g = dy * gamma,
               dx = r * (g - mean(g) - xhat * mean(g * xhat))      (means over the row),
               dgamma = sum(dy * xhat),  dbeta = sum(dy)           (sums over every row)

Forward returns ``mean`` and ``inv_std`` (``mu`` and ``r``, float64, shape ``x.shape[:-1]``);
backward recomputes ``xhat`` from ``x`` with them. ``dgamma, dbeta`` are float64.

Softmax along the last axis of ``scale * s`` (``scale > 0``: attention's ``1 / sqrt(d)``)::

    forward:   z = scale * s,  a = exp(z - max(z)) / sum(exp(z - max(z)))
    backward:  ds = scale * a * (da - sum(da * a))                 (sums over the row)

Shifting by the row maximum keeps ``exp`` from overflowing (the result is unchanged).
Outputs have the input's dtype (the statistics aside).
"""

from __future__ import annotations

import math

from mpidl.engine.backend import get_array_module

__all__ = ["gelu_forward", "gelu_backward", "layernorm_forward", "layernorm_backward",
           "softmax_forward", "softmax_backward"]


def _erf(xp, x):
    """The error function with the array module's SciPy (``scipy.special`` /
    ``cupyx.scipy.special``): NumPy has no ``erf`` of its own."""
    if xp.__name__ == "cupy":
        from cupyx.scipy.special import erf  # noqa: PLC0415 - only with CuPy
    else:
        from scipy.special import erf  # noqa: PLC0415
    return erf(x)


def gelu_forward(x):
    """``(y, cdf)``: ``y = x * Phi(x)`` and ``cdf = Phi(x)``, both of x's shape and dtype."""
    xp = get_array_module(x)
    cdf = _erf(xp, x * x.dtype.type(1.0 / math.sqrt(2.0)))
    cdf += 1
    cdf *= 0.5
    return x * cdf, cdf


def gelu_backward(dy, x, cdf):
    """``dx = dy * (Phi(x) + x * phi(x))``, with ``cdf = Phi(x)`` from the forward."""
    xp = get_array_module(dy)
    pdf = xp.exp(x * x * x.dtype.type(-0.5)) * x.dtype.type(1.0 / math.sqrt(2.0 * math.pi))
    return dy * (cdf + x * pdf)


def layernorm_forward(x, gamma, beta, eps: float):
    """``(y, mean, inv_std)``: ``y`` of x's shape and dtype; ``mean, inv_std : x.shape[:-1]``
    float64."""
    xp = get_array_module(x)
    x64 = x.astype(xp.float64)
    mean = x64.mean(axis=-1)
    centred = x64 - mean[..., None]
    inv_std = 1.0 / xp.sqrt((centred * centred).mean(axis=-1) + eps)
    xhat = centred * inv_std[..., None]
    y = xhat * gamma.astype(xp.float64) + beta.astype(xp.float64)
    return y.astype(x.dtype), mean, inv_std


def layernorm_backward(dy, x, gamma, mean, inv_std):
    """``(dx, dgamma, dbeta)`` for the forward that gave ``mean, inv_std``; ``dx`` has dy's
    dtype, ``dgamma, dbeta : (D,)`` float64."""
    xp = get_array_module(dy)
    dy64 = dy.astype(xp.float64)
    xhat = (x.astype(xp.float64) - mean[..., None]) * inv_std[..., None]
    rows = tuple(range(dy.ndim - 1))
    dbeta = dy64.sum(axis=rows)
    dgamma = (dy64 * xhat).sum(axis=rows)
    g = dy64 * gamma.astype(xp.float64)
    mean_g = g.mean(axis=-1, keepdims=True)
    mean_gx = (g * xhat).mean(axis=-1, keepdims=True)
    dx = (g - mean_g - xhat * mean_gx) * inv_std[..., None]
    return dx.astype(dy.dtype), dgamma, dbeta


def softmax_forward(s, scale: float = 1.0):
    """``a = softmax(scale * s)`` along the last axis, of s's shape and dtype."""
    xp = get_array_module(s)
    z = s * s.dtype.type(scale)
    a = xp.exp(z - z.max(axis=-1, keepdims=True))
    a /= a.sum(axis=-1, keepdims=True)
    return a


def softmax_backward(da, a, scale: float = 1.0):
    """``ds = scale * a * (da - sum(da * a))`` for the forward that gave ``a``."""
    ds = a * (da - (da * a).sum(axis=-1, keepdims=True))
    ds *= da.dtype.type(scale)
    return ds
