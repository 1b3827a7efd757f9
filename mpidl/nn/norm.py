"""Batch normalization over the channels of NCHW feature maps."""

from __future__ import annotations

import numpy as np

from mpidl.backend import get_array_module, to_host
from mpidl.nn.module import Module
from mpidl.params import Parameter, ones, zeros

__all__ = ["BatchNorm2d"]


class BatchNorm2d(Module):
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
    Saved for backward: ``xhat`` and ``1 / sqrt(var + eps)``.
    """

    buffer_names = ("running_mean", "running_var")
    _AXES = (0, 2, 3)  # every axis but the channel axis

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

    @staticmethod
    def _per_channel(v):
        """(C,) -> (1, C, 1, 1), to broadcast against (N, C, H, W)."""
        return v[None, :, None, None]

    def forward(self, x):
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm2d expects (N, {self.num_features}, H, W), got {tuple(x.shape)}")
        xp = get_array_module(x)
        self._buffers_like(x)
        count = x.shape[0] * x.shape[2] * x.shape[3]

        if self.training:
            if count < 2:
                raise ValueError(
                    f"BatchNorm2d needs more than one value per channel in training mode, got input {tuple(x.shape)}"
                )
            mean = x.mean(axis=self._AXES)
            centered = x - self._per_channel(mean)
            var = (centered * centered).mean(axis=self._AXES)
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
            raise RuntimeError("BatchNorm2d.backward called before forward")
        xhat = self._xhat
        count = dy.shape[0] * dy.shape[2] * dy.shape[3]
        dy.sum(axis=self._AXES, out=self.bias.grad)
        (dy * xhat).sum(axis=self._AXES, out=self.weight.grad)
        scale = self._per_channel(self.weight.data * self._inv_std)
        if not self._used_batch_stats:
            return dy * scale
        dbeta, dgamma = self._per_channel(self.bias.grad), self._per_channel(self.weight.grad)
        return scale * (dy - dbeta / count - xhat * (dgamma / count))

    def _drop_workspaces(self) -> None:
        self._xhat = self._inv_std = None

    def extra_repr(self) -> str:
        return f"{self.num_features}, momentum={self.momentum}, eps={self.eps}"
