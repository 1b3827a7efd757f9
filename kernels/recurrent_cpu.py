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
  they are GEMMs over all ``N*T`` rows afterwards (:func:`_weight_gradients`).

Around the loops (:func:`lstm_forward`, :func:`lstm_backward`): the input projection with the
bias folded in is one GEMM (:func:`_inputs_with_ones`), and every array lives in the layer's
workspaces, reused step after step (:func:`_buffer` says why that matters).

The batch is split into contiguous blocks of rows, one ``prange`` iteration each: the rows of
an LSTM never meet (each sequence has its own state), so a block runs its whole loop over time
without waiting for the others, and no two blocks write the same element. With the state time
first, a block's rows of one step are a contiguous (rows, ·) matrix, the operand of its GEMM
as it lies. Each block's GEMM is a one-thread BLAS call (the thread policy,
:mod:`mpidl.engine.threads`, limits SciPy's OpenBLAS, which Numba calls, to one thread). Blocks are
at least ``MIN_BLOCK_ROWS`` rows, so a small batch runs as one block.

The element-wise passes compute in float64 and store in the arrays' dtype; the sigmoids and
tanhs are built from ``exp`` of a non-positive number (no overflow), itself written out in
arithmetic so that the loops vectorize (:mod:`mpidl.kernels.vector_math`). ``error_model="numpy"``:
a division by zero gives inf/nan instead of raising, so the divisions carry no branch that
would stop the vectorizer (none can be by zero here).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from mpidl.engine import threads as _threads
from mpidl.engine.blas import matmul, run_shares

from .vector_math import sigmoid, tanh

__all__ = ["lstm_forward", "lstm_backward", "MIN_BLOCK_ROWS"]

#: The fewest batch rows worth a thread of their own (below it the GEMMs are too small).
MIN_BLOCK_ROWS = 16
#: The weight gradients are sums over this many ranges of steps, one thread each (a fixed
#: count, so the sums are the same whatever the thread count).
WEIGHT_GRADIENT_PARTS = 2


# --------------------------------------------------------------------------------------------
# the loops over time
# --------------------------------------------------------------------------------------------


_ELEMENTWISE = dict(cache=True, fastmath={"contract"}, error_model="numpy")


@njit(**_ELEMENTWISE)
def _forward_step(z, z_in, c_prev, gate, cell, tanh_cell, hidden):
    """One step of a block of rows, all (rows, ·) matrices: ``z = h_{t-1} W_hh^T`` and
    ``z_in`` (the input projection, bias included) give the gates ``i, f, g, o`` (``gate``),
    ``c_t = f c_{t-1} + i g`` (``cell``), ``tanh(c_t)`` and ``h_t = o tanh(c_t)``.

    A function of its own, not the body of the ``prange`` loop: compiled with its own flags,
    its loops vectorize, which they did only in part inside the parallel loop's body. Few
    arrays per loop for the same reason: LLVM vectorizes a loop only when it can rule out,
    with a bounded number of run-time checks, that the arrays it writes overlap the others.
    """
    rows, four_h = z.shape
    hid = four_h // 4
    for r in range(rows):
        gate_row, z_row, z_in_row = gate[r], z[r], z_in[r]
        for k in range(2 * hid):  # i, f
            gate_row[k] = sigmoid(np.float64(z_row[k] + z_in_row[k]))
        for k in range(2 * hid, 3 * hid):  # g
            gate_row[k] = tanh(np.float64(z_row[k] + z_in_row[k]))
        for k in range(3 * hid, four_h):  # o
            gate_row[k] = sigmoid(np.float64(z_row[k] + z_in_row[k]))
        cell_row, c_prev_row = cell[r], c_prev[r]
        for j in range(hid):
            cell_row[j] = np.float64(gate_row[hid + j]) * c_prev_row[j] + np.float64(gate_row[j]) * gate_row[2 * hid + j]
        tanh_row, hidden_row = tanh_cell[r], hidden[r]
        for j in range(hid):
            tc = tanh(np.float64(cell_row[j]))
            tanh_row[j] = tc
            hidden_row[j] = gate_row[3 * hid + j] * tc


@njit(**_ELEMENTWISE)
def _backward_step(dh, dc, gate, tanh_cell, c_prev, dz):
    """One step of a block of rows back: from ``dh`` (reaching ``h_t``) and ``dc`` (reaching
    ``c_t`` from step ``t+1``, float64) the pre-activation gradients ``dz`` (rows, 4H); ``dc``
    becomes what reaches ``c_{t-1}``. Its own function for the reason :func:`_forward_step` is."""
    rows, four_h = gate.shape
    hid = four_h // 4
    for r in range(rows):
        gate_row, th, dh_row, dc_row = gate[r], tanh_cell[r], dh[r], dc[r]
        for j in range(hid):  # dc += dh o (1 - tanh(c_t)^2)
            dc_row[j] += dh_row[j] * np.float64(gate_row[3 * hid + j]) * (1.0 - np.float64(th[j]) * th[j])
        dz_row, c_prev_row = dz[r], c_prev[r]
        for j in range(hid):
            i_gate = np.float64(gate_row[j])
            f_gate = np.float64(gate_row[hid + j])
            g_gate = np.float64(gate_row[2 * hid + j])
            o_gate = np.float64(gate_row[3 * hid + j])
            dz_row[j] = dc_row[j] * g_gate * i_gate * (1.0 - i_gate)
            dz_row[hid + j] = dc_row[j] * c_prev_row[j] * f_gate * (1.0 - f_gate)
            dz_row[2 * hid + j] = dc_row[j] * i_gate * (1.0 - g_gate * g_gate)
            dz_row[3 * hid + j] = dh_row[j] * th[j] * o_gate * (1.0 - o_gate)
        for j in range(hid):  # what reaches c_{t-1}
            dc_row[j] *= gate_row[hid + j]


@njit(parallel=True, cache=True)
def _forward(z_in, w_hh_t, blocks, gates, cells, tanh_c, hiddens):
    """Fill ``gates, cells, tanh_c`` and ``hiddens[1:]`` (time first) from the input
    projections ``z_in`` (T, N, 4H; bias included) and ``w_hh_t = W_hh^T`` (H, 4H,
    C-contiguous); ``hiddens[0]`` must be 0."""
    steps, n_size, four_h = z_in.shape
    hid = four_h // 4
    for block in prange(blocks):
        lo = n_size * block // blocks
        hi = n_size * (block + 1) // blocks
        z = np.zeros((hi - lo, four_h), dtype=z_in.dtype)  # h_{t-1} W_hh^T (zero at t = 0)
        no_cell = np.zeros((hi - lo, hid), dtype=cells.dtype)  # c_0 = 0
        for t in range(steps):
            if t > 0:
                np.dot(hiddens[t, lo:hi], w_hh_t, z)  # the block's rows of h_{t-1}: contiguous
            c_prev = cells[t - 1, lo:hi] if t > 0 else no_cell
            _forward_step(z, z_in[t, lo:hi], c_prev, gates[t, lo:hi], cells[t, lo:hi], tanh_c[t, lo:hi],
                          hiddens[t + 1, lo:hi])


@njit(parallel=True, cache=True)
def _backward(dy, sequence, w_hh, gates, cells, tanh_c, blocks, dz):
    """Fill ``dz`` (T, N, 4H), the pre-activation gradients of every step, from ``dy`` ((N, T,
    H) when ``sequence``, else (N, 1, H): the last step's) and the forward's state (time
    first). ``dc`` is carried in float64."""
    steps, n_size, four_h = gates.shape
    hid = four_h // 4
    for block in prange(blocks):
        lo = n_size * block // blocks
        hi = n_size * (block + 1) // blocks
        dh = np.zeros((hi - lo, hid), dtype=gates.dtype)  # reaching h_t: from step t+1, then dy
        dc = np.zeros((hi - lo, hid), dtype=np.float64)  # reaching c_t
        no_cell = np.zeros((hi - lo, hid), dtype=cells.dtype)  # c_0 = 0
        for t in range(steps - 1, -1, -1):
            if sequence or t == steps - 1:
                dh += dy[lo:hi, t if sequence else 0]
            c_prev = cells[t - 1, lo:hi] if t > 0 else no_cell
            _backward_step(dh, dc, gates[t, lo:hi], tanh_c[t, lo:hi], c_prev, dz[t, lo:hi])
            if t > 0:
                np.dot(dz[t, lo:hi], w_hh, dh)  # dh reaching h_{t-1}; dy[t-1] is added next step


def _blocks(batch: int) -> int:
    return max(1, min(numba.get_num_threads(), batch // MIN_BLOCK_ROWS))


def _buffer(workspaces, key: str, shape: tuple, dtype):
    """``workspaces[key]`` if it has this shape and dtype, else a new array kept there: the
    layer passes the same dict every step, so the (T, N, 4H) arrays are allocated once. Fresh
    arrays of that size each step cost more than the kernels: glibc hands the freed memory
    back to the system, and every page of the next allocation is a page fault."""
    if workspaces is None:
        return np.empty(shape, dtype=dtype)
    buffer = workspaces.get(key)
    if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
        buffer = workspaces[key] = np.empty(shape, dtype=dtype)
    return buffer


def _inputs_with_ones(x, out):
    """``[x_t, 1]`` of every step, time first: ``(N, T, D) -> (T*N, D+1)``. The bias is the
    weight of a constant input 1, so with it the input projection and the bias are one GEMM
    forward, ``z_in = [X, 1] [W_ih, b]^T``, and their gradients one GEMM backward,
    ``[dW_ih, db] = dz^T [X, 1]`` (no separate pass to add ``b`` or to sum ``dz``)."""
    n, steps, d = x.shape
    x1 = out.reshape(steps, n, d + 1)
    x1[:, :, :d] = x.transpose(1, 0, 2)
    x1[:, :, d] = 1
    return x1.reshape(steps * n, d + 1)


def _weight_gradients(inputs, hidden_prev, dz2, workspaces):
    """``(dW_ih, db, dW_hh)`` from every step's rows, time first: ``inputs = [x_t, 1]`` (T*N,
    D+1), ``hidden_prev = h_{t-1}`` (T*N, H; ``h_0 = 0``) and ``dz2 = dz_t`` (T*N, 4H).

    ``[dW_ih, db] = ([X, 1]^T dz)^T`` (with D+1 = 13 columns, (D+1, T*N) x (T*N, 4H) is the
    shape BLAS runs fastest: 65 us against 120 us for ``dz^T X``, spectral_lstm) and
    ``dW_hh = dz^T H_prev``, each summed over ``WEIGHT_GRADIENT_PARTS`` contiguous ranges of
    steps whose two GEMMs run on one thread (:func:`mpidl.engine.blas.run_shares`): one hand-off for
    all of the weight gradients' work.
    """
    rows, four_h = dz2.shape
    parts = WEIGHT_GRADIENT_PARTS
    grad_ih = _buffer(workspaces, "grad_ih", (parts, inputs.shape[1], four_h), dz2.dtype)
    grad_hh = _buffer(workspaces, "grad_hh", (parts, four_h, hidden_prev.shape[1]), dz2.dtype)

    def part(k, lo, hi):
        np.matmul(inputs[lo:hi].T, dz2[lo:hi], out=grad_ih[k])
        np.matmul(dz2[lo:hi].T, hidden_prev[lo:hi], out=grad_hh[k])

    run_shares(part, [(k, rows * k // parts, rows * (k + 1) // parts) for k in range(parts)])
    grad_ih = grad_ih.sum(axis=0)
    return grad_ih[:-1].T, grad_ih[-1], grad_hh.sum(axis=0)


def lstm_forward(x, weight_ih, weight_hh, bias, workspaces=None):
    n, steps, d = x.shape
    hid = weight_hh.shape[1]
    dtype = x.dtype
    weight_and_bias = np.concatenate([weight_ih, bias[:, None]], axis=1)  # (4H, D+1)
    inputs = _inputs_with_ones(x, _buffer(workspaces, "inputs", (steps * n, d + 1), dtype))
    z_in = _buffer(workspaces, "z_in", (steps, n, 4 * hid), dtype)
    matmul(inputs, weight_and_bias.T, out=z_in.reshape(steps * n, 4 * hid))
    gates = _buffer(workspaces, "gates", (steps, n, 4 * hid), dtype)
    cells = _buffer(workspaces, "cells", (steps, n, hid), dtype)
    tanh_c = _buffer(workspaces, "tanh_c", (steps, n, hid), dtype)
    hiddens = _buffer(workspaces, "hiddens", (steps + 1, n, hid), dtype)
    hiddens[0] = 0
    with _threads.one_blas_thread():  # BLAS is called from the parallel threads
        _forward(z_in, np.ascontiguousarray(weight_hh.T), _blocks(n), gates, cells, tanh_c, hiddens)
    return gates, cells, tanh_c, hiddens


def lstm_backward(dy, x, weight_ih, weight_hh, gates, cells, tanh_c, hiddens, sequence: bool, input_grad: bool = True,
                  workspaces=None):
    n, steps, d = x.shape
    hid = weight_hh.shape[1]
    dtype = x.dtype
    dy3 = np.ascontiguousarray(dy).reshape(n, steps if sequence else 1, hid)
    dz = _buffer(workspaces, "dz", (steps, n, 4 * hid), dtype)
    with _threads.one_blas_thread():  # BLAS is called from the parallel threads
        _backward(dy3, bool(sequence), np.ascontiguousarray(weight_hh), np.ascontiguousarray(gates),
                  np.ascontiguousarray(cells), np.ascontiguousarray(tanh_c), _blocks(n), dz)
    dz2 = dz.reshape(steps * n, 4 * hid)
    inputs = _inputs_with_ones(x, _buffer(workspaces, "inputs", (steps * n, d + 1), dtype))
    hidden_prev = np.ascontiguousarray(hiddens[:steps]).reshape(steps * n, hid)
    dweight_ih, dbias, dweight_hh = _weight_gradients(inputs, hidden_prev, dz2, workspaces)
    if not input_grad:
        return None, dweight_ih, dweight_hh, dbias
    dx = matmul(dz2, weight_ih, out=np.empty((steps * n, d), dtype=dtype))
    return dx.reshape(steps, n, d).transpose(1, 0, 2), dweight_ih, dweight_hh, dbias
