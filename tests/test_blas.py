"""mpidl.engine.blas: the same products as numpy.matmul, whatever the split between threads."""

from __future__ import annotations

import numpy as np
import pytest

from mpidl.engine import blas, threads


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(params=[1, 2, 3])
def gemm_threads(request, monkeypatch):
    """Run the test with the products (and stacks of products) split between 1, 2 and 3
    threads."""
    # the split counts threads.apply() decides, set for this test (no policy applied: the test
    # process's thread counts stay as they are)
    monkeypatch.setitem(threads._state, "gemm_threads", request.param)
    monkeypatch.setitem(threads._state, "stack_threads", request.param)
    return request.param


@pytest.mark.parametrize("batch", [1, 2, 5, 25])
@pytest.mark.parametrize("layout", ["contiguous", "transposed_b", "strided_out"])
def test_batched_matmul_equals_matmul(batch, layout, gemm_threads):
    a = _random((batch, 4, 6), 0)
    if layout == "transposed_b":
        b = _random((batch, 7, 6), 1).transpose(0, 2, 1)  # (batch, 6, 7) view
    else:
        b = _random((batch, 6, 7), 1)
    if layout == "strided_out":
        storage = np.full((4, batch, 7), np.nan, np.float32)
        out = storage.transpose(1, 0, 2)  # (batch, 4, 7) with a leading dimension of batch*7
    else:
        out = np.full((batch, 4, 7), np.nan, np.float32)
    result = blas.batched_matmul(a, b, out)
    assert result is out
    # Each product is one BLAS call either way, so the results agree to the bit.
    np.testing.assert_array_equal(out, np.matmul(a, b))


@pytest.mark.parametrize("shape", [(16, 300, 2000), (2000, 300, 16), (3, 5, 7)])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_equals_matmul(shape, transposed, gemm_threads):
    m, k, n = shape
    a = _random((k, m), 0).T if transposed else _random((m, k), 0)
    b = _random((n, k), 1).T if transposed else _random((k, n), 1)
    out = np.full((m, n), np.nan, np.float32)
    assert blas.matmul(a, b, out) is out
    # A block of rows or columns is the same dot products over the whole of K, but BLAS may
    # block K differently for another shape: equal to float32 rounding.
    np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-5, atol=1e-4)


def test_matmul_into_a_strided_view(gemm_threads):
    a, b = _random((16, 400), 0), _random((400, 1000), 1)
    storage = np.full((16, 2000), np.nan, np.float32)
    out = storage[:, ::2]
    blas.matmul(a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)
    assert np.isnan(storage[:, 1::2]).all()


def test_run_shares_runs_every_share_once(gemm_threads):
    a = np.arange(12.0).reshape(4, 3)
    out = np.zeros((4, 4))
    calls = []

    def share(lo, hi):
        calls.append((lo, hi))
        np.matmul(a[lo:hi], a.T, out=out[lo:hi])

    blas.run_shares(share, [(0, 1), (1, 3), (3, 4)])
    assert sorted(calls) == [(0, 1), (1, 3), (3, 4)]
    np.testing.assert_array_equal(out, a @ a.T)
