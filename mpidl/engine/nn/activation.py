"""Element-wise activations."""

from __future__ import annotations

from mpidl import kernels
from mpidl.engine.backend import get_array_module
from mpidl.kernels.elementwise_reference import sigmoid
from mpidl.engine.nn.module import Module

__all__ = ["ReLU", "LeakyReLU", "GELU", "Tanh", "Sigmoid", "sigmoid"]


class ReLU(Module):
    """Rectified linear unit, any shape.

    Notes
    -----
    ``y = max(x, 0)``; ``dL/dx = dL/dy * [x > 0]`` (the subgradient at 0 is taken as 0, like
    PyTorch). Only the boolean mask ``x > 0`` is saved for backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self._mask = None

    def forward(self, x):
        xp = get_array_module(x)
        self._mask = x > 0
        # A multiply by the mask, not xp.where: much faster on NumPy for the same result (a NaN
        # input stays NaN, as in PyTorch).
        return xp.multiply(x, self._mask, dtype=x.dtype)

    def backward(self, dy):
        if self._mask is None:
            raise RuntimeError("ReLU.backward called before forward")
        xp = get_array_module(dy)
        return xp.multiply(dy, self._mask, dtype=dy.dtype)


class LeakyReLU(Module):
    """Leaky ReLU with slope ``negative_slope`` for negative inputs, any shape.

    Notes
    -----
    ``y = x if x > 0 else a*x``; ``dL/dx = dL/dy * (1 if x > 0 else a)``.
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        if negative_slope < 0:
            raise ValueError(f"negative_slope must be >= 0, got {negative_slope}")
        self.negative_slope = float(negative_slope)
        self._mask = None

    def forward(self, x):
        xp = get_array_module(x)
        self._mask = x > 0
        return xp.where(self._mask, x, x * self.negative_slope)

    def backward(self, dy):
        if self._mask is None:
            raise RuntimeError("LeakyReLU.backward called before forward")
        xp = get_array_module(dy)
        return xp.where(self._mask, dy, dy * self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"


class GELU(Module):
    """Gaussian error linear unit, the exact (erf) form, any shape: PyTorch's default
    (``torch.nn.GELU(approximate="none")``), not the tanh approximation.

    Notes
    -----
    ``y = x * Phi(x)`` with ``Phi(x) = (1 + erf(x / sqrt(2))) / 2`` the standard normal CDF;
    ``dL/dx = dL/dy * (Phi(x) + x * phi(x))`` with ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)``.
    Saved for backward: ``x`` and ``Phi(x)``. Computed by :func:`mpidl.kernels.gelu_forward`
    and ``gelu_backward`` (Numba kernels for NumPy arrays, the reference for CuPy); on float32
    NumPy arrays the kernel takes ``Phi`` from a fit of ``erfc``, within 1.7e-7 relative of
    the exact value (:mod:`mpidl.kernels.transformer_cpu`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._x = self._cdf = None

    def forward(self, x):
        y, cdf = kernels.gelu_forward(x)
        self._x, self._cdf = x, cdf
        return y

    def backward(self, dy):
        if self._x is None:
            raise RuntimeError("GELU.backward called before forward")
        return kernels.gelu_backward(dy, self._x, self._cdf)


class Tanh(Module):
    """Hyperbolic tangent, any shape.

    Notes
    -----
    ``y = tanh(x)``; ``dL/dx = dL/dy * (1 - y^2)``. Only ``y`` is saved for backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self._y = None

    def forward(self, x):
        self._y = get_array_module(x).tanh(x)
        return self._y

    def backward(self, dy):
        if self._y is None:
            raise RuntimeError("Tanh.backward called before forward")
        return dy * (1 - self._y * self._y)


class Sigmoid(Module):
    """Logistic sigmoid, any shape.

    Notes
    -----
    ``y = 1 / (1 + exp(-x))``; ``dL/dx = dL/dy * y * (1 - y)``. Only ``y`` is saved for backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self._y = None

    def forward(self, x):
        self._y = sigmoid(get_array_module(x), x)
        return self._y

    def backward(self, dy):
        if self._y is None:
            raise RuntimeError("Sigmoid.backward called before forward")
        return dy * self._y * (1 - self._y)
