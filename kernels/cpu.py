"""Numba CPU kernels: im2col / col2im, pooling and the Winograd transforms, ``@njit(parallel=True)``.

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
winograd input       channel ``c``'s block ``V[c]``          channel ``c`` of every sample
winograd input adj.  channel ``c`` of ``dx``                 ``dV[c]``
winograd output      filter ``f`` of ``y``                   ``M[f]``
winograd output adj. filter ``f``'s block ``dM[f]``          filter ``f`` of ``dy``
===================  ======================================  ==============================

``col2im`` and the pooling backward passes are scatter-adds (several columns / windows add
into the same pixel); they are race-free because every pixel a plane iteration adds into
belongs to that iteration's own plane. Plane iterations are numbered channel-major
(``p = c*N + n``) in ``col2im``, so the contiguous block of iterations a thread gets walks
the rows of ``cols`` in memory order.

Padding is never materialized: for each output row the valid range of output columns is
computed once, so the innermost loop is branch-free (a plain strided copy / add that LLVM
vectorizes) and the padded border is written as zeros (or skipped) outside it.

No kernel fuses im2col with anything: im2col runs at the speed of a memory copy and col2im
takes about 1 ms on the hsicnn shapes, next to about 10 ms for each GEMM, so fusing has little
to gain. The transposed layout ``(N*OH*OW, C*kh*kw)`` ("im2row") was measured too: its GEMMs
are a little faster with some BLAS kernels, but building it is a gather with short inner
loops, 2-5x slower than im2col, and the convolution as a whole got slower. What did pay was a
different algorithm: Winograd's transforms (below) cut the GEMM work of hsicnn's 3x3 layers to
31 %; the output transform adds the bias on the way (no separate pass).

Only float32 and float64 are compiled (one specialization each; ``cache=True`` keeps the
machine code in ``__pycache__`` so later processes start at once). Any other dtype is handed
to the reference implementation, which defines the result for it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from . import reference
from .reference import conv_output_size

__all__ = [
    "conv_output_size",
    "im2col",
    "col2im",
    "maxpool2d_forward",
    "maxpool2d_backward",
    "avgpool2d_forward",
    "avgpool2d_backward",
]

_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# Every array index in the hot loops goes through _u (a cast to uint64, free at run time).
# For a signed index Numba emits Python's wraparound (x[-1] is the last element): a compare
# and branch per access that also stops LLVM from vectorizing the loop. Our indices are never
# negative (the padding is handled by the loop bounds), and an unsigned index says so; on the
# hsicnn shapes this makes im2col about 5x faster, as fast as a plain memory copy.
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


@njit(parallel=True, cache=True)
def _im2col_kernel(x, kh, kw, stride, pad, out_h, out_w, cols):
    n_size, c_size, h_size, w_size = x.shape
    plane = out_h * out_w
    # One iteration per row r = (c*kh + i)*kw + j of cols: the row is a contiguous stretch of
    # N*OH*OW elements written by this iteration alone (race-free).
    for r in prange(c_size * kh * kw):
        c = r // (kh * kw)
        i = (r // kw) % kh
        j = r % kw
        oh_lo, oh_hi = _valid_range(i, stride, pad, h_size, out_h)
        ow_lo, ow_hi = _valid_range(j, stride, pad, w_size, out_w)
        row = cols[r]
        for n in range(n_size):
            src = x[n, c]
            start = n * plane
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
            for q in range(start + oh_hi * out_w, start + plane):
                row[_u(q)] = 0


@njit(parallel=True, cache=True)
def _col2im_kernel(cols, kh, kw, stride, pad, out_h, out_w, dx):
    n_size, c_size, h_size, w_size = dx.shape
    plane = out_h * out_w
    # One iteration per input plane dx[n, c]: all the columns that touch a pixel of that plane
    # come from rows (c, i, j) and columns of sample n, and this iteration alone writes the
    # plane, so the scatter-add needs no atomics. p = c*N + n: a thread's contiguous block of
    # iterations reads the rows of channel c front to back.
    for p in prange(c_size * n_size):
        c = p // n_size
        n = p % n_size
        dst = dx[n, c]
        dst[:, :] = 0
        for i in range(kh):
            oh_lo, oh_hi = _valid_range(i, stride, pad, h_size, out_h)
            for j in range(kw):
                row = cols[(c * kh + i) * kw + j]
                ow_lo, ow_hi = _valid_range(j, stride, pad, w_size, out_w)
                for oh in range(oh_lo, oh_hi):
                    dst_row = dst[_u(oh * stride + i - pad)]
                    start = n * plane + oh * out_w
                    # Within one offset (i, j) each pixel is hit at most once: a plain add.
                    for ow in range(ow_lo, ow_hi):
                        dst_row[_u(ow * stride + j - pad)] += row[_u(start + ow)]


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
