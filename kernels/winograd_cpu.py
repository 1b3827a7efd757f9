"""Winograd F(m x m, r x r) transforms as Numba CPU kernels, ``@njit(parallel=True)``: the same
functions as :mod:`mpidl.kernels.winograd_reference` (math and layout there), taking NumPy
arrays and the arguments checked by the dispatcher, :mod:`mpidl.kernels`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import winograd_reference as reference
from .cpu import _COMPILED_DTYPES, _as_compiled, _u

__all__ = ["winograd_input", "winograd_input_adjoint", "winograd_output", "winograd_output_adjoint"]


# --------------------------------------------------------------------------------------------
# Winograd F(m x m, r x r) transforms (the math and the layout: mpidl.kernels.winograd_reference)
# --------------------------------------------------------------------------------------------
#
# One prange iteration per channel (input side) or filter (output side): it gathers that
# channel of every sample into a private zero-padded plane laid out (H, W*N), the sample
# innermost, so every transform step is "vector = sum of coefficient * vector" over contiguous
# memory, a loop LLVM vectorizes. The 2-D transforms are separable and done as two 1-D passes,
# each over a whole tile row at once where the layout allows (long loops; on the input side
# the r - 1 columns that neighbouring tiles share are transformed once), and each writes its
# result front to back: the transformed arrays are (C, alpha^2, P), so a channel's block is
# contiguous (writing alpha^2 rows a whole (C, P) matrix apart instead was 3x slower). Each pass
# skips the zero coefficients of its matrix (about half of B^T's) and assigns on the first
# nonzero one instead of zeroing first. Each iteration writes only its own channel's block of
# V / dM or its own plane of x / y: race-free, even for the overlapping patches of the input
# adjoint. Measured on hsicnn (batch 64, one thread), the four transforms take about 40 % of
# the convolution time, the GEMMs the rest.


@njit(inline="always", cache=True)
def _combine(coefficients, row, src, row_base, row_step, col_base, col_step, dst, dst_start, length):
    """``dst[dst_start : +length] = sum_k coefficients[row, k] * source_k`` over the nonzero
    coefficients, where ``source_k = src[row_base + k*row_step, col_base + k*col_step : +length]``.

    Every array is C-contiguous (``src`` 2-D, ``dst`` 1-D) and addressed by explicit offsets,
    so the innermost loops have unit stride that LLVM can see and vectorize (a strided view
    of a 4-D array would compile to a generic, scalar loop)."""
    first = True
    for k in range(coefficients.shape[1]):
        coef = coefficients[_u(row), _u(k)]
        if coef != 0:
            source = src[_u(row_base + k * row_step)]
            offset = col_base + k * col_step
            if first:
                for t in range(length):
                    dst[_u(dst_start + t)] = coef * source[_u(offset + t)]
                first = False
            else:
                for t in range(length):
                    dst[_u(dst_start + t)] += coef * source[_u(offset + t)]
    if first:
        for t in range(length):
            dst[_u(dst_start + t)] = 0


@njit(inline="always", cache=True)
def _combine_tiles(coefficients, row, src, tiles_w, m, n_size, dst, dst_start):
    """The pass along W of one tile row: for every tile ``tw < tiles_w``,
    ``dst[dst_start + tw*N : +N] = sum_l coefficients[row, l] * src[(tw*m + l)*N : +N]``
    (nonzero coefficients only; the tile loop is inside the coefficient loop, so each
    coefficient is read and tested once per tile row rather than once per tile)."""
    first = True
    for l in range(coefficients.shape[1]):
        coef = coefficients[_u(row), _u(l)]
        if coef != 0:
            for tw in range(tiles_w):
                d0 = dst_start + tw * n_size
                s0 = (tw * m + l) * n_size
                if first:
                    for t in range(n_size):
                        dst[_u(d0 + t)] = coef * src[_u(s0 + t)]
                else:
                    for t in range(n_size):
                        dst[_u(d0 + t)] += coef * src[_u(s0 + t)]
            first = False
    if first:
        for t in range(tiles_w * n_size):
            dst[_u(dst_start + t)] = 0


@njit(parallel=True, cache=True)
def _winograd_input_kernel(x, bt, m, pad, tiles_h, tiles_w, v):
    # v : (C, alpha*alpha, P); this iteration writes the contiguous block v[c]
    n_size, c_size, h_size, w_size = x.shape
    alpha = bt.shape[0]
    height, width = tiles_h * m + alpha - m, (tiles_w * m + alpha - m) * n_size
    for c in prange(c_size):
        plane = np.zeros((height, width), x.dtype)  # x_pad[:, c] as (H, W*N)
        for n in range(n_size):  # reads along x's rows; the strided writes stay in the cached plane
            for h in range(h_size):
                row = plane[_u(h + pad)]
                for w in range(w_size):
                    row[_u((w + pad) * n_size + n)] = x[_u(n), _u(c), _u(h), _u(w)]
        rows = np.empty((tiles_h * alpha, width), x.dtype)  # B^T along H, row th*alpha + a
        for th in range(tiles_h):
            for a in range(alpha):
                _combine(bt, a, plane, th * m, 1, 0, 0, rows[_u(th * alpha + a)], 0, width)
        block = v[_u(c)]
        for a in range(alpha):
            for b in range(alpha):
                dst = block[_u(a * alpha + b)]  # written front to back
                for th in range(tiles_h):
                    _combine_tiles(bt, b, rows[_u(th * alpha + a)], tiles_w, m, n_size, dst, th * tiles_w * n_size)


@njit(parallel=True, cache=True)
def _winograd_input_adjoint_kernel(dv, bt_t, m, pad, tiles_h, tiles_w, dx):
    # dv : (C, alpha*alpha, P); bt_t = B (the transpose of B^T): d = B dV B^T.
    n_size, c_size, h_size, w_size = dx.shape
    alpha = bt_t.shape[0]
    height, width = tiles_h * m + alpha - m, (tiles_w * m + alpha - m) * n_size
    band = tiles_w * n_size  # the columns of one tile row
    for c in prange(c_size):
        block = dv[_u(c)]
        plane = np.zeros((height, width), dx.dtype)
        rows = np.empty((alpha, width), dx.dtype)  # dV B^T of one tile row, by a, tiles overlapped
        tiles = np.empty((alpha * alpha, band), dx.dtype)  # dV B^T per tile, row a*alpha + l
        for th in range(tiles_h):
            for a in range(alpha):
                for l in range(alpha):
                    # source b: block[a*alpha + b, th*band : +band] (every tile of the row at once)
                    _combine(bt_t, l, block, a * alpha, 1, th * band, 0, tiles[_u(a * alpha + l)], 0, band)
            rows[:, :] = 0
            for a in range(alpha):
                dst = rows[_u(a)]
                for l in range(alpha):
                    src = tiles[_u(a * alpha + l)]
                    for tw in range(tiles_w):
                        # Neighbouring tiles overlap by r - 1 columns: add.
                        d0 = (tw * m + l) * n_size
                        s0 = tw * n_size
                        for t in range(n_size):
                            dst[_u(d0 + t)] += src[_u(s0 + t)]
            for k in range(alpha):
                dst = plane[_u(th * m + k)]
                for a in range(alpha):
                    coef = bt_t[_u(k), _u(a)]
                    if coef != 0:
                        src = rows[_u(a)]
                        for t in range(width):
                            dst[_u(t)] += coef * src[_u(t)]
        for n in range(n_size):
            for h in range(h_size):
                row = plane[_u(h + pad)]
                for w in range(w_size):
                    dx[_u(n), _u(c), _u(h), _u(w)] = row[_u((w + pad) * n_size + n)]


@njit(parallel=True, cache=True)
def _winograd_output_kernel(mt, at, bias, m, tiles_h, tiles_w, y):
    # mt : (F, alpha*alpha, P); this iteration reads the contiguous block mt[f]
    n_size, f_size, out_h, out_w = y.shape
    alpha = at.shape[1]
    band = tiles_w * n_size  # the columns of one tile row: q = th*band + tw*N + n
    for f in prange(f_size):
        block = mt[_u(f)]
        plane = np.empty((tiles_h * m, tiles_w * m * n_size), y.dtype)  # y[:, f] as (H, W*N)
        cols = np.empty((m * alpha, band), y.dtype)  # A^T M of one tile row, row i*alpha + b
        for th in range(tiles_h):
            for i in range(m):
                for b in range(alpha):
                    # source a: block[a*alpha + b, th*band : +band] (every tile of the row at once)
                    _combine(at, i, block, b, alpha, th * band, 0, cols[_u(i * alpha + b)], 0, band)
            for i in range(m):
                dst = plane[_u(th * m + i)]
                for j in range(m):
                    # dst[(tw*m + j)*N + n] = sum_b AT[j, b] cols[i*alpha + b, tw*N + n]
                    first = True
                    for b in range(alpha):
                        coef = at[_u(j), _u(b)]
                        if coef != 0:
                            src = cols[_u(i * alpha + b)]
                            for tw in range(tiles_w):
                                d0 = (tw * m + j) * n_size
                                s0 = tw * n_size
                                if first:
                                    for t in range(n_size):
                                        dst[_u(d0 + t)] = coef * src[_u(s0 + t)]
                                else:
                                    for t in range(n_size):
                                        dst[_u(d0 + t)] += coef * src[_u(s0 + t)]
                            first = False
                    if first:
                        for tw in range(tiles_w):
                            for t in range(n_size):
                                dst[_u((tw * m + j) * n_size + t)] = 0
        b0 = bias[_u(f)]
        for n in range(n_size):
            for oh in range(out_h):
                row = plane[_u(oh)]
                for ow in range(out_w):
                    y[_u(n), _u(f), _u(oh), _u(ow)] = row[_u(ow * n_size + n)] + b0


@njit(parallel=True, cache=True)
def _winograd_output_adjoint_kernel(dy, at_t, m, tiles_h, tiles_w, dm):
    # dm : (F, alpha*alpha, P); at_t = A (the transpose of A^T): dM = A dY A^T.
    n_size, f_size, out_h, out_w = dy.shape
    alpha = at_t.shape[0]
    width = tiles_w * m * n_size
    for f in prange(f_size):
        plane = np.zeros((tiles_h * m, width), dy.dtype)
        for n in range(n_size):  # reads along dy's rows (as the input transform)
            for oh in range(out_h):
                row = plane[_u(oh)]
                for ow in range(out_w):
                    row[_u(ow * n_size + n)] = dy[_u(n), _u(f), _u(oh), _u(ow)]
        rows = np.empty((tiles_h * alpha, width), dy.dtype)  # A along H, row th*alpha + a
        for th in range(tiles_h):
            for a in range(alpha):
                _combine(at_t, a, plane, th * m, 1, 0, 0, rows[_u(th * alpha + a)], 0, width)
        block = dm[_u(f)]
        for a in range(alpha):
            for b in range(alpha):
                dst = block[_u(a * alpha + b)]  # written front to back
                for th in range(tiles_h):
                    _combine_tiles(at_t, b, rows[_u(th * alpha + a)], tiles_w, m, n_size, dst, th * tiles_w * n_size)


def _transform_shape(channels, tiles_h, tiles_w, n, m, r):
    alpha = m + r - 1
    return (channels, alpha, alpha, tiles_h * tiles_w * n)


def _blocks(transformed):
    """``(C, alpha, alpha, P)`` -> the ``(C, alpha^2, P)`` view the kernels index (explicit sizes:
    ``-1`` cannot be inferred when ``P = 0``, an empty batch)."""
    c, alpha, _, columns = transformed.shape
    return transformed.reshape(c, alpha * alpha, columns)


def winograd_input(x, m: int, r: int, pad: int = 0, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_input`, parallel over channels."""
    if x.dtype not in _COMPILED_DTYPES:
        return reference.winograd_input(x, m, r, pad, out=out)
    n, c, _, _ = x.shape
    _, _, tiles_h, tiles_w = reference.winograd_geometry(x.shape, m, r, pad)
    v = np.empty(_transform_shape(c, tiles_h, tiles_w, n, m, r), dtype=x.dtype) if out is None else out
    bt = reference.winograd_matrices(m, r)[2].astype(x.dtype)
    _winograd_input_kernel(_as_compiled(x), bt, m, pad, tiles_h, tiles_w, _blocks(v))
    return v


def winograd_input_adjoint(dv, x_shape, m: int, r: int, pad: int = 0, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_input_adjoint`, parallel over channels."""
    if dv.dtype not in _COMPILED_DTYPES:
        return reference.winograd_input_adjoint(dv, x_shape, m, r, pad, out=out)
    _, _, tiles_h, tiles_w = reference.winograd_geometry(x_shape, m, r, pad)
    dx = np.empty(x_shape, dtype=dv.dtype) if out is None else out
    bt_t = np.ascontiguousarray(reference.winograd_matrices(m, r)[2].T, dtype=dv.dtype)
    _winograd_input_adjoint_kernel(_blocks(_as_compiled(dv)), bt_t, m, pad, tiles_h, tiles_w, dx)
    return dx


def winograd_output(mt, y_shape, m: int, r: int, bias=None, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_output`, the bias added on the way;
    parallel over filters."""
    if mt.dtype not in _COMPILED_DTYPES:
        return reference.winograd_output(mt, y_shape, m, r, bias=bias, out=out)
    n, f, out_h, out_w = y_shape
    tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
    y = np.empty(y_shape, dtype=mt.dtype) if out is None else out
    bias = np.zeros(f, mt.dtype) if bias is None else np.ascontiguousarray(bias, dtype=mt.dtype).reshape(f)
    at = reference.winograd_matrices(m, r)[0].astype(mt.dtype)
    _winograd_output_kernel(_blocks(_as_compiled(mt)), at, bias, m, tiles_h, tiles_w, y)
    return y


def winograd_output_adjoint(dy, m: int, r: int, out=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_output_adjoint`, parallel over filters."""
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.winograd_output_adjoint(dy, m, r, out=out)
    n, f, out_h, out_w = dy.shape
    tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
    dm = np.empty(_transform_shape(f, tiles_h, tiles_w, n, m, r), dtype=dy.dtype) if out is None else out
    at_t = np.ascontiguousarray(reference.winograd_matrices(m, r)[0].T, dtype=dy.dtype)
    _winograd_output_adjoint_kernel(_as_compiled(dy), at_t, m, tiles_h, tiles_w, _blocks(dm))
    return dm
