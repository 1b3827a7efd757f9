"""Element-wise passes over whole buffers: the finiteness check of a gradient, and the sum of
a residual block's two branches with the ReLU after it, forward and backward. This is the
reference (``xp`` code, NumPy or CuPy), the definition the Numba kernels
(:mod:`mpidl.kernels.elementwise_cpu`) are tested against, and the path for CuPy arrays.

Any shape; ``a, b`` (``dy, y``) of one shape and dtype::

    all_finite(x)        = no element of x is NaN or +-inf
    add_relu(a, b)       = s * [s > 0],   s = a + b           (mpidl.engine.nn.ReLU's values of the sum)
    relu_backward(dy, y) = dy * [y > 0]                        (y > 0 iff s > 0)
    add(a, b)            = a + b                               (a new array)
    sigmoid(xp, x)       = 1 / (1 + exp(-x))                     (mpidl.engine.nn.Sigmoid, the LSTM's gates)

Multiplying by the mask rather than selecting keeps NumPy's values: a negative ``s`` gives
``-0.0``, and a NaN stays NaN (in ``s`` and in ``dy``).
"""

from __future__ import annotations

from mpidl.engine.backend import get_array_module

__all__ = ["all_finite", "add_relu", "relu_backward", "add", "sigmoid"]


def all_finite(x) -> bool:
    """True iff no element of ``x`` (any shape) is NaN or +-inf."""
    return bool(get_array_module(x).isfinite(x).all())


def add_relu(a, b):
    """``y = relu(a + b)`` elementwise (a residual sum and the ReLU after it), with
    :class:`mpidl.engine.nn.ReLU`'s values: ``s * [s > 0]`` for ``s = a + b``."""
    s = a + b
    return get_array_module(s).multiply(s, s > 0, dtype=s.dtype)


def relu_backward(dy, y):
    """``dL/ds = dy * [y > 0]`` for ``y = add_relu(a, b)`` (``y > 0`` iff ``s > 0``); a NaN in
    ``dy`` stays NaN, as with :class:`mpidl.engine.nn.ReLU`."""
    return get_array_module(dy).multiply(dy, y > 0, dtype=dy.dtype)


def add(a, b):
    """``a + b`` elementwise (the gradients of a residual's two branches), a new array."""
    return a + b


def sigmoid(xp, x):
    """``1 / (1 + exp(-x))`` without overflow warnings: ``exp`` of a non-positive number only
    (``exp(x) / (1 + exp(x))`` for ``x < 0``)."""
    z = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + z), z / (1 + z))
