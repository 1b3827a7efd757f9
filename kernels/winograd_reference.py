"""Winograd F(m x m, r x r) transforms, the reference: the definition the Numba kernels
(:mod:`mpidl.kernels.winograd_cpu`, :mod:`mpidl.kernels.winograd_cuda`) are tested against.

Written once against ``xp`` (NumPy or CuPy). The layouts and math are in the comment below;
the layer that uses them is :mod:`mpidl.engine.nn.winograd`. The arguments are checked by the
dispatcher, :mod:`mpidl.kernels`; the transforms here take checked ones.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from mpidl.engine.backend import get_array_module

from .reference import conv_output_size

__all__ = [
    "winograd_matrices",
    "winograd_geometry",
    "winograd_input",
    "winograd_input_adjoint",
    "winograd_output",
    "winograd_output_adjoint",
    "winograd_conv_forward",
    "winograd_conv_backward",
]


# --------------------------------------------------------------------------------------------
# Winograd F(m x m, r x r): a stride-1 convolution with fewer multiplications
# --------------------------------------------------------------------------------------------
#
# Split the output into m x m tiles. Tile (th, tw) needs the alpha x alpha input patch
# d = x_padded[th*m : th*m + alpha, tw*m : tw*m + alpha] (alpha = m + r - 1), and
#
#     Y_tile = A^T [ (G g G^T) (.) (B^T d B) ] A        (.) = elementwise product
#
# equals the r x r cross-correlation of d with the filter g (Lavin & Gray, "Fast Algorithms for
# Convolutional Neural Networks", 2016). Summed over input channels, the elementwise product
# becomes, for each of the alpha^2 positions xi = (a, b) of the transformed tile, one matrix
# product over channels:
#
#     M[:, xi] (F, P) = U[xi] (F, C) @ V[:, xi] (C, P),   U = G g G^T,  V = B^T d B,
#
# with P = TH*TW*N columns, one per (tile, sample). A direct convolution spends m^2 r^2 multiplies
# per tile and channel pair, Winograd alpha^2: F(3x3, 3x3) on a 9x9 output does 3.24x fewer.
#
# Layout (every implementation): V : (C, alpha, alpha, P) and M : (F, alpha, alpha, P), column
# q = (th*TW + tw)*N + n. The sample is innermost, so the transforms run over N contiguous values,
# and the channel outermost, so each channel's transform writes one contiguous block (writing
# alpha^2 rows a whole (C, P) matrix apart would miss the cache on every write). The
# GEMMs see V as ``V.transpose(1, 2, 0, 3)``: alpha^2 matrices (C, P) with row stride
# alpha^2 * P, which BLAS takes as its leading dimension at no cost.
#
# The kernels are the four linear maps around the GEMMs and their adjoints (the backward pass):
#
#     winograd_input           x (N, C, H, W)  -> V (C, alpha, alpha, P)      V = B^T d B per tile
#     winograd_input_adjoint   dV              -> dx (N, C, H, W)              scatter-add d = B dV B^T
#     winograd_output          M (+ bias)      -> y (N, F, OH, OW)             Y = A^T M A per tile
#     winograd_output_adjoint  dy              -> dM (F, alpha, alpha, P)      dM = A dY A^T per tile
#
# The filter transform U = G g G^T and its adjoint dg = G^T dU G are tiny (F*C*alpha^2 values)
# and stay in the layer. A whole convolution, given U, is winograd_conv_forward (input transform,
# products, output transform) and winograd_conv_backward (their adjoints); here they compose the
# four transforms, and what forward saves for backward (V) is each implementation's own business:
# the Numba CPU kernels fuse the passes per block of samples and keep V in another layout.

_WINOGRAD_POINTS = (0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0)


@functools.lru_cache(maxsize=None)
def winograd_matrices(m: int, r: int):
    """The transform matrices of Winograd's minimal filtering algorithm F(m, r), float64.

    Returns
    -------
    AT : (m, alpha), G : (alpha, r), BT : (alpha, alpha) with ``alpha = m + r - 1``, such that
    for every filter ``g`` (r,) and input ``d`` (alpha,):

        AT @ ((G @ g) * (BT @ d)) == correlate(d, g)   i.e.  y[i] = sum_k g[k] d[i + k]

    (exact in exact arithmetic). The 2-D algorithm nests the 1-D one: ``A^T [(G g G^T) (.) (B^T d B)] A``.

    Notes
    -----
    Toom-Cook construction on the interpolation points ``0, 1, -1, 2, -2, 1/2, ...`` (the first
    ``alpha - 1``) plus the point at infinity: ``AT[i, j] = p_j**i``, ``G[j, k] = p_j**k / prod_{l != j}(p_j - p_l)``
    (the infinity column / row picks the leading coefficient). Given those two, the identity above
    is linear in ``BT``: ``sum_j AT[i, j] G[j, k] BT[j, l] = [l == i + k]`` for all ``i, k, l``; it
    is solved column by column and checked. Small points keep the float32 error low: ``m <= 4``
    (points up to +-2) is what the convolution layer uses.
    """
    m, r = int(m), int(r)
    alpha = m + r - 1
    if m < 1 or r < 1 or alpha - 1 > len(_WINOGRAD_POINTS):
        raise ValueError(f"winograd_matrices: need m, r >= 1 and m + r - 2 <= {len(_WINOGRAD_POINTS)}; got m={m}, r={r}")
    points = _WINOGRAD_POINTS[: alpha - 1]
    at = np.zeros((m, alpha))
    g = np.zeros((alpha, r))
    for j, p in enumerate(points):
        at[:, j] = [p**i for i in range(m)]
        g[j] = [p**k / np.prod([p - q for q in points if q != p]) for k in range(r)]
    at[m - 1, alpha - 1] = 1.0
    g[alpha - 1, r - 1] = 1.0

    system = np.einsum("ij,jk->ikj", at, g).reshape(m * r, alpha)  # row (i, k), column j
    shift = np.array([[1.0 if l == i + k else 0.0 for l in range(alpha)] for i in range(m) for k in range(r)])
    bt = np.linalg.lstsq(system, shift, rcond=None)[0]
    bt = np.round(bt * 64.0) / 64.0  # the exact solution has small dyadic entries: drop the lstsq noise
    if not np.allclose(system @ bt, shift, atol=1e-12):
        raise ArithmeticError(f"winograd_matrices: no B^T satisfies the identity for m={m}, r={r}")
    for matrix in (at, g, bt):
        matrix.setflags(write=False)
    return at, g, bt


def winograd_geometry(x_shape, m: int, r: int, pad: int) -> tuple[int, int, int, int]:
    """``(OH, OW, TH, TW)`` of a stride-1 ``r x r`` convolution of ``x_shape`` tiled by ``m x m``:
    ``OH = H + 2*pad - r + 1``, ``TH = ceil(OH / m)`` (the last tile row may stick out of the
    output; its extra outputs are computed from zeros and dropped)."""
    _, _, h, w = (int(s) for s in x_shape)
    oh, ow = conv_output_size(h, r, 1, pad), conv_output_size(w, r, 1, pad)
    return oh, ow, -(-oh // m), -(-ow // m)


def _winograd_padded_input(x, m: int, r: int, pad: int, th: int, tw: int):
    """x with ``pad`` zeros before and enough after that every tile's patch is inside:
    ``(N, C, TH*m + r - 1, TW*m + r - 1)``."""
    xp = get_array_module(x)
    _, _, h, w = x.shape
    hp, wp = th * m + r - 1, tw * m + r - 1
    return xp.pad(x, ((0, 0), (0, 0), (pad, hp - h - pad), (pad, wp - w - pad)))


def _patch_slice(k: int, l: int, m: int, th: int, tw: int):
    """Index of element ``(k, l)`` of every tile's patch in the padded input: ``(N, C, TH, TW)``."""
    return slice(None), slice(None), slice(k, k + m * (th - 1) + 1, m), slice(l, l + m * (tw - 1) + 1, m)


def winograd_input(x, m: int, r: int, pad: int = 0, out=None):
    """Input transform: every tile's ``alpha x alpha`` patch ``d`` becomes ``B^T d B``.

    Parameters
    ----------
    x : (N, C, H, W)
    m, r : output tile size and filter size (alpha = m + r - 1); stride 1; ``pad`` zeros
    out : optional (C, alpha, alpha, TH*TW*N) buffer of x's dtype

    Returns
    -------
    V : (C, alpha, alpha, TH*TW*N);
    ``V[c, a, b, (th*TW + tw)*N + n] = sum_{k,l} BT[a, k] BT[b, l] x_pad[n, c, th*m + k, tw*m + l]``
    """
    xp = get_array_module(x)
    n, c, _, _ = x.shape
    _, _, th, tw = winograd_geometry(x.shape, m, r, pad)
    alpha = m + r - 1
    shape = (c, alpha, alpha, th * tw * n)
    bt = xp.asarray(winograd_matrices(m, r)[2], dtype=x.dtype)
    x_padded = _winograd_padded_input(x, m, r, pad, th, tw)
    patches = xp.stack([xp.stack([x_padded[_patch_slice(k, l, m, th, tw)] for l in range(alpha)]) for k in range(alpha)])
    v = xp.einsum("ak,bl,klncij->cabijn", bt, bt, patches, optimize=True).reshape(shape)  # (k, l, N, C, TH, TW) -> layout
    if out is None:
        return xp.ascontiguousarray(v)
    out[...] = v
    return out


def winograd_input_adjoint(dv, x_shape, m: int, r: int, pad: int = 0, out=None):
    """Adjoint of :func:`winograd_input`: ``d = B dV B^T`` per tile, scatter-added onto the input.

    Parameters
    ----------
    dv : (C, alpha, alpha, TH*TW*N)
    x_shape : (N, C, H, W)

    Returns
    -------
    dx : (N, C, H, W);
    ``dx[n, c, th*m + k - pad, tw*m + l - pad] += sum_{a,b} BT[a, k] BT[b, l] dV[c, a, b, q]``
    (neighbouring patches overlap by ``r - 1`` pixels: their contributions add up; those that
    land in the padding are dropped).
    """
    xp = get_array_module(dv)
    n, c, h, w = x_shape
    _, _, th, tw = winograd_geometry(x_shape, m, r, pad)
    alpha = m + r - 1
    bt = xp.asarray(winograd_matrices(m, r)[2], dtype=dv.dtype)
    patches = xp.einsum("ak,bl,cabijn->klncij", bt, bt, dv.reshape(c, alpha, alpha, th, tw, n), optimize=True)
    dx_padded = xp.zeros((n, c, th * m + r - 1, tw * m + r - 1), dtype=dv.dtype)
    for k in range(alpha):
        for l in range(alpha):
            dx_padded[_patch_slice(k, l, m, th, tw)] += patches[k, l]
    dx = dx_padded[:, :, pad : pad + h, pad : pad + w]
    if out is None:
        return xp.ascontiguousarray(dx)
    out[...] = dx
    return out


def winograd_output(mt, y_shape, m: int, r: int, bias=None, out=None):
    """Output transform: every tile's ``alpha x alpha`` product ``M`` becomes ``A^T M A`` (+ bias).

    Parameters
    ----------
    mt : (F, alpha, alpha, TH*TW*N), the batched GEMM's result
    y_shape : (N, F, OH, OW)
    bias : optional (F,)

    Returns
    -------
    y : (N, F, OH, OW);
    ``y[n, f, th*m + i, tw*m + j] = bias[f] + sum_{a,b} AT[i, a] AT[j, b] M[f, a, b, q]``
    (outputs of the last tile row / column beyond OH / OW are dropped).
    """
    xp = get_array_module(mt)
    n, f, oh, ow = y_shape
    th, tw = -(-oh // m), -(-ow // m)
    alpha = m + r - 1
    at = xp.asarray(winograd_matrices(m, r)[0], dtype=mt.dtype)
    tiles = xp.einsum("ia,jb,fabtun->nftiuj", at, at, mt.reshape(f, alpha, alpha, th, tw, n), optimize=True)
    y = tiles.reshape(n, f, th * m, tw * m)[:, :, :oh, :ow]
    if bias is not None:
        y = y + bias.reshape(1, f, 1, 1)
    if out is None:
        return xp.ascontiguousarray(y)
    out[...] = y
    return out


def winograd_output_adjoint(dy, m: int, r: int, out=None):
    """Adjoint of :func:`winograd_output` (without the bias): ``dM = A dY A^T`` per tile.

    Parameters
    ----------
    dy : (N, F, OH, OW)

    Returns
    -------
    dM : (F, alpha, alpha, TH*TW*N);
    ``dM[f, a, b, q] = sum_{i,j} AT[i, a] AT[j, b] dy[n, f, th*m + i, tw*m + j]`` (zero beyond OH / OW)
    """
    xp = get_array_module(dy)
    n, f, oh, ow = dy.shape
    th, tw = -(-oh // m), -(-ow // m)
    alpha = m + r - 1
    shape = (f, alpha, alpha, th * tw * n)
    at = xp.asarray(winograd_matrices(m, r)[0], dtype=dy.dtype)
    dy_padded = xp.pad(dy, ((0, 0), (0, 0), (0, th * m - oh), (0, tw * m - ow)))
    dm = xp.einsum("ia,jb,nftiuj->fabtun", at, at, dy_padded.reshape(n, f, th, m, tw, m), optimize=True).reshape(shape)
    if out is None:
        return xp.ascontiguousarray(dm)
    out[...] = dm
    return out


def _by_position(transformed):
    """``(C, alpha, alpha, P)`` -> the ``(alpha^2, C, P)`` view the products take (no copy)."""
    c, alpha, _, columns = transformed.shape
    return transformed.reshape(c, alpha * alpha, columns).transpose(1, 0, 2)


def winograd_conv_forward(x, u, m: int, r: int, pad: int = 0, bias=None, transforms=None):
    """The whole stride-1 convolution given the transformed filters: ``V = B^T d B`` per tile,
    ``M[:, xi] = U[xi] @ V[:, xi]`` at each of the alpha^2 positions, ``y = A^T M A + bias``.

    Parameters
    ----------
    x : (N, C, H, W)
    u : (alpha^2, F, C), ``U[a*alpha + b, f, c] = (G g_fc G^T)[a, b]``
    bias : optional (F,)
    transforms : the module whose four transforms to use (default: this one's; the CUDA module
        passes its own)

    Returns
    -------
    (y, V): y (N, F, OH, OW), and V (C, alpha, alpha, TH*TW*N), saved for
    :func:`winograd_conv_backward`.
    """
    transforms = transforms or sys.modules[__name__]
    xp = get_array_module(x)
    n, _, _, _ = x.shape
    f = u.shape[1]
    oh, ow, th, tw = winograd_geometry(x.shape, m, r, pad)
    alpha = m + r - 1
    v = transforms.winograd_input(x, m, r, pad)
    mt = xp.empty((f, alpha, alpha, th * tw * n), dtype=x.dtype)
    _by_position(mt)[...] = xp.matmul(u, _by_position(v))
    return transforms.winograd_output(mt, (n, f, oh, ow), m, r, bias=bias), v


def winograd_conv_backward(dy, u, v, x_shape, m: int, r: int, pad: int = 0, input_grad: bool = True, transforms=None):
    """The adjoints of :func:`winograd_conv_forward` in reverse order: ``dM = A dY A^T``,
    ``dU[xi] = dM[:, xi] @ V[:, xi]^T``, ``dV[:, xi] = U[xi]^T @ dM[:, xi]``, ``dx`` = scatter-add
    of ``B dV B^T``.

    Returns
    -------
    (dU (alpha^2, F, C), dx (N, C, H, W) or None without ``input_grad``). The bias gradient is
    ``dy.sum((0, 2, 3))`` and the filter gradient ``G^T dU G``: the caller's.
    """
    transforms = transforms or sys.modules[__name__]
    xp = get_array_module(dy)
    dm = transforms.winograd_output_adjoint(dy, m, r)
    du = xp.matmul(_by_position(dm), _by_position(v).transpose(0, 2, 1))
    if not input_grad:
        return du, None
    dv = xp.empty(v.shape, dtype=dy.dtype)
    _by_position(dv)[...] = xp.matmul(u.transpose(0, 2, 1), _by_position(dm))
    return du, transforms.winograd_input_adjoint(dv, x_shape, m, r, pad)

