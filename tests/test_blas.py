"""mpidl.blas.batched_matmul: the same products as numpy.matmul, whatever the split."""

from __future__ import annotations

import numpy as np
import pytest

from mpidl import blas


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("batch", [1, 2, 5, 25])
@pytest.mark.parametrize("layout", ["contiguous", "transposed_b", "strided_out"])
def test_batched_matmul_equals_matmul(batch, layout):
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


def test_thread_count_is_restored():
    before = blas.blas_threads()
    blas.batched_matmul(_random((8, 3, 3), 0), _random((8, 3, 3), 1), np.empty((8, 3, 3), np.float32))
    assert blas.blas_threads() == before


def test_openblas_thread_functions_are_found_with_numpy_openblas():
    config = np.show_config(mode="dicts") if "mode" in np.show_config.__code__.co_varnames else {}
    blas_name = str(config.get("Build Dependencies", {}).get("blas", {}).get("name", "")).lower()
    if "openblas" not in blas_name:
        pytest.skip(f"NumPy is not built on OpenBLAS ({blas_name or 'unknown'}): the plain matmul fallback is used")
    assert blas._openblas_thread_functions() is not None
    assert blas.blas_threads() >= 1


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_between_threads_equals_matmul(threads):
    functions = blas._openblas_thread_functions()
    if functions is None:
        pytest.skip("OpenBLAS thread-count functions not found: batched_matmul is a plain matmul here")
    set_threads, get_threads = functions
    before = get_threads()
    set_threads(threads)
    try:
        assert blas.blas_threads() == threads
        a, b = _random((7, 5, 9), 2), _random((7, 9, 4), 3)
        out = blas.batched_matmul(a, b, np.empty((7, 5, 4), np.float32))
        np.testing.assert_array_equal(out, np.matmul(a, b))
        assert get_threads() == threads  # restored after the products ran with 1 thread each
    finally:
        set_threads(before)
