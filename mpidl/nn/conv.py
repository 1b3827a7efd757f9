"""2-D convolution as im2col + one matrix product (no library convolution)."""

from __future__ import annotations

import math

from mpidl import kernels
from mpidl.backend import get_array_module
from mpidl.nn.module import Module
from mpidl.params import Initializer, Parameter, kaiming_uniform, uniform

__all__ = ["Conv2d"]


def _workspace(cache: dict, key: str, shape: tuple, like):
    """A scratch array of ``shape`` with ``like``'s dtype and device, reused across calls.

    Training runs the same shapes step after step, so the large im2col matrices are
    allocated once instead of every step (allocation of a few hundred MB per step is a
    measurable cost on the CPU and fragments the GPU memory pool).
    """
    xp = get_array_module(like)
    buffer = cache.get(key)
    if buffer is None or buffer.shape != shape or buffer.dtype != like.dtype or get_array_module(buffer) is not xp:
        buffer = xp.empty(shape, dtype=like.dtype)
        cache[key] = buffer
    return buffer


class Conv2d(Module):
    """2-D cross-correlation (what deep learning calls convolution), NCHW.

    Parameters
    ----------
    in_channels, out_channels : C and F
    kernel_size : k (square kernel k x k)
    stride, padding : same for both spatial axes; padding is with zeros
    bias : whether to add a per-channel bias
    weight_init, bias_init : initializers; default PyTorch's (``kaiming_uniform(fan_in)`` and
        ``uniform(1/sqrt(fan_in))`` with ``fan_in = C*k*k``)

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, F, OH, OW), ``OH = (H + 2*padding - k) // stride + 1``
    weight : (F, C, k, k); bias : (F,)

    Notes
    -----
    ``y[n, f, oh, ow] = b[f] + sum_{c,i,j} W[f, c, i, j] * x[n, c, oh*s + i - p, ow*s + j - p]``.

    With ``cols = im2col(x) : (C*k*k, N*OH*OW)`` and ``W2 = W.reshape(F, C*k*k)`` this is one GEMM,
    ``Y2 = W2 @ cols + b[:, None]``, ``Y2 : (F, N*OH*OW)``, and ``y = Y2.reshape(F, N, OH, OW)``
    with its first two axes swapped. Backward, with ``dY2`` the same rearrangement of ``dy``:

    * ``dW2 = dY2 @ cols.T``                 (F, C*k*k)
    * ``db  = dY2.sum(axis=1)``              (F,)
    * ``dcols = W2.T @ dY2``, ``dx = col2im(dcols)``   (col2im is the adjoint of im2col)

    Only ``cols`` and the input shape are saved for backward. The kernels come from
    :mod:`mpidl.kernels` (NumPy reference, Numba CPU or Numba CUDA, chosen by the array).
    Setting ``compute_input_grad = False`` skips ``dcols`` and ``col2im`` (the model does this
    for its first layer, whose input gradient nobody uses); backward then returns ``None``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
        weight_init: Initializer | None = None,
        bias_init: Initializer | None = None,
    ):
        super().__init__()
        if min(in_channels, out_channels, kernel_size, stride) < 1 or padding < 0:
            raise ValueError(
                f"Conv2d needs positive channels, kernel_size and stride and padding >= 0; got "
                f"in={in_channels}, out={out_channels}, k={kernel_size}, stride={stride}, padding={padding}"
            )
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        fan_in = in_channels * kernel_size * kernel_size
        self.weight = Parameter(
            (out_channels, in_channels, kernel_size, kernel_size),
            weight_init if weight_init is not None else kaiming_uniform(fan_in),
        )
        self.bias = (
            Parameter((out_channels,), bias_init if bias_init is not None else uniform(1.0 / math.sqrt(fan_in)))
            if bias
            else None
        )
        self.compute_input_grad = True
        self._x_shape: tuple | None = None
        self._cols = None
        self._workspaces: dict = {}

    def output_shape(self, x_shape: tuple) -> tuple:
        """``(N, C, H, W) -> (N, F, OH, OW)`` (ValueError if the output would be empty)."""
        n, _, h, w = x_shape
        k, s, p = self.kernel_size, self.stride, self.padding
        return (n, self.out_channels, kernels.conv_output_size(h, k, s, p), kernels.conv_output_size(w, k, s, p))

    def forward(self, x):
        xp = get_array_module(x)
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"Conv2d expects (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        n, f, oh, ow = self.output_shape(x.shape)
        k, s, p = self.kernel_size, self.stride, self.padding

        cols = kernels.im2col(
            x, k, k, s, p, out=_workspace(self._workspaces, "cols", (self.in_channels * k * k, n * oh * ow), x)
        )
        y2d = _workspace(self._workspaces, "y2d", (f, n * oh * ow), x)
        xp.matmul(self.weight.data.reshape(f, -1), cols, out=y2d)
        if self.bias is not None:
            y2d += self.bias.data[:, None]

        self._x_shape, self._cols = tuple(x.shape), cols
        # (F, N, OH, OW) -> (N, F, OH, OW): a fresh array, since the caller may keep it.
        return xp.ascontiguousarray(y2d.reshape(f, n, oh, ow).transpose(1, 0, 2, 3))

    def backward(self, dy):
        if self._cols is None:
            raise RuntimeError("Conv2d.backward called before forward")
        xp = get_array_module(dy)
        n, f, oh, ow = dy.shape
        k, s, p = self.kernel_size, self.stride, self.padding

        dy2d = _workspace(self._workspaces, "dy2d", (f, n * oh * ow), dy)
        dy2d.reshape(f, n, oh, ow)[...] = dy.transpose(1, 0, 2, 3)

        xp.matmul(dy2d, self._cols.T, out=self.weight.grad.reshape(f, -1))
        if self.bias is not None:
            xp.sum(dy2d, axis=1, out=self.bias.grad)
        if not self.compute_input_grad:
            return None

        dcols = _workspace(self._workspaces, "dcols", self._cols.shape, dy)
        xp.matmul(self.weight.data.reshape(f, -1).T, dy2d, out=dcols)
        # dx is returned to the previous layer, which may keep it: a fresh array.
        return kernels.col2im(dcols, self._x_shape, k, k, s, p)

    def _drop_workspaces(self) -> None:
        self._workspaces = {}
        self._cols = None

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, bias={self.bias is not None}"
        )
