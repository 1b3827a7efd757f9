"""The LSTM's forward and backward through time: the reference (vectorized ``xp`` code, NumPy
or CuPy), the definition the Numba kernels (:mod:`mpidl.kernels.recurrent_cpu`) are tested
against.

Math (PyTorch's ``nn.LSTM``, gate order i, f, g, o; ``h_0 = c_0 = 0``), for ``t = 1..T``:

* ``z_t = x_t W_ih^T + h_{t-1} W_hh^T + b`` (N, 4H), ``b = b_ih + b_hh``, split into
  ``z^i, z^f, z^g, z^o``;
* ``i_t = sigmoid(z^i)``, ``f_t = sigmoid(z^f)``, ``g_t = tanh(z^g)``, ``o_t = sigmoid(z^o)``;
* ``c_t = f_t * c_{t-1} + i_t * g_t``, ``h_t = o_t * tanh(c_t)``.

Backward through time, ``t = T..1``, with ``dh`` the gradient reaching ``h_t`` (from the output
``dy`` and from step ``t+1``) and ``dc`` the one reaching ``c_t`` from step ``t+1``:

* ``dc += dh * o_t * (1 - tanh(c_t)^2)``;
* ``dz^i = dc * g_t * i_t (1 - i_t)``, ``dz^f = dc * c_{t-1} * f_t (1 - f_t)``,
  ``dz^g = dc * i_t * (1 - g_t^2)``, ``dz^o = dh * tanh(c_t) * o_t (1 - o_t)``;
* ``dh = dz_t W_hh`` and ``dc = dc * f_t`` (what reaches step ``t-1``).

Summed over the steps: ``dW_ih = sum dz_t^T x_t``, ``dW_hh = sum dz_t^T h_{t-1}``,
``db = sum dz_t`` (the gradient of both ``b_ih`` and ``b_hh``), and ``dx_t = dz_t W_ih``. The
input projection of all steps is one GEMM (N*T, D) x (D, 4H) before the loop, and each
weight gradient one GEMM over all N*T rows after it.

Shapes: ``x : (N, T, D)`` (batch first, as the layer takes it); ``weight_ih : (4H, D)``,
``weight_hh : (4H, H)``, ``bias : (4H,)``. Saved by forward for backward, the "state", time
first (step ``t``'s rows ``[t]`` are one contiguous (N, ·) block, the operand of that step's
GEMM): ``gates : (T, N, 4H)`` (the activations i, f, g, o), ``cells : (T, N, H)`` (``c_t``),
``tanh_c : (T, N, H)`` and ``hiddens : (T+1, N, H)`` (``hiddens[0] = h_0 = 0``). Every array
has ``x``'s dtype. Since ``h_0 = 0``, step 1 adds nothing to ``dW_hh``: its GEMM runs over the
``(T-1)*N`` rows of steps 2..T.
"""

from __future__ import annotations

from mpidl.engine.backend import get_array_module
from .elementwise_reference import sigmoid

__all__ = ["lstm_forward", "lstm_backward"]


def _time_major(x):
    """``(N, T, D) -> (T*N, D)``, the rows of step 0 first (a copy)."""
    n, steps, d = x.shape
    return x.transpose(1, 0, 2).reshape(steps * n, d)


def lstm_forward(x, weight_ih, weight_hh, bias, workspaces=None):
    """``(gates, cells, tanh_c, hiddens)`` of the sequences ``x`` (shapes: the module docstring).
    ``workspaces`` is not used: the reference allocates its arrays."""
    xp = get_array_module(x)
    n, steps, _ = x.shape
    hid = weight_hh.shape[1]
    w_hh_t = weight_hh.T
    # every step's input projection and the bias at once
    z_in = (_time_major(x) @ weight_ih.T).reshape(steps, n, 4 * hid)
    z_in += bias
    gates = xp.empty_like(z_in)
    cells = xp.empty((steps, n, hid), dtype=x.dtype)
    tanh_c = xp.empty((steps, n, hid), dtype=x.dtype)
    hiddens = xp.zeros((steps + 1, n, hid), dtype=x.dtype)  # hiddens[0] = h_0 = 0
    c = xp.zeros((n, hid), dtype=x.dtype)
    for t in range(steps):
        z = z_in[t] + hiddens[t] @ w_hh_t
        gate = gates[t]
        gate[:, : 2 * hid] = sigmoid(xp, z[:, : 2 * hid])  # i, f
        gate[:, 2 * hid : 3 * hid] = xp.tanh(z[:, 2 * hid : 3 * hid])  # g
        gate[:, 3 * hid :] = sigmoid(xp, z[:, 3 * hid :])  # o
        c = gate[:, hid : 2 * hid] * c + gate[:, :hid] * gate[:, 2 * hid : 3 * hid]
        cells[t] = c
        tanh_c[t] = xp.tanh(c)
        hiddens[t + 1] = gate[:, 3 * hid :] * tanh_c[t]
    return gates, cells, tanh_c, hiddens


def lstm_backward(dy, x, weight_ih, weight_hh, gates, cells, tanh_c, hiddens, sequence: bool, input_grad: bool = True,
                  workspaces=None):
    """``(dx, dweight_ih, dweight_hh, dbias)`` for the forward that gave the state.

    ``dy`` is the gradient of every step's hidden state (N, T, H) when ``sequence``, else of
    the last one only (N, H). ``dx`` (N, T, D) is None when not ``input_grad``.
    """
    xp = get_array_module(dy)
    n, steps, d = x.shape
    hid = weight_hh.shape[1]
    dz = xp.empty_like(gates)
    dh = xp.zeros((n, hid), dtype=dy.dtype)
    dc = xp.zeros((n, hid), dtype=dy.dtype)
    for t in range(steps - 1, -1, -1):
        if sequence:
            dh = dh + dy[:, t]
        elif t == steps - 1:
            dh = dh + dy
        i, f = gates[t, :, :hid], gates[t, :, hid : 2 * hid]
        g, o = gates[t, :, 2 * hid : 3 * hid], gates[t, :, 3 * hid :]
        th = tanh_c[t]
        dc = dc + dh * o * (1 - th * th)
        c_prev = cells[t - 1] if t > 0 else xp.zeros_like(dc)
        step = dz[t]
        step[:, :hid] = dc * g * i * (1 - i)
        step[:, hid : 2 * hid] = dc * c_prev * f * (1 - f)
        step[:, 2 * hid : 3 * hid] = dc * i * (1 - g * g)
        step[:, 3 * hid :] = dh * th * o * (1 - o)
        dh = step @ weight_hh
        dc = dc * f
    dz2 = dz.reshape(steps * n, 4 * hid)
    dweight_ih = dz2.T @ _time_major(x)
    dweight_hh = dz2[n:].T @ hiddens[1:steps].reshape((steps - 1) * n, hid)
    dbias = dz2.sum(axis=0)
    dx = (dz2 @ weight_ih).reshape(steps, n, d).transpose(1, 0, 2) if input_grad else None
    return dx, dweight_ih, dweight_hh, dbias
