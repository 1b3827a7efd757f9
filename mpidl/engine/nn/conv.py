"""2-D convolution as matrix products (no library convolution): im2col + one GEMM, or, for
stride-1 3x3 filters, Winograd's minimal filtering (alpha^2 batched GEMMs with fewer FLOPs)."""

from __future__ import annotations

import math

from mpidl import kernels, settings
from mpidl.engine.backend import get_array_module, is_device_array
from mpidl.engine.nn import winograd
from mpidl.engine.nn.module import Module
from mpidl.engine.params import Initializer, Parameter, kaiming_uniform, uniform

__all__ = ["Conv2d", "CONV_ALGORITHMS"]

CONV_ALGORITHMS = ("auto", "im2col", "winograd")
_WINOGRAD_TILES = (2, 3, 4)  # m of F(m x m, r x r); m <= 4 keeps the float32 error near 1e-6 (points 0, +-1, +-2)
_WINOGRAD_MAX_KERNEL = 5  # alpha = m + k - 1 <= 8: the CUDA kernels' tile arrays, and points up to +-1/2
#: "auto" takes Winograd from this many input channels: its transforms cost per channel what the
#: GEMMs save, and with few channels they dominate (im2col is faster below 8 channels, the two
#: are even at 8 and Winograd wins from 16; benchmarks/results/notebook.md has the timings)
_WINOGRAD_MIN_CHANNELS = 8


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

    Each way is one call, :func:`mpidl.kernels.conv2d_forward` / ``conv2d_backward`` (NumPy
    reference, Numba CPU or Numba CUDA, chosen by the array). The CPU kernels do im2col, the
    product and col2im one sample at a time, so cols stays in cache, and keep ``x`` for backward
    (as :class:`~mpidl.engine.nn.Linear` keeps its input); the others keep ``cols``.
    Setting ``compute_input_grad = False`` skips ``dcols`` and ``col2im`` (the model does this
    for its first layer, whose input gradient nobody uses); backward then returns ``None``.

    Winograd (``algorithm="winograd"``; ``"auto"`` picks it for stride-1 3x3 filters of 8 or more
    input channels on the CPU)
    ------------------------------------------------------------------------------------------
    The algorithm, its math and its code are in :mod:`mpidl.engine.nn.winograd`. In exact arithmetic
    this is the same function and gradient as im2col; it does ``alpha^2 / (m^2 k^2)`` of the
    multiplications (F(3x3, 3x3): 25/81), at the price of float32 rounding a few times larger
    (about 1e-6 relative). ``m`` is the tile in (2, 3, 4) that minimizes ``alpha^2 * tiles``
    (9x9 outputs: m = 3, no wasted tile; 32x32: m = 4). ``"auto"`` can be overridden for every
    layer of a run with the environment variable ``MPIDL_CONV_ALGORITHM=im2col|winograd`` (for
    debugging or comparing), read once by :mod:`mpidl.settings` and looked at by each forward
    of an ``"auto"`` layer; a layer built with an explicit ``algorithm`` (or whose
    ``algorithm`` attribute is set later: the next forward uses it) ignores it.
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
        algorithm: str = "auto",
    ):
        super().__init__()
        if algorithm not in CONV_ALGORITHMS:
            raise ValueError(f"Conv2d: algorithm must be one of {', '.join(CONV_ALGORITHMS)}; got {algorithm!r}")
        if algorithm == "winograd" and (stride != 1 or kernel_size > _WINOGRAD_MAX_KERNEL):
            raise ValueError(
                f"Conv2d: the winograd algorithm needs stride 1 and kernel_size <= {_WINOGRAD_MAX_KERNEL}, "
                f"got stride={stride}, kernel_size={kernel_size}"
            )
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
        self.algorithm = algorithm
        self.compute_input_grad = True
        self._saved = None  # the kernels' saved state of an im2col forward
        self._winograd = None  # (m, U, the kernels' saved state) of a Winograd forward
        self._workspaces: dict = {}

    def output_shape(self, x_shape: tuple) -> tuple:
        """``(N, C, H, W) -> (N, F, OH, OW)`` (ValueError if the output would be empty)."""
        n, _, h, w = x_shape
        k, s, p = self.kernel_size, self.stride, self.padding
        return (n, self.out_channels, kernels.conv_output_size(h, k, s, p), kernels.conv_output_size(w, k, s, p))

    def winograd_tile(self, out_h: int, out_w: int, on_gpu: bool = False) -> int | None:
        """The Winograd tile ``m`` this layer uses for an ``out_h x out_w`` output, or ``None``
        when it runs im2col: stride != 1, a kernel larger than 5x5, ``algorithm="im2col"``, or
        ``"auto"`` with a kernel other than 3x3, fewer than 8 input channels (an RGB stem), on
        the GPU, or under ``MPIDL_CONV_ALGORITHM=im2col`` (``settings.SETTINGS.conv_algorithm``).

        ``"auto"`` picks Winograd only where it was measured to win: on the CPU (see
        ``benchmarks/conv.py``). On the GPU one large cuBLAS GEMM is already efficient and the
        Winograd transforms have not been timed on a device yet, so ``"auto"`` stays im2col
        there; ``benchmarks/gpu_step.py`` times both for the session that has a GPU."""
        algorithm = self.algorithm
        if algorithm == "auto":
            forced = settings.SETTINGS.conv_algorithm  # MPIDL_CONV_ALGORITHM; ValueError if malformed
            if forced is not None:
                algorithm = forced
            else:
                algorithm = ("winograd" if self.kernel_size == 3 and not on_gpu
                             and self.in_channels >= _WINOGRAD_MIN_CHANNELS else "im2col")
        k = self.kernel_size
        if algorithm != "winograd" or self.stride != 1 or k > _WINOGRAD_MAX_KERNEL:
            return None

        def multiplies(m: int) -> int:  # per (sample, filter, channel): alpha^2 per tile
            return (m + k - 1) ** 2 * (-(-out_h // m)) * (-(-out_w // m))

        return min(_WINOGRAD_TILES, key=lambda m: (multiplies(m), m))

    def forward(self, x):
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"Conv2d expects (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        _, _, oh, ow = self.output_shape(x.shape)
        self._saved = self._winograd = None
        m = self.winograd_tile(oh, ow, on_gpu=is_device_array(x))
        if m is not None:
            return winograd.forward(self, x, m)
        bias = None if self.bias is None else self.bias.data
        y, self._saved = kernels.conv2d_forward(x, self.weight.data, bias, self.stride, self.padding)
        return y

    def backward(self, dy):
        if self._winograd is not None:
            dx = winograd.backward(self, dy)
        elif self._saved is not None:
            dw, dx = kernels.conv2d_backward(dy, self.weight.data, self._saved, self.stride, self.padding,
                                             input_grad=self.compute_input_grad)
            self.weight.grad[...] = dw
        else:
            raise RuntimeError("Conv2d.backward called before forward")
        if self.bias is not None:
            get_array_module(dy).sum(dy, axis=(0, 2, 3), out=self.bias.grad)
        return dx

    def _drop_workspaces(self) -> None:
        self._workspaces = {}
        self._saved = None
        self._winograd = None

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, bias={self.bias is not None}"
            + ("" if self.algorithm == "auto" else f", algorithm={self.algorithm!r}")
        )
