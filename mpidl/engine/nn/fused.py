"""Batch normalization, and a residual sum, fused with the ReLU after it: same results, fewer
passes.

:func:`fuse_batchnorm_relu` rewrites a network in place: every :class:`~mpidl.engine.nn.BatchNorm2d`
in a :class:`~mpidl.engine.nn.Sequential` becomes a :class:`FusedBatchNorm2d` (the same parameters
and buffers, computed by :func:`mpidl.kernels.batchnorm_forward` / ``batchnorm_backward``), and
a :class:`~mpidl.engine.nn.ReLU` right after it is absorbed (``relu=True``) and replaced by a
:class:`FusedAway` placeholder that passes values through. Indices, parameter and buffer names
stay as they were (a ReLU has none), so checkpoints and twins are unaffected.
``build_model`` applies it to every model.

Why: on NumPy the separate layers make about ten passes over the data per direction, each
with a temporary (see :mod:`mpidl.kernels.batchnorm_cpu`); the fused kernels make three
forward (two for the statistics, one to write the output) and two backward.

:func:`fuse_residual_relu` does the same for a :class:`~mpidl.engine.nn.Residual` followed by a
:class:`~mpidl.engine.nn.ReLU` (ResNet's basic block): :class:`FusedResidual` computes
``relu(F(x) + S(x))`` in one pass and masks the gradient in one (:func:`mpidl.kernels.add_relu`,
``relu_backward``, ``add``: Numba-parallel on the CPU, where NumPy's additions and masks run on
one thread), with the values of the separate layers.
"""

from __future__ import annotations

from mpidl import kernels
from mpidl.engine.nn.activation import ReLU
from mpidl.engine.nn.module import Module, Sequential
from mpidl.engine.nn.norm import BatchNorm2d
from mpidl.engine.nn.residual import Residual

__all__ = ["FusedBatchNorm2d", "FusedResidual", "FusedAway", "fuse_batchnorm_relu", "fuse_residual_relu"]


class FusedBatchNorm2d(BatchNorm2d):
    """:class:`~mpidl.engine.nn.BatchNorm2d` (math in its docstring), followed by ``max(y, 0)`` when
    ``relu``; the statistics are accumulated in float64. Saved for backward: references to the
    input and (with ``relu``) the output, and the channel statistics."""

    def __init__(self, num_features: int, momentum: float = 0.1, eps: float = 1e-5, relu: bool = False) -> None:
        super().__init__(num_features, momentum, eps)
        self.relu = bool(relu)
        self._saved = None

    @classmethod
    def from_layer(cls, bn: BatchNorm2d, relu: bool) -> "FusedBatchNorm2d":
        """The fused layer with ``bn``'s parameters, buffers and mode."""
        fused = cls(bn.num_features, bn.momentum, bn.eps, relu)
        fused.weight, fused.bias = bn.weight, bn.bias
        fused.running_mean, fused.running_var = bn.running_mean, bn.running_var
        fused.training = bn.training
        return fused

    def forward(self, x):
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm2d expects (N, {self.num_features}, H, W), got {tuple(x.shape)}")
        self._buffers_like(x)
        count = x.shape[0] * x.shape[2] * x.shape[3]
        if self.training:
            if count < 2:
                raise ValueError(
                    f"BatchNorm2d needs more than one value per channel in training mode, got input {tuple(x.shape)}"
                )
            y, mean, var = kernels.batchnorm_forward(x, self.weight.data, self.bias.data, self.eps, self.relu)
            # In place, so references handed out by named_buffers() stay valid.
            self.running_mean *= 1.0 - self.momentum
            self.running_mean += (self.momentum * mean).astype(self.running_mean.dtype)
            self.running_var *= 1.0 - self.momentum
            self.running_var += (self.momentum * count / (count - 1) * var).astype(self.running_var.dtype)
        else:
            stats = (self.running_mean, self.running_var)
            y, mean, var = kernels.batchnorm_forward(x, self.weight.data, self.bias.data, self.eps, self.relu, stats)
        self._saved = (x, y, mean, var, self.training)
        return y

    def backward(self, dy):
        if self._saved is None:
            raise RuntimeError("BatchNorm2d.backward called before forward")
        x, y, mean, var, batch_stats = self._saved
        dx, dgamma, dbeta = kernels.batchnorm_backward(
            dy, x, y, self.weight.data, mean, var, self.eps, self.relu, batch_stats
        )
        self.weight.grad[...] = dgamma
        self.bias.grad[...] = dbeta
        return dx

    def _drop_workspaces(self) -> None:
        self._saved = None

    def extra_repr(self) -> str:
        return super().extra_repr() + (", relu=True (the ReLU after it, fused)" if self.relu else "")


class FusedResidual(Residual):
    """:class:`~mpidl.engine.nn.Residual` followed by ``max(., 0)``: ``y = relu(F(x) + S(x))``,
    ``dL/dx = F'(g) + S'(g)`` with ``g = dL/dy * [y > 0]``. Saved for backward: the output."""

    def __init__(self, body: Module, shortcut: Module | None = None) -> None:
        super().__init__(body, shortcut)
        self._y = None

    @classmethod
    def from_layer(cls, residual: Residual) -> "FusedResidual":
        """The fused block with ``residual``'s body and shortcut (the same modules) and mode."""
        fused = cls(residual.body, residual.shortcut)
        fused.training = residual.training
        return fused

    def forward(self, x):
        self._y = kernels.add_relu(*self._branches(x))
        return self._y

    def backward(self, dy):
        if self._y is None:
            raise RuntimeError("Residual.backward called before forward")
        return super().backward(kernels.relu_backward(dy, self._y))

    def _drop_workspaces(self) -> None:
        self._y = None

    def extra_repr(self) -> str:
        return "relu=True (the ReLU after the sum, fused)"


class FusedAway(Module):
    """The place of a layer fused into the one before it: passes values and gradients through."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, x):
        return x

    def backward(self, dy):
        return dy

    def extra_repr(self) -> str:
        return f"{self.what}, fused into the previous layer"


def fuse_batchnorm_relu(module: Module) -> Module:
    """Rewrite ``module`` in place (see the module docstring); returns it. Call before the
    parameters are bound (``build_model`` does)."""
    for _, child in module.children():
        fuse_batchnorm_relu(child)
    if isinstance(module, Sequential):
        layers = module.layers
        for k, layer in enumerate(layers):
            if type(layer) is BatchNorm2d:
                relu = k + 1 < len(layers) and type(layers[k + 1]) is ReLU
                layers[k] = FusedBatchNorm2d.from_layer(layer, relu)
                if relu:
                    layers[k + 1] = FusedAway("ReLU")
    return module


def fuse_residual_relu(module: Module) -> Module:
    """Rewrite ``module`` in place: every :class:`~mpidl.engine.nn.Residual` of a
    :class:`~mpidl.engine.nn.Sequential` that a :class:`~mpidl.engine.nn.ReLU` follows becomes a
    :class:`FusedResidual` and the ReLU a :class:`FusedAway` (names and indices unchanged);
    returns it. Call before the parameters are bound (``build_model`` does)."""
    for _, child in module.children():
        fuse_residual_relu(child)
    if isinstance(module, Sequential):
        layers = module.layers
        for k, layer in enumerate(layers):
            if type(layer) is Residual and k + 1 < len(layers) and type(layers[k + 1]) is ReLU:
                layers[k] = FusedResidual.from_layer(layer)
                layers[k + 1] = FusedAway("ReLU")
    return module
