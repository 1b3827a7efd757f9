"""Winograd F(m x m, r x r) transforms as Numba CUDA kernels: the same functions as
:mod:`mpidl.kernels.winograd_reference` (math and layout there), on the launch helpers of
:mod:`mpidl.kernels.cuda`. The arguments are checked by the dispatcher, :mod:`mpidl.kernels`;
the functions here check only what is theirs: float32 / float64 and ``m + r - 1 <= 8``.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import cuda
from numba import float64 as numba_float64

from .cuda import _Device, _check_float, _nchw
from . import winograd_reference as reference
from .winograd_reference import winograd_geometry, winograd_matrices

__all__ = [
    "winograd_input",
    "winograd_input_adjoint",
    "winograd_output",
    "winograd_output_adjoint",
    "winograd_conv_forward",
    "winograd_conv_backward",
]


# --------------------------------------------------------------------------------------------
# Winograd F(m x m, r x r) transforms (math and layout: mpidl.kernels.winograd_reference)
# --------------------------------------------------------------------------------------------
# One thread per (channel, column q = tile*N + n): consecutive threads take consecutive
# samples of one tile, so the transformed arrays (C, alpha, alpha, P) are read and written
# coalesced. The alpha x alpha tile lives in a per-thread local array of the largest size the
# layer uses (m <= 4, r <= 5: alpha <= 8). The input adjoint is a gather like col2im: one
# thread per input pixel sums the (at most ceil(alpha / m)^2) tiles that overlap it.

_MAX_ALPHA = 8


@cuda.jit(device=True)
def _tile_column(t, columns, n_size, tiles_w, m):
    """Thread ``t`` of a transform kernel -> ``(channel, q, n, h0, w0)``: the channel (or
    filter) ``t // columns``, the column ``q = tile*N + n`` and the top-left output pixel
    ``(h0, w0)`` of its ``m x m`` tile (tiles row-major, ``tiles_w`` per row)."""
    channel = t // columns
    q = t - channel * columns
    tile = q // n_size
    return channel, q, q % n_size, (tile // tiles_w) * m, (tile % tiles_w) * m


@cuda.jit
def _winograd_input_kernel(x, bt, m, pad, tiles_w, columns, v):
    n_size, c_size, h_size, w_size = x.shape
    alpha = bt.shape[0]
    t = cuda.grid(1)
    if t >= c_size * columns:
        return
    c, q, n, h0, w0 = _tile_column(t, columns, n_size, tiles_w, m)
    h0 -= pad
    w0 -= pad
    rows = cuda.local.array((_MAX_ALPHA, _MAX_ALPHA), numba_float64)  # B^T d
    for a in range(alpha):
        for l in range(alpha):
            total = 0.0
            for k in range(alpha):
                h, w = h0 + k, w0 + l
                if 0 <= h < h_size and 0 <= w < w_size:
                    total += bt[a, k] * x[n, c, h, w]
            rows[a, l] = total
    for a in range(alpha):
        for b in range(alpha):
            total = 0.0
            for l in range(alpha):
                total += rows[a, l] * bt[b, l]
            v[c, a, b, q] = total


@cuda.jit
def _winograd_output_kernel(mt, at, bias, m, tiles_w, columns, y):
    n_size, f_size, out_h, out_w = y.shape
    alpha = at.shape[1]
    t = cuda.grid(1)
    if t >= f_size * columns:
        return
    f, q, n, h0, w0 = _tile_column(t, columns, n_size, tiles_w, m)
    cols = cuda.local.array((_MAX_ALPHA, _MAX_ALPHA), numba_float64)  # A^T M
    for i in range(m):
        for b in range(alpha):
            total = 0.0
            for a in range(alpha):
                total += at[i, a] * mt[f, a, b, q]
            cols[i, b] = total
    for i in range(m):
        for j in range(m):
            if h0 + i < out_h and w0 + j < out_w:
                total = 0.0
                for b in range(alpha):
                    total += cols[i, b] * at[j, b]
                y[n, f, h0 + i, w0 + j] = total + bias[f]


@cuda.jit
def _winograd_output_adjoint_kernel(dy, at, m, tiles_w, columns, dm):
    n_size, f_size, out_h, out_w = dy.shape
    alpha = at.shape[1]
    t = cuda.grid(1)
    if t >= f_size * columns:
        return
    f, q, n, h0, w0 = _tile_column(t, columns, n_size, tiles_w, m)
    cols = cuda.local.array((_MAX_ALPHA, _MAX_ALPHA), numba_float64)  # A dY, (a, j)
    for a in range(alpha):
        for j in range(m):
            total = 0.0
            for i in range(m):
                if h0 + i < out_h and w0 + j < out_w:
                    total += at[i, a] * dy[n, f, h0 + i, w0 + j]
            cols[a, j] = total
    for a in range(alpha):
        for b in range(alpha):
            total = 0.0
            for j in range(m):
                total += cols[a, j] * at[j, b]
            dm[f, a, b, q] = total


@cuda.jit
def _winograd_input_adjoint_kernel(dv, bt, m, pad, tiles_h, tiles_w, zero, dx):
    n_size, c_size, h_size, w_size = dx.shape
    alpha = bt.shape[0]
    t = cuda.grid(1)
    if t >= n_size * c_size * h_size * w_size:
        return
    n, c, h, w = _nchw(t, c_size, h_size, w_size)
    hp, wp = h + pad, w + pad  # position in the padded input
    total = zero
    # tiles th with th*m <= hp < th*m + alpha, i.e. hp - alpha < th*m <= hp
    th_hi = hp // m
    for th in range(th_hi, -1, -1):
        k = hp - th * m
        if k >= alpha:
            break
        if th >= tiles_h:
            continue
        for tw in range(wp // m, -1, -1):
            l = wp - tw * m
            if l >= alpha:
                break
            if tw >= tiles_w:
                continue
            q = (th * tiles_w + tw) * n_size + n
            for a in range(alpha):
                for b in range(alpha):
                    total += bt[a, k] * bt[b, l] * dv[c, a, b, q]
    dx[n, c, h, w] = total


# --------------------------------------------------------------------------------------------
# Winograd transforms
# --------------------------------------------------------------------------------------------


def _check_alpha(m, r):
    """The tile lives in a per-thread local array of ``_MAX_ALPHA``^2 values."""
    if m + r - 1 > _MAX_ALPHA:
        raise ValueError(f"winograd: the CUDA kernels need m + r - 1 <= {_MAX_ALPHA}; got m={m}, r={r}")


def _matrix(device, matrix, dtype):
    """A transform matrix (float64 NumPy) as a device array of ``dtype`` (small: a copy per call)."""
    host = np.array(matrix, dtype=dtype, order="C")  # a writable copy (the cached matrices are read-only)
    if device.kind == "cupy":
        import cupy  # noqa: PLC0415

        return cupy.asarray(host)
    return host if device.kind == "numpy" else cuda.to_device(host)


def winograd_input(x, m: int, r: int, pad: int = 0, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_input`, one thread per (channel, column)."""
    device = _Device(x)
    _check_float(x.dtype, "winograd_input")
    _check_alpha(m, r)
    n, c, _, _ = x.shape
    _, _, tiles_h, tiles_w = winograd_geometry(x.shape, m, r, pad)
    alpha, columns = m + r - 1, tiles_h * tiles_w * n
    v = device.empty((c, alpha, alpha, columns), x.dtype) if out is None else out
    bt = _matrix(device, winograd_matrices(m, r)[2], x.dtype)
    device.launch(_winograd_input_kernel, c * columns, device.contiguous(x), bt, m, pad, tiles_w, columns, v)
    return v


def winograd_input_adjoint(dv, x_shape, m: int, r: int, pad: int = 0, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_input_adjoint` as a gather: one thread
    per pixel of ``dx`` sums the tiles that overlap it."""
    device = _Device(dv)
    _check_float(dv.dtype, "winograd_input_adjoint")
    _check_alpha(m, r)
    n, c, h, w = x_shape
    _, _, tiles_h, tiles_w = winograd_geometry(x_shape, m, r, pad)
    dx = device.empty((n, c, h, w), dv.dtype) if out is None else out
    bt = _matrix(device, winograd_matrices(m, r)[2], dv.dtype)
    device.launch(_winograd_input_adjoint_kernel, n * c * h * w, device.contiguous(dv), bt, m, pad, tiles_h, tiles_w,
                  dv.dtype.type(0), dx)
    return dx


def winograd_output(mt, y_shape, m: int, r: int, bias=None, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_output`, one thread per (filter, column)."""
    device = _Device(mt)
    _check_float(mt.dtype, "winograd_output")
    _check_alpha(m, r)
    n, f, out_h, out_w = y_shape
    tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
    columns = tiles_h * tiles_w * n
    y = device.empty((n, f, out_h, out_w), mt.dtype) if out is None else out
    bias = _matrix(device, np.zeros(f), mt.dtype) if bias is None else device.contiguous(bias.reshape(f), dtype=mt.dtype)
    at = _matrix(device, winograd_matrices(m, r)[0], mt.dtype)
    device.launch(_winograd_output_kernel, f * columns, device.contiguous(mt), at, bias, m, tiles_w, columns, y)
    return y


def winograd_output_adjoint(dy, m: int, r: int, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_output_adjoint`, one thread per
    (filter, column)."""
    device = _Device(dy)
    _check_float(dy.dtype, "winograd_output_adjoint")
    _check_alpha(m, r)
    n, f, out_h, out_w = dy.shape
    tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
    alpha, columns = m + r - 1, tiles_h * tiles_w * n
    dm = device.empty((f, alpha, alpha, columns), dy.dtype) if out is None else out
    at = _matrix(device, winograd_matrices(m, r)[0], dy.dtype)
    device.launch(_winograd_output_adjoint_kernel, f * columns, device.contiguous(dy), at, m, tiles_w, columns, dm)
    return dm


def winograd_conv_forward(x, u, m: int, r: int, pad: int = 0, bias=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_conv_forward` with the transforms above
    and cuBLAS's products (CuPy)."""
    return reference.winograd_conv_forward(x, u, m, r, pad, bias, transforms=sys.modules[__name__])


def winograd_conv_backward(dy, u, v, x_shape, m: int, r: int, pad: int = 0, input_grad: bool = True):
    """:func:`mpidl.kernels.winograd_reference.winograd_conv_backward` with the transforms above."""
    return reference.winograd_conv_backward(dy, u, v, x_shape, m, r, pad, input_grad, transforms=sys.modules[__name__])
