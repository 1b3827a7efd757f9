"""Transformer pieces: multi-head self-attention, a learned positional embedding, a class
token, a per-token wrapper and the pre-norm encoder block built from them."""

from __future__ import annotations

import math

from mpidl import kernels
from mpidl.engine.backend import get_array_module
from mpidl.engine.blas import batched_matmul, matmul
from mpidl.engine.nn.activation import GELU
from mpidl.engine.nn.linear import Linear
from mpidl.engine.nn.module import Module, Sequential
from mpidl.engine.nn.norm import LayerNorm
from mpidl.engine.nn.residual import Residual
from mpidl.engine.params import Parameter, normal, uniform, zeros

__all__ = ["Tokenwise", "MultiHeadSelfAttention", "PositionalEmbedding", "ClassToken", "SelectToken",
           "TransformerEncoderBlock"]


class Tokenwise(Module):
    """Apply a layer of (M, D) rows to every token of (N, T, D) sequences.

    Notes
    -----
    ``y[n, t] = f(x[n, t])``: ``x`` is reshaped to (N*T, D), ``f`` applied, the result
    reshaped to (N, T, D'); backward reshapes the same way around ``f``'s backward.
    ``compute_input_grad`` is ``f``'s (vit's token embedding skips ``dx`` of the data).
    """

    def __init__(self, layer: Module) -> None:
        super().__init__()
        self.layer = layer
        self._shape: tuple | None = None

    @property
    def compute_input_grad(self) -> bool:
        return self.layer.compute_input_grad  # AttributeError when f has no such switch

    @compute_input_grad.setter
    def compute_input_grad(self, value: bool) -> None:
        if not hasattr(self.layer, "compute_input_grad"):
            raise AttributeError(f"{type(self.layer).__name__} always computes its input gradient")
        self.layer.compute_input_grad = bool(value)

    def forward(self, x):
        if x.ndim != 3:
            raise ValueError(f"Tokenwise expects (N, T, D), got {tuple(x.shape)}")
        self._shape = tuple(x.shape)
        y = self.layer.forward(x.reshape(x.shape[0] * x.shape[1], x.shape[2]))
        return y.reshape(x.shape[0], x.shape[1], -1)

    def backward(self, dy):
        if self._shape is None:
            raise RuntimeError("Tokenwise.backward called before forward")
        n, t, _ = self._shape
        dx = self.layer.backward(dy.reshape(n * t, -1))
        return None if dx is None else dx.reshape(self._shape)


class MultiHeadSelfAttention(Module):
    """Multi-head scaled dot-product self-attention (PyTorch's ``nn.MultiheadAttention`` with
    ``batch_first=True``, query = key = value = x, no mask, no dropout; same parameter layout).

    Parameters
    ----------
    embed_dim : E; num_heads : h, dividing E (head size ``d = E / h``)

    Shapes
    ------
    x : (N, T, E) -> y : (N, T, E); in_proj_weight : (3E, E) (rows: the q, k, v projections),
    in_proj_bias : (3E,), out_proj.weight : (E, E), out_proj.bias : (E,). Initialization as
    PyTorch: in_proj_weight Xavier-uniform ``U(+-sqrt(6 / (E + 3E)))``, both biases 0,
    out_proj.weight Linear's default ``U(+-1/sqrt(E))``.

    Notes
    -----
    ``[q | k | v] = x W_in^T + b_in``, each split into h heads (N, h, T, d);
    ``S = q k^T / sqrt(d)`` (N, h, T, T); ``A = softmax(S)`` along the keys (the last axis);
    ``O = A v`` (N, h, T, d), heads concatenated back to (N, T, E); ``y = O W_out^T + b_out``.

    Backward: ``dO`` from the output projection; ``dA = dO v^T``, ``dv = A^T dO``;
    ``dS = A * (dA - sum_keys(dA * A))`` (the softmax Jacobian); ``dq = dS k / sqrt(d)``,
    ``dk = dS^T q / sqrt(d)``; then ``d[q | k | v]`` through the input projection:
    ``dW_in = d[qkv]^T x``, ``db_in = sum d[qkv]``, ``dx = d[qkv] W_in``.
    Saved for backward: x, ``[q | k | v]`` and A.

    Layout: no head is copied. ``[q | k | v]`` stays as the input projection wrote it, rows
    ``(N*T, 3E)``, and each head is a ``(T, d)`` view into it with a row stride of ``3E`` (a
    leading dimension, which BLAS takes as it lies); ``O`` is written by its per-head products
    straight into ``(N*T, E)`` rows, the heads concatenated, which the output projection reads;
    backward writes ``dq, dk, dv`` the same way into ``(N*T, 3E)`` rows. The per-head products
    are batched GEMMs over ``(N, h)``, split between threads by
    :func:`mpidl.engine.blas.batched_matmul`; the projections go through :func:`mpidl.engine.blas.matmul`.
    (Copying the heads to contiguous stacks first, then back, would add two passes over every
    head's data each way.) The softmax and its backward (with the ``1 / sqrt(d)`` folded
    in) are :func:`mpidl.kernels.softmax_forward` / ``softmax_backward``.
    """

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        if embed_dim < 1 or num_heads < 1 or embed_dim % num_heads:
            raise ValueError(f"MultiHeadSelfAttention needs num_heads dividing embed_dim, got {embed_dim}, {num_heads}")
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        e = self.embed_dim
        self.in_proj_weight = Parameter((3 * e, e), uniform(math.sqrt(6.0 / (4 * e))))
        self.in_proj_bias = Parameter((3 * e,), zeros())
        self.out_proj = Linear(e, e, bias_init=zeros())
        self._saved = None

    def _heads(self, rows, n, t):
        """``(N*T, c*E)`` rows (``c`` blocks of E features, e.g. ``[q | k | v]``) as a
        ``(c, N, h, T, d)`` view, no copy: each ``(T, d)`` head matrix has unit column stride and
        a row stride of ``c*E``, which BLAS takes as it lies (a leading dimension)."""
        h = self.num_heads
        return rows.reshape(n, t, -1, h, self.embed_dim // h).transpose(2, 0, 3, 1, 4)

    def forward(self, x):
        if x.ndim != 3 or x.shape[2] != self.embed_dim:
            raise ValueError(f"MultiHeadSelfAttention expects (N, T, {self.embed_dim}), got {tuple(x.shape)}")
        xp = get_array_module(x)
        n, t, e = x.shape
        h = self.num_heads
        x_rows = x.reshape(n * t, e)
        dtype = xp.result_type(x, self.in_proj_weight.data)  # as x @ W_in^T would give
        qkv = matmul(x_rows, self.in_proj_weight.data.T, out=xp.empty((n * t, 3 * e), dtype=dtype))
        qkv += self.in_proj_bias.data
        q, k, v = self._heads(qkv, n, t)
        scale = 1.0 / math.sqrt(e // h)
        scores = batched_matmul(q, k.transpose(0, 1, 3, 2), out=xp.empty((n, h, t, t), dtype=dtype))
        attn = kernels.softmax_forward(scores, scale)
        out_rows = xp.empty((n * t, e), dtype=dtype)  # O with the heads concatenated: (N*T, E)
        batched_matmul(attn, v, out=self._heads(out_rows, n, t)[0])
        self._saved = (x_rows, qkv, attn, scale)
        return self.out_proj.forward(out_rows).reshape(n, t, e)

    def backward(self, dy):
        if self._saved is None:
            raise RuntimeError("MultiHeadSelfAttention.backward called before forward")
        x_rows, qkv, attn, scale = self._saved
        xp = get_array_module(dy)
        n, t, e = dy.shape
        q, k, v = self._heads(qkv, n, t)
        d_out = self._heads(self.out_proj.backward(dy.reshape(n * t, e)), n, t)[0]
        d_attn = batched_matmul(d_out, v.transpose(0, 1, 3, 2), out=xp.empty_like(attn))
        d_scores = kernels.softmax_backward(d_attn, attn, scale)  # includes the 1/sqrt(d)
        dqkv = xp.empty((n * t, 3 * e), dtype=xp.result_type(dy, q))  # rows [dq | dk | dv], as qkv
        d_q, d_k, d_v = self._heads(dqkv, n, t)
        batched_matmul(d_scores, k, out=d_q)
        batched_matmul(d_scores.transpose(0, 1, 3, 2), q, out=d_k)
        batched_matmul(attn.transpose(0, 1, 3, 2), d_out, out=d_v)
        matmul(dqkv.T, x_rows, out=self.in_proj_weight.grad)
        xp.sum(dqkv, axis=0, out=self.in_proj_bias.grad)
        w_in = self.in_proj_weight.data
        dx = matmul(dqkv, w_in, out=xp.empty((n * t, e), dtype=xp.result_type(dqkv, w_in)))
        return dx.reshape(n, t, e)

    def _drop_workspaces(self) -> None:
        self._saved = None

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"


class PositionalEmbedding(Module):
    """A learned embedding added to each position: ``y[n, t] = x[n, t] + P[t]``.

    Shapes
    ------
    x : (N, T, E) -> y : (N, T, E); weight P : (T, E), starts N(0, 0.02^2) (as in ViT).

    Notes
    -----
    ``dP = sum_n dy[n]``, ``dx = dy``. Nothing is saved for backward.
    """

    def __init__(self, num_positions: int, embed_dim: int) -> None:
        super().__init__()
        if num_positions < 1 or embed_dim < 1:
            raise ValueError(f"PositionalEmbedding needs positive sizes, got {num_positions}, {embed_dim}")
        self.num_positions, self.embed_dim = int(num_positions), int(embed_dim)
        self.weight = Parameter((self.num_positions, self.embed_dim), normal(0.02))

    def forward(self, x):
        if x.ndim != 3 or tuple(x.shape[1:]) != (self.num_positions, self.embed_dim):
            raise ValueError(
                f"PositionalEmbedding expects (N, {self.num_positions}, {self.embed_dim}), got {tuple(x.shape)}"
            )
        return x + self.weight.data

    def backward(self, dy):
        get_array_module(dy).sum(dy, axis=0, out=self.weight.grad)
        return dy

    def extra_repr(self) -> str:
        return f"{self.num_positions}, {self.embed_dim}"


class ClassToken(Module):
    """Prepend one learned token to every sequence: ``y = [c; x[n]]``.

    Shapes
    ------
    x : (N, T, E) -> y : (N, T + 1, E); weight c : (E,), starts N(0, 0.02^2).

    Notes
    -----
    ``dc = sum_n dy[n, 0]``, ``dx = dy[:, 1:]``.
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        if embed_dim < 1:
            raise ValueError(f"ClassToken needs embed_dim >= 1, got {embed_dim}")
        self.embed_dim = int(embed_dim)
        self.weight = Parameter((self.embed_dim,), normal(0.02))

    def forward(self, x):
        if x.ndim != 3 or x.shape[2] != self.embed_dim:
            raise ValueError(f"ClassToken expects (N, T, {self.embed_dim}), got {tuple(x.shape)}")
        xp = get_array_module(x)
        y = xp.empty((x.shape[0], x.shape[1] + 1, self.embed_dim), dtype=x.dtype)
        y[:, 0] = self.weight.data
        y[:, 1:] = x
        return y

    def backward(self, dy):
        get_array_module(dy).sum(dy[:, 0], axis=0, out=self.weight.grad)
        return dy[:, 1:]

    def extra_repr(self) -> str:
        return f"{self.embed_dim}"


class SelectToken(Module):
    """Keep one token of each sequence: ``y = x[:, index]`` ((N, T, E) -> (N, E)); backward
    puts ``dy`` at that position and zeros elsewhere."""

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.index = int(index)
        self._shape: tuple | None = None

    def forward(self, x):
        if x.ndim != 3:
            raise ValueError(f"SelectToken expects (N, T, E), got {tuple(x.shape)}")
        self._shape = tuple(x.shape)
        return x[:, self.index]

    def backward(self, dy):
        if self._shape is None:
            raise RuntimeError("SelectToken.backward called before forward")
        dx = get_array_module(dy).zeros(self._shape, dtype=dy.dtype)
        dx[:, self.index] = dy
        return dx

    def extra_repr(self) -> str:
        return f"index={self.index}"


class TransformerEncoderBlock(Sequential):
    """Pre-norm transformer encoder block (as in ViT and PyTorch's
    ``TransformerEncoderLayer(norm_first=True, activation="gelu", dropout=0)``).

    Notes
    -----
    ``u = x + MHSA(LN_1(x))``; ``y = u + W_2 GELU(W_1 LN_2(u) + b_1) + b_2``, the MLP
    (E -> mlp_dim -> E) applied to every token. Shapes (N, T, E) -> (N, T, E). Built from
    :class:`~mpidl.engine.nn.residual.Residual` (identity shortcuts), so its backward is the
    composition of its parts'. Children: ``0`` the attention residual, ``1`` the MLP residual.
    """

    def __init__(self, embed_dim: int, num_heads: int, mlp_dim: int) -> None:
        attention = Sequential(LayerNorm(embed_dim), MultiHeadSelfAttention(embed_dim, num_heads))
        mlp = Sequential(
            LayerNorm(embed_dim),
            Tokenwise(Linear(embed_dim, mlp_dim)),
            GELU(),
            Tokenwise(Linear(mlp_dim, embed_dim)),
        )
        super().__init__(Residual(attention), Residual(mlp))
