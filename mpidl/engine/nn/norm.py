"""Normalization layers: batch normalization (NCHW maps, (N, F) features) and layer normalization.

Statistics are accumulated in float64 whatever the input's dtype, by two passes (the mean,
then the mean and mean square of the centred values): on inputs far from zero (a mean of
1000 and a spread of 3) a float32 mean can be off by half a float32 step of 1000, about 1e-5
of the spread, which gives batch norm's weight gradient a 3.5e-5 relative error (3e-6 with
the two passes; tests/test_layers_sequence.py).
"""

from __future__ import annotations

import numpy as np

from mpidl import kernels
from mpidl.engine.backend import get_array_module, to_host
from mpidl.engine.nn.module import Module
from mpidl.engine.params import Parameter, ones, zeros

__all__ = ["BatchNorm1d", "BatchNorm2d", "LayerNorm"]


def centred_moments(x, axis):
    """``(x - mean(x), var(x))`` along ``axis`` (biased variance), with the sums in float64.

    The first pass subtracts the float64 mean rounded to x's dtype; the centred values then
    have a small remaining mean (at most half a step of the rounded mean), removed by the
    second pass, whose sums are of values of the data's spread, not of its magnitude.
    ``var`` has x's dtype and keeps the reduced axes (broadcastable against x).
    """
    xp = get_array_module(x)
    mean = x.mean(axis=axis, dtype=xp.float64, keepdims=True)
    centred = x - mean.astype(x.dtype)
    residual = centred.mean(axis=axis, dtype=xp.float64, keepdims=True)
    centred -= residual.astype(x.dtype)
    var = (centred * centred).mean(axis=axis, dtype=xp.float64, keepdims=True)
    return centred, var.astype(x.dtype), mean + residual


class _BatchNorm(Module):
    """Batch normalization of the channel axis 1 over every other axis; see BatchNorm2d."""

    buffer_names = ("running_mean", "running_var")
    _AXES: tuple[int, ...] = (0, 2, 3)  # every axis but the channel axis
    _LAYOUT = "(N, C, H, W)"

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        if not 0.0 <= momentum <= 1.0 or eps <= 0:
            raise ValueError(f"need 0 <= momentum <= 1 and eps > 0, got momentum={momentum}, eps={eps}")
        self.num_features, self.momentum, self.eps = num_features, float(momentum), float(eps)
        self.weight = Parameter((num_features,), ones())
        self.bias = Parameter((num_features,), zeros())
        self.running_mean = np.zeros(num_features)
        self.running_var = np.ones(num_features)
        self._xhat = None
        self._inv_std = None
        self._used_batch_stats = False

    def _buffers_like(self, x) -> None:
        """Move the running statistics to x's device and dtype if they are elsewhere (first call)."""
        xp = get_array_module(x)
        for name in self.buffer_names:
            buffer = getattr(self, name)
            if get_array_module(buffer) is not xp or buffer.dtype != x.dtype:
                setattr(self, name, xp.asarray(to_host(buffer), dtype=x.dtype))

    def _per_channel(self, v):
        """(C,) -> broadcastable against x (``(1, C, 1, 1)`` for NCHW, ``(1, C)`` for (N, C))."""
        return v.reshape((1, -1) + (1,) * (len(self._AXES) - 1))

    def _count(self, shape) -> int:
        return int(np.prod([shape[a] for a in self._AXES]))

    def forward(self, x):
        if x.ndim != len(self._AXES) + 1 or x.shape[1] != self.num_features:
            layout = self._LAYOUT.replace("C", str(self.num_features))
            raise ValueError(f"{type(self).__name__} expects {layout}, got {tuple(x.shape)}")
        xp = get_array_module(x)
        self._buffers_like(x)
        count = self._count(x.shape)

        if self.training:
            if count < 2:
                raise ValueError(
                    f"{type(self).__name__} needs more than one value per channel in training mode, "
                    f"got input {tuple(x.shape)}"
                )
            centered, var, mean = centred_moments(x, self._AXES)
            var, mean = var.reshape(-1), mean.reshape(-1).astype(x.dtype)
            # In place, so references handed out by named_buffers() stay valid.
            self.running_mean *= 1.0 - self.momentum
            self.running_mean += self.momentum * mean
            self.running_var *= 1.0 - self.momentum
            self.running_var += (self.momentum * count / (count - 1)) * var
        else:
            centered = x - self._per_channel(self.running_mean)
            var = self.running_var

        inv_std = 1.0 / xp.sqrt(var + self.eps)
        xhat = centered * self._per_channel(inv_std)
        self._xhat, self._inv_std, self._used_batch_stats = xhat, inv_std, self.training
        return xhat * self._per_channel(self.weight.data) + self._per_channel(self.bias.data)

    def backward(self, dy):
        if self._xhat is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        xp = get_array_module(dy)
        xhat = self._xhat
        count = self._count(dy.shape)
        # float64 sums, like the statistics (the gradients of gamma and beta are sums over
        # the whole batch)
        self.bias.grad[...] = dy.sum(axis=self._AXES, dtype=xp.float64)
        self.weight.grad[...] = (dy * xhat).sum(axis=self._AXES, dtype=xp.float64)
        scale = self._per_channel(self.weight.data * self._inv_std)
        if not self._used_batch_stats:
            return dy * scale
        dbeta, dgamma = self._per_channel(self.bias.grad), self._per_channel(self.weight.grad)
        return scale * (dy - dbeta / count - xhat * (dgamma / count))

    def _drop_workspaces(self) -> None:
        self._xhat = self._inv_std = None

    def extra_repr(self) -> str:
        return f"{self.num_features}, momentum={self.momentum}, eps={self.eps}"


class BatchNorm2d(_BatchNorm):
    """Normalize each channel with batch statistics (training) or running statistics (evaluation).

    Parameters
    ----------
    num_features : C
    momentum : weight of the current batch in the running averages
    eps : added to the variance for numerical safety

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, C, H, W); weight (gamma) : (C,), bias (beta) : (C,)

    Buffers
    -------
    running_mean : (C,), starts at 0; running_var : (C,), starts at 1. Host float64 arrays until
    ``to(backend)`` (or the first forward) moves them to the input's device and dtype; they are
    updated in place.

    Notes
    -----
    Per channel, over the ``M = N*H*W`` values of the batch (training mode):

    ``mu = mean(x)``, ``var = mean((x - mu)^2)`` (biased), ``xhat = (x - mu) / sqrt(var + eps)``,
    ``y = gamma * xhat + beta``; then
    ``running_mean <- (1 - momentum) * running_mean + momentum * mu`` and
    ``running_var <- (1 - momentum) * running_var + momentum * var * M / (M - 1)`` (unbiased, as
    in PyTorch). Evaluation mode uses ``running_mean`` / ``running_var`` in place of ``mu`` / ``var``.

    Backward (training), with sums over the ``M`` values of a channel:
    ``dbeta = sum(dy)``, ``dgamma = sum(dy * xhat)``,
    ``dx = gamma / sqrt(var + eps) * (dy - dbeta / M - xhat * dgamma / M)``
    (the last two terms are the gradient flowing through ``mu`` and ``var``). In evaluation mode
    the statistics are constants and ``dx = gamma / sqrt(running_var + eps) * dy``.
    Saved for backward: ``xhat`` and ``1 / sqrt(var + eps)``. The sums (statistics and the
    gradients of gamma and beta) are accumulated in float64, see :func:`centred_moments`.
    """

    _AXES = (0, 2, 3)
    _LAYOUT = "(N, C, H, W)"


class BatchNorm1d(_BatchNorm):
    """Batch normalization of features: the same as :class:`BatchNorm2d` with ``x : (N, C)``
    and the statistics taken over the ``M = N`` samples of the batch (PyTorch's
    ``BatchNorm1d`` on 2-D input).

    Shapes
    ------
    x : (N, C) -> y : (N, C); weight, bias, running_mean, running_var : (C,)
    """

    _AXES = (0,)
    _LAYOUT = "(N, C)"


class LayerNorm(Module):
    """Normalize each sample's last axis (of size D) to zero mean and unit variance, then scale
    and shift per feature (PyTorch's ``LayerNorm(D)``).

    Parameters
    ----------
    normalized_shape : D
    eps : added to the variance

    Shapes
    ------
    x : (..., D) -> y : (..., D); weight (gamma) : (D,) starts at 1, bias (beta) : (D,) at 0

    Notes
    -----
    Per row ``x`` of D values: ``mu = mean(x)``, ``var = mean((x - mu)^2)``,
    ``xhat = (x - mu) / sqrt(var + eps)``, ``y = gamma * xhat + beta`` (the same in training
    and evaluation: no running statistics). Backward, with ``g = dy * gamma`` and means over
    the row: ``dx = (g - mean(g) - xhat * mean(g * xhat)) / sqrt(var + eps)``;
    ``dgamma = sum(dy * xhat)``, ``dbeta = sum(dy)`` over every leading axis. The statistics
    and sums are float64 whatever x's dtype. Saved for backward: ``x`` and each row's mean and
    ``1 / sqrt(var + eps)`` (``xhat`` is recomputed). Computed by
    :func:`mpidl.kernels.layernorm_forward` and ``layernorm_backward`` (Numba kernels for
    NumPy arrays, the reference for CuPy).
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5) -> None:
        super().__init__()
        if int(normalized_shape) < 1 or eps <= 0:
            raise ValueError(f"LayerNorm needs normalized_shape >= 1 and eps > 0, got {normalized_shape}, {eps}")
        self.normalized_shape, self.eps = int(normalized_shape), float(eps)
        self.weight = Parameter((self.normalized_shape,), ones())
        self.bias = Parameter((self.normalized_shape,), zeros())
        self._saved = None  # (x, mean, inv_std)

    def forward(self, x):
        if x.ndim < 1 or x.shape[-1] != self.normalized_shape:
            raise ValueError(f"LayerNorm expects (..., {self.normalized_shape}), got {tuple(x.shape)}")
        y, mean, inv_std = kernels.layernorm_forward(x, self.weight.data, self.bias.data, self.eps)
        self._saved = (x, mean, inv_std)
        return y

    def backward(self, dy):
        if self._saved is None:
            raise RuntimeError("LayerNorm.backward called before forward")
        x, mean, inv_std = self._saved
        dx, dgamma, dbeta = kernels.layernorm_backward(dy, x, self.weight.data, mean, inv_std)
        self.weight.grad[...] = dgamma
        self.bias.grad[...] = dbeta
        return dx

    def _drop_workspaces(self) -> None:
        self._saved = None

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
