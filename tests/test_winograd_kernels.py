"""Winograd F(m x m, r x r): the transform matrices, the reference transforms and convolution,
and the Numba CPU convolution (mpidl.kernels.winograd_reference / winograd_cpu).

* ``winograd_matrices`` satisfies its defining identity (1-D correlation) exactly in float64.
* The reference transforms are what their docstrings say: each adjoint satisfies
  ``<T x, y> == <x, T* y>``, and ``input -> batched GEMM -> output`` equals a direct
  convolution (im2col) in float64; the reference convolution's backward is the adjoint of its
  forward.
* The CPU convolution (all passes fused per block of samples) equals the reference on a product
  of shapes, tiles, filter sizes and paddings, with one block per sample as well as the
  default blocks: float64 to 1e-12 and float32 to 1e-6 relative to the largest value (single
  elements can cancel, so the tolerance is relative to the array's scale rather than
  elementwise).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_reference_fills_out_buffers_and_checks_shapes():
    x = _random((2, 2, 5, 5))
    out = np.full((2, 5, 5, 2 * 2 * 2), np.nan)
    assert winograd_reference.winograd_input(x, 3, 3, 1, out=out) is out
    np.testing.assert_array_equal(out, winograd_reference.winograd_input(x, 3, 3, 1))
    with kernels.use("reference"):
        with pytest.raises(ValueError, match="expected"):
            kernels.winograd_input_adjoint(out[:, :4], x.shape, 3, 3, 1)
        with pytest.raises(ValueError, match="expected"):
            kernels.winograd_output(np.zeros((2, 5, 5, 3)), (2, 2, 5, 5), 3, 3)


@pytest.mark.parametrize("shape, m, r, pad", CASES[:4])
def test_reference_convolution_backward_is_the_adjoint_of_forward(shape, m, r, pad):
    n, c, _, _, _, alpha = _geometry(shape, m, r, pad)
    f = 2
    x, u = _random(shape), _random((alpha * alpha, f, c), seed=1)
    y, v = winograd_reference.winograd_conv_forward(x, u, m, r, pad)
    dy = _random(y.shape, seed=2)
    du, dx = winograd_reference.winograd_conv_backward(dy, u, v, shape, m, r, pad)
    # y is bilinear in (x, u): <y, dy> = <x, dx> = <u, du>
    assert np.vdot(y, dy) == pytest.approx(np.vdot(x, dx), rel=1e-12)
    assert np.vdot(y, dy) == pytest.approx(np.vdot(u, du), rel=1e-12)
    assert winograd_reference.winograd_conv_backward(dy, u, v, shape, m, r, pad, input_grad=False)[1] is None


# --------------------------------------------------------------------------------------------
# the Numba CPU convolution against the reference (and through the dispatch)
# --------------------------------------------------------------------------------------------


def _convolution_case(shape, m, r, dtype, f=3):
    n, c = shape[:2]
    alpha = m + r - 1
    return _random(shape, dtype), _random((alpha * alpha, f, c), dtype, seed=1), _random(f, dtype, seed=2)


@pytest.mark.parametrize("block_columns", [None, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, m, r, pad", CASES)
def test_cpu_convolution_matches_the_reference(monkeypatch, shape, m, r, pad, dtype, block_columns):
    if block_columns is not None:  # one sample per block: the most blocks, every one its own
        monkeypatch.setattr(winograd_cpu, "_MAX_BLOCK_COLUMNS", block_columns)
    x, u, bias = _convolution_case(shape, m, r, dtype)
    for b in (None, bias):
        y, v = winograd_cpu.winograd_conv_forward(x, u, m, r, pad, b)
        expected_y, expected_v = winograd_reference.winograd_conv_forward(x, u, m, r, pad, b)
        _assert_scaled_close(y, expected_y, dtype)
    dy = _random(y.shape, dtype, seed=3)
    du, dx = winograd_cpu.winograd_conv_backward(dy, u, v, shape, m, r, pad)
    expected_du, expected_dx = winograd_reference.winograd_conv_backward(dy, u, expected_v, shape, m, r, pad)
    _assert_scaled_close(du, expected_du, dtype)
    _assert_scaled_close(dx, expected_dx, dtype)
    du_only, no_dx = winograd_cpu.winograd_conv_backward(dy, u, v, shape, m, r, pad, input_grad=False)
    assert no_dx is None
    np.testing.assert_array_equal(du_only, du)


def test_cpu_blocks_cover_every_sample_once():
    for n in (1, 2, 3, 5, 64, 65, 200):
        for tiles in (1, 4, 64):
            nb = winograd_cpu.samples_per_block(n, tiles)
            blocks = -(-n // nb)
            assert 1 <= nb <= n and (blocks - 1) * nb < n <= blocks * nb
            assert nb * tiles < winograd_cpu._MAX_BLOCK_COLUMNS + tiles  # ceil: at most one more sample


def test_cpu_convolution_is_dispatched_and_backward_follows_forward(mpidl_settings):
    x, u, bias = _convolution_case((2, 3, 9, 9), 3, 3, np.float32)
    mpidl_settings()  # no MPIDL_KERNELS: the array decides
    assert kernels.implementation_for(x) is cpu
    y, saved = kernels.winograd_conv_forward(x, u, 3, 3, 1, bias)
    assert saved[0] is winograd_cpu
    # The four transforms alone have no CPU kernel: NumPy arrays get the reference.
    np.testing.assert_array_equal(kernels.winograd_input(x, 3, 3, 1), winograd_reference.winograd_input(x, 3, 3, 1))
    dy = _random(y.shape, np.float32, seed=3)
    with kernels.use("reference"):
        du, dx = kernels.winograd_conv_backward(dy, u, saved, 3, 3, 1)  # still the CPU kernels: they saved V
        assert kernels.winograd_conv_forward(x, u, 3, 3, 1)[1][0] is winograd_reference
    expected = winograd_reference.winograd_conv_backward(dy, u, winograd_reference.winograd_conv_forward(x, u, 3, 3, 1)[1],
                                                         x.shape, 3, 3, 1)
    _assert_scaled_close(du, expected[0], np.float32)
    _assert_scaled_close(dx, expected[1], np.float32)


def test_convolution_dispatch_refuses_bad_arguments():
    x, u, bias = _convolution_case((2, 3, 9, 9), 3, 3, np.float32)
    with pytest.raises(ValueError, match=r"u has shape \(25, 3, 3\), expected \(16, F, 3\)"):
        kernels.winograd_conv_forward(x, u, 2, 3, 1)
    with pytest.raises(ValueError, match="u must be a numpy array of dtype float32"):
        kernels.winograd_conv_forward(x, u.astype(np.float64), 3, 3, 1)
    with pytest.raises(ValueError, match="bias has shape"):
        kernels.winograd_conv_forward(x, u, 3, 3, 1, bias[:2])
    with pytest.raises(ValueError, match="must be 4-D"):
        kernels.winograd_conv_forward(x[0], u, 3, 3, 1)
    y, saved = kernels.winograd_conv_forward(x, u, 3, 3, 1)
    with pytest.raises(ValueError, match="dy has shape"):
        kernels.winograd_conv_backward(y[:, :, :-1], u, saved, 3, 3, 1)


def test_cpu_convolution_hands_other_dtypes_to_the_reference():
    x, u, _ = _convolution_case((1, 2, 5, 5), 3, 3, np.float16)
    y, v = winograd_cpu.winograd_conv_forward(x, u, 3, 3, 1)
    assert y.dtype == np.float16
    expected_y, expected_v = winograd_reference.winograd_conv_forward(x, u, 3, 3, 1)
    np.testing.assert_array_equal(y, expected_y)
    np.testing.assert_array_equal(v, expected_v)


_THREADED_PROBE = """
import json
import numba
import numpy as np
from mpidl.kernels import cpu, reference, winograd_cpu, winograd_reference

rng = np.random.default_rng(0)
errors = {}
for dtype in (np.float32, np.float64):
    x = rng.standard_normal((9, 8, 12, 12)).astype(dtype)
    u = rng.standard_normal((36, 5, 8)).astype(dtype)
    w = rng.standard_normal((5, 8, 3, 3)).astype(dtype)
    y, v = winograd_cpu.winograd_conv_forward(x, u, 4, 3, 1)
    ry, rv = winograd_reference.winograd_conv_forward(x, u, 4, 3, 1)
    dy = rng.standard_normal(y.shape).astype(dtype)
    got = (y, *winograd_cpu.winograd_conv_backward(dy, u, v, x.shape, 4, 3, 1))
    want = (ry, *winograd_reference.winograd_conv_backward(dy, u, rv, x.shape, 4, 3, 1))
    y2, state = cpu.conv2d_forward(x, w, None, 2, 1)
    ry2, cols = reference.conv2d_forward(x, w, None, 2, 1)
    dy2 = rng.standard_normal(y2.shape).astype(dtype)
    got += (y2, *cpu.conv2d_backward(dy2, w, state, x.shape, 2, 1))
    want += (ry2, *reference.conv2d_backward(dy2, w, cols, x.shape, 2, 1))
    errors[np.dtype(dtype).name] = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, want))
print(json.dumps({"threads": numba.get_num_threads(), "errors": errors}))
"""


@pytest.mark.slow
def test_fused_convolutions_on_two_threads_match_the_reference():
    """The suite runs Numba on one thread; here two threads run blocks at once (each calling
    BLAS from its own thread), in a fresh interpreter."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "OPENBLAS_", "MKL_", "NUMBA_NUM_THREADS"))}
    env.update(NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="2", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _THREADED_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["threads"] == 2
    assert result["errors"]["float32"] < SCALE_RTOL[np.float32] and result["errors"]["float64"] < SCALE_RTOL[np.float64], result
