"""Pooling layers: max, average, and global average (no parameters)."""

from __future__ import annotations

from mpidl import kernels
from mpidl.engine.backend import get_array_module
from mpidl.engine.nn.module import Module

__all__ = ["MaxPool2d", "AvgPool2d", "GlobalAvgPool2d"]


class _Pool2d(Module):
    def __init__(self, kernel_size: int, stride: int | None = None, padding: int = 0):
        super().__init__()
        stride = kernel_size if stride is None else stride
        if kernel_size < 1 or stride < 1 or padding < 0:
            raise ValueError(
                f"{type(self).__name__} needs kernel_size >= 1, stride >= 1, padding >= 0; "
                f"got {kernel_size}, {stride}, {padding}"
            )
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self._x_shape: tuple | None = None

    def output_shape(self, x_shape: tuple) -> tuple:
        n, c, h, w = x_shape
        k, s, p = self.kernel_size, self.stride, self.padding
        return (n, c, kernels.conv_output_size(h, k, s, p), kernels.conv_output_size(w, k, s, p))

    def _check_input(self, x) -> None:
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__} expects (N, C, H, W), got {tuple(x.shape)}")

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2d(_Pool2d):
    """Max over ``k x k`` windows (stride defaults to ``k``; windows that do not fit are dropped).

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, C, OH, OW), ``OH = (H + 2*padding - k) // stride + 1``
    (so a 9x9 input with k = 2 gives 4x4: the last row and column are not pooled).

    Notes
    -----
    ``y = max over the window``; ``dL/dx`` is ``dL/dy`` at the window's winning pixel and 0
    elsewhere (summed where windows overlap). Only the winners' indices (``argmax``) are
    saved for backward.
    """

    def __init__(self, kernel_size: int, stride: int | None = None, padding: int = 0):
        super().__init__(kernel_size, stride, padding)
        if padding > kernel_size // 2:
            raise ValueError(f"MaxPool2d needs padding <= kernel_size // 2, got padding={padding}, k={kernel_size}")
        self._argmax = None

    def forward(self, x):
        self._check_input(x)
        y, self._argmax = kernels.maxpool2d_forward(x, self.kernel_size, self.stride, self.padding)
        self._x_shape = tuple(x.shape)
        return y

    def backward(self, dy):
        if self._argmax is None:
            raise RuntimeError("MaxPool2d.backward called before forward")
        return kernels.maxpool2d_backward(dy, self._argmax, self._x_shape, self.kernel_size, self.stride, self.padding)


class AvgPool2d(_Pool2d):
    """Mean over ``k x k`` windows; zero padding counts in the mean (``count_include_pad``).

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, C, OH, OW)

    Notes
    -----
    ``y = (1/k^2) * sum over the window``; ``dL/dx`` receives ``dL/dy / k^2`` at every pixel of
    the window. Only the input shape is saved for backward.
    """

    def forward(self, x):
        self._check_input(x)
        self._x_shape = tuple(x.shape)
        return kernels.avgpool2d_forward(x, self.kernel_size, self.stride, self.padding)

    def backward(self, dy):
        if self._x_shape is None:
            raise RuntimeError("AvgPool2d.backward called before forward")
        return kernels.avgpool2d_backward(dy, self._x_shape, self.kernel_size, self.stride, self.padding)


class GlobalAvgPool2d(Module):
    """Mean over the whole spatial plane of each channel, flattened.

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, C)

    Notes
    -----
    ``y[n, c] = (1 / (H*W)) * sum_{h,w} x[n, c, h, w]`` and ``dL/dx[n, c, h, w] = dL/dy[n, c] / (H*W)``.
    This is a plain reduction rather than a pooling kernel call: the "window" is the whole
    (possibly non-square) plane, so there is nothing to slide.
    """

    def __init__(self) -> None:
        super().__init__()
        self._x_shape: tuple | None = None

    def forward(self, x):
        if x.ndim != 4:
            raise ValueError(f"GlobalAvgPool2d expects (N, C, H, W), got {tuple(x.shape)}")
        self._x_shape = tuple(x.shape)
        return x.mean(axis=(2, 3))

    def backward(self, dy):
        if self._x_shape is None:
            raise RuntimeError("GlobalAvgPool2d.backward called before forward")
        xp = get_array_module(dy)
        n, c, h, w = self._x_shape
        share = dy / (h * w)
        return xp.ascontiguousarray(xp.broadcast_to(share[:, :, None, None], self._x_shape))
