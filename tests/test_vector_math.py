"""The written-out ``exp``, sigmoid and tanh of :mod:`mpidl.kernels.vector_math`, against
NumPy in float64: a few ulps over the whole range, the clamped tail, nan, and the small ``|z|``
where ``1 - e`` would cancel; and the loops that call them vectorize."""

import numpy as np
import pytest
from numba import njit

from mpidl.kernels import vector_math


@njit(error_model="numpy")
def _apply(z, exp, sig, tanh):
    for k in range(z.size):
        exp[k] = vector_math.exp(-abs(z[k]))
        sig[k] = vector_math.sigmoid(z[k])
        tanh[k] = vector_math.tanh(z[k])


def _run(z):
    out = [np.empty_like(z) for _ in range(3)]
    _apply(z, *out)
    return out


def test_match_numpy_over_the_whole_range():
    z = np.concatenate([np.linspace(-800, 800, 20001), np.geomspace(1e-12, 1, 200), -np.geomspace(1e-12, 1, 200),
                        np.random.default_rng(0).uniform(-40, 40, 5000), [0.0, -0.0]])
    exp, sig, tanh = _run(z)
    kept = np.abs(z) <= 708  # below -708 exp is clamped at exp(-708), ~3e-308 (the docstring)
    np.testing.assert_allclose(exp[kept], np.exp(-np.abs(z[kept])), rtol=6e-16, atol=0)
    np.testing.assert_allclose(exp[~kept], np.exp(-708.0), rtol=6e-16)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(sig, 1 / (1 + np.exp(-z)), rtol=6e-16, atol=1e-300)
    np.testing.assert_allclose(tanh, np.tanh(z), rtol=6e-16, atol=0)


def test_special_values():
    z = np.array([np.nan, np.inf, -np.inf])
    exp, sig, tanh = _run(z)
    assert np.isnan(exp[0]) and np.isnan(sig[0]) and np.isnan(tanh[0])
    assert exp[1] == exp[2] == pytest.approx(np.exp(-708.0))
    assert (sig[1], sig[2]) == (1.0, pytest.approx(0.0, abs=1e-300))
    assert (tanh[1], tanh[2]) == (1.0, -1.0)


@njit(error_model="numpy", fastmath={"contract"})
def _exp_loop(x, out):
    for k in range(x.size):
        out[k] = vector_math.exp(x[k])


def test_a_loop_that_calls_exp_vectorizes():
    """The reason the module exists: LLVM turns the loop into packed (SIMD) float64 arithmetic,
    which a call into libm per element would prevent. Checked in the machine code for the
    packed-double multiply of whatever vector width the CPU has (``mulpd``: SSE2, AVX, AVX-512)."""
    x = -np.linspace(0, 50, 64)
    out = np.empty_like(x)
    _exp_loop(x, out)
    asm = _exp_loop.inspect_asm(_exp_loop.signatures[0])
    assert "mulpd" in asm
    assert "exp" not in [line.split()[-1] for line in asm.splitlines() if "call" in line]


@njit(error_model="numpy")
def _apply_single(x, single, for32, for64, full):
    for k in range(x.size):
        single[k] = vector_math.exp_single(x[k])
        for32[k] = vector_math.exp_for(x[k], for32)
        for64[k] = vector_math.exp_for(x[k], for64)
        full[k] = vector_math.exp(x[k])


def test_exp_single_and_the_choice_by_dtype():
    """``exp_single`` within 1e-8 relative (float32 rounds at 6e-8); ``exp_for`` picks it for a
    float32 destination and the full ``exp`` otherwise."""
    x = np.concatenate([-np.linspace(0, 708, 20001), -np.geomspace(1e-12, 1, 200), [np.nan]])
    single, full = np.empty_like(x), np.empty_like(x)
    for32, for64 = np.empty(x.size, np.float32), np.empty_like(x)
    _apply_single(x, single, for32, for64, full)
    np.testing.assert_allclose(single[:-1], np.exp(x[:-1]), rtol=1e-8, atol=0)
    assert np.isnan(single[-1]) and np.isnan(for32[-1])
    np.testing.assert_array_equal(for32, single.astype(np.float32))
    np.testing.assert_array_equal(for64, full)
