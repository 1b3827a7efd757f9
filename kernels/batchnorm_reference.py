"""Batch normalization over the channels of NCHW arrays, optionally followed by a ReLU: the
reference (vectorized ``xp`` code, NumPy or CuPy), the definition the Numba kernels
(:mod:`mpidl.kernels.batchnorm_cpu`) are tested against.

Math, per channel ``c`` over its ``M = N*H*W`` values (statistics accumulated in float64, the
variance from the centered values: two passes, exact for inputs with a large mean):

* forward: ``mu = mean(x)``, ``var = mean((x - mu)^2)`` (or the given running statistics),
  ``s = gamma / sqrt(var + eps)``, ``y = s * (x - mu) + beta``, then ``y = max(y, 0)`` with ``relu``;
* backward: ``g = dy * [y > 0]`` with ``relu`` (else ``dy``), ``xhat = (x - mu) / sqrt(var + eps)``,
  ``dbeta = sum(g)``, ``dgamma = sum(g * xhat)``, and ``dx = s * (g - dbeta/M - xhat * dgamma/M)``
  with batch statistics (their gradient included), ``dx = s * g`` with fixed ones.

Shapes: ``x, dy, y, dx : (N, C, H, W)``; ``gamma, beta : (C,)``; ``mean, var, dgamma, dbeta :
(C,)`` float64. ``y`` and ``dx`` have ``x``'s dtype.
"""

from __future__ import annotations

from mpidl.engine.backend import get_array_module

__all__ = ["batchnorm_forward", "batchnorm_backward"]

_AXES = (0, 2, 3)


def _channel(v):
    return v[None, :, None, None]


def batchnorm_forward(x, gamma, beta, eps: float, relu: bool = False, stats=None):
    """``(y, mean, var)``; ``stats = (mean, var)`` uses those instead of the batch's."""
    xp = get_array_module(x)
    if stats is None:
        x64 = x.astype(xp.float64)
        mean = x64.mean(axis=_AXES)
        var = ((x64 - _channel(mean)) ** 2).mean(axis=_AXES)
    else:
        mean, var = (xp.asarray(s, dtype=xp.float64) for s in stats)
    scale = gamma.astype(xp.float64) / xp.sqrt(var + eps)
    y = (x - _channel(mean)) * _channel(scale) + _channel(beta.astype(xp.float64))
    if relu:
        y = xp.maximum(y, 0.0)
    return y.astype(x.dtype), mean, var


def batchnorm_backward(dy, x, y, gamma, mean, var, eps: float, relu: bool = False, batch_stats: bool = True):
    """``(dx, dgamma, dbeta)`` for the forward that gave ``y`` (``y`` is read only with ``relu``)."""
    xp = get_array_module(dy)
    g = dy.astype(xp.float64)
    if relu:
        g = g * (y > 0)
    inv_std = 1.0 / xp.sqrt(xp.asarray(var, dtype=xp.float64) + eps)
    xhat = (x - _channel(mean)) * _channel(inv_std)
    dbeta = g.sum(axis=_AXES)
    dgamma = (g * xhat).sum(axis=_AXES)
    scale = _channel(gamma.astype(xp.float64) * inv_std)
    if batch_stats:
        count = x.shape[0] * x.shape[2] * x.shape[3]
        dx = scale * (g - _channel(dbeta / count) - xhat * _channel(dgamma / count))
    else:
        dx = scale * g
    return dx.astype(dy.dtype), dgamma, dbeta
