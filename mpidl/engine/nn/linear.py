"""Fully connected layer and Flatten."""

from __future__ import annotations

import math

from mpidl.engine.backend import get_array_module
from mpidl.engine.blas import matmul
from mpidl.engine.nn.module import Module
from mpidl.engine.params import Initializer, Parameter, kaiming_uniform, uniform

__all__ = ["Linear", "Flatten"]


class Linear(Module):
    """Affine map ``y = x @ W.T + b``.

    Parameters
    ----------
    in_features, out_features : D and K
    bias : whether to add ``b``
    weight_init, bias_init : default PyTorch's (``kaiming_uniform(D)``, ``uniform(1/sqrt(D))``)

    Shapes
    ------
    x : (N, D) -> y : (N, K); weight : (K, D) (PyTorch's layout); bias : (K,)

    Notes
    -----
    ``y[n, k] = sum_d x[n, d] * W[k, d] + b[k]``. Backward:
    ``dW = dy.T @ x`` (K, D), ``db = dy.sum(axis=0)`` (K,), ``dx = dy @ W`` (N, D).
    Only ``x`` is saved for backward. The three products go through
    :func:`mpidl.engine.blas.matmul`, which splits a large one between the thread policy's threads.
    With ``compute_input_grad = False`` backward skips ``dx`` and returns None (the model sets
    this on its first layer with parameters: nobody needs ``dx`` of the data).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        weight_init: Initializer | None = None,
        bias_init: Initializer | None = None,
    ):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear needs positive sizes, got in={in_features}, out={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(
            (out_features, in_features), weight_init if weight_init is not None else kaiming_uniform(in_features)
        )
        self.bias = (
            Parameter((out_features,), bias_init if bias_init is not None else uniform(1.0 / math.sqrt(in_features)))
            if bias
            else None
        )
        self.compute_input_grad = True
        self._x = None

    def forward(self, x):
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear expects (N, {self.in_features}), got {tuple(x.shape)}")
        self._x = x
        xp = get_array_module(x)
        dtype = xp.result_type(x, self.weight.data)  # as x @ W.T would give
        y = matmul(x, self.weight.data.T, out=xp.empty((x.shape[0], self.out_features), dtype=dtype))
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy):
        if self._x is None:
            raise RuntimeError("Linear.backward called before forward")
        xp = get_array_module(dy)
        matmul(dy.T, self._x, out=self.weight.grad)
        if self.bias is not None:
            xp.sum(dy, axis=0, out=self.bias.grad)
        if not self.compute_input_grad:
            return None
        dtype = xp.result_type(dy, self.weight.data)
        return matmul(dy, self.weight.data, out=xp.empty((dy.shape[0], self.in_features), dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Flatten(Module):
    """Collapse all axes but the first: ``(N, C, H, W) -> (N, C*H*W)`` (a view, no copy).

    The order is C-order, i.e. feature ``(c*H + h)*W + w``, the same as PyTorch's ``flatten``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._x_shape: tuple | None = None

    def forward(self, x):
        self._x_shape = tuple(x.shape)
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        if self._x_shape is None:
            raise RuntimeError("Flatten.backward called before forward")
        return dy.reshape(self._x_shape)
