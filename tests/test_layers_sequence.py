"""The recurrent, attention and normalization layers: float64 gradient checks to 1e-7
relative (tests/gradcheck.py) and forward values against direct evaluations of the formulas
in their docstrings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcheck import bind_parameters, check_backward
from mpidl.engine.nn import (
    GELU,
    GRU,
    LSTM,
    BandGroups,
    BatchNorm1d,
    BatchNorm2d,
    CenterPixel,
    ClassToken,
    LayerNorm,
    Linear,
    MultiHeadSelfAttention,
    Patchify,
    PositionalEmbedding,
    SelectToken,
    Sigmoid,
    Tanh,
    Tokenwise,
    TransformerEncoderBlock,
)

#: the issue's bound: every analytic gradient within 1e-7 relative of central differences
RTOL, ATOL = 1e-7, 1e-9


def normal(shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def gradcheck(module, x, **kwargs):
    check_backward(module, x, atol=ATOL, rtol=RTOL, **kwargs)


# --------------------------------------------------------------------------------------------
# gradient checks
# --------------------------------------------------------------------------------------------

LAYERS = {
    "gelu": (GELU, (3, 4, 5)),
    "tanh": (Tanh, (3, 4)),
    "sigmoid": (Sigmoid, (2, 3, 4)),
    "layernorm": (lambda: LayerNorm(5), (2, 3, 5)),
    "layernorm-2d": (lambda: LayerNorm(6), (4, 6)),
    "batchnorm1d": (lambda: BatchNorm1d(5), (6, 5)),
    "lstm-last": (lambda: LSTM(3, 4), (2, 5, 3)),
    "lstm-sequence": (lambda: LSTM(3, 4, return_sequence=True), (2, 5, 3)),
    "lstm-one-step": (lambda: LSTM(2, 3), (3, 1, 2)),
    "gru-last": (lambda: GRU(3, 4), (2, 5, 3)),
    "gru-sequence": (lambda: GRU(3, 4, return_sequence=True), (2, 5, 3)),
    "attention-2-heads": (lambda: MultiHeadSelfAttention(6, 2), (2, 4, 6)),
    "attention-1-head": (lambda: MultiHeadSelfAttention(4, 1), (3, 3, 4)),
    "positional": (lambda: PositionalEmbedding(4, 6), (2, 4, 6)),
    "class-token": (lambda: ClassToken(6), (2, 4, 6)),
    "select-token": (lambda: SelectToken(0), (2, 4, 6)),
    "tokenwise-linear": (lambda: Tokenwise(Linear(6, 3)), (2, 4, 6)),
    "encoder-block": (lambda: TransformerEncoderBlock(6, 2, 8), (2, 4, 6)),
    "center-pixel": (CenterPixel, (2, 3, 5, 4)),
    "band-groups-padded": (lambda: BandGroups(7, 3), (2, 7)),
    "band-groups-exact": (lambda: BandGroups(6, 3), (2, 6)),
    "patchify": (lambda: Patchify(2), (2, 3, 4, 6)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradcheck(name):
    make, shape = LAYERS[name]
    gradcheck(make(), normal(shape, seed=len(name)))


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm1d_gradcheck_with_statistics(training):
    bn = BatchNorm1d(3)
    bind_parameters(bn, seed=1)
    bn.weight.data[...] = [0.5, 1.0, 1.5]
    bn.bias.data[...] = [-0.3, 0.0, 0.3]
    bn.running_mean[...] = [-0.2, 0.0, 0.2]
    bn.running_var[...] = [0.5, 1.0, 2.0]
    bn.train(training)
    gradcheck(bn, normal((5, 3), seed=2) * 2 + 1)


def test_layernorm_gradcheck_with_scale_and_shift():
    ln = LayerNorm(4)
    bind_parameters(ln, seed=1)
    ln.weight.data[...] = [0.5, 1.0, 1.5, -1.0]
    ln.bias.data[...] = [0.1, -0.2, 0.3, 0.0]
    gradcheck(ln, normal((3, 2, 4), seed=3) * 3 + 2)


# --------------------------------------------------------------------------------------------
# forward values
# --------------------------------------------------------------------------------------------


def test_activation_values():
    x = np.array([-30.0, -1.0, 0.0, 0.5, 800.0])
    gelu = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x]
    np.testing.assert_allclose(GELU().forward(x), gelu, rtol=1e-15, atol=1e-300)
    np.testing.assert_allclose(Tanh().forward(x), np.tanh(x))
    with np.errstate(over="raise"):  # no exp overflow for large |x|
        s = Sigmoid().forward(np.array([-800.0, -1.0, 0.0, 2.0, 800.0]))
    np.testing.assert_allclose(s, [0.0, 1 / (1 + math.e), 0.5, 1 / (1 + math.exp(-2)), 1.0], atol=1e-300)
    # float32 stays float32
    for layer in (GELU(), Tanh(), Sigmoid()):
        assert layer.forward(x.astype(np.float32)).dtype == np.float32


def test_lstm_matches_the_gate_equations_step_by_step():
    lstm = LSTM(3, 2, return_sequence=True)
    bind_parameters(lstm, seed=4)
    x = normal((2, 4, 3), seed=5)
    out = lstm.forward(x)
    w_ih, w_hh = lstm.weight_ih.data, lstm.weight_hh.data
    b = lstm.bias_ih.data + lstm.bias_hh.data
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    for n in range(2):
        h, c = np.zeros(2), np.zeros(2)
        for t in range(4):
            z = w_ih @ x[n, t] + w_hh @ h + b
            i, f, g, o = sig(z[0:2]), sig(z[2:4]), np.tanh(z[4:6]), sig(z[6:8])
            c = f * c + i * g
            h = o * np.tanh(c)
            np.testing.assert_allclose(out[n, t], h, rtol=1e-13)
    last = LSTM(3, 2)
    last.weight_ih, last.weight_hh, last.bias_ih, last.bias_hh = lstm.weight_ih, lstm.weight_hh, lstm.bias_ih, lstm.bias_hh
    np.testing.assert_allclose(last.forward(x), out[:, -1], rtol=1e-15)


def test_gru_matches_the_gate_equations_step_by_step():
    gru = GRU(3, 2, return_sequence=True)
    bind_parameters(gru, seed=4)
    x = normal((2, 4, 3), seed=5)
    out = gru.forward(x)
    w_ih, w_hh, b_ih, b_hh = gru.weight_ih.data, gru.weight_hh.data, gru.bias_ih.data, gru.bias_hh.data
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    for n in range(2):
        h = np.zeros(2)
        for t in range(4):
            a, b = w_ih @ x[n, t] + b_ih, w_hh @ h + b_hh
            r, z = sig(a[0:2] + b[0:2]), sig(a[2:4] + b[2:4])
            cand = np.tanh(a[4:6] + r * b[4:6])
            h = (1 - z) * cand + z * h
            np.testing.assert_allclose(out[n, t], h, rtol=1e-13)


def test_attention_matches_a_per_head_loop():
    e, heads = 6, 3
    mha = MultiHeadSelfAttention(e, heads)
    bind_parameters(mha, seed=2)
    mha.in_proj_bias.data[...] = normal(3 * e, seed=7)  # starts at 0: make it count
    x = normal((2, 5, e), seed=6)
    y = mha.forward(x)
    w, b = mha.in_proj_weight.data, mha.in_proj_bias.data
    d = e // heads
    for n in range(2):
        q, k, v = (x[n] @ w[j * e:(j + 1) * e].T + b[j * e:(j + 1) * e] for j in range(3))
        heads_out = []
        for h in range(heads):
            cols = slice(h * d, (h + 1) * d)
            s = q[:, cols] @ k[:, cols].T / math.sqrt(d)
            a = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)  # softmax along the keys
            heads_out.append(a @ v[:, cols])
        expected = np.concatenate(heads_out, axis=1) @ mha.out_proj.weight.data.T + mha.out_proj.bias.data
        np.testing.assert_allclose(y[n], expected, rtol=1e-12, atol=1e-14)


def test_attention_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="num_heads dividing embed_dim"):
        MultiHeadSelfAttention(6, 4)


def test_layernorm_normalizes_each_row():
    ln = LayerNorm(8)
    bind_parameters(ln)
    x = normal((3, 4, 8), seed=1) * 5 + 100
    y = ln.forward(x)
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), 1 / (1 + ln.eps / x.var(axis=-1)), rtol=1e-12)


def test_batchnorm1d_is_batchnorm2d_on_1x1_maps():
    x = normal((6, 4), seed=3) * 2 + 1
    bn1, bn2 = BatchNorm1d(4), BatchNorm2d(4)
    for bn in (bn1, bn2):
        bind_parameters(bn, seed=2)
    y1 = bn1.forward(x)
    y2 = bn2.forward(x[:, :, None, None])
    np.testing.assert_allclose(y1, y2[:, :, 0, 0], rtol=1e-14)
    np.testing.assert_allclose(bn1.running_var, bn2.running_var, rtol=1e-14)
    with pytest.raises(ValueError, match=r"BatchNorm1d expects \(N, 4\)"):
        bn1.forward(x[:, :3])


def test_tokens_and_class_token_layout():
    x = normal((2, 3, 4, 6), seed=1)
    tokens = Patchify(2).forward(x)
    assert tokens.shape == (2, 2 * 3, 3 * 2 * 2)
    # token (a, b) = sub-patch rows 2a..2a+1, columns 2b..2b+1, flattened as (c, i, j)
    np.testing.assert_array_equal(tokens[1, 1 * 3 + 2], x[1, :, 2:4, 4:6].reshape(-1))
    with pytest.raises(ValueError, match="multiples of 4"):
        Patchify(4).forward(x)
    cls = ClassToken(12)
    bind_parameters(cls)
    y = cls.forward(tokens)
    assert y.shape == (2, 7, 12)
    np.testing.assert_array_equal(y[:, 0], np.broadcast_to(cls.weight.data, (2, 12)))
    np.testing.assert_array_equal(y[:, 1:], tokens)
    spectra = CenterPixel().forward(x)
    np.testing.assert_array_equal(spectra, x[:, :, 2, 3])
    groups = BandGroups(3, 2).forward(spectra)
    np.testing.assert_array_equal(groups[:, 1, 1], 0.0)  # zero padding of the last group


# --------------------------------------------------------------------------------------------
# batch-norm statistics in float32 on inputs far from zero
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer, shape", [(BatchNorm2d, (64, 8, 7, 7)), (BatchNorm1d, (3136, 8))])
def test_batchnorm_float32_statistics_on_a_large_mean(layer, shape):
    """Inputs 1000 + 3 N(0, 1): a float32 mean is off by up to half a float32 step of 1000
    (3e-5, 1e-5 of the spread), which reached the weight gradient as a 3.5e-5 relative error
    (PyTorch's float32: 9e-6). The float64 two-pass statistics keep it under 1e-5."""
    rng = np.random.default_rng(0)
    x = 1000 + 3 * rng.standard_normal(shape)
    dy = rng.standard_normal(shape)
    results = {}
    for dtype in ("float64", "float32"):
        bn = layer(shape[1])
        bind_parameters(bn, dtype=dtype)
        y = bn.forward(x.astype(dtype))
        dx = bn.backward(dy.astype(dtype))
        results[dtype] = (y, bn.weight.grad.copy(), dx, bn.running_mean.copy())

    def rel(k):
        a, b = results["float32"][k].astype(np.float64), results["float64"][k]
        return float(np.abs(a - b).max() / np.abs(b).max())

    assert rel(1) < 1e-5, f"weight gradient {rel(1):.2e} off the float64 reference"
    assert rel(0) < 1e-5 and rel(2) < 1e-5 and rel(3) < 1e-6


def test_sequential_stops_at_a_skipped_input_gradient_only_before_parameters():
    """A layer that returns no input gradient ends backward when nothing before it has
    parameters; behind a layer with parameters it is an
    error (that layer's gradients would be stale)."""
    from mpidl.engine.nn import Linear, Sequential  # noqa: PLC0415

    lstm = LSTM(3, 2)
    lstm.compute_input_grad = False
    net = Sequential(BandGroups(6, 3), lstm)
    bind_parameters(net, seed=1)
    net.forward(normal((4, 6), seed=2))
    assert net.backward(normal((4, 2), seed=3)) is None
    second = LSTM(3, 2)
    second.compute_input_grad = False
    behind = Sequential(Linear(6, 6), BandGroups(6, 3), second)
    bind_parameters(behind, seed=1)
    behind.forward(normal((4, 6), seed=2))
    with pytest.raises(RuntimeError, match="layers before it have parameters"):
        behind.backward(normal((4, 2), seed=3))
