"""The LSTM's forward and backward through time as Numba CPU kernels: the same functions as
:mod:`mpidl.kernels.recurrent_reference` (the math and the shapes are there).

Why kernels: a small LSTM (spectral_lstm: N = 64, T = 13, H = 64) is a chain of tiny
operations. The reference makes about fifteen NumPy calls per step each way, each with its
own temporary; their call overhead, not the arithmetic, was most of the step. Here each
direction is one call that runs the whole loop over time:

* forward, per step: one GEMM ``h_{t-1} W_hh^T`` (``np.dot`` in Numba is a BLAS call), then
  one pass over the (rows, 4H) pre-activations that applies the gates' nonlinearities, updates
  ``c`` and ``h`` and writes what backward needs;
* backward, per step: one pass that turns ``dh, dc`` into ``dz_t`` (and the ``dc`` for step
  ``t-1``), then one GEMM ``dz_t W_hh``. The weight gradients are not accumulated per step:
  they are one GEMM each over all ``N*T`` rows afterwards (:func:`lstm_backward`).

The batch is split into contiguous blocks of rows, one ``prange`` iteration each: the rows of
an LSTM never meet (each sequence has its own state), so a block runs its whole loop over time
without waiting for the others, and no two blocks write the same element. Each block's GEMM
is a one-thread BLAS call (the thread policy, :mod:`mpidl.threads`, limits SciPy's OpenBLAS,
which Numba calls, to one thread). Blocks are at least ``MIN_BLOCK_ROWS`` rows, so a small
batch runs as one block.

The nonlinearities are written with ``exp`` of a non-positive number only (no overflow):
``sigmoid(z) = 1/(1 + e)`` for ``z >= 0`` and ``e/(1 + e)`` for ``z < 0``, ``e = exp(-|z|)``;
``tanh(z) = sign(z) (1 - e)/(1 + e)``, ``e = exp(-2|z|)``. They match NumPy's to rounding.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

__all__ = ["lstm_forward", "lstm_backward", "MIN_BLOCK_ROWS"]

#: The fewest batch rows worth a thread of their own (below it the GEMMs are too small).
MIN_BLOCK_ROWS = 16


@njit(cache=True, inline="always")
def _sigmoid(z):
    e = math.exp(-abs(z))
    s = 1 / (1 + e)
    return s if z >= 0 else e * s


@njit(cache=True, inline="always")
def _tanh(z):
    e = math.exp(-2 * abs(z))
    t = (1 - e) / (1 + e)
    return t if z >= 0 else -t


@njit(parallel=True, cache=True)
def _forward(z_in, w_hh_t, blocks, gates, cells, tanh_c, hiddens):
    """Fill ``gates, cells, tanh_c, hiddens[:, 1:]`` from the input projections ``z_in`` (N, T,
    4H; bias included) and ``w_hh_t = W_hh^T`` (H, 4H, C-contiguous)."""
    n_size, steps, four_h = z_in.shape
    hid = four_h // 4
    for block in prange(blocks):
        lo = n_size * block // blocks
        hi = n_size * (block + 1) // blocks
        rows = hi - lo
        h = np.zeros((rows, hid), dtype=z_in.dtype)  # h_{t-1} of this block, contiguous for BLAS
        c = np.zeros((rows, hid), dtype=z_in.dtype)
        z = np.zeros((rows, four_h), dtype=z_in.dtype)  # h_{t-1} W_hh^T (zero at t = 0)
        for t in range(steps):
            if t > 0:
                np.dot(h, w_hh_t, z)
            for r in range(rows):
                n = lo + r
                for j in range(hid):
                    i_gate = _sigmoid(z[r, j] + z_in[n, t, j])
                    f_gate = _sigmoid(z[r, hid + j] + z_in[n, t, hid + j])
                    g_gate = _tanh(z[r, 2 * hid + j] + z_in[n, t, 2 * hid + j])
                    o_gate = _sigmoid(z[r, 3 * hid + j] + z_in[n, t, 3 * hid + j])
                    c_new = f_gate * c[r, j] + i_gate * g_gate
                    tc = _tanh(c_new)
                    h_new = o_gate * tc
                    gates[n, t, j] = i_gate
                    gates[n, t, hid + j] = f_gate
                    gates[n, t, 2 * hid + j] = g_gate
                    gates[n, t, 3 * hid + j] = o_gate
                    cells[n, t, j] = c_new
                    tanh_c[n, t, j] = tc
                    hiddens[n, t + 1, j] = h_new
                    c[r, j] = c_new
                    h[r, j] = h_new


@njit(parallel=True, cache=True)
def _backward(dy, sequence, w_hh, gates, cells, tanh_c, blocks, dz):
    """Fill ``dz`` (N, T, 4H), the pre-activation gradients of every step, from ``dy`` ((N, T,
    H) when ``sequence``, else (N, 1, H): the last step's) and the forward's state."""
    n_size, steps, four_h = gates.shape
    hid = four_h // 4
    for block in prange(blocks):
        lo = n_size * block // blocks
        hi = n_size * (block + 1) // blocks
        rows = hi - lo
        dh = np.zeros((rows, hid), dtype=gates.dtype)  # reaching h_t: from step t+1, then dy
        dc = np.zeros((rows, hid), dtype=gates.dtype)  # reaching c_t from step t+1
        dz_block = np.empty((rows, four_h), dtype=gates.dtype)  # dz_t, contiguous for BLAS
        for t in range(steps - 1, -1, -1):
            for r in range(rows):
                n = lo + r
                for j in range(hid):
                    if sequence:
                        dh[r, j] += dy[n, t, j]
                    elif t == steps - 1:
                        dh[r, j] += dy[n, 0, j]
                    i_gate = gates[n, t, j]
                    f_gate = gates[n, t, hid + j]
                    g_gate = gates[n, t, 2 * hid + j]
                    o_gate = gates[n, t, 3 * hid + j]
                    th = tanh_c[n, t, j]
                    c_prev = cells[n, t - 1, j] if t > 0 else 0
                    dcj = dc[r, j] + dh[r, j] * o_gate * (1 - th * th)
                    dz_block[r, j] = dcj * g_gate * i_gate * (1 - i_gate)
                    dz_block[r, hid + j] = dcj * c_prev * f_gate * (1 - f_gate)
                    dz_block[r, 2 * hid + j] = dcj * i_gate * (1 - g_gate * g_gate)
                    dz_block[r, 3 * hid + j] = dh[r, j] * th * o_gate * (1 - o_gate)
                    dc[r, j] = dcj * f_gate
                for k in range(four_h):
                    dz[n, t, k] = dz_block[r, k]
            if t > 0:
                np.dot(dz_block, w_hh, dh)  # dh reaching h_{t-1}; dy[t-1] is added next step


def _blocks(batch: int) -> int:
    return max(1, min(numba.get_num_threads(), batch // MIN_BLOCK_ROWS))


def lstm_forward(x, weight_ih, weight_hh, bias):
    n, steps, d = x.shape
    hid = weight_hh.shape[1]
    z_in = (x.reshape(n * steps, d) @ weight_ih.T).reshape(n, steps, 4 * hid)
    z_in += bias
    gates = np.empty_like(z_in)
    cells = np.empty((n, steps, hid), dtype=x.dtype)
    tanh_c = np.empty((n, steps, hid), dtype=x.dtype)
    hiddens = np.zeros((n, steps + 1, hid), dtype=x.dtype)
    _forward(z_in, np.ascontiguousarray(weight_hh.T), _blocks(n), gates, cells, tanh_c, hiddens)
    return gates, cells, tanh_c, hiddens


def lstm_backward(dy, x, weight_ih, weight_hh, gates, cells, tanh_c, hiddens, sequence: bool, input_grad: bool = True):
    n, steps, d = x.shape
    hid = weight_hh.shape[1]
    dy3 = np.ascontiguousarray(dy).reshape(n, steps if sequence else 1, hid)
    dz = np.empty_like(gates)
    _backward(dy3, bool(sequence), np.ascontiguousarray(weight_hh), gates, cells, tanh_c, _blocks(n), dz)
    dz2 = dz.reshape(n * steps, 4 * hid)
    dweight_ih = dz2.T @ x.reshape(n * steps, d)
    dweight_hh = dz2.T @ hiddens[:, :steps].reshape(n * steps, hid)
    dbias = dz2.sum(axis=0)
    dx = (dz2 @ weight_ih).reshape(x.shape) if input_grad else None
    return dx, dweight_ih, dweight_hh, dbias
