"""A whole Winograd F(m x m, r x r) convolution as two Numba CPU kernels, ``@njit(parallel=True)``:
forward (input transform, products, output transform) and backward (their adjoints), one
parallel loop over blocks of samples each. The math is :mod:`mpidl.kernels.winograd_reference`'s
(:func:`~mpidl.kernels.winograd_reference.winograd_conv_forward` and ``..._backward`` compose its
transforms; these kernels compute the same); the arguments are checked by the dispatcher,
:mod:`mpidl.kernels`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from mpidl.engine import threads as _threads

from . import winograd_reference as reference
from .cpu import _COMPILED_DTYPES, _as_compiled, _samples_per_block, _u

__all__ = ["winograd_conv_forward", "winograd_conv_backward"]


# --------------------------------------------------------------------------------------------
# Why fused, and the layout
# --------------------------------------------------------------------------------------------
#
# Done as separate passes over the whole batch, the transformed arrays V and M are the largest
# tensors of a step (resnet8's 16-channel layer: 9.4 MiB each at batch 64, against 4 MiB for
# its input), written by one pass and read back by the next from memory. Here one parallel
# iteration takes a block of ``nb`` samples through every pass: the block's V and M are made,
# multiplied and consumed while they are in cache, and only V (needed again by backward) is
# written out. Timed per layer against the separate passes (their own Numba kernels and a
# threaded batched GEMM), forward + backward of resnet8's Winograd layers took 20-50 % less.
#
# Block ``k`` holds samples ``[k*nb, k*nb + nb)`` (the last may be short: its missing samples
# are zeros that are never written out). Within a block, column ``q = (th*TW + tw)*nb + j`` is
# tile (th, tw) of sample ``k*nb + j``, the sample innermost, so every transform step is
# "vector = sum of coefficient * vector" over ``nb`` contiguous values, a loop LLVM vectorizes.
# A block's transformed arrays are position-major, ``V_k : (alpha^2, C, L)`` and
# ``M_k : (alpha^2, F, L)`` with ``L = TH*TW*nb``, so the product at each position xi is one
# contiguous GEMM, ``M_k[xi] = U[xi] @ V_k[xi]``, done by BLAS through Numba's ``np.dot``
# (SciPy's OpenBLAS, one thread per call under mpidl's thread policy). The 2-D transforms
# are separable and done as two 1-D passes, each over a whole tile row at once where the layout
# allows; each skips the zero coefficients of its matrix (about half of B^T's).
#
# Backward per block: ``dM_k = A dY A^T`` per tile, ``dU_k[xi] = dM_k[xi] @ V_k[xi]^T`` (one
# partial sum per block, added up in block order after the loop, so the result does not
# depend on which thread ran which block), ``dV_k[xi] = U[xi]^T @ dM_k[xi]``, and the input
# gradient scatter-added from ``B dV_k B^T``. Every iteration writes only its own block of V,
# of dU's partial sums and of the samples of y or dx: race-free.


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
def _combine_tiles(coefficients, row, src, tiles_w, m, nb, dst, dst_start):
    """The pass along W of one tile row: for every tile ``tw < tiles_w``,
    ``dst[dst_start + tw*nb : +nb] = sum_l coefficients[row, l] * src[(tw*m + l)*nb : +nb]``
    (nonzero coefficients only; the tile loop is inside the coefficient loop, so each
    coefficient is read and tested once per tile row rather than once per tile)."""
    first = True
    for l in range(coefficients.shape[1]):
        coef = coefficients[_u(row), _u(l)]
        if coef != 0:
            for tw in range(tiles_w):
                d0 = dst_start + tw * nb
                s0 = (tw * m + l) * nb
                if first:
                    for t in range(nb):
                        dst[_u(d0 + t)] = coef * src[_u(s0 + t)]
                else:
                    for t in range(nb):
                        dst[_u(d0 + t)] += coef * src[_u(s0 + t)]
            first = False
    if first:
        for t in range(tiles_w * nb):
            dst[_u(dst_start + t)] = 0


@njit(inline="always", cache=True)
def _gather_plane(src, n0, count, channel, offset, nb, plane):
    """``plane[h + offset, (w + offset)*nb + j] = src[n0 + j, channel, h, w]`` for ``j < count``:
    one channel of the block's samples as a ``(H, W*nb)`` plane, the sample innermost (reads
    along ``src``'s rows; the strided writes stay in the cached plane). What is not written
    (the padding, the block's missing samples) keeps the zeros the plane was made with."""
    for j in range(count):
        for h in range(src.shape[2]):
            row = plane[_u(h + offset)]
            for w in range(src.shape[3]):
                row[_u((w + offset) * nb + j)] = src[_u(n0 + j), _u(channel), _u(h), _u(w)]


@njit(inline="always", cache=True)
def _scatter_plane(plane, offset, nb, n0, count, channel, shift, dst):
    """The inverse of :func:`_gather_plane`: ``dst[n0 + j, channel, h, w] = plane[h + offset,
    (w + offset)*nb + j] + shift[channel]`` for ``j < count``."""
    extra = shift[_u(channel)]
    for j in range(count):
        for h in range(dst.shape[2]):
            row = plane[_u(h + offset)]
            for w in range(dst.shape[3]):
                dst[_u(n0 + j), _u(channel), _u(h), _u(w)] = row[_u((w + offset) * nb + j)] + extra


@njit(inline="always", cache=True)
def _tile_transform(matrix, m, tiles_h, tiles_w, nb, plane, rows, out, out_row, out_step):
    """``out[out_row + (a*alpha + b)*out_step, (th*TW + tw)*nb + j] = sum_{k,l} matrix[a, k]
    matrix[b, l] plane[th*m + k, (tw*m + l)*nb + j]``: the ``alpha x alpha`` patch of every tile
    of a ``(H, W*nb)`` plane transformed on both sides (``B^T d B`` for the input, ``A dY A^T``
    with ``matrix = A`` for the output gradient). ``rows : (TH*alpha, W*nb)`` is scratch."""
    alpha = matrix.shape[0]
    width = plane.shape[1]
    for th in range(tiles_h):  # along H: row th*alpha + a of rows
        for a in range(alpha):
            _combine(matrix, a, plane, th * m, 1, 0, 0, rows[_u(th * alpha + a)], 0, width)
    for a in range(alpha):  # along W, each destination row written front to back
        for b in range(alpha):
            dst = out[_u(out_row + (a * alpha + b) * out_step)]
            for th in range(tiles_h):
                _combine_tiles(matrix, b, rows[_u(th * alpha + a)], tiles_w, m, nb, dst, th * tiles_w * nb)


@njit(inline="always", cache=True)
def _output_tiles(at, m, tiles_h, tiles_w, nb, mt, row, step, cols, plane):
    """``plane[th*m + i, (tw*m + j)*nb + n] = sum_{a,b} AT[i, a] AT[j, b] mt[row + (a*alpha + b)*step,
    (th*TW + tw)*nb + n]``: ``A^T M A`` of every tile, written as a ``(TH*m, TW*m*nb)`` plane.
    ``cols : (m*alpha, TW*nb)`` is scratch (``A^T M`` of one tile row)."""
    alpha = at.shape[1]
    band = tiles_w * nb  # the columns of one tile row
    for th in range(tiles_h):
        for i in range(m):
            for b in range(alpha):
                # source a: mt[row + (a*alpha + b)*step, th*band : +band] (every tile of the row)
                _combine(at, i, mt, row + b * step, alpha * step, th * band, 0, cols[_u(i * alpha + b)], 0, band)
        for i in range(m):
            dst = plane[_u(th * m + i)]
            for j in range(m):
                # dst[(tw*m + j)*nb + n] = sum_b AT[j, b] cols[i*alpha + b, tw*nb + n]
                first = True
                for b in range(alpha):
                    coef = at[_u(j), _u(b)]
                    if coef != 0:
                        src = cols[_u(i * alpha + b)]
                        for tw in range(tiles_w):
                            d0 = (tw * m + j) * nb
                            s0 = tw * nb
                            if first:
                                for t in range(nb):
                                    dst[_u(d0 + t)] = coef * src[_u(s0 + t)]
                            else:
                                for t in range(nb):
                                    dst[_u(d0 + t)] += coef * src[_u(s0 + t)]
                        first = False
                if first:
                    for tw in range(tiles_w):
                        for t in range(nb):
                            dst[_u((tw * m + j) * nb + t)] = 0


@njit(inline="always", cache=True)
def _input_adjoint_tiles(bt_t, m, tiles_h, tiles_w, nb, dv, row, step, rows, tiles, plane):
    """``plane[th*m + k, (tw*m + l)*nb + n] += sum_{a,b} BT[a, k] BT[b, l] dv[row + (a*alpha + b)*step,
    (th*TW + tw)*nb + n]`` (``bt_t = B``): ``B dV B^T`` of every tile scatter-added onto a zeroed
    ``(H_pad, W_pad*nb)`` plane; neighbouring tiles overlap by ``r - 1`` pixels. ``rows :
    (alpha, W_pad*nb)`` and ``tiles : (alpha^2, TW*nb)`` are scratch."""
    alpha = bt_t.shape[0]
    band = tiles_w * nb
    width = plane.shape[1]
    for th in range(tiles_h):
        for a in range(alpha):
            for l in range(alpha):
                # source b: dv[row + (a*alpha + b)*step, th*band : +band] (every tile of the row)
                _combine(bt_t, l, dv, row + a * alpha * step, step, th * band, 0, tiles[_u(a * alpha + l)], 0, band)
        rows[:, :] = 0
        for a in range(alpha):
            dst = rows[_u(a)]
            for l in range(alpha):
                src = tiles[_u(a * alpha + l)]
                for tw in range(tiles_w):
                    d0 = (tw * m + l) * nb
                    s0 = tw * nb
                    for t in range(nb):
                        dst[_u(d0 + t)] += src[_u(s0 + t)]
        for k in range(alpha):
            dst = plane[_u(th * m + k)]
            for a in range(alpha):
                coef = bt_t[_u(k), _u(a)]
                if coef != 0:
                    src = rows[_u(a)]
                    for t in range(width):
                        dst[_u(t)] += coef * src[_u(t)]


@njit(parallel=True, cache=True)
def _forward_kernel(x, u, bt, at, bias, m, pad, tiles_h, tiles_w, v, y):
    # v : (blocks, alpha^2, C, L), written; y : (N, F, OH, OW), written
    n_size, c_size = x.shape[0], x.shape[1]
    a2, f_size = u.shape[0], u.shape[1]
    alpha = bt.shape[0]
    length = v.shape[3]
    nb = length // (tiles_h * tiles_w)
    height, width = tiles_h * m + alpha - m, (tiles_w * m + alpha - m) * nb
    for k in prange(v.shape[0]):
        n0 = k * nb
        count = min(nb, n_size - n0)
        vk = v[k]
        v_rows = vk.reshape(a2 * c_size, length)  # row xi*C + c
        plane = np.zeros((height, width), x.dtype)
        rows = np.empty((tiles_h * alpha, width), x.dtype)
        for c in range(c_size):
            _gather_plane(x, n0, count, c, pad, nb, plane)
            _tile_transform(bt, m, tiles_h, tiles_w, nb, plane, rows, v_rows, c, c_size)
        mk = np.empty((a2, f_size, length), x.dtype)
        for xi in range(a2):
            np.dot(u[xi], vk[xi], mk[xi])
        m_rows = mk.reshape(a2 * f_size, length)  # row xi*F + f
        out_plane = np.empty((tiles_h * m, tiles_w * m * nb), x.dtype)
        cols = np.empty((m * alpha, tiles_w * nb), x.dtype)
        for f in range(f_size):
            _output_tiles(at, m, tiles_h, tiles_w, nb, m_rows, f, f_size, cols, out_plane)
            _scatter_plane(out_plane, 0, nb, n0, count, f, bias, y)


@njit(parallel=True, cache=True)
def _backward_kernel(dy, u, v, at_t, bt_t, m, pad, tiles_h, tiles_w, du_blocks, input_grad, zeros, dx):
    # du_blocks : (blocks, alpha^2, F, C), written; dx : (N, C, H, W), written when input_grad;
    # zeros : (C,), the shift _scatter_plane adds
    n_size, f_size = dy.shape[0], dy.shape[1]
    a2, c_size = u.shape[0], u.shape[2]
    alpha = at_t.shape[0]
    length = v.shape[3]
    nb = length // (tiles_h * tiles_w)
    out_width = tiles_w * m * nb
    height, width = tiles_h * m + alpha - m, (tiles_w * m + alpha - m) * nb
    for k in prange(v.shape[0]):
        n0 = k * nb
        count = min(nb, n_size - n0)
        vk = v[k]
        dm = np.empty((a2, f_size, length), dy.dtype)
        dm_rows = dm.reshape(a2 * f_size, length)
        plane = np.zeros((tiles_h * m, out_width), dy.dtype)
        rows = np.empty((tiles_h * alpha, out_width), dy.dtype)
        for f in range(f_size):
            _gather_plane(dy, n0, count, f, 0, nb, plane)
            _tile_transform(at_t, m, tiles_h, tiles_w, nb, plane, rows, dm_rows, f, f_size)
        duk = du_blocks[k]
        for xi in range(a2):
            np.dot(dm[xi], vk[xi].T, duk[xi])
        if input_grad:
            dv = np.empty((a2, c_size, length), dy.dtype)
            for xi in range(a2):
                np.dot(u[xi].T, dm[xi], dv[xi])
            dv_rows = dv.reshape(a2 * c_size, length)
            in_plane = np.empty((height, width), dy.dtype)
            in_rows = np.empty((alpha, width), dy.dtype)
            tiles = np.empty((a2, tiles_w * nb), dy.dtype)
            for c in range(c_size):
                in_plane[:, :] = 0
                _input_adjoint_tiles(bt_t, m, tiles_h, tiles_w, nb, dv_rows, c, c_size, in_rows, tiles, in_plane)
                _scatter_plane(in_plane, pad, nb, n0, count, c, zeros, dx)


#: A block's columns ``TH*TW*nb`` stop growing here (more blocks instead), so its arrays stay a
#: few MiB and in cache; at 2048 resnet8's 32x32 layers at batch 64 still run one block per
#: thread on two threads. Much smaller blocks are slower: each pays the products' fixed costs.
_MAX_BLOCK_COLUMNS = 2048


def samples_per_block(n: int, tiles: int) -> int:
    """``nb``: one block per thread (``numba.get_num_threads()``), more when a block would
    pass ``_MAX_BLOCK_COLUMNS`` columns; never more blocks than samples."""
    return _samples_per_block(n, -(-n * tiles // _MAX_BLOCK_COLUMNS))


def winograd_conv_forward(x, u, m: int, r: int, pad: int = 0, bias=None):
    """:func:`mpidl.kernels.winograd_reference.winograd_conv_forward`, fused, parallel over
    blocks of samples. Returns ``(y, V)``, ``V : (blocks, alpha^2, C, TH*TW*nb)`` (this
    module's layout, for :func:`winograd_conv_backward`)."""
    if x.dtype not in _COMPILED_DTYPES:
        return reference.winograd_conv_forward(x, u, m, r, pad, bias)
    n, c, _, _ = x.shape
    a2, f, _ = u.shape
    oh, ow, tiles_h, tiles_w = reference.winograd_geometry(x.shape, m, r, pad)
    tiles = tiles_h * tiles_w
    nb = samples_per_block(n, tiles)
    v = np.empty((-(-n // nb), a2, c, tiles * nb), dtype=x.dtype)
    y = np.empty((n, f, oh, ow), dtype=x.dtype)
    bias = np.zeros(f, x.dtype) if bias is None else np.ascontiguousarray(bias, dtype=x.dtype).reshape(f)
    mats = reference.winograd_matrices(m, r)
    with _threads.one_blas_thread():  # BLAS is called from the parallel threads
        _forward_kernel(_as_compiled(x), np.ascontiguousarray(u, dtype=x.dtype), mats[2].astype(x.dtype),
                        mats[0].astype(x.dtype), bias, m, pad, tiles_h, tiles_w, v, y)
    return y, v


def winograd_conv_backward(dy, u, v, x_shape, m: int, r: int, pad: int = 0, input_grad: bool = True):
    """:func:`mpidl.kernels.winograd_reference.winograd_conv_backward`, fused, parallel over
    blocks of samples; ``v`` is what :func:`winograd_conv_forward` returned. Returns ``(dU, dx)``
    (``dx`` None without ``input_grad``)."""
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.winograd_conv_backward(dy, u, v, x_shape, m, r, pad, input_grad)
    blocks, a2, c, _ = v.shape
    f = u.shape[1]
    _, _, tiles_h, tiles_w = reference.winograd_geometry(x_shape, m, r, pad)
    du_blocks = np.empty((blocks, a2, f, c), dtype=dy.dtype)
    dx = np.empty(x_shape, dtype=dy.dtype) if input_grad else np.empty((0, 0, 0, 0), dtype=dy.dtype)
    mats = reference.winograd_matrices(m, r)
    with _threads.one_blas_thread():  # BLAS is called from the parallel threads
        _backward_kernel(_as_compiled(dy), np.ascontiguousarray(u, dtype=dy.dtype), v,
                         np.ascontiguousarray(mats[0].T, dtype=dy.dtype), np.ascontiguousarray(mats[2].T, dtype=dy.dtype),
                         m, pad, tiles_h, tiles_w, du_blocks, bool(input_grad), np.zeros(c, dy.dtype), dx)
    du = du_blocks[0] if blocks == 1 else du_blocks.sum(axis=0)
    return du, (dx if input_grad else None)
