"""Numba CPU kernels: im2col / col2im, the whole im2col convolution, pooling, ``@njit(parallel=True)``.

Same functions, signatures and layouts as :mod:`mpidl.kernels.reference` (the math and the
layouts are there); the tests compare the two on every shape they try. The arguments are
checked by the dispatcher, :mod:`mpidl.kernels`: the functions here take NumPy arrays and
checked arguments, and check only what is theirs (``argmax`` indices in their plane).

How the work is split between threads
-------------------------------------
Every kernel is a thin Python wrapper (allocate the result unless given a workspace, make the
inputs C-contiguous) around one jitted function whose outer loop is a ``prange``.
Each ``prange`` iteration owns a disjoint part of the result, so no two threads ever write
the same element and no locks or atomics are needed:

===================  ======================================  ==============================
kernel               one ``prange`` iteration owns           reads
===================  ======================================  ==============================
im2col               one row ``(c, i, j)`` of ``cols``       channel ``c`` of every sample
col2im               one input plane ``dx[n, c]``            the ``kh*kw`` rows of channel c
pooling, forward     one output plane ``y[n, c]``            input plane ``x[n, c]``
pooling, backward    one input plane ``dx[n, c]``            output plane ``dy[n, c]``
conv2d, forward      a block of samples of ``y``             those samples of ``x``
conv2d, backward     those samples of ``dx``, one partial    those samples of ``x``, ``dy``
                     sum of ``dW``
===================  ======================================  ==============================

``col2im`` and the pooling backward passes are scatter-adds (several columns / windows add
into the same pixel); they are race-free because every pixel a plane iteration adds into
belongs to that iteration's own plane. Plane iterations are numbered channel-major
(``p = c*N + n``) in ``col2im``, so the contiguous block of iterations a thread gets walks
the rows of ``cols`` in memory order.

Padding is never materialized: for each output row the valid range of output columns is
computed once, so the innermost loop is branch-free (a plain strided copy / add that LLVM
vectorizes) and the padded border is written as zeros (or skipped) outside it.

The convolution itself (``conv2d_forward`` / ``conv2d_backward``) fuses im2col, the product
and col2im per sample, so cols never leaves the cache and the output is written in NCHW
directly (no transpose pass); why, below. The transposed layout ``(N*OH*OW, C*kh*kw)``
("im2row") is not used: its GEMMs are a little faster with some BLAS kernels, but building
it is a gather with short inner loops, several times slower than im2col, which makes the
convolution as a whole slower. Stride-1 3x3 layers of 8 or more channels take another algorithm, Winograd's
(:mod:`mpidl.kernels.winograd_cpu`), which cuts their GEMM work to 31-41 %.

Only float32 and float64 are compiled (one specialization each; ``cache=True`` keeps the
machine code in ``__pycache__`` so later processes start at once). Any other dtype is handed
to the reference implementation, which defines the result for it.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, uint64

from mpidl.engine import threads as _threads

from . import reference
from .reference import conv_output_size

__all__ = [
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

_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# Every array index in the hot loops goes through _u (a cast to uint64, free at run time).
# For a signed index Numba emits Python's wraparound (x[-1] is the last element): a compare
# and branch per access that also stops LLVM from vectorizing the loop. Our indices are never
# negative (the padding is handled by the loop bounds), and an unsigned index says so, which
# lets im2col run as fast as a plain memory copy.
_u = uint64


# --------------------------------------------------------------------------------------------
# helpers shared by the jitted kernels
# --------------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _valid_range(offset, stride, pad, in_size, out_size):
    """Output positions ``o`` in ``[lo, hi)`` whose input index ``o*stride + offset - pad``
    falls inside ``[0, in_size)``; outside that range the input index is in the padding.

    Notes
    -----
    ``o*stride + offset - pad >= 0``  <=>  ``o >= ceil((pad - offset) / stride)``;
    ``o*stride + offset - pad <= in_size - 1``  <=>  ``o <= floor((in_size - 1 + pad - offset) / stride)``.
    Numba's integer ``//`` floors like Python's, so negative numerators are handled.
    """
    lo = 0
    if pad - offset > 0:
        lo = (pad - offset + stride - 1) // stride
    hi = (in_size - 1 + pad - offset) // stride + 1
    if hi > out_size:
        hi = out_size
    if hi < lo:
        hi = lo
    return lo, hi


# --------------------------------------------------------------------------------------------
# im2col / col2im
# --------------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _im2col_row(src, i, j, stride, pad, out_h, out_w, row, start):
    """``row[start + oh*OW + ow] = src_padded[oh*stride + i, ow*stride + j]``: one input plane
    ``src : (H, W)`` at kernel offset ``(i, j)``, i.e. one sample's stretch of one row of cols
    (zeros where the window is in the padding)."""
    oh_lo, oh_hi = _valid_range(i, stride, pad, src.shape[0], out_h)
    ow_lo, ow_hi = _valid_range(j, stride, pad, src.shape[1], out_w)
    # Output rows whose input row is in the padding: zeros.
    for q in range(start, start + oh_lo * out_w):
        row[_u(q)] = 0
    for oh in range(oh_lo, oh_hi):
        src_row = src[_u(oh * stride + i - pad)]
        dst = start + oh * out_w
        for ow in range(ow_lo):
            row[_u(dst + ow)] = 0
        for ow in range(ow_lo, ow_hi):
            row[_u(dst + ow)] = src_row[_u(ow * stride + j - pad)]
        for ow in range(ow_hi, out_w):
            row[_u(dst + ow)] = 0
    for q in range(start + oh_hi * out_w, start + out_h * out_w):
        row[_u(q)] = 0


@njit(inline="always", cache=True)
def _col2im_plane(cols, c, kh, kw, stride, pad, out_h, out_w, start, dst):
    """``dst : (H, W)`` = the scatter-add of input channel ``c``'s rows of ``cols``, columns
    ``[start, start + OH*OW)`` (one sample): every pixel sums the windows that cover it."""
    dst[:, :] = 0
    for i in range(kh):
        oh_lo, oh_hi = _valid_range(i, stride, pad, dst.shape[0], out_h)
        for j in range(kw):
            row = cols[_u((c * kh + i) * kw + j)]
            ow_lo, ow_hi = _valid_range(j, stride, pad, dst.shape[1], out_w)
            for oh in range(oh_lo, oh_hi):
                dst_row = dst[_u(oh * stride + i - pad)]
                first = start + oh * out_w
                # Within one offset (i, j) each pixel is hit at most once: a plain add.
                for ow in range(ow_lo, ow_hi):
                    dst_row[_u(ow * stride + j - pad)] += row[_u(first + ow)]


@njit(parallel=True, cache=True)
def _im2col_kernel(x, kh, kw, stride, pad, out_h, out_w, cols):
    n_size = x.shape[0]
    plane = out_h * out_w
    # One iteration per row r = (c*kh + i)*kw + j of cols: the row is a contiguous stretch of
    # N*OH*OW elements written by this iteration alone (race-free).
    for r in prange(x.shape[1] * kh * kw):
        c = r // (kh * kw)
        i = (r // kw) % kh
        j = r % kw
        row = cols[r]
        for n in range(n_size):
            _im2col_row(x[n, c], i, j, stride, pad, out_h, out_w, row, n * plane)


@njit(parallel=True, cache=True)
def _col2im_kernel(cols, kh, kw, stride, pad, out_h, out_w, dx):
    n_size, c_size = dx.shape[0], dx.shape[1]
    # One iteration per input plane dx[n, c]: all the columns that touch a pixel of that plane
    # come from rows (c, i, j) and columns of sample n, and this iteration alone writes the
    # plane, so the scatter-add needs no atomics. p = c*N + n: a thread's contiguous block of
    # iterations reads the rows of channel c front to back.
    for p in prange(c_size * n_size):
        c = p // n_size
        n = p % n_size
        _col2im_plane(cols, c, kh, kw, stride, pad, out_h, out_w, n * out_h * out_w, dx[n, c])


# --------------------------------------------------------------------------------------------
# the whole im2col convolution, per block of samples
# --------------------------------------------------------------------------------------------
#
# Done as separate passes over the batch (as the reference does), a 3x3 layer writes cols, nine
# times its input, reads it back for the product, and moves the output through an (F, N*OH*OW)
# matrix and a transpose into NCHW; backward the same with dy and dcols. Here each parallel
# iteration takes a block of samples, one at a time: sample n's cols block (C*kh*kw, OH*OW)
# is built in cache and multiplied at once, ``y[n] (F, OH*OW) = W2 @ cols_n``, already in NCHW.
# Backward builds it again from x (x is kept, as Linear keeps its input, instead of cols):
# ``dW += dy[n] @ cols_n^T`` (one partial sum per block, added up in block order after the loop,
# so the result does not depend on which thread ran which block), ``dcols_n = W2^T @ dy[n]``
# and its scatter-add into dx[n]. Products by BLAS through Numba's np.dot (SciPy's OpenBLAS,
# one thread per call under mpidl's thread policy); every iteration writes only its own
# samples of y / dx and its own partial sum: race-free.


@njit(parallel=True, cache=True)
def _conv_forward_kernel(x, w2, bias, add_bias, kh, kw, stride, pad, out_h, out_w, nb, y):
    n_size, c_size = x.shape[0], x.shape[1]
    f_size, plane = w2.shape[0], out_h * out_w
    for k in prange(-(-n_size // nb)):
        cols = np.empty((w2.shape[1], plane), x.dtype)
        for n in range(k * nb, min(n_size, k * nb + nb)):
            for r in range(c_size * kh * kw):
                _im2col_row(x[n, r // (kh * kw)], (r // kw) % kh, r % kw, stride, pad, out_h, out_w, cols[r], 0)
            yn = y[n].reshape(f_size, plane)
            np.dot(w2, cols, yn)
            if add_bias:
                for f in range(f_size):
                    b = bias[f]
                    row = yn[f]
                    for q in range(plane):
                        row[_u(q)] += b


@njit(parallel=True, cache=True)
def _conv_backward_kernel(dy, x, w2, kh, kw, stride, pad, nb, dw_blocks, input_grad, dx):
    n_size, c_size = x.shape[0], x.shape[1]
    f_size, out_h, out_w = dy.shape[1], dy.shape[2], dy.shape[3]
    rows, plane = w2.shape[1], out_h * out_w
    for k in prange(dw_blocks.shape[0]):
        cols = np.empty((rows, plane), x.dtype)
        part = np.empty((f_size, rows), x.dtype)
        dcols = np.empty((rows if input_grad else 0, plane), x.dtype)
        dwk = dw_blocks[k]
        for n in range(k * nb, min(n_size, k * nb + nb)):
            for r in range(rows):
                _im2col_row(x[n, r // (kh * kw)], (r // kw) % kh, r % kw, stride, pad, out_h, out_w, cols[r], 0)
            dyn = dy[n].reshape(f_size, plane)
            if n == k * nb:
                np.dot(dyn, cols.T, dwk)
            else:
                np.dot(dyn, cols.T, part)
                dwk += part
            if input_grad:
                np.dot(w2.T, dyn, dcols)
                for c in range(c_size):
                    _col2im_plane(dcols, c, kh, kw, stride, pad, out_h, out_w, 0, dx[n, c])


def _as_compiled(a):
    """A C-contiguous view (or copy) of ``a`` that the jitted kernels take."""
    return np.ascontiguousarray(a)


def im2col(x, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """:func:`mpidl.kernels.reference.im2col`, parallel over the rows of ``cols``."""
    if x.dtype not in _COMPILED_DTYPES:
        return reference.im2col(x, kh, kw, stride, pad, out=out)
    n, c, h, w = x.shape
    out_h = conv_output_size(h, kh, stride, pad)
    out_w = conv_output_size(w, kw, stride, pad)
    cols = np.empty((c * kh * kw, n * out_h * out_w), dtype=x.dtype) if out is None else out
    _im2col_kernel(_as_compiled(x), kh, kw, stride, pad, out_h, out_w, cols)
    return cols


def col2im(cols, x_shape, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """:func:`mpidl.kernels.reference.col2im`, a scatter-add parallel over the ``(n, c)`` planes."""
    if cols.dtype not in _COMPILED_DTYPES:
        return reference.col2im(cols, x_shape, kh, kw, stride, pad, out=out)
    n, c, h, w = x_shape
    out_h = conv_output_size(h, kh, stride, pad)
    out_w = conv_output_size(w, kw, stride, pad)
    # The kernel zeroes each plane itself (inside the parallel loop, while the plane is hot in
    # cache), so np.empty is enough and a reused `out` needs no separate fill.
    dx = np.empty((n, c, h, w), dtype=cols.dtype) if out is None else out
    _col2im_kernel(_as_compiled(cols), kh, kw, stride, pad, out_h, out_w, dx)
    return dx


def conv2d_forward(x, weight, bias=None, stride: int = 1, pad: int = 0):
    """:func:`mpidl.kernels.reference.conv2d_forward`, parallel over blocks of samples; returns
    ``(y, x)``: backward builds each sample's cols again from ``x`` (kept, not copied)."""
    if x.dtype not in _COMPILED_DTYPES:
        return reference.conv2d_forward(x, weight, bias, stride, pad)
    n, _, h, w = x.shape
    f, _, kh, kw = weight.shape
    out_h, out_w = conv_output_size(h, kh, stride, pad), conv_output_size(w, kw, stride, pad)
    y = np.empty((n, f, out_h, out_w), dtype=x.dtype)
    add_bias = bias is not None
    bias = np.ascontiguousarray(bias if add_bias else np.zeros(f), dtype=x.dtype).reshape(f)
    x = _as_compiled(x)
    with _threads.one_blas_thread():  # BLAS is called from the parallel threads
        _conv_forward_kernel(x, np.ascontiguousarray(weight, dtype=x.dtype).reshape(f, -1), bias, add_bias,
                             kh, kw, stride, pad, out_h, out_w, _samples_per_block(n), y)
    return y, x


def conv2d_backward(dy, weight, x, x_shape, stride: int = 1, pad: int = 0, input_grad: bool = True):
    """:func:`mpidl.kernels.reference.conv2d_backward`, parallel over blocks of samples; ``x`` is
    what :func:`conv2d_forward` returned (of ``x_shape``). Returns ``(dW, dx)`` (``dx`` None
    without ``input_grad``)."""
    if dy.dtype not in _COMPILED_DTYPES:  # forward handed these to the reference: x is its cols
        return reference.conv2d_backward(dy, weight, x, x_shape, stride, pad, input_grad)
    n = x.shape[0]
    f, _, kh, kw = weight.shape
    nb = _samples_per_block(n)
    dw_blocks = np.empty((-(-n // nb), f, weight[0].size), dtype=dy.dtype)
    dx = np.empty(x.shape, dtype=dy.dtype) if input_grad else np.empty((0, 0, 0, 0), dtype=dy.dtype)
    with _threads.one_blas_thread():  # BLAS is called from the parallel threads
        _conv_backward_kernel(_as_compiled(dy), x, np.ascontiguousarray(weight, dtype=dy.dtype).reshape(f, -1),
                              kh, kw, stride, pad, nb, dw_blocks, bool(input_grad), dx)
    dw = (dw_blocks[0] if dw_blocks.shape[0] == 1 else dw_blocks.sum(axis=0)).reshape(weight.shape)
    return dw, (dx if input_grad else None)


def _samples_per_block(n: int, min_blocks: int = 1) -> int:
    """``nb`` for ``n`` samples: at least one block per Numba thread and ``min_blocks`` blocks,
    never more blocks than samples."""
    blocks = max(numba.get_num_threads(), min_blocks)
    return max(1, -(-n // max(1, min(n, blocks))))


# --------------------------------------------------------------------------------------------
# max pooling
# --------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _maxpool_forward_kernel(x, k, stride, pad, y, argmax):
    n_size, c_size, h_size, w_size = x.shape
    out_h, out_w = y.shape[2], y.shape[3]
    # One iteration per plane (n, c): it writes only y[n, c] and argmax[n, c].
    for p in prange(n_size * c_size):
        n = p // c_size
        c = p % c_size
        src, dst, dst_index = x[n, c], y[n, c], argmax[n, c]
        for oh in range(out_h):
            h0 = oh * stride - pad
            i_lo = max(0, -h0)
            i_hi = min(k, h_size - h0)
            for ow in range(out_w):
                w0 = ow * stride - pad
                j_lo = max(0, -w0)
                j_hi = min(k, w_size - w0)
                # Start from the first real pixel of the window (pad <= k//2 guarantees one),
                # then take a later one only if strictly greater: ties go to the first maximum
                # in row-major window order, and a NaN in the first place stays (as in the
                # reference, whose comparisons are the same).
                best = src[_u(h0 + i_lo), _u(w0 + j_lo)]
                best_index = (h0 + i_lo) * w_size + (w0 + j_lo)
                for i in range(i_lo, i_hi):
                    src_row = src[_u(h0 + i)]
                    for j in range(j_lo, j_hi):
                        v = src_row[_u(w0 + j)]
                        if v > best:
                            best = v
                            best_index = (h0 + i) * w_size + (w0 + j)
                dst[_u(oh), _u(ow)] = best
                dst_index[_u(oh), _u(ow)] = best_index


@njit(parallel=True, cache=True)
def _maxpool_backward_kernel(dy, argmax, dx):
    n_size, c_size, h_size, w_size = dx.shape
    out_h, out_w = dy.shape[2], dy.shape[3]
    # One iteration per plane (n, c); argmax indexes into that same plane, so every add lands
    # in memory owned by this iteration (race-free scatter-add).
    for p in prange(n_size * c_size):
        n = p // c_size
        c = p % c_size
        grad, index, dst = dy[n, c], argmax[n, c], dx[n, c].reshape(h_size * w_size)
        dst[:] = 0
        # Windows are visited last to first: a pixel then receives its contributions in
        # increasing kernel offset (i, j) (offset i = h - oh*stride + pad grows as oh falls),
        # the order the reference adds them in, so float sums agree to the last bit.
        for oh in range(out_h - 1, -1, -1):
            for ow in range(out_w - 1, -1, -1):
                dst[_u(index[_u(oh), _u(ow)])] += grad[_u(oh), _u(ow)]



def maxpool2d_forward(x, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.maxpool2d_forward`, parallel over the planes."""
    if x.dtype not in _COMPILED_DTYPES:
        return reference.maxpool2d_forward(x, k, stride, pad)
    n, c, h, w = x.shape
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    y = np.empty((n, c, out_h, out_w), dtype=x.dtype)
    argmax = np.empty((n, c, out_h, out_w), dtype=np.int32)
    _maxpool_forward_kernel(_as_compiled(x), k, stride, pad, y, argmax)
    return y, argmax


def maxpool2d_backward(dy, argmax, x_shape, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.maxpool2d_backward`, a scatter-add parallel over the
    planes; the range of the ``argmax`` indices is checked here."""
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.maxpool2d_backward(dy, argmax, x_shape, k, stride, pad)
    n, c, h, w = x_shape
    # An index outside its plane would write into a neighbouring plane (another thread's):
    # refuse it rather than race. One pass over a small int array; cheap next to the kernel.
    if argmax.size and (int(argmax.min()) < 0 or int(argmax.max()) >= h * w):
        raise ValueError(f"maxpool2d_backward: argmax holds indices outside [0, {h * w})")
    dx = np.empty((n, c, h, w), dtype=dy.dtype)
    _maxpool_backward_kernel(_as_compiled(dy), np.ascontiguousarray(argmax, dtype=np.int32), dx)
    return dx


# --------------------------------------------------------------------------------------------
# average pooling
# --------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _avgpool_forward_kernel(x, k, stride, pad, window, y):
    n_size, c_size, h_size, w_size = x.shape
    out_h, out_w = y.shape[2], y.shape[3]
    # One iteration per plane (n, c): it writes only y[n, c].
    for p in prange(n_size * c_size):
        n = p // c_size
        c = p % c_size
        src, dst = x[n, c], y[n, c]
        for oh in range(out_h):
            h0 = oh * stride - pad
            i_lo = max(0, -h0)
            i_hi = min(k, h_size - h0)
            for ow in range(out_w):
                w0 = ow * stride - pad
                j_lo = max(0, -w0)
                j_hi = min(k, w_size - w0)
                # Padded pixels are zeros: skipping them leaves the sum unchanged, and the
                # divisor stays k*k (count_include_pad=True).
                total = window - window  # a zero of the array's dtype
                for i in range(i_lo, i_hi):
                    src_row = src[_u(h0 + i)]
                    for j in range(j_lo, j_hi):
                        total += src_row[_u(w0 + j)]
                dst[_u(oh), _u(ow)] = total / window


@njit(parallel=True, cache=True)
def _avgpool_backward_kernel(dy, k, stride, pad, window, dx):
    n_size, c_size, h_size, w_size = dx.shape
    out_h, out_w = dy.shape[2], dy.shape[3]
    # One iteration per plane (n, c): each window lies inside plane (n, c) of dx, so the
    # scatter-add stays in memory this iteration owns (race-free).
    for p in prange(n_size * c_size):
        n = p // c_size
        c = p % c_size
        grad, dst = dy[n, c], dx[n, c]
        dst[:, :] = 0
        # Last window first, so each pixel gets its shares in increasing kernel offset, the
        # reference's order (see _maxpool_backward_kernel): the float sums agree exactly.
        for oh in range(out_h - 1, -1, -1):
            h0 = oh * stride - pad
            i_lo = max(0, -h0)
            i_hi = min(k, h_size - h0)
            for ow in range(out_w - 1, -1, -1):
                w0 = ow * stride - pad
                j_lo = max(0, -w0)
                j_hi = min(k, w_size - w0)
                share = grad[_u(oh), _u(ow)] / window
                for i in range(i_lo, i_hi):
                    dst_row = dst[_u(h0 + i)]
                    for j in range(j_lo, j_hi):
                        dst_row[_u(w0 + j)] += share


def _window_size(k, dtype):
    """``k*k`` as a scalar of the array's dtype: Numba would promote ``float32 / int64`` to
    float64, while NumPy (and so the reference) keeps float32 arithmetic."""
    return dtype.type(k * k)


def avgpool2d_forward(x, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.avgpool2d_forward`, parallel over the planes."""
    if x.dtype not in _COMPILED_DTYPES:
        return reference.avgpool2d_forward(x, k, stride, pad)
    n, c, h, w = x.shape
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    y = np.empty((n, c, out_h, out_w), dtype=x.dtype)
    _avgpool_forward_kernel(_as_compiled(x), k, stride, pad, _window_size(k, x.dtype), y)
    return y


def avgpool2d_backward(dy, x_shape, k: int, stride: int, pad: int = 0):
    """:func:`mpidl.kernels.reference.avgpool2d_backward`, a scatter-add parallel over the planes."""
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.avgpool2d_backward(dy, x_shape, k, stride, pad)
    n, c, h, w = x_shape
    dx = np.empty((n, c, h, w), dtype=dy.dtype)
    _avgpool_backward_kernel(_as_compiled(dy), k, stride, pad, _window_size(k, dy.dtype), dx)
    return dx
