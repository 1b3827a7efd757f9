"""Recurrent layers: LSTM and GRU, with full backpropagation through time."""

from __future__ import annotations

import math

from mpidl import kernels
from mpidl.engine.backend import get_array_module
from mpidl.engine.nn.activation import sigmoid
from mpidl.engine.nn.module import Module
from mpidl.engine.params import Parameter, uniform

__all__ = ["LSTM", "GRU"]


class LSTM(Module):
    """One-layer long short-term memory over a batch of sequences (PyTorch's ``nn.LSTM`` with
    ``batch_first=True``, zero initial state, the same gate order and parameter layout).

    Parameters
    ----------
    input_size, hidden_size : D and H
    return_sequence : return every step's hidden state (N, T, H); otherwise only the last (N, H)

    Shapes
    ------
    x : (N, T, D) -> y : (N, T, H) or (N, H); weight_ih : (4H, D), weight_hh : (4H, H),
    bias_ih, bias_hh : (4H,); the four row blocks of each are the gates i, f, g, o. Every
    parameter starts U(-1/sqrt(H), 1/sqrt(H)) (PyTorch's initialization).

    Notes
    -----
    With ``h_0 = c_0 = 0``, for ``t = 1..T``:

    ``z_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh`` (N, 4H), split into ``z^i, z^f, z^g, z^o``;
    ``i_t = sigmoid(z^i)``, ``f_t = sigmoid(z^f)``, ``g_t = tanh(z^g)``, ``o_t = sigmoid(z^o)``;
    ``c_t = f_t * c_{t-1} + i_t * g_t``; ``h_t = o_t * tanh(c_t)``.

    Backward through time, ``t = T..1``, with ``dh`` the gradient reaching ``h_t`` (from the
    output and from step ``t+1``) and ``dc`` the one reaching ``c_t`` from step ``t+1``:

    ``dc += dh * o_t * (1 - tanh(c_t)^2)``;
    ``dz^o = dh * tanh(c_t) * o_t (1 - o_t)``, ``dz^i = dc * g_t * i_t (1 - i_t)``,
    ``dz^g = dc * i_t * (1 - g_t^2)``, ``dz^f = dc * c_{t-1} * f_t (1 - f_t)``;
    then ``dh_{t-1} = dz_t W_hh``, ``dc_{t-1} = dc * f_t``. Finally, summed over t:
    ``dW_ih = sum dz_t^T x_t``, ``dW_hh = sum dz_t^T h_{t-1}``, ``db_ih = db_hh = sum dz_t``,
    ``dx_t = dz_t W_ih``. The input projection of all steps is one GEMM (N*T, D) x (D, 4H)
    before the loop, and each weight gradient one GEMM over all N*T rows after it. Saved for
    backward: x, the gate activations (T, N, 4H), c and tanh(c) (T, N, H) and the hidden
    states (T+1, N, H), time first.

    Both directions run in :func:`mpidl.kernels.lstm_forward` / :func:`~mpidl.kernels.lstm_backward`:
    Numba kernels for NumPy arrays (one call per direction for the whole loop over time),
    the reference (:mod:`mpidl.kernels.recurrent_reference`, the same math as array code)
    for CuPy arrays and when the reference is forced (``kernels.use("reference")``,
    ``MPIDL_KERNELS=reference``). With ``compute_input_grad = False``
    backward skips ``dx`` (the GEMM ``dz W_ih``) and returns None.
    """

    def __init__(self, input_size: int, hidden_size: int, return_sequence: bool = False) -> None:
        super().__init__()
        if input_size < 1 or hidden_size < 1:
            raise ValueError(f"LSTM needs positive sizes, got input_size={input_size}, hidden_size={hidden_size}")
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        self.return_sequence = bool(return_sequence)
        init = uniform(1.0 / math.sqrt(hidden_size))
        h4 = 4 * self.hidden_size
        self.weight_ih = Parameter((h4, self.input_size), init)
        self.weight_hh = Parameter((h4, self.hidden_size), init)
        self.bias_ih = Parameter((h4,), init)
        self.bias_hh = Parameter((h4,), init)
        self.compute_input_grad = True
        self._saved = None
        self._workspaces: dict = {}  # the CPU kernels' arrays, reused step after step

    def forward(self, x):
        if x.ndim != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"LSTM expects (N, T, {self.input_size}), got {tuple(x.shape)}")
        bias = self.bias_ih.data + self.bias_hh.data
        state = kernels.lstm_forward(x, self.weight_ih.data, self.weight_hh.data, bias, self._workspaces)
        self._saved = (x, state)
        hiddens = state[3]  # (T+1, N, H), time first; reused by the next forward: copied out
        return hiddens[1:].transpose(1, 0, 2).copy() if self.return_sequence else hiddens[x.shape[1]].copy()

    def backward(self, dy):
        if self._saved is None:
            raise RuntimeError("LSTM.backward called before forward")
        x, state = self._saved
        dx, dw_ih, dw_hh, db = kernels.lstm_backward(
            dy, x, self.weight_ih.data, self.weight_hh.data, state, self.return_sequence, self.compute_input_grad,
            self._workspaces,
        )
        self.weight_ih.grad[...] = dw_ih
        self.weight_hh.grad[...] = dw_hh
        self.bias_ih.grad[...] = db
        self.bias_hh.grad[...] = db
        return dx

    def _drop_workspaces(self) -> None:
        self._saved = None
        self._workspaces = {}

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, return_sequence={self.return_sequence}"


class GRU(Module):
    """One-layer gated recurrent unit over a batch of sequences (PyTorch's ``nn.GRU`` with
    ``batch_first=True``, zero initial state, the same gate order and parameter layout).

    Parameters
    ----------
    input_size, hidden_size : D and H
    return_sequence : return every step's hidden state (N, T, H); otherwise only the last (N, H)

    Shapes
    ------
    x : (N, T, D) -> y : (N, T, H) or (N, H); weight_ih : (3H, D), weight_hh : (3H, H),
    bias_ih, bias_hh : (3H,); row blocks r, z, n. Every parameter starts U(+-1/sqrt(H)).

    Notes
    -----
    With ``h_0 = 0``, ``a = x_t W_ih^T + b_ih`` and ``b = h_{t-1} W_hh^T + b_hh`` (each split
    into r, z, n blocks):

    ``r_t = sigmoid(a^r + b^r)``, ``z_t = sigmoid(a^z + b^z)``, ``n_t = tanh(a^n + r_t * b^n)``,
    ``h_t = (1 - z_t) * n_t + z_t * h_{t-1}``.

    Backward through time, with ``dh`` the gradient reaching ``h_t``:
    ``da^n = dh (1 - z_t)(1 - n_t^2)``, ``da^z = db^z = dh (h_{t-1} - n_t) z_t (1 - z_t)``,
    ``da^r = db^r = da^n b^n r_t (1 - r_t)``, ``db^n = da^n r_t``;
    ``dh_{t-1} = dh z_t + db W_hh``; ``dW_ih = sum da^T x_t``, ``dW_hh = sum db^T h_{t-1}``,
    ``db_ih = sum da``, ``db_hh = sum db``, ``dx_t = da W_ih``. Saved for backward: x, the
    gates r, z, n, ``b^n`` and the hidden states.
    """

    def __init__(self, input_size: int, hidden_size: int, return_sequence: bool = False) -> None:
        super().__init__()
        if input_size < 1 or hidden_size < 1:
            raise ValueError(f"GRU needs positive sizes, got input_size={input_size}, hidden_size={hidden_size}")
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        self.return_sequence = bool(return_sequence)
        init = uniform(1.0 / math.sqrt(hidden_size))
        h3 = 3 * self.hidden_size
        self.weight_ih = Parameter((h3, self.input_size), init)
        self.weight_hh = Parameter((h3, self.hidden_size), init)
        self.bias_ih = Parameter((h3,), init)
        self.bias_hh = Parameter((h3,), init)
        self._saved = None

    def forward(self, x):
        if x.ndim != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"GRU expects (N, T, {self.input_size}), got {tuple(x.shape)}")
        xp = get_array_module(x)
        n, steps, _ = x.shape
        hid = self.hidden_size
        a_all = (x.reshape(n * steps, -1) @ self.weight_ih.data.T).reshape(n, steps, 3 * hid)
        a_all += self.bias_ih.data
        gates = xp.empty_like(a_all)  # r, z, n
        b_new = xp.empty((n, steps, hid), dtype=x.dtype)  # b^n = h_{t-1} W_hn^T + b_hn
        hiddens = xp.zeros((n, steps + 1, hid), dtype=x.dtype)
        w_hh_t = self.weight_hh.data.T
        for t in range(steps):
            h = hiddens[:, t]
            b = h @ w_hh_t + self.bias_hh.data
            a = a_all[:, t]
            gate = gates[:, t]
            gate[:, : 2 * hid] = sigmoid(xp, a[:, : 2 * hid] + b[:, : 2 * hid])
            b_new[:, t] = b[:, 2 * hid :]
            gate[:, 2 * hid :] = xp.tanh(a[:, 2 * hid :] + gate[:, :hid] * b_new[:, t])
            z, cand = gate[:, hid : 2 * hid], gate[:, 2 * hid :]
            hiddens[:, t + 1] = cand + z * (h - cand)
        self._saved = (x, gates, b_new, hiddens)
        return hiddens[:, 1:] if self.return_sequence else hiddens[:, steps]

    def backward(self, dy):
        if self._saved is None:
            raise RuntimeError("GRU.backward called before forward")
        x, gates, b_new, hiddens = self._saved
        xp = get_array_module(dy)
        n, steps, _ = x.shape
        hid = self.hidden_size
        w_hh = self.weight_hh.data
        da = xp.empty_like(gates)
        db = xp.empty_like(gates)
        dh = xp.zeros((n, hid), dtype=dy.dtype)
        for t in range(steps - 1, -1, -1):
            if self.return_sequence:
                dh = dh + dy[:, t]
            elif t == steps - 1:
                dh = dh + dy
            r, z, cand = gates[:, t, :hid], gates[:, t, hid : 2 * hid], gates[:, t, 2 * hid :]
            h_prev = hiddens[:, t]
            d_an = dh * (1 - z) * (1 - cand * cand)
            d_az = dh * (h_prev - cand) * z * (1 - z)
            d_ar = d_an * b_new[:, t] * r * (1 - r)
            da[:, t, :hid], da[:, t, hid : 2 * hid], da[:, t, 2 * hid :] = d_ar, d_az, d_an
            db[:, t, :hid], db[:, t, hid : 2 * hid], db[:, t, 2 * hid :] = d_ar, d_az, d_an * r
            dh = dh * z + db[:, t] @ w_hh
        da2, db2 = da.reshape(n * steps, 3 * hid), db.reshape(n * steps, 3 * hid)
        xp.matmul(da2.T, x.reshape(n * steps, -1), out=self.weight_ih.grad)
        xp.matmul(db2.T, hiddens[:, :steps].reshape(n * steps, hid), out=self.weight_hh.grad)
        xp.sum(da2, axis=0, out=self.bias_ih.grad)
        xp.sum(db2, axis=0, out=self.bias_hh.grad)
        return (da2 @ self.weight_ih.data).reshape(x.shape)

    def _drop_workspaces(self) -> None:
        self._saved = None

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, return_sequence={self.return_sequence}"
