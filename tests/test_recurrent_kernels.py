"""LSTM kernels: the Numba CPU kernels against the reference (outputs and every gradient,
float32 and float64), their exp/sigmoid/tanh against NumPy's, the dispatcher's choice and
checks, and the layer's skipped input gradient."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import bind_parameters
from mpidl import kernels
from mpidl.kernels import recurrent_cpu, recurrent_reference
from mpidl.engine.nn import LSTM, BandGroups

# (N, T, D, H): spectral_lstm's own shape, one step, odd sizes, a batch split into blocks
# of unequal size (N = 37 on two threads), fewer rows than MIN_BLOCK_ROWS
SHAPES = [(64, 13, 12, 64), (5, 1, 3, 7), (37, 4, 5, 9), (3, 6, 2, 1)]


def _problem(shape, dtype, sequence, seed=0, zero_last_step=False):
    n, steps, d, hid = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, steps, d)).astype(dtype)
    if zero_last_step:  # BandGroups pads the last group of bands with zeros
        x[:, -1, d // 2 :] = 0
    scale = 1 / np.sqrt(hid)
    weight_ih = rng.uniform(-scale, scale, (4 * hid, d)).astype(dtype)
    weight_hh = rng.uniform(-scale, scale, (4 * hid, hid)).astype(dtype)
    bias = rng.uniform(-2 * scale, 2 * scale, 4 * hid).astype(dtype)
    dy = rng.standard_normal((n, steps, hid) if sequence else (n, hid)).astype(dtype)
    return x, weight_ih, weight_hh, bias, dy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sequence", [False, True])
def test_cpu_kernels_equal_reference(shape, dtype, sequence):
    x, weight_ih, weight_hh, bias, dy = _problem(shape, dtype, sequence, zero_last_step=shape[1] > 1)
    state_ref = recurrent_reference.lstm_forward(x, weight_ih, weight_hh, bias)
    state = recurrent_cpu.lstm_forward(x, weight_ih, weight_hh, bias)
    grads_ref = recurrent_reference.lstm_backward(dy, x, weight_ih, weight_hh, *state_ref, sequence)
    grads = recurrent_cpu.lstm_backward(dy, x, weight_ih, weight_hh, *state, sequence)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    names = ["gates", "cells", "tanh_c", "hiddens", "dx", "dweight_ih", "dweight_hh", "dbias"]
    for name, got, want in zip(names, state + grads, state_ref + grads_ref):
        assert got.dtype == dtype and got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


def test_cpu_kernels_skip_the_input_gradient():
    x, weight_ih, weight_hh, bias, dy = _problem((8, 3, 2, 4), np.float64, False)
    state = recurrent_cpu.lstm_forward(x, weight_ih, weight_hh, bias)
    full = recurrent_cpu.lstm_backward(dy, x, weight_ih, weight_hh, *state, False)
    skipped = recurrent_cpu.lstm_backward(dy, x, weight_ih, weight_hh, *state, False, False)
    assert skipped[0] is None
    for got, want in zip(skipped[1:], full[1:]):
        np.testing.assert_array_equal(got, want)


def _layer_step(layer, x, dy):
    y = layer.forward(x)
    dx = layer.backward(dy)
    return y, dx, [p.grad.copy() for p in (layer.weight_ih, layer.weight_hh, layer.bias_ih, layer.bias_hh)]


@pytest.mark.parametrize("sequence", [False, True])
def test_reference_setting_takes_the_reference_path(monkeypatch, sequence):
    """``kernels.use("reference")`` sends the layer through the reference (spied on), and both
    paths give the same layer outputs and gradients."""
    x, *_ = _problem((6, 4, 3, 5), np.float64, sequence)
    layer = LSTM(3, 5, return_sequence=sequence)
    bind_parameters(layer, seed=1)
    dy = np.random.default_rng(1).standard_normal((6, 4, 5) if sequence else (6, 5))

    calls = []
    for module in (recurrent_reference, recurrent_cpu):
        for name in ("lstm_forward", "lstm_backward"):
            original = getattr(module, name)

            def spy(*args, _original=original, _where=f"{module.__name__.split('.')[-1]}.{name}"):
                calls.append(_where)
                return _original(*args)

            monkeypatch.setattr(module, name, spy)

    with kernels.use("reference"):
        y_ref, dx_ref, grads_ref = _layer_step(layer, x, dy)
    assert calls == ["recurrent_reference.lstm_forward", "recurrent_reference.lstm_backward"]
    calls.clear()
    with kernels.use("auto"):
        y, dx, grads = _layer_step(layer, x, dy)
    assert calls == ["recurrent_cpu.lstm_forward", "recurrent_cpu.lstm_backward"]
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_layer_behind_band_groups_with_a_padded_last_step():
    """spectral_lstm's path: 14 bands in groups of 4, the last group zero-padded; the CPU and
    reference layers agree on outputs and gradients (float32)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, 14)).astype(np.float32)
    groups = BandGroups(14, 4)
    seq = groups.forward(x)
    assert seq.shape == (20, 4, 4) and not seq[:, -1, 2:].any()
    layer = LSTM(4, 6)
    bind_parameters(layer, seed=2, dtype="float32")
    dy = rng.standard_normal((20, 6)).astype(np.float32)
    with kernels.use("auto"):
        y, dx, grads = _layer_step(layer, seq, dy)
    with kernels.use("reference"):
        y_ref, dx_ref, grads_ref = _layer_step(layer, seq, dy)
    for got, want in zip([y, dx, *grads], [y_ref, dx_ref, *grads_ref]):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_dispatcher_checks_the_arguments():
    x, weight_ih, weight_hh, bias, dy = _problem((4, 3, 2, 5), np.float64, False)
    with pytest.raises(ValueError, match=r"x must be \(N, T, D\)"):
        kernels.lstm_forward(x[0], weight_ih, weight_hh, bias)
    with pytest.raises(ValueError, match="weight_ih must be"):
        kernels.lstm_forward(x, weight_ih[:, :1], weight_hh, bias)
    with pytest.raises(ValueError, match="bias has shape"):
        kernels.lstm_forward(x, weight_ih, weight_hh, bias[:-1])
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.lstm_forward(x.astype(np.float32), weight_ih, weight_hh, bias)
    state = kernels.lstm_forward(x, weight_ih, weight_hh, bias)
    with pytest.raises(ValueError, match="dy has shape"):
        kernels.lstm_backward(dy[:, :-1], x, weight_ih, weight_hh, state, False)
    with pytest.raises(ValueError, match="hiddens has shape"):
        kernels.lstm_backward(dy, x, weight_ih, weight_hh, (*state[:3], state[3][1:]), False)


def test_reused_workspaces_give_the_same_results_and_keep_outputs():
    """With a layer's workspaces the CPU kernels reuse their arrays call after call: the
    results equal fresh arrays', and a layer output from an earlier step is not overwritten."""
    x, weight_ih, weight_hh, bias, dy = _problem((9, 5, 3, 4), np.float32, False)
    workspaces: dict = {}
    fresh = recurrent_cpu.lstm_forward(x, weight_ih, weight_hh, bias)
    for _ in range(2):
        reused = recurrent_cpu.lstm_forward(x, weight_ih, weight_hh, bias, workspaces)
        grads = recurrent_cpu.lstm_backward(dy, x, weight_ih, weight_hh, *reused, False, True, workspaces)
    for got, want in zip(reused, fresh):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(grads, recurrent_cpu.lstm_backward(dy, x, weight_ih, weight_hh, *fresh, False)):
        np.testing.assert_array_equal(got, want)
    layer = LSTM(3, 4)
    bind_parameters(layer, seed=3, dtype="float32")
    first = layer.forward(x)
    kept = first.copy()
    layer.forward(x[::-1].copy())
    np.testing.assert_array_equal(first, kept)
