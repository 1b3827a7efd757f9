"""Numba CPU kernels: im2col / col2im, pooling and the Winograd transforms, ``@njit(parallel=True)``.

Same functions, signatures and layouts as :mod:`mpidl.kernels.reference` (read the layout
contract in :mod:`mpidl.kernels`); the tests compare the two on every shape they try.

How the work is split between threads
-------------------------------------
Every kernel is a thin Python wrapper (check the arguments, allocate or check the result,
make the inputs C-contiguous) around one jitted function whose outer loop is a ``prange``.
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
from .reference import as_ints, conv_output_size, pool_args

__all__ = [
    "conv_output_size",
    "im2col",
    "col2im",
    "maxpool2d_forward",
    "maxpool2d_backward",
    "avgpool2d_forward",
    "avgpool2d_backward",
    "winograd_input",
    "winograd_input_adjoint",
    "winograd_output",
    "winograd_output_adjoint",
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


def _check_out(out, shape, dtype, what):
    if not isinstance(out, np.ndarray):
        raise ValueError(f"{what}: out must be a NumPy array, got {type(out).__name__}")
    return reference._check_out(out, shape, dtype, what)


def im2col(x, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """Unfold every receptive field of ``x`` into one column (parallel over rows of ``cols``).

    Parameters
    ----------
    x : (N, C, H, W), float32 or float64 (other dtypes go to the reference)
    kh, kw, stride, pad : kernel height / width, stride and zero padding
    out : optional C-contiguous (C*kh*kw, N*OH*OW) buffer of x's dtype, filled and returned

    Returns
    -------
    cols : (C*kh*kw, N*OH*OW)

    Notes
    -----
    ``cols[(c*kh + i)*kw + j, (n*OH + oh)*OW + ow] = x[n, c, oh*stride + i - pad, ow*stride + j - pad]``,
    zero in the padding.
    """
    x = np.asarray(x)
    n, c, h, w = reference._check_4d(x)
    kh, kw, stride, pad = as_ints(kh, kw, stride, pad)
    if x.dtype not in _COMPILED_DTYPES:
        return reference.im2col(x, kh, kw, stride, pad, out=out)
    out_h = conv_output_size(h, kh, stride, pad)
    out_w = conv_output_size(w, kw, stride, pad)
    shape = (c * kh * kw, n * out_h * out_w)
    cols = np.empty(shape, dtype=x.dtype) if out is None else _check_out(out, shape, x.dtype, "im2col")
    _im2col_kernel(_as_compiled(x), kh, kw, stride, pad, out_h, out_w, cols)
    return cols


def col2im(cols, x_shape, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """Adjoint of :func:`im2col`: scatter-add the columns back (parallel over ``(n, c)`` planes).

    Parameters
    ----------
    cols : (C*kh*kw, N*OH*OW)
    x_shape : (N, C, H, W)
    out : optional C-contiguous ``x_shape`` buffer of cols' dtype, overwritten and returned

    Returns
    -------
    dx : (N, C, H, W)

    Notes
    -----
    ``dx[n, c, h, w] = sum over (i, j, oh, ow) with oh*stride + i - pad = h and
    ow*stride + j - pad = w of cols[(c*kh + i)*kw + j, (n*OH + oh)*OW + ow]``.
    """
    cols = np.asarray(cols)
    kh, kw, stride, pad = as_ints(kh, kw, stride, pad)
    if cols.dtype not in _COMPILED_DTYPES:
        return reference.col2im(cols, x_shape, kh, kw, stride, pad, out=out)
    n, c, h, w = (int(s) for s in x_shape)
    out_h = conv_output_size(h, kh, stride, pad)
    out_w = conv_output_size(w, kw, stride, pad)
    expected = (c * kh * kw, n * out_h * out_w)
    if tuple(cols.shape) != expected:
        raise ValueError(
            f"col2im: cols has shape {tuple(cols.shape)}, expected {expected} for x_shape {tuple(x_shape)}"
        )
    shape = (n, c, h, w)
    # The kernel zeroes each plane itself (inside the parallel loop, while the plane is hot in
    # cache), so np.empty is enough and a reused `out` needs no separate fill.
    dx = np.empty(shape, dtype=cols.dtype) if out is None else _check_out(out, shape, cols.dtype, "col2im")
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
    """Max over each ``k x k`` window and the plane index of its winner (parallel over planes).

    Parameters
    ----------
    x : (N, C, H, W)
    k, stride, pad : window size, stride, padding (with -inf; ``pad <= k // 2``)

    Returns
    -------
    y : (N, C, OH, OW), x's dtype
    argmax : (N, C, OH, OW) int32, index ``h*W + w`` of the winner in its input plane

    Notes
    -----
    ``y[n, c, oh, ow] = max_{i,j < k} x[n, c, oh*stride + i - pad, ow*stride + j - pad]``;
    ties go to the first maximum in row-major window order.
    """
    x = np.asarray(x)
    n, c, h, w = reference._check_4d(x)
    if x.dtype not in _COMPILED_DTYPES:
        return reference.maxpool2d_forward(x, k, stride, pad)
    k, stride, pad = pool_args(k, stride, pad)
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    if pad > k // 2:
        raise ValueError(f"max pooling needs pad <= k // 2 (k={k}), got pad={pad}")
    y = np.empty((n, c, out_h, out_w), dtype=x.dtype)
    argmax = np.empty((n, c, out_h, out_w), dtype=np.int32)
    _maxpool_forward_kernel(_as_compiled(x), k, stride, pad, y, argmax)
    return y, argmax


def maxpool2d_backward(dy, argmax, x_shape, k: int, stride: int, pad: int = 0):
    """Route each output gradient to the input pixel that won its window (parallel over planes).

    Parameters
    ----------
    dy : (N, C, OH, OW)
    argmax : (N, C, OH, OW) int32, from :func:`maxpool2d_forward`
    x_shape : (N, C, H, W)

    Returns
    -------
    dx : (N, C, H, W), dy's dtype

    Notes
    -----
    ``dx[n, c].flat[argmax[n, c, oh, ow]] += dy[n, c, oh, ow]`` (overlapping windows add up).
    """
    dy = np.asarray(dy)
    argmax = np.asarray(argmax)
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.maxpool2d_backward(dy, argmax, x_shape, k, stride, pad)
    k, stride, pad = pool_args(k, stride, pad)
    n, c, h, w = (int(s) for s in x_shape)
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    if tuple(dy.shape) != (n, c, out_h, out_w) or tuple(argmax.shape) != (n, c, out_h, out_w):
        raise ValueError(
            f"maxpool2d_backward: dy {tuple(dy.shape)} and argmax {tuple(argmax.shape)} "
            f"must both be {(n, c, out_h, out_w)} for x_shape {tuple(x_shape)}"
        )
    if argmax.dtype.kind not in "iu":
        raise ValueError(f"maxpool2d_backward: argmax must be an integer array, got {argmax.dtype}")
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
    """Mean over each ``k x k`` window, zero padding counted (parallel over planes).

    Parameters
    ----------
    x : (N, C, H, W)

    Returns
    -------
    y : (N, C, OH, OW)

    Notes
    -----
    ``y[n, c, oh, ow] = (1 / k^2) * sum_{i,j < k} x[n, c, oh*stride + i - pad, ow*stride + j - pad]``.
    """
    x = np.asarray(x)
    n, c, h, w = reference._check_4d(x)
    if x.dtype not in _COMPILED_DTYPES:
        return reference.avgpool2d_forward(x, k, stride, pad)
    k, stride, pad = pool_args(k, stride, pad)
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    y = np.empty((n, c, out_h, out_w), dtype=x.dtype)
    _avgpool_forward_kernel(_as_compiled(x), k, stride, pad, _window_size(k, x.dtype), y)
    return y


def avgpool2d_backward(dy, x_shape, k: int, stride: int, pad: int = 0):
    """Spread each output gradient evenly over its window (parallel over planes).

    Parameters
    ----------
    dy : (N, C, OH, OW)
    x_shape : (N, C, H, W)

    Returns
    -------
    dx : (N, C, H, W)

    Notes
    -----
    ``dx[n, c, oh*stride + i - pad, ow*stride + j - pad] += dy[n, c, oh, ow] / k^2``; the share
    that lands in the padding is dropped.
    """
    dy = np.asarray(dy)
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.avgpool2d_backward(dy, x_shape, k, stride, pad)
    k, stride, pad = pool_args(k, stride, pad)
    n, c, h, w = (int(s) for s in x_shape)
    out_h = conv_output_size(h, k, stride, pad)
    out_w = conv_output_size(w, k, stride, pad)
    if tuple(dy.shape) != (n, c, out_h, out_w):
        raise ValueError(
            f"avgpool2d_backward: dy has shape {tuple(dy.shape)}, expected {(n, c, out_h, out_w)}"
        )
    dx = np.empty((n, c, h, w), dtype=dy.dtype)
    _avgpool_backward_kernel(_as_compiled(dy), k, stride, pad, _window_size(k, dy.dtype), dx)
    return dx


# --------------------------------------------------------------------------------------------
# Winograd F(m x m, r x r) transforms (the math and the layout: mpidl.kernels.reference)
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
        for h in range(h_size):
            row = plane[_u(h + pad)]
            for w in range(w_size):
                for n in range(n_size):
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
        for oh in range(out_h):
            row = plane[_u(oh)]
            for ow in range(out_w):
                for n in range(n_size):
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


def _winograd_args(m, r, pad):
    m, r, pad = as_ints(m, r, pad)
    if m < 1 or r < 1 or pad < 0:
        raise ValueError(f"winograd: need m >= 1, r >= 1, pad >= 0; got m={m}, r={r}, pad={pad}")
    return m, r, pad


def _transform_shape(channels, tiles_h, tiles_w, n, m, r):
    alpha = m + r - 1
    return (channels, alpha, alpha, tiles_h * tiles_w * n)


def _blocks(transformed):
    """``(C, alpha, alpha, P)`` -> the ``(C, alpha^2, P)`` view the kernels index (explicit sizes:
    ``-1`` cannot be inferred when ``P = 0``, an empty batch)."""
    c, alpha, _, columns = transformed.shape
    return transformed.reshape(c, alpha * alpha, columns)


def _check_shape(array, shape, what):
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(array.shape)}, expected {tuple(shape)}")


def winograd_input(x, m: int, r: int, pad: int = 0, out=None):
    """``x : (N, C, H, W)`` -> ``V : (C, alpha, alpha, TH*TW*N)``, ``V = B^T d B`` per tile
    (see :func:`mpidl.kernels.reference.winograd_input`). Parallel over channels."""
    x = np.asarray(x)
    m, r, pad = _winograd_args(m, r, pad)
    n, c, _, _ = reference._check_4d(x)
    if x.dtype not in _COMPILED_DTYPES:
        return reference.winograd_input(x, m, r, pad, out=out)
    _, _, tiles_h, tiles_w = reference.winograd_geometry(x.shape, m, r, pad)
    shape = _transform_shape(c, tiles_h, tiles_w, n, m, r)
    v = np.empty(shape, dtype=x.dtype) if out is None else _check_out(out, shape, x.dtype, "winograd_input")
    bt = reference.winograd_matrices(m, r)[2].astype(x.dtype)
    _winograd_input_kernel(_as_compiled(x), bt, m, pad, tiles_h, tiles_w, _blocks(v))
    return v


def winograd_input_adjoint(dv, x_shape, m: int, r: int, pad: int = 0, out=None):
    """Adjoint of :func:`winograd_input`: ``dV -> dx : x_shape`` (overlapping patches add up).
    Parallel over channels."""
    dv = np.asarray(dv)
    m, r, pad = _winograd_args(m, r, pad)
    if dv.dtype not in _COMPILED_DTYPES:
        return reference.winograd_input_adjoint(dv, x_shape, m, r, pad, out=out)
    n, c, h, w = (int(s) for s in x_shape)
    _, _, tiles_h, tiles_w = reference.winograd_geometry(x_shape, m, r, pad)
    _check_shape(dv, _transform_shape(c, tiles_h, tiles_w, n, m, r), "winograd_input_adjoint: dv")
    dx = np.empty((n, c, h, w), dtype=dv.dtype) if out is None else _check_out(out, (n, c, h, w), dv.dtype, "winograd_input_adjoint")
    bt_t = np.ascontiguousarray(reference.winograd_matrices(m, r)[2].T, dtype=dv.dtype)
    _winograd_input_adjoint_kernel(_blocks(_as_compiled(dv)), bt_t, m, pad, tiles_h, tiles_w, dx)
    return dx


def winograd_output(mt, y_shape, m: int, r: int, bias=None, out=None):
    """``M : (F, alpha, alpha, TH*TW*N)`` -> ``y : y_shape = (N, F, OH, OW)``, ``A^T M A`` per
    tile plus ``bias[f]``. Parallel over filters."""
    mt = np.asarray(mt)
    m, r, _ = _winograd_args(m, r, 0)
    if mt.dtype not in _COMPILED_DTYPES:
        return reference.winograd_output(mt, y_shape, m, r, bias=bias, out=out)
    n, f, out_h, out_w = (int(s) for s in y_shape)
    tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
    _check_shape(mt, _transform_shape(f, tiles_h, tiles_w, n, m, r), "winograd_output: M")
    y = np.empty((n, f, out_h, out_w), dtype=mt.dtype) if out is None else _check_out(out, (n, f, out_h, out_w), mt.dtype, "winograd_output")
    bias = np.zeros(f, mt.dtype) if bias is None else np.ascontiguousarray(bias, dtype=mt.dtype).reshape(f)
    at = reference.winograd_matrices(m, r)[0].astype(mt.dtype)
    _winograd_output_kernel(_blocks(_as_compiled(mt)), at, bias, m, tiles_h, tiles_w, y)
    return y


def winograd_output_adjoint(dy, m: int, r: int, out=None):
    """Adjoint of :func:`winograd_output` (bias aside): ``dy -> dM``, ``A dY A^T`` per tile.
    Parallel over filters."""
    dy = np.asarray(dy)
    m, r, _ = _winograd_args(m, r, 0)
    n, f, out_h, out_w = reference._check_4d(dy, "dy")
    if dy.dtype not in _COMPILED_DTYPES:
        return reference.winograd_output_adjoint(dy, m, r, out=out)
    tiles_h, tiles_w = -(-out_h // m), -(-out_w // m)
    shape = _transform_shape(f, tiles_h, tiles_w, n, m, r)
    dm = np.empty(shape, dtype=dy.dtype) if out is None else _check_out(out, shape, dy.dtype, "winograd_output_adjoint")
    at_t = np.ascontiguousarray(reference.winograd_matrices(m, r)[0].T, dtype=dy.dtype)
    _winograd_output_adjoint_kernel(_as_compiled(dy), at_t, m, tiles_h, tiles_w, _blocks(dm))
    return dm
