"""Winograd's minimal filtering F(m x m, k x k) for :class:`~mpidl.nn.Conv2d` (stride 1).

With output tiles of ``m x m`` and ``alpha = m + k - 1`` (transform matrices ``A^T, G, B^T``
from :func:`mpidl.kernels.winograd_matrices`):

* ``U = G W G^T``  per filter pair,       ``U : (alpha^2, F, C)``
* ``V = B^T d B``  per input tile,        ``V : (C, alpha^2, P)``, ``P = tiles * N``
* ``M[:, xi] = U[xi] @ V[:, xi]`` for each of the alpha^2 positions xi (one batched GEMM)
* ``y = A^T M A`` per tile, plus the bias.

Every step is linear, so backward is the adjoints in reverse order:
``dM = A dY A^T``; ``dU[xi] = dM[:, xi] @ V[:, xi].T`` then ``dW = G^T dU G``;
``dV[:, xi] = U[xi].T @ dM[:, xi]`` then ``dx`` = scatter-add of ``B dV B^T``. The transforms
are kernels (:mod:`mpidl.kernels`, layout ``(C, alpha, alpha, P)``), the products
:func:`mpidl.blas.batched_matmul`. The functions take the layer (its weights, gradients and
workspaces) and are called by ``Conv2d.forward`` / ``backward`` when
:meth:`Conv2d.winograd_tile` picks a tile.
"""

from __future__ import annotations

import numpy as np

from mpidl import kernels
from mpidl.backend import get_array_module
from mpidl.blas import batched_matmul
from mpidl.nn.module import workspace as _workspace

__all__ = ["forward", "backward"]


def _by_position(transformed):
    """``(C, alpha, alpha, P)`` -> the ``(alpha^2, C, P)`` view the batched GEMMs take (no copy)."""
    c, alpha, _, columns = transformed.shape
    return transformed.reshape(c, alpha * alpha, columns).transpose(1, 0, 2)


def _filter_matrix(conv, m: int, like):
    """``K = kron(G, G) : (alpha^2, k^2)`` of F(m, k) in ``like``'s dtype and device (cached):
    ``K[a*alpha + b, i*k + j] = G[a, i] G[b, j]``, so the filter transform is one product."""
    xp = get_array_module(like)
    key = ("winograd_filter", m, str(like.dtype), xp.__name__)
    matrix = conv._workspaces.get(key)
    if matrix is None:
        g = kernels.winograd_matrices(m, conv.kernel_size)[1]
        matrix = conv._workspaces[key] = xp.asarray(np.kron(g, g), dtype=like.dtype)
    return matrix


def _filter_transform(conv, m: int, like):
    """``U[a, b, f, c] = sum_{i,j} G[a, i] W[f, c, i, j] G[b, j]``, as ``(alpha^2, F, C)``:
    ``U = K @ W2.T`` with ``W2 = W.reshape(F*C, k*k)`` (one GEMM; BLAS reads the transpose
    in place, and the result is already in the layout the batched GEMMs take)."""
    f, c, k = conv.out_channels, conv.in_channels, conv.kernel_size
    alpha = m + k - 1
    u = _workspace(conv._workspaces, "U", (alpha * alpha, f * c), like)
    get_array_module(like).matmul(_filter_matrix(conv, m, like), conv.weight.data.reshape(f * c, k * k).T, out=u)
    return u.reshape(alpha * alpha, f, c)


def _filter_transform_adjoint(conv, du, m: int) -> None:
    """``weight.grad[f, c, i, j] = sum_{a,b} G[a, i] dU[a, b, f, c] G[b, j]`` (adjoint of
    :func:`_filter_transform`): ``dW2 = dU2.T @ K``, written in place."""
    f, c, k = conv.out_channels, conv.in_channels, conv.kernel_size
    alpha = m + k - 1
    get_array_module(du).matmul(
        du.reshape(alpha * alpha, f * c).T, _filter_matrix(conv, m, du), out=conv.weight.grad.reshape(f * c, k * k)
    )


def forward(conv, x, m: int, y_shape: tuple):
    """``y : y_shape = (N, F, OH, OW)`` of ``conv`` for ``x`` with tiles of ``m``; saves ``(m, U, V)``."""
    n, f, oh, ow = y_shape
    c, k, p = conv.in_channels, conv.kernel_size, conv.padding
    alpha = m + k - 1
    _, _, tiles_h, tiles_w = kernels.winograd_geometry(x.shape, m, k, p)
    columns = tiles_h * tiles_w * n
    u = _filter_transform(conv, m, x)
    v = kernels.winograd_input(x, m, k, p, out=_workspace(conv._workspaces, "V", (c, alpha, alpha, columns), x))
    mt = _workspace(conv._workspaces, "M", (f, alpha, alpha, columns), x)
    # The transforms keep the channel outermost (see mpidl.kernels.winograd_reference); the batched
    # GEMM takes the (alpha^2, C, P) views with a row stride of alpha^2 * P.
    batched_matmul(u, _by_position(v), _by_position(mt))
    conv._x_shape, conv._winograd = tuple(x.shape), (m, u, v)
    # A fresh array (the caller may keep it); the bias is added inside the output transform.
    return kernels.winograd_output(mt, y_shape, m, k, bias=None if conv.bias is None else conv.bias.data)


def backward(conv, dy):
    """Fills ``conv``'s weight (and bias) gradient; returns ``dx`` (None without ``compute_input_grad``)."""
    xp = get_array_module(dy)
    m, u, v = conv._winograd
    f, c, k, p = conv.out_channels, conv.in_channels, conv.kernel_size, conv.padding
    alpha = m + k - 1
    columns = v.shape[-1]
    dm = kernels.winograd_output_adjoint(dy, m, k, out=_workspace(conv._workspaces, "dM", (f, alpha, alpha, columns), dy))
    du = _workspace(conv._workspaces, "dU", (alpha * alpha, f, c), dy)
    batched_matmul(_by_position(dm), _by_position(v).transpose(0, 2, 1), du)
    _filter_transform_adjoint(conv, du, m)
    if conv.bias is not None:
        xp.sum(dy, axis=(0, 2, 3), out=conv.bias.grad)
    if not conv.compute_input_grad:
        return None
    dv = _workspace(conv._workspaces, "dV", (c, alpha, alpha, columns), dy)
    batched_matmul(u.transpose(0, 2, 1), _by_position(dm), _by_position(dv))
    # dx is returned to the previous layer, which may keep it: a fresh array.
    return kernels.winograd_input_adjoint(dv, conv._x_shape, m, k, p)
