"""Reference convolution and pooling kernels: the definition the fast kernels are tested against.

Written once against ``xp`` (NumPy or CuPy, from :func:`mpidl.engine.backend.get_array_module`),
vectorized over the batch, the channels and the output pixels. The only Python loops run over
the ``kh*kw`` kernel offsets: for a fixed offset ``(i, j)`` the input pixels that meet it form
one strided slice of the (padded) input,

    x_padded[:, :, i : i + stride*OH : stride, j : j + stride*OW : stride]   # (N, C, OH, OW)

so every kernel is "for each offset: one slice, one array operation". The arguments are
checked by the dispatcher, :mod:`mpidl.kernels`; the functions here take checked ones.

Layouts and conventions, shared by all three implementations (NCHW everywhere)
------------------------------------------------------------------------------
* ``OH = (H + 2*pad - kh) // stride + 1`` (same for ``OW``, :func:`conv_output_size`).
* ``cols : (C*kh*kw, N*OH*OW)``: row ``(c*kh + i)*kw + j`` holds input channel ``c`` at kernel
  offset ``(i, j)``, column ``(n*OH + oh)*OW + ow`` is output pixel ``(oh, ow)`` of sample ``n``.
* Max pooling pads with ``-inf`` and returns ``argmax`` (int32), the index ``h*W + w`` of the
  winner in its unpadded ``(H, W)`` input plane. Ties go to the first maximum in row-major
  window order (offset ``(i, j)`` before ``(i, j+1)`` before ``(i+1, 0)``). ``pad`` may be at
  most ``k // 2`` (as in PyTorch), so every window holds at least one real pixel.
* Average pooling pads with zeros and always divides by ``k*k`` (``count_include_pad=True``).
* ``out=`` (im2col / col2im only): a preallocated, C-contiguous result buffer of the exact
  shape and dtype; it is filled and returned, so a layer can reuse one workspace every step.
"""

from __future__ import annotations

import sys

from mpidl.engine.backend import get_array_module

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


# --------------------------------------------------------------------------------------------
# geometry and helpers
# --------------------------------------------------------------------------------------------


def conv_output_size(size: int, k: int, stride: int = 1, pad: int = 0) -> int:
    """Output length of a convolution / pooling window sliding over ``size`` input pixels.

    Notes
    -----
    ``out = (size + 2*pad - k) // stride + 1`` (the floor drops a last partial window).

    Raises
    ------
    ValueError
        For ``k < 1``, ``stride < 1``, ``pad < 0`` or when the output would be empty
        (the window is larger than the padded input): the dispatcher's geometry check.
    """
    if k < 1 or stride < 1 or pad < 0:
        raise ValueError(f"need k >= 1, stride >= 1, pad >= 0; got k={k}, stride={stride}, pad={pad}")
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise ValueError(
            f"window k={k} (stride={stride}, pad={pad}) does not fit in an input of size {size}: "
            f"the output would be empty"
        )
    return out


def _pad_planes(x, pad: int, value: float = 0.0):
    """``(N, C, H, W)`` -> ``(N, C, H + 2*pad, W + 2*pad)`` with ``value`` in the border."""
    if pad == 0:
        return x
    xp = get_array_module(x)
    return xp.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode="constant", constant_values=value)


def _window_slice(i: int, j: int, stride: int, oh: int, ow: int):
    """Index of the padded-input pixels that meet kernel offset ``(i, j)``: ``(N, C, OH, OW)``."""
    return (
        slice(None),
        slice(None),
        slice(i, i + stride * (oh - 1) + 1, stride),
        slice(j, j + stride * (ow - 1) + 1, stride),
    )


# --------------------------------------------------------------------------------------------
# im2col / col2im
# --------------------------------------------------------------------------------------------


def im2col(x, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """Unfold every receptive field of ``x`` into one column, so convolution becomes one GEMM.

    Parameters
    ----------
    x : (N, C, H, W)
    kh, kw, stride, pad : kernel height / width, stride and zero padding (same for H and W)
    out : optional (C*kh*kw, N*OH*OW) buffer of x's dtype, filled and returned

    Returns
    -------
    cols : (C*kh*kw, N*OH*OW)

    Notes
    -----
    ``cols[(c*kh + i)*kw + j, (n*OH + oh)*OW + ow] = x[n, c, oh*stride + i - pad, ow*stride + j - pad]``
    (zero where the index falls in the padding). Viewed as a 6-D array
    ``(C, kh, kw, N, OH, OW)``, the slab at offset ``(i, j)`` is one strided slice of the padded
    input with its ``N`` and ``C`` axes swapped.
    """
    xp = get_array_module(x)
    n, c, h, w = x.shape
    oh = conv_output_size(h, kh, stride, pad)
    ow = conv_output_size(w, kw, stride, pad)
    cols = xp.empty((c * kh * kw, n * oh * ow), dtype=x.dtype) if out is None else out

    x_padded = _pad_planes(x, pad)
    cols6 = cols.reshape(c, kh, kw, n, oh, ow)  # a view: writes land in `cols`
    for i in range(kh):
        for j in range(kw):
            cols6[:, i, j] = x_padded[_window_slice(i, j, stride, oh, ow)].transpose(1, 0, 2, 3)
    return cols


def col2im(cols, x_shape, kh: int, kw: int, stride: int = 1, pad: int = 0, out=None):
    """Adjoint of :func:`im2col`: scatter-add every column back onto the pixels it came from.

    Parameters
    ----------
    cols : (C*kh*kw, N*OH*OW)
    x_shape : (N, C, H, W), the shape of the image ``cols`` was unfolded from
    out : optional ``x_shape`` buffer of cols' dtype, filled and returned

    Returns
    -------
    dx : (N, C, H, W)

    Notes
    -----
    ``dx[n, c, h, w] = sum over (i, j, oh, ow) with oh*stride + i - pad = h and
    ow*stride + j - pad = w of cols[(c*kh + i)*kw + j, (n*OH + oh)*OW + ow]``.
    Being the adjoint, ``<im2col(x), cols> == <x, col2im(cols)>`` for all ``x`` and ``cols``;
    this is how the convolution's input gradient is formed from ``dcols = W.T @ dY``.
    Within one offset ``(i, j)`` the strided slice touches each pixel at most once, so a plain
    ``+=`` per offset is a correct scatter-add.
    """
    xp = get_array_module(cols)
    n, c, h, w = x_shape
    oh = conv_output_size(h, kh, stride, pad)
    ow = conv_output_size(w, kw, stride, pad)
    dx_padded = xp.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=cols.dtype)
    cols6 = cols.reshape(c, kh, kw, n, oh, ow)
    for i in range(kh):
        for j in range(kw):
            dx_padded[_window_slice(i, j, stride, oh, ow)] += cols6[:, i, j].transpose(1, 0, 2, 3)
    dx = dx_padded[:, :, pad : pad + h, pad : pad + w]
    if out is None:
        return dx if pad == 0 else xp.ascontiguousarray(dx)
    out[...] = dx
    return out


# --------------------------------------------------------------------------------------------
# max pooling
# --------------------------------------------------------------------------------------------


def conv2d_forward(x, weight, bias=None, stride: int = 1, pad: int = 0, pieces=None):
    """The convolution as im2col and one product: ``Y2 = W2 @ cols (+ bias)``.

    Parameters
    ----------
    x : (N, C, H, W); weight : (F, C, kh, kw), ``W2 = weight.reshape(F, C*kh*kw)``; bias : (F,)
    pieces : the module whose ``im2col`` to use (default this one's; the CUDA module passes its own)

    Returns
    -------
    (y, cols): ``y : (N, F, OH, OW)``, ``y[n, f] = Y2[f, n*OH*OW : (n+1)*OH*OW]`` as a plane, and
    ``cols`` (see the layout above), saved for :func:`conv2d_backward`.
    """
    pieces = pieces or sys.modules[__name__]
    xp = get_array_module(x)
    n, _, h, w = x.shape
    f, _, kh, kw = weight.shape
    oh, ow = conv_output_size(h, kh, stride, pad), conv_output_size(w, kw, stride, pad)
    cols = pieces.im2col(x, kh, kw, stride, pad)
    y2 = xp.matmul(weight.reshape(f, -1), cols)
    if bias is not None:
        y2 += bias.reshape(f, 1)
    return xp.ascontiguousarray(y2.reshape(f, n, oh, ow).transpose(1, 0, 2, 3)), cols


def conv2d_backward(dy, weight, cols, x_shape, stride: int = 1, pad: int = 0, input_grad: bool = True, pieces=None):
    """The adjoint of :func:`conv2d_forward`: with ``dY2 = dy`` as ``(F, N*OH*OW)``,
    ``dW2 = dY2 @ cols^T`` and ``dx = col2im(W2^T @ dY2)``.

    Returns
    -------
    (dW (F, C, kh, kw), dx (N, C, H, W) or None without ``input_grad``); the bias gradient,
    ``dy.sum((0, 2, 3))``, is the caller's.
    """
    pieces = pieces or sys.modules[__name__]
    xp = get_array_module(dy)
    f, _, kh, kw = weight.shape
    dy2 = xp.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(f, -1)
    dw = xp.matmul(dy2, cols.T).reshape(weight.shape)
    if not input_grad:
        return dw, None
    return dw, pieces.col2im(xp.matmul(weight.reshape(f, -1).T, dy2), x_shape, kh, kw, stride, pad)


def _pool_geometry(x_shape, k: int, stride: int, pad: int):
    n, c, h, w = x_shape
    return n, c, h, w, conv_output_size(h, k, stride, pad), conv_output_size(w, k, stride, pad)


def _offset_plane_index(xp, i: int, j: int, stride: int, pad: int, oh: int, ow: int, w: int):
    """For kernel offset ``(i, j)``: the input row, column and plane index ``h*W + w`` that
    each output pixel ``(oh, ow)`` reads, as ``(OH, 1)``, ``(1, OW)`` and ``(OH, OW)`` arrays."""
    rows = (xp.arange(oh) * stride + i - pad)[:, None]
    cols = (xp.arange(ow) * stride + j - pad)[None, :]
    return rows, cols, (rows * w + cols).astype(xp.int32)


def maxpool2d_forward(x, k: int, stride: int, pad: int = 0):
    """Max over each ``k x k`` window, and where the max was.

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
    ``y[n, c, oh, ow] = max_{i,j < k} x[n, c, oh*stride + i - pad, ow*stride + j - pad]``.
    Offsets are visited in row-major order and a later offset wins only if strictly greater,
    so ties go to the first maximum.
    """
    xp = get_array_module(x)
    n, c, h, w, oh, ow = _pool_geometry(x.shape, k, stride, pad)

    x_padded = _pad_planes(x, pad, value=-xp.inf)
    best = xp.full((n, c, oh, ow), -xp.inf, dtype=x.dtype)
    argmax = xp.full((n, c, oh, ow), -1, dtype=xp.int32)
    for i in range(k):
        for j in range(k):
            rows, cols, index = _offset_plane_index(xp, i, j, stride, pad, oh, ow, w)
            inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
            candidate = x_padded[_window_slice(i, j, stride, oh, ow)]
            # `argmax < 0`: nothing taken yet, so the first real pixel is taken even if it is
            # -inf (an all -inf window must still point at a pixel inside the window).
            better = (candidate > best) | ((argmax < 0) & inside)
            best = xp.where(better, candidate, best)
            argmax = xp.where(better, index, argmax)
    return best, argmax


def maxpool2d_backward(dy, argmax, x_shape, k: int, stride: int, pad: int = 0):
    """Route each output gradient to the input pixel that won its window.

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
    Given ``(oh, ow)``, the winner's index fixes the kernel offset ``(i, j)``, so looping over
    the offsets and adding ``dy`` where ``argmax`` equals that offset's index is a scatter-add
    made of strided slices only (no ``add.at``, which is slow on NumPy and CuPy alike).
    """
    xp = get_array_module(dy)
    n, c, h, w, oh, ow = _pool_geometry(x_shape, k, stride, pad)
    dx_padded = xp.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=dy.dtype)
    for i in range(k):
        for j in range(k):
            _, _, index = _offset_plane_index(xp, i, j, stride, pad, oh, ow, w)
            dx_padded[_window_slice(i, j, stride, oh, ow)] += xp.where(argmax == index, dy, 0)
    return xp.ascontiguousarray(dx_padded[:, :, pad : pad + h, pad : pad + w])


# --------------------------------------------------------------------------------------------
# average pooling
# --------------------------------------------------------------------------------------------


def avgpool2d_forward(x, k: int, stride: int, pad: int = 0):
    """Mean over each ``k x k`` window (zero padding counted).

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
    xp = get_array_module(x)
    n, c, h, w, oh, ow = _pool_geometry(x.shape, k, stride, pad)
    x_padded = _pad_planes(x, pad)
    total = xp.zeros((n, c, oh, ow), dtype=x.dtype)
    for i in range(k):
        for j in range(k):
            total += x_padded[_window_slice(i, j, stride, oh, ow)]
    total /= k * k
    return total


def avgpool2d_backward(dy, x_shape, k: int, stride: int, pad: int = 0):
    """Spread each output gradient evenly over its window.

    Parameters
    ----------
    dy : (N, C, OH, OW)
    x_shape : (N, C, H, W)

    Returns
    -------
    dx : (N, C, H, W)

    Notes
    -----
    ``dx[n, c, oh*stride + i - pad, ow*stride + j - pad] += dy[n, c, oh, ow] / k^2`` for every
    offset ``(i, j)``; the share that lands in the padding is dropped.
    """
    xp = get_array_module(dy)
    n, c, h, w, oh, ow = _pool_geometry(x_shape, k, stride, pad)
    share = dy / (k * k)
    dx_padded = xp.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=dy.dtype)
    for i in range(k):
        for j in range(k):
            dx_padded[_window_slice(i, j, stride, oh, ow)] += share
    return xp.ascontiguousarray(dx_padded[:, :, pad : pad + h, pad : pad + w])
