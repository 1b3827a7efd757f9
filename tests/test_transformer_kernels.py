"""GELU, layer norm and softmax kernels: the Numba CPU kernels against the reference in float32
and float64 (odd sizes, one-row and one-column shapes, large means), the dispatcher's choice
(``kernels.use("reference")`` takes the reference) and its argument checks, and the layers'
float64 gradient checks on both paths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcheck import bind_parameters, check_backward
from mpidl import kernels
from mpidl.kernels import transformer_cpu, transformer_reference
from mpidl.engine.nn import GELU, LayerNorm, MultiHeadSelfAttention, TransformerEncoderBlock

SHAPES = [(4, 3, 5), (1, 7), (2, 1, 1), (3, 50, 64), (13,)]
DTYPES = [np.float32, np.float64]


def _tolerance(dtype) -> float:
    return 2e-6 if dtype == np.float32 else 1e-13


def _normal(shape, dtype, seed=0, scale=1.0, offset=0.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale + offset).astype(dtype)


def _close(got, expected, dtype, what):
    tol = _tolerance(dtype)
    assert got.dtype == expected.dtype, what
    assert got.shape == expected.shape, what
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_kernels_equal_the_reference(shape, dtype):
    x, dy = _normal(shape, dtype, scale=3.0), _normal(shape, dtype, seed=1)
    y_ref, cdf_ref = transformer_reference.gelu_forward(x)
    y, cdf = transformer_cpu.gelu_forward(x)
    _close(y, y_ref, dtype, "y")
    _close(cdf, cdf_ref, dtype, "cdf")
    _close(transformer_cpu.gelu_backward(dy, x, cdf), transformer_reference.gelu_backward(dy, x, cdf_ref), dtype, "dx")


def test_float32_gelu_is_within_its_stated_error_of_the_exact_phi():
    """The float32 kernel's erfc fit: Phi(x) within 1.7e-7 relative and 7.2e-8 absolute of
    the exact value on a dense grid (every float32 step of Phi is at least 6e-8 near 1/2)."""
    x = np.concatenate([np.linspace(-40, 40, 400_001), [0.0, -0.0, 1e-30, -1e-30]]).astype(np.float32)
    y, cdf = transformer_cpu.gelu_forward(x)
    exact = np.array([0.5 * math.erfc(-float(v) / math.sqrt(2)) for v in x])
    tiny = exact < np.finfo(np.float32).tiny  # below float32's normal range: compare absolutely
    assert np.abs(cdf - exact).max() < 7.2e-8
    assert (np.abs(cdf - exact) / np.where(tiny, 1.0, exact))[~tiny].max() < 1.7e-7
    np.testing.assert_allclose(y, x.astype(np.float64) * exact, rtol=2.3e-7, atol=1e-37)  # + rounding to float32
    with np.errstate(invalid="ignore"):
        special = transformer_cpu.gelu_forward(np.array([np.inf, -np.inf, np.nan], np.float32))[0]
        expected = transformer_reference.gelu_forward(np.array([np.inf, -np.inf, np.nan], np.float32))[0]
    np.testing.assert_array_equal(special, expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_kernels_equal_the_reference(shape, dtype):
    d = shape[-1]
    x, dy = _normal(shape, dtype, scale=2.0, offset=1.0), _normal(shape, dtype, seed=1)
    gamma, beta = np.linspace(0.5, 1.5, d).astype(dtype), np.linspace(-0.3, 0.3, d).astype(dtype)
    y_ref, mean_ref, inv_std_ref = transformer_reference.layernorm_forward(x, gamma, beta, 1e-5)
    y, mean, inv_std = transformer_cpu.layernorm_forward(x, gamma, beta, 1e-5)
    _close(y, y_ref, dtype, "y")
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(inv_std, inv_std_ref, rtol=1e-12)
    assert mean.dtype == inv_std.dtype == np.float64 and mean.shape == shape[:-1]
    got = transformer_cpu.layernorm_backward(dy, x, gamma, mean, inv_std)
    ref = transformer_reference.layernorm_backward(dy, x, gamma, mean_ref, inv_std_ref)
    _close(got[0], ref[0], dtype, "dx")
    for name, a, b in zip(("dgamma", "dbeta"), got[1:], ref[1:]):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11, err_msg=name)


def test_layernorm_statistics_of_rows_with_a_large_mean_are_float64_accurate():
    """1000 + 3 N(0, 1) in float32: the two-pass float64 statistics lose nothing."""
    x = _normal((64, 50, 64), np.float32, scale=3.0, offset=1000.0)
    d = x.shape[-1]
    _, mean, inv_std = transformer_cpu.layernorm_forward(x, np.ones(d, np.float32), np.zeros(d, np.float32), 1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=-1), rtol=1e-14)
    np.testing.assert_allclose(inv_std, 1 / np.sqrt(x64.var(axis=-1) + 1e-5), rtol=1e-10)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_kernels_equal_the_reference(shape, dtype):
    s, da = _normal(shape, dtype, scale=4.0), _normal(shape, dtype, seed=1)
    a_ref = transformer_reference.softmax_forward(s, 0.25)
    a = transformer_cpu.softmax_forward(s, 0.25)
    _close(a, a_ref, dtype, "a")
    np.testing.assert_allclose(a.sum(axis=-1), 1.0, rtol=_tolerance(dtype) * 4)
    _close(transformer_cpu.softmax_backward(da, a, 0.25), transformer_reference.softmax_backward(da, a_ref, 0.25),
           dtype, "ds")


def test_softmax_of_large_scores_does_not_overflow():
    s = np.array([[1000.0, 999.0, -1000.0]], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise"):
        a = kernels.softmax_forward(s)
    np.testing.assert_allclose(a, [[1 / (1 + np.exp(-1)), np.exp(-1) / (1 + np.exp(-1)), 0.0]], rtol=1e-6)


def test_strided_inputs_give_the_contiguous_result():
    x = _normal((6, 10), np.float64)[:, ::2]
    contiguous = np.ascontiguousarray(x)
    for got, expected in zip(kernels.gelu_forward(x), kernels.gelu_forward(contiguous)):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(kernels.softmax_forward(x, 0.5), kernels.softmax_forward(contiguous, 0.5))
    gamma, beta = np.ones(5), np.zeros(5)
    np.testing.assert_array_equal(kernels.layernorm_forward(x, gamma, beta, 1e-5)[0],
                                  kernels.layernorm_forward(contiguous, gamma, beta, 1e-5)[0])


def test_dispatch_takes_the_kernels_for_numpy_and_the_reference_when_forced(monkeypatch):
    x = np.ones((2, 3), np.float32)
    with kernels.use("auto"):
        assert kernels._transformer_module(x) is transformer_cpu
        assert kernels._transformer_module(x.astype(np.float16)) is transformer_reference
    with kernels.use("reference"):
        assert kernels._transformer_module(x) is transformer_reference
        # and the layers follow: the reference's float64 LayerNorm statistics, SciPy's erf
        calls = []
        original = transformer_reference.gelu_forward
        monkeypatch.setattr(transformer_reference, "gelu_forward", lambda v: calls.append(v.shape) or original(v))
        GELU().forward(x)
        assert calls == [(2, 3)]


def test_dispatch_checks_the_arguments():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="gamma, beta of shape"):
        kernels.layernorm_forward(x, np.ones(2), np.zeros(3), 1e-5)
    with pytest.raises(ValueError, match="mean, inv_std"):
        kernels.layernorm_backward(x, x, np.ones(3), np.zeros(3), np.ones(2))
    with pytest.raises(ValueError, match="scale > 0"):
        kernels.softmax_forward(x, 0.0)
    with pytest.raises(ValueError, match="cdf has shape"):
        kernels.gelu_backward(x, x, np.ones((3, 2)))
    with pytest.raises(ValueError, match="da has shape"):
        kernels.softmax_backward(np.ones((2, 4)), x)


@pytest.mark.parametrize("path", ["auto", "reference"])
@pytest.mark.parametrize("make, shape", [
    (GELU, (3, 4, 5)),
    (lambda: LayerNorm(7), (2, 3, 7)),
    (lambda: MultiHeadSelfAttention(6, 2), (2, 5, 6)),
    (lambda: TransformerEncoderBlock(6, 2, 8), (2, 4, 6)),
])
def test_layers_gradcheck_on_both_paths(path, make, shape):
    """float64 gradients within 1e-7 relative of central differences, kernels or reference."""
    layer = make()
    bind_parameters(layer, seed=3)
    with kernels.use(path):
        check_backward(layer, _normal(shape, np.float64, seed=4), atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_encoder_block_is_the_same_on_both_paths(dtype):
    """A whole encoder block (layer norms, attention's softmax, GELU): output, input gradient
    and parameter gradients of the kernels equal the reference's."""
    block = TransformerEncoderBlock(8, 2, 12)
    flat = bind_parameters(block, seed=5, dtype=dtype)
    x, dy = _normal((3, 9, 8), dtype, seed=6), _normal((3, 9, 8), dtype, seed=7)
    results = {}
    for path in ("auto", "reference"):
        with kernels.use(path):
            y = block.forward(x)
            results[path] = (y, block.backward(dy), flat.grad.copy())
    tol = 1e-5 if dtype == "float32" else 1e-12
    for name, a, b in zip(("y", "dx", "parameter gradients"), results["auto"], results["reference"]):
        assert a.dtype == b.dtype == np.dtype(dtype)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
