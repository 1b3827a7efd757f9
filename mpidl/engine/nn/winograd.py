"""Winograd's minimal filtering F(m x m, k x k) for :class:`~mpidl.engine.nn.Conv2d` (stride 1).

With output tiles of ``m x m`` and ``alpha = m + k - 1`` (transform matrices ``A^T, G, B^T``
from :func:`mpidl.kernels.winograd_matrices`):

* ``U = G W G^T``  per filter pair,       ``U : (alpha^2, F, C)``
* ``V = B^T d B``  per input tile,        ``V : (C, alpha^2, P)``, ``P = tiles * N``
* ``M[:, xi] = U[xi] @ V[:, xi]`` for each of the alpha^2 positions xi (one batched GEMM)
* ``y = A^T M A`` per tile, plus the bias.

Every step is linear, so backward is the adjoints in reverse order:
``dM = A dY A^T``; ``dU[xi] = dM[:, xi] @ V[:, xi].T`` then ``dW = G^T dU G``;
``dV[:, xi] = U[xi].T @ dM[:, xi]`` then ``dx`` = scatter-add of ``B dV B^T``. The filter
transform and its adjoint are here (one small GEMM each); everything between ``U`` and ``y``
is one kernel call each way, :func:`mpidl.kernels.winograd_conv_forward` / ``_backward`` (on
the CPU all passes fused per block of samples, see :mod:`mpidl.kernels.winograd_cpu`). The
functions take the layer (its weights, gradients and workspaces) and are called by
``Conv2d.forward`` / ``backward`` when :meth:`Conv2d.winograd_tile` picks a tile.
"""

from __future__ import annotations

import numpy as np

from mpidl import kernels
from mpidl.engine.backend import get_array_module
from mpidl.engine.nn.module import workspace as _workspace

__all__ = ["forward", "backward"]


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


def forward(conv, x, m: int):
    """``y : (N, F, OH, OW)`` of ``conv`` for ``x`` with tiles of ``m``; saves what backward
    needs (``U`` and the kernels' own saved state)."""
    u = _filter_transform(conv, m, x)
    bias = None if conv.bias is None else conv.bias.data
    y, saved = kernels.winograd_conv_forward(x, u, m, conv.kernel_size, conv.padding, bias)
    conv._winograd = (m, u, saved)
    return y


def backward(conv, dy):
    """Fills ``conv``'s weight gradient; returns ``dx`` (None without ``compute_input_grad``)."""
    m, u, saved = conv._winograd
    du, dx = kernels.winograd_conv_backward(dy, u, saved, m, conv.kernel_size, conv.padding,
                                            input_grad=conv.compute_input_grad)
    _filter_transform_adjoint(conv, du, m)
    return dx
