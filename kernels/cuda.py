"""Numba CUDA kernels: im2col / col2im and pooling on the GPU (``numba.cuda.jit``).

Same functions, signatures and layouts as :mod:`mpidl.kernels.reference` (the math and the
layouts are there). The arguments are checked by the dispatcher, :mod:`mpidl.kernels`; the
functions here check only what is theirs: the dtype (float32 or float64) and the kind of
array (below). Every kernel runs one thread per element of its result, on a 1-D grid of
``ceil(total / 256)`` blocks of 256 threads, each thread checking ``t < total``.

Every kernel is a gather
------------------------
The adjoint kernels (``col2im`` and the pooling backward passes) are scatter-adds when read
from the output side. Here each thread instead owns one *input* pixel and sums everything
that lands on it: for kernel offset ``i`` the only output row that can touch pixel ``h`` is
``oh = (h + pad - i) / stride``, and only when that division is exact and
``0 <= oh < OH``. So every result element is written by exactly one thread, with no atomics,
no zero-fill and a deterministic result. The offsets are visited in increasing ``(i, j)``,
the order in which the reference adds them, so the sums agree with it to the last bit.
Max pooling backward is a gather too: the thread for pixel ``(h, w)`` adds ``dy`` of each
window covering it whose ``argmax`` equals ``h*W + w``.

Arrays this module takes
------------------------
* CuPy arrays (the normal case): results are CuPy arrays. Numba sees them zero-copy through
  ``__cuda_array_interface__`` and the kernels are launched on CuPy's current stream, so they
  are ordered with the CuPy work around them.
* Numba device arrays (``cuda.to_device``) or any other object exposing
  ``__cuda_array_interface__``: results are Numba device arrays. :mod:`mpidl.kernels` sends
  these here too.
* NumPy arrays, only under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), called directly
  (the dispatcher sends NumPy arrays to ``cpu``): results are NumPy arrays. That is how the
  tests run these kernels on a machine without a GPU.

Nothing here touches CUDA or imports CuPy at import time: the kernels compile at their first
launch, and CuPy is imported only when a CuPy array comes in, so this module imports cleanly
on a machine with neither.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import config as numba_config
from numba import cuda

from . import reference
from .reference import conv_output_size

__all__ = [
    "THREADS_PER_BLOCK",
    "blocks_for",
    "conv_output_size",
    "im2col",
    "col2im",
    "conv2d_forward",
    "conv2d_backward",
    "maxpool2d_forward",
    "maxpool2d_backward",
    "avgpool2d_forward",
    "avgpool2d_backward",
]

THREADS_PER_BLOCK = 256
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def blocks_for(total: int, threads_per_block: int = THREADS_PER_BLOCK) -> int:
    """Blocks of a 1-D grid with one thread per element: ``ceil(total / threads_per_block)``
    (at least 1; the threads past ``total`` return at their bounds check)."""
    return max(1, (int(total) + threads_per_block - 1) // threads_per_block)


# --------------------------------------------------------------------------------------------
# the kernels (one thread per result element)
# --------------------------------------------------------------------------------------------


@cuda.jit(device=True)
def _nchw(t, c_size, h_size, w_size):
    """``(n, c, h, w)`` of flat index ``t`` in a C-contiguous ``(N, C, H, W)`` array: the
    one-thread-per-element kernels decode their thread index with it."""
    w = t % w_size
    rest = t // w_size
    h = rest % h_size
    rest = rest // h_size
    return rest // c_size, rest % c_size, h, w


@cuda.jit
def _im2col_kernel(x, kh, kw, stride, pad, out_h, out_w, cols):
    """Thread ``t`` writes ``cols.flat[t]``: consecutive threads write consecutive columns of
    one row (coalesced stores) and read neighbouring pixels of one input row."""
    rows, width = cols.shape
    t = cuda.grid(1)
    if t >= rows * width:
        return
    r = t // width
    col = t - r * width
    c = r // (kh * kw)
    i = (r // kw) % kh
    j = r % kw
    plane = out_h * out_w
    n = col // plane
    oh = (col % plane) // out_w
    ow = col % out_w
    h = oh * stride + i - pad
    w = ow * stride + j - pad
    if 0 <= h < x.shape[2] and 0 <= w < x.shape[3]:
        cols[r, col] = x[n, c, h, w]
    else:
        cols[r, col] = 0


@cuda.jit(device=True)
def _source_index(pixel, pad, offset, stride, out_size):
    """The output index ``o`` with ``o*stride + offset - pad == pixel``, or -1 if none exists
    (the division is not exact, or ``o`` falls outside ``[0, out_size)``)."""
    shifted = pixel + pad - offset
    if shifted < 0 or shifted % stride != 0:
        return -1
    o = shifted // stride
    if o >= out_size:
        return -1
    return o


@cuda.jit(device=True)
def _window_range(start, k, size):
    """Offsets ``[lo, hi)`` of a ``k``-wide window starting at ``start`` that land inside
    ``[0, size)`` (the rest is padding). Written with branches: the ``max``/``min`` builtins
    do not type for CUDA device code in every Numba version."""
    lo = -start if start < 0 else 0
    hi = size - start if start + k > size else k
    return lo, hi


@cuda.jit
def _col2im_kernel(cols, kh, kw, stride, pad, out_h, out_w, zero, dx):
    """Thread ``t`` owns pixel ``dx.flat[t] = dx[n, c, h, w]`` and sums the (at most kh*kw)
    columns that hold it, offsets in increasing ``(i, j)``."""
    n_size, c_size, h_size, w_size = dx.shape
    t = cuda.grid(1)
    if t >= n_size * c_size * h_size * w_size:
        return
    n, c, h, w = _nchw(t, c_size, h_size, w_size)
    total = zero
    for i in range(kh):
        oh = _source_index(h, pad, i, stride, out_h)
        if oh < 0:
            continue
        for j in range(kw):
            ow = _source_index(w, pad, j, stride, out_w)
            if ow < 0:
                continue
            total += cols[(c * kh + i) * kw + j, (n * out_h + oh) * out_w + ow]
    dx[n, c, h, w] = total


@cuda.jit
def _maxpool_forward_kernel(x, k, stride, pad, y, argmax):
    """Thread ``t`` owns output pixel ``y.flat[t]``: first real pixel of the window, then a
    later one only if strictly greater (ties to the first maximum, as in the reference)."""
    n_size, c_size, out_h, out_w = y.shape
    h_size, w_size = x.shape[2], x.shape[3]
    t = cuda.grid(1)
    if t >= n_size * c_size * out_h * out_w:
        return
    n, c, oh, ow = _nchw(t, c_size, out_h, out_w)
    h0 = oh * stride - pad
    w0 = ow * stride - pad
    i_lo, i_hi = _window_range(h0, k, h_size)
    j_lo, j_hi = _window_range(w0, k, w_size)
    best = x[n, c, h0 + i_lo, w0 + j_lo]
    best_index = (h0 + i_lo) * w_size + (w0 + j_lo)
    for i in range(i_lo, i_hi):
        for j in range(j_lo, j_hi):
            v = x[n, c, h0 + i, w0 + j]
            if v > best:
                best = v
                best_index = (h0 + i) * w_size + (w0 + j)
    y[n, c, oh, ow] = best
    argmax[n, c, oh, ow] = best_index


@cuda.jit
def _maxpool_backward_kernel(dy, argmax, k, stride, pad, zero, dx):
    """Thread ``t`` owns input pixel ``dx.flat[t]`` and adds ``dy`` of each covering window
    that this pixel won (gather: no atomics)."""
    n_size, c_size, h_size, w_size = dx.shape
    out_h, out_w = dy.shape[2], dy.shape[3]
    t = cuda.grid(1)
    if t >= n_size * c_size * h_size * w_size:
        return
    n, c, h, w = _nchw(t, c_size, h_size, w_size)
    me = h * w_size + w
    total = zero
    for i in range(k):
        oh = _source_index(h, pad, i, stride, out_h)
        if oh < 0:
            continue
        for j in range(k):
            ow = _source_index(w, pad, j, stride, out_w)
            if ow >= 0 and argmax[n, c, oh, ow] == me:
                total += dy[n, c, oh, ow]
    dx[n, c, h, w] = total


@cuda.jit
def _avgpool_forward_kernel(x, k, stride, pad, window, zero, y):
    """Thread ``t`` owns ``y.flat[t]``: the window's sum (padding adds zeros) over ``k*k``."""
    n_size, c_size, out_h, out_w = y.shape
    h_size, w_size = x.shape[2], x.shape[3]
    t = cuda.grid(1)
    if t >= n_size * c_size * out_h * out_w:
        return
    n, c, oh, ow = _nchw(t, c_size, out_h, out_w)
    h0 = oh * stride - pad
    w0 = ow * stride - pad
    i_lo, i_hi = _window_range(h0, k, h_size)
    j_lo, j_hi = _window_range(w0, k, w_size)
    total = zero
    for i in range(i_lo, i_hi):
        for j in range(j_lo, j_hi):
            total += x[n, c, h0 + i, w0 + j]
    y[n, c, oh, ow] = total / window


@cuda.jit
def _avgpool_backward_kernel(dy, k, stride, pad, window, zero, dx):
    """Thread ``t`` owns ``dx.flat[t]`` and sums ``dy / k^2`` of every window covering it."""
    n_size, c_size, h_size, w_size = dx.shape
    out_h, out_w = dy.shape[2], dy.shape[3]
    t = cuda.grid(1)
    if t >= n_size * c_size * h_size * w_size:
        return
    n, c, h, w = _nchw(t, c_size, h_size, w_size)
    total = zero
    for i in range(k):
        oh = _source_index(h, pad, i, stride, out_h)
        if oh < 0:
            continue
        for j in range(k):
            ow = _source_index(w, pad, j, stride, out_w)
            if ow >= 0:
                total += dy[n, c, oh, ow] / window
    dx[n, c, h, w] = total


# --------------------------------------------------------------------------------------------
# arrays in, arrays out: CuPy, Numba device arrays, or NumPy under the simulator
# --------------------------------------------------------------------------------------------


def _simulating() -> bool:
    return bool(numba_config.ENABLE_CUDASIM)


class _Device:
    """How to allocate results like a given input array and how to launch on it.

    ``kind`` is ``"cupy"``, ``"numba"`` (Numba device arrays and other
    ``__cuda_array_interface__`` objects) or ``"numpy"`` (simulator only).
    """

    def __init__(self, like):
        module = type(like).__module__
        if module.startswith("cupy"):
            self.kind = "cupy"
        elif isinstance(like, np.ndarray):
            if not _simulating():
                raise ValueError(
                    "the CUDA kernels take device arrays (CuPy, or Numba device arrays); got a "
                    "NumPy array (mpidl.kernels sends those to the cpu kernels; NUMBA_ENABLE_CUDASIM=1 simulates)"
                )
            self.kind = "numpy"
        elif getattr(like, "__cuda_ndarray__", False) or hasattr(like, "__cuda_array_interface__"):
            self.kind = "numba"
        else:
            raise ValueError(f"the CUDA kernels cannot take an array of type {type(like).__name__}")

    def empty(self, shape, dtype):
        if self.kind == "cupy":
            import cupy  # noqa: PLC0415 - optional dependency, only needed for CuPy input

            return cupy.empty(shape, dtype=dtype)
        if self.kind == "numpy":
            return np.empty(shape, dtype=dtype)
        return cuda.device_array(shape, dtype=dtype)

    def contiguous(self, a, dtype=None):
        """``a`` as a C-contiguous array of this kind (a copy only when needed)."""
        if self.kind == "cupy":
            import cupy  # noqa: PLC0415

            return cupy.ascontiguousarray(a, dtype=dtype)
        if self.kind == "numpy":
            return np.ascontiguousarray(a, dtype=dtype)
        if not getattr(a, "__cuda_ndarray__", False):
            a = cuda.as_cuda_array(a)
        if not a.is_c_contiguous() or (dtype is not None and a.dtype != np.dtype(dtype)):
            raise ValueError("Numba device arrays passed to the CUDA kernels must be C-contiguous and of the right dtype")
        return a

    def kernel_arg(self, a):
        """What the jitted kernel receives for array ``a``: CuPy arrays become zero-copy Numba
        views. ``sync=False``: the launch goes on CuPy's current stream (see ``launch``), which
        already orders it after the work that produced ``a``, so a host-side wait is not needed."""
        if self.kind == "cupy":
            return cuda.as_cuda_array(a, sync=False)
        return a

    def launch(self, kernel, total, *args):
        """Launch ``kernel`` with one thread per result element (``total`` of them)."""
        args = tuple(self.kernel_arg(a) if _is_array(a) else a for a in args)
        stream = 0  # Numba's default stream, for Numba device arrays and the simulator
        if self.kind == "cupy":
            import cupy  # noqa: PLC0415

            # Run on CuPy's current stream, so the kernel is ordered with the CuPy operations
            # before and after it (Numba's default stream could be a different one).
            stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        kernel[blocks_for(total), THREADS_PER_BLOCK, stream](*args)


def _is_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not np.isscalar(a)


def _check_float(dtype, what):
    if np.dtype(dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"{what}: the CUDA kernels take float32 or float64, got {np.dtype(dtype)}")



# --------------------------------------------------------------------------------------------
# the public functions
# --------------------------------------------------------------------------------------------


def im2col(x, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """:func:`mpidl.kernels.reference.im2col`, one thread per element of ``cols``."""
    device = _Device(x)
    _check_float(x.dtype, "im2col")
    n, c, h, w = x.shape
    out_h = conv_output_size(h, kh, stride, pad)
    out_w = conv_output_size(w, kw, stride, pad)
    shape = (c * kh * kw, n * out_h * out_w)
    cols = device.empty(shape, x.dtype) if out is None else out
    device.launch(_im2col_kernel, shape[0] * shape[1], device.contiguous(x), kh, kw, stride, pad, out_h, out_w, cols)
    return cols


def col2im(cols, x_shape, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """:func:`mpidl.kernels.reference.col2im` as a gather: one thread per pixel of ``dx`` sums
    the columns for which ``oh = (h + pad - i) / stride`` and ``ow = (w + pad - j) / stride`` are
    exact and inside the output; no atomics."""
    device = _Device(cols)
    _check_float(cols.dtype, "col2im")
    n, c, h, w = x_shape
    out_h = conv_output_size(h, kh, stride, pad)
    out_w = conv_output_size(w, kw, stride, pad)
    dx = device.empty((n, c, h, w), cols.dtype) if out is None else out
    zero = cols.dtype.type(0)
    device.launch(_col2im_kernel, n * c * h * w, device.contiguous(cols), kh, kw, stride, pad, out_h, out_w, zero, dx)
    return dx



def conv2d_forward(x, weight, bias=None, stride: int = 1, pad: int = 0):
    """:func:`mpidl.kernels.reference.conv2d_forward` with :func:`im2col` above and cuBLAS's
    product (CuPy); returns ``(y, cols)``."""
    return reference.conv2d_forward(x, weight, bias, stride, pad, pieces=sys.modules[__name__])


def conv2d_backward(dy, weight, cols, x_shape, stride: int = 1, pad: int = 0, input_grad: bool = True):
    """:func:`mpidl.kernels.reference.conv2d_backward` with :func:`col2im` above."""
    return reference.conv2d_backward(dy, weight, cols, x_shape, stride, pad, input_grad, pieces=sys.modules[__name__])


def maxpool2d_forward(x, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.maxpool2d_forward`, one thread per output pixel."""
    device = _Device(x)
    _check_float(x.dtype, "maxpool2d_forward")
    n, c, h, w = x.shape
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    y = device.empty((n, c, out_h, out_w), x.dtype)
    argmax = device.empty((n, c, out_h, out_w), np.int32)
    device.launch(_maxpool_forward_kernel, n * c * out_h * out_w, device.contiguous(x), k, stride, pad, y, argmax)
    return y, argmax


def maxpool2d_backward(dy, argmax, x_shape, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.maxpool2d_backward` as a gather: the thread for input
    pixel ``(h, w)`` adds ``dy`` of each covering window with ``argmax == h*W + w``. An index
    outside the window can match no thread, so a corrupt ``argmax`` loses gradient but never
    writes out of bounds."""
    device = _Device(dy)
    _check_float(dy.dtype, "maxpool2d_backward")
    n, c, h, w = x_shape
    dx = device.empty((n, c, h, w), dy.dtype)
    zero = dy.dtype.type(0)
    device.launch(
        _maxpool_backward_kernel, n * c * h * w,
        device.contiguous(dy), device.contiguous(argmax, np.int32), k, stride, pad, zero, dx,
    )
    return dx


def avgpool2d_forward(x, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.avgpool2d_forward`, one thread per output pixel."""
    device = _Device(x)
    _check_float(x.dtype, "avgpool2d_forward")
    n, c, h, w = x.shape
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    y = device.empty((n, c, out_h, out_w), x.dtype)
    # k*k and 0 as scalars of the array's dtype, so float32 arrays get float32 arithmetic.
    window, zero = x.dtype.type(k * k), x.dtype.type(0)
    device.launch(_avgpool_forward_kernel, n * c * out_h * out_w, device.contiguous(x), k, stride, pad, window, zero, y)
    return y


def avgpool2d_backward(dy, x_shape, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.avgpool2d_backward` as a gather: one thread per input
    pixel sums ``dy / k^2`` of every window covering it."""
    device = _Device(dy)
    _check_float(dy.dtype, "avgpool2d_backward")
    n, c, h, w = x_shape
    dx = device.empty((n, c, h, w), dy.dtype)
    window, zero = dy.dtype.type(k * k), dy.dtype.type(0)
    device.launch(_avgpool_backward_kernel, n * c * h * w, device.contiguous(dy), k, stride, pad, window, zero, dx)
    return dx
