"""Winograd F(m x m, r x r): the transform matrices, the reference transforms and the Numba CPU
transforms (mpidl.kernels.reference / cpu).

* ``winograd_matrices`` satisfies its defining identity (1-D correlation) exactly in float64.
* The reference transforms are what their docstrings say: each adjoint satisfies
  ``<T x, y> == <x, T* y>``, and ``input -> batched GEMM -> output`` equals a direct
  convolution (im2col) in float64.
* The CPU kernels equal the reference on a product of shapes, tiles, filter sizes and paddings:
  float64 to 1e-12 and float32 to 1e-6 relative to the largest value (single elements can
  cancel, so the tolerance is relative to the array's scale rather than elementwise).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpidl import kernels
from mpidl.kernels import cpu, reference, winograd_cpu, winograd_reference

SCALE_RTOL = {np.float32: 1e-6, np.float64: 1e-12}
# (N, C, H, W), m, r, pad: exact tilings and tiles that stick out, N = 1 and more, 1x1 to 5x5 filters
CASES = [
    ((2, 3, 9, 9), 3, 3, 1),
    ((1, 2, 7, 5), 2, 3, 0),
    ((3, 2, 8, 8), 4, 3, 1),
    ((2, 1, 6, 7), 3, 2, 1),
    ((1, 2, 5, 6), 2, 5, 2),
    ((2, 2, 4, 4), 4, 1, 0),
    ((2, 3, 32, 32), 4, 3, 1),
]
DTYPES = (np.float32, np.float64)


def _random(shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _assert_scaled_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = float(np.abs(expected).max()) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=SCALE_RTOL[dtype] * scale)


def _geometry(shape, m, r, pad):
    n, c, h, w = shape
    oh, ow, th, tw = winograd_reference.winograd_geometry(shape, m, r, pad)
    return n, c, oh, ow, th * tw * n, m + r - 1


# --------------------------------------------------------------------------------------------
# the matrices
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, r", [(m, r) for m in range(1, 6) for r in range(1, 6) if m + r - 2 <= 8])
def test_matrices_compute_a_correlation(m, r):
    at, g, bt = winograd_reference.winograd_matrices(m, r)
    alpha = m + r - 1
    assert at.shape == (m, alpha) and g.shape == (alpha, r) and bt.shape == (alpha, alpha)
    rng = np.random.default_rng(m * 10 + r)
    for _ in range(3):
        d, filt = rng.standard_normal(alpha), rng.standard_normal(r)
        np.testing.assert_allclose(at @ ((g @ filt) * (bt @ d)), np.correlate(d, filt, "valid"), atol=1e-9)


def test_known_matrices_of_f2_3():
    # Lavin & Gray (2016), F(2, 3): B^T, G, A^T with the points 0, 1, -1 and infinity (up to signs
    # of whole rows, which cancel between G and B^T).
    at, g, bt = winograd_reference.winograd_matrices(2, 3)
    np.testing.assert_array_equal(at, [[1, 1, 1, 0], [0, 1, -1, 1]])
    products = np.einsum("ij,jk,jl->ikl", at, g, bt)  # y[i] = sum_{k,l} P[i,k,l] g[k] d[l]
    expected = np.zeros((2, 3, 4))
    for i, k in itertools.product(range(2), range(3)):
        expected[i, k, i + k] = 1
    np.testing.assert_allclose(products, expected, atol=1e-15)


def test_matrices_are_read_only_and_refuse_bad_sizes():
    at, _, _ = winograd_reference.winograd_matrices(3, 3)
    with pytest.raises(ValueError):
        at[0, 0] = 2
    with pytest.raises(ValueError, match="m, r >= 1"):
        winograd_reference.winograd_matrices(0, 3)
    with pytest.raises(ValueError, match="m, r >= 1"):
        winograd_reference.winograd_matrices(8, 3)


# --------------------------------------------------------------------------------------------
# the reference transforms
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, m, r, pad", CASES)
def test_reference_adjoints(shape, m, r, pad):
    n, c, oh, ow, _, _ = _geometry(shape, m, r, pad)
    x = _random(shape)
    v = winograd_reference.winograd_input(x, m, r, pad)
    dv = _random(v.shape, seed=1)
    assert np.vdot(v, dv) == pytest.approx(np.vdot(x, winograd_reference.winograd_input_adjoint(dv, shape, m, r, pad)), rel=1e-12)

    f = 2
    mt = _random((f, *v.shape[1:]), seed=2)
    y = winograd_reference.winograd_output(mt, (n, f, oh, ow), m, r)
    dy = _random(y.shape, seed=3)
    assert np.vdot(y, dy) == pytest.approx(np.vdot(mt, winograd_reference.winograd_output_adjoint(dy, m, r)), rel=1e-12)


@pytest.mark.parametrize("shape, m, r, pad", CASES)
def test_reference_pipeline_is_a_convolution(shape, m, r, pad):
    n, c, oh, ow, columns, alpha = _geometry(shape, m, r, pad)
    f = 3
    x, weight, bias = _random(shape), _random((f, c, r, r), seed=1), _random(f, seed=2)
    _, g, _ = winograd_reference.winograd_matrices(m, r)
    u = np.einsum("ak,fckl,bl->abfc", g, weight, g).reshape(alpha * alpha, f, c)
    v = winograd_reference.winograd_input(x, m, r, pad)  # (C, alpha, alpha, P)
    mt = np.matmul(u, v.reshape(c, alpha * alpha, columns).transpose(1, 0, 2))  # (alpha^2, F, P)
    mt = np.ascontiguousarray(mt.transpose(1, 0, 2)).reshape(f, alpha, alpha, columns)
    y = winograd_reference.winograd_output(mt, (n, f, oh, ow), m, r, bias=bias)

    cols = reference.im2col(x, r, r, 1, pad)
    direct = (weight.reshape(f, -1) @ cols + bias[:, None]).reshape(f, n, oh, ow).transpose(1, 0, 2, 3)
    np.testing.assert_allclose(y, direct, atol=1e-10 * np.abs(direct).max())


def test_reference_fills_out_buffers_and_checks_shapes(monkeypatch):
    x = _random((2, 2, 5, 5))
    out = np.full((2, 5, 5, 2 * 2 * 2), np.nan)
    assert winograd_reference.winograd_input(x, 3, 3, 1, out=out) is out
    np.testing.assert_array_equal(out, winograd_reference.winograd_input(x, 3, 3, 1))
    monkeypatch.setenv("MPIDL_KERNELS", "reference")
    with pytest.raises(ValueError, match="expected"):
        kernels.winograd_input_adjoint(out[:, :4], x.shape, 3, 3, 1)
    with pytest.raises(ValueError, match="expected"):
        kernels.winograd_output(np.zeros((2, 5, 5, 3)), (2, 2, 5, 5), 3, 3)


# --------------------------------------------------------------------------------------------
# the Numba CPU kernels against the reference (and through the dispatch)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, m, r, pad", CASES)
def test_cpu_transforms_match_the_reference(shape, m, r, pad, dtype):
    n, c, oh, ow, _, _ = _geometry(shape, m, r, pad)
    x = _random(shape, dtype)
    v = winograd_cpu.winograd_input(x, m, r, pad)
    _assert_scaled_close(v, winograd_reference.winograd_input(x, m, r, pad), dtype)

    dv = _random(v.shape, dtype, seed=1)
    _assert_scaled_close(winograd_cpu.winograd_input_adjoint(dv, shape, m, r, pad),
                         winograd_reference.winograd_input_adjoint(dv, shape, m, r, pad), dtype)

    f = 3
    mt, bias = _random((f, *v.shape[1:]), dtype, seed=2), _random(f, dtype, seed=3)
    for b in (None, bias):
        _assert_scaled_close(winograd_cpu.winograd_output(mt, (n, f, oh, ow), m, r, bias=b),
                             winograd_reference.winograd_output(mt, (n, f, oh, ow), m, r, bias=b), dtype)
    dy = _random((n, f, oh, ow), dtype, seed=4)
    _assert_scaled_close(winograd_cpu.winograd_output_adjoint(dy, m, r), winograd_reference.winograd_output_adjoint(dy, m, r), dtype)


def test_cpu_kernels_fill_out_buffers_and_are_dispatched(monkeypatch):
    x = _random((2, 3, 9, 9), np.float32)
    out = np.full((3, 5, 5, 9 * 2), np.nan, np.float32)
    monkeypatch.delenv("MPIDL_KERNELS", raising=False)
    assert kernels.implementation_for(x) is cpu
    assert kernels.winograd_input(x, 3, 3, 1, out=out) is out
    _assert_scaled_close(out, winograd_reference.winograd_input(x, 3, 3, 1), np.float32)
    monkeypatch.setenv("MPIDL_KERNELS", "reference")
    assert kernels.implementation_for(x) is reference
    monkeypatch.setenv("MPIDL_KERNELS", "cpu")
    with pytest.raises(ValueError, match="out has shape"):
        kernels.winograd_input(x, 3, 3, 1, out=np.empty((3, 5, 5, 9), np.float32))
    with pytest.raises(ValueError, match="expected"):
        kernels.winograd_output(out, (2, 3, 9, 9), 2, 3)  # M for m = 3, asked for m = 2


def test_cpu_kernels_hand_other_dtypes_to_the_reference():
    x = _random((1, 2, 5, 5)).astype(np.float16)
    v = winograd_cpu.winograd_input(x, 3, 3, 1)
    assert v.dtype == np.float16
    np.testing.assert_array_equal(v, winograd_reference.winograd_input(x, 3, 3, 1))
