"""2-D convolution as matrix products (no library convolution): im2col + one GEMM, or, for
stride-1 3x3 filters, Winograd's minimal filtering (alpha^2 batched GEMMs with fewer FLOPs)."""

from __future__ import annotations

import math
import os

import numpy as np

from mpidl import kernels
from mpidl.backend import get_array_module, is_device_array
from mpidl.blas import batched_matmul, matmul
from mpidl.nn.module import Module
from mpidl.params import Initializer, Parameter, kaiming_uniform, uniform

__all__ = ["Conv2d", "CONV_ALGORITHMS"]

CONV_ALGORITHMS = ("auto", "im2col", "winograd")
_ALGORITHM_ENV = "MPIDL_CONV_ALGORITHM"
_WINOGRAD_TILES = (2, 3, 4)  # m of F(m x m, r x r); m <= 4 keeps the float32 error near 1e-6 (points 0, +-1, +-2)
_WINOGRAD_MAX_KERNEL = 5  # alpha = m + k - 1 <= 8: the CUDA kernels' tile arrays, and points up to +-1/2


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


def _by_position(transformed):
    """``(C, alpha, alpha, P)`` -> the ``(alpha^2, C, P)`` view the batched GEMMs take (no copy)."""
    c, alpha, _, columns = transformed.shape
    return transformed.reshape(c, alpha * alpha, columns).transpose(1, 0, 2)


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

    Winograd (``algorithm="winograd"``; ``"auto"`` picks it for stride-1 3x3 filters on the CPU)
    ------------------------------------------------------------------------------------------
    With output tiles of ``m x m`` and ``alpha = m + k - 1`` (transform matrices ``A^T, G, B^T``
    from :func:`mpidl.kernels.reference.winograd_matrices`):

    * ``U = G W G^T``  per filter pair,       ``U : (alpha^2, F, C)``
    * ``V = B^T d B``  per input tile,        ``V : (C, alpha^2, P)``, ``P = tiles * N``
    * ``M[:, xi] = U[xi] @ V[:, xi]`` for each of the alpha^2 positions xi (one batched GEMM)
    * ``y = A^T M A`` per tile, plus the bias.

    Every step is linear, so backward is the adjoints in reverse order:
    ``dM = A dY A^T``; ``dU[xi] = dM[:, xi] @ V[:, xi].T`` then ``dW = G^T dU G``;
    ``dV[:, xi] = U[xi].T @ dM[:, xi]`` then ``dx`` = scatter-add of ``B dV B^T``. In exact arithmetic
    this is the same function and gradient as im2col; it does ``alpha^2 / (m^2 k^2)`` of the
    multiplications (F(3x3, 3x3): 25/81), at the price of float32 rounding a few times larger
    (about 1e-6 relative). ``m`` is the tile in (2, 3, 4) that minimizes ``alpha^2 * tiles``
    (9x9 outputs: m = 3, no wasted tile; 32x32: m = 4). ``"auto"`` can be overridden for every
    layer with the environment variable ``MPIDL_CONV_ALGORITHM=im2col|winograd`` (for
    debugging or comparing; it is read at each forward).
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
        self._x_shape: tuple | None = None
        self._cols = None
        self._winograd = None  # (m, U, V) saved by a Winograd forward
        self._workspaces: dict = {}

    def output_shape(self, x_shape: tuple) -> tuple:
        """``(N, C, H, W) -> (N, F, OH, OW)`` (ValueError if the output would be empty)."""
        n, _, h, w = x_shape
        k, s, p = self.kernel_size, self.stride, self.padding
        return (n, self.out_channels, kernels.conv_output_size(h, k, s, p), kernels.conv_output_size(w, k, s, p))

    def winograd_tile(self, out_h: int, out_w: int, on_gpu: bool = False) -> int | None:
        """The Winograd tile ``m`` this layer uses for an ``out_h x out_w`` output, or ``None``
        when it runs im2col: stride != 1, a kernel larger than 5x5, ``algorithm="im2col"``, or
        ``"auto"`` with a kernel other than 3x3, on the GPU, or under ``MPIDL_CONV_ALGORITHM=im2col``.

        ``"auto"`` picks Winograd only where it was measured to win: on the CPU (see
        ``benchmarks/conv.py``). On the GPU one large cuBLAS GEMM is already efficient and the
        Winograd transforms have not been timed on a device yet, so ``"auto"`` stays im2col
        there; ``benchmarks/gpu_step.py`` times both for the session that has a GPU."""
        algorithm = self.algorithm
        if algorithm == "auto":
            forced = os.environ.get(_ALGORITHM_ENV, "").strip().lower()
            if forced not in ("", *CONV_ALGORITHMS):
                raise ValueError(f"{_ALGORITHM_ENV}={forced!r} is not one of {', '.join(CONV_ALGORITHMS)} (or unset)")
            if forced in ("im2col", "winograd"):
                algorithm = forced
            else:
                algorithm = "winograd" if self.kernel_size == 3 and not on_gpu else "im2col"
        k = self.kernel_size
        if algorithm != "winograd" or self.stride != 1 or k > _WINOGRAD_MAX_KERNEL:
            return None

        def multiplies(m: int) -> int:  # per (sample, filter, channel): alpha^2 per tile
            return (m + k - 1) ** 2 * (-(-out_h // m)) * (-(-out_w // m))

        return min(_WINOGRAD_TILES, key=lambda m: (multiplies(m), m))

    def forward(self, x):
        xp = get_array_module(x)
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"Conv2d expects (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        n, f, oh, ow = self.output_shape(x.shape)
        k, s, p = self.kernel_size, self.stride, self.padding
        self._cols = self._winograd = None
        m = self.winograd_tile(oh, ow, on_gpu=is_device_array(x))
        if m is not None:
            return self._winograd_forward(x, m, (n, f, oh, ow))

        cols = kernels.im2col(
            x, k, k, s, p, out=_workspace(self._workspaces, "cols", (self.in_channels * k * k, n * oh * ow), x)
        )
        y2d = _workspace(self._workspaces, "y2d", (f, n * oh * ow), x)
        matmul(self.weight.data.reshape(f, -1), cols, y2d)
        if self.bias is not None:
            y2d += self.bias.data[:, None]

        self._x_shape, self._cols = tuple(x.shape), cols
        # (F, N, OH, OW) -> (N, F, OH, OW): a fresh array, since the caller may keep it.
        return xp.ascontiguousarray(y2d.reshape(f, n, oh, ow).transpose(1, 0, 2, 3))

    def backward(self, dy):
        if self._winograd is not None:
            return self._winograd_backward(dy)
        if self._cols is None:
            raise RuntimeError("Conv2d.backward called before forward")
        xp = get_array_module(dy)
        n, f, oh, ow = dy.shape
        k, s, p = self.kernel_size, self.stride, self.padding

        dy2d = _workspace(self._workspaces, "dy2d", (f, n * oh * ow), dy)
        dy2d.reshape(f, n, oh, ow)[...] = dy.transpose(1, 0, 2, 3)

        matmul(dy2d, self._cols.T, self.weight.grad.reshape(f, -1))
        if self.bias is not None:
            xp.sum(dy2d, axis=1, out=self.bias.grad)
        if not self.compute_input_grad:
            return None

        dcols = _workspace(self._workspaces, "dcols", self._cols.shape, dy)
        matmul(self.weight.data.reshape(f, -1).T, dy2d, dcols)
        # dx is returned to the previous layer, which may keep it: a fresh array.
        return kernels.col2im(dcols, self._x_shape, k, k, s, p)

    # ----------------------------------------------------------------------------------------
    # Winograd F(m x m, k x k) (see the class docstring)
    # ----------------------------------------------------------------------------------------

    def _filter_matrix(self, m: int, like):
        """``K = kron(G, G) : (alpha^2, k^2)`` of F(m, k) in ``like``'s dtype and device (cached):
        ``K[a*alpha + b, i*k + j] = G[a, i] G[b, j]``, so the filter transform is one product."""
        xp = get_array_module(like)
        key = ("winograd_filter", m, str(like.dtype), xp.__name__)
        matrix = self._workspaces.get(key)
        if matrix is None:
            g = kernels.winograd_matrices(m, self.kernel_size)[1]
            matrix = self._workspaces[key] = xp.asarray(np.kron(g, g), dtype=like.dtype)
        return matrix

    def _filter_transform(self, m: int, like):
        """``U[a, b, f, c] = sum_{i,j} G[a, i] W[f, c, i, j] G[b, j]``, as ``(alpha^2, F, C)``:
        ``U = K @ W2.T`` with ``W2 = W.reshape(F*C, k*k)`` (one GEMM; BLAS reads the transpose
        in place, and the result is already in the layout the batched GEMMs take)."""
        f, c, k = self.out_channels, self.in_channels, self.kernel_size
        alpha = m + k - 1
        u = _workspace(self._workspaces, "U", (alpha * alpha, f * c), like)
        get_array_module(like).matmul(self._filter_matrix(m, like), self.weight.data.reshape(f * c, k * k).T, out=u)
        return u.reshape(alpha * alpha, f, c)

    def _filter_transform_adjoint(self, du, m: int) -> None:
        """``weight.grad[f, c, i, j] = sum_{a,b} G[a, i] dU[a, b, f, c] G[b, j]`` (adjoint of
        :meth:`_filter_transform`): ``dW2 = dU2.T @ K``, written in place."""
        f, c, k = self.out_channels, self.in_channels, self.kernel_size
        alpha = m + k - 1
        get_array_module(du).matmul(
            du.reshape(alpha * alpha, f * c).T, self._filter_matrix(m, du), out=self.weight.grad.reshape(f * c, k * k)
        )

    def _winograd_forward(self, x, m: int, y_shape: tuple):
        n, f, oh, ow = y_shape
        c, k, p = self.in_channels, self.kernel_size, self.padding
        alpha = m + k - 1
        _, _, tiles_h, tiles_w = kernels.winograd_geometry(x.shape, m, k, p)
        columns = tiles_h * tiles_w * n
        u = self._filter_transform(m, x)
        v = kernels.winograd_input(x, m, k, p, out=_workspace(self._workspaces, "V", (c, alpha, alpha, columns), x))
        mt = _workspace(self._workspaces, "M", (f, alpha, alpha, columns), x)
        # The transforms keep the channel outermost (see mpidl.kernels.reference); the batched
        # GEMM takes the (alpha^2, C, P) views with a row stride of alpha^2 * P.
        batched_matmul(u, _by_position(v), _by_position(mt))
        self._x_shape, self._winograd = tuple(x.shape), (m, u, v)
        # A fresh array (the caller may keep it); the bias is added inside the output transform.
        return kernels.winograd_output(mt, y_shape, m, k, bias=None if self.bias is None else self.bias.data)

    def _winograd_backward(self, dy):
        xp = get_array_module(dy)
        m, u, v = self._winograd
        f, c, k, p = self.out_channels, self.in_channels, self.kernel_size, self.padding
        alpha = m + k - 1
        columns = v.shape[-1]
        dm = kernels.winograd_output_adjoint(dy, m, k, out=_workspace(self._workspaces, "dM", (f, alpha, alpha, columns), dy))
        du = _workspace(self._workspaces, "dU", (alpha * alpha, f, c), dy)
        batched_matmul(_by_position(dm), _by_position(v).transpose(0, 2, 1), du)
        self._filter_transform_adjoint(du, m)
        if self.bias is not None:
            xp.sum(dy, axis=(0, 2, 3), out=self.bias.grad)
        if not self.compute_input_grad:
            return None
        dv = _workspace(self._workspaces, "dV", (c, alpha, alpha, columns), dy)
        batched_matmul(u.transpose(0, 2, 1), _by_position(dm), _by_position(dv))
        # dx is returned to the previous layer, which may keep it: a fresh array.
        return kernels.winograd_input_adjoint(dv, self._x_shape, m, k, p)

    def _drop_workspaces(self) -> None:
        self._workspaces = {}
        self._cols = None
        self._winograd = None

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, bias={self.bias is not None}"
            + ("" if self.algorithm == "auto" else f", algorithm={self.algorithm!r}")
        )
