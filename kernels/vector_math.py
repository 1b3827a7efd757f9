"""``exp``, sigmoid and tanh written out in arithmetic, for Numba loops that must vectorize.

Numba compiles ``math.exp``, ``math.tanh`` and ``math.erf`` to calls into libm, one element at
a time (it links no vector math library unless Intel's SVML is installed), and a call in a loop
stops LLVM from vectorizing it: on an AVX2 CPU that costs more than the matrix products
around it in an LSTM step or a transformer's softmax and GELU. NumPy's ``np.exp`` is no way out everywhere: it is vectorized
for float32 on AVX2 but for float64 only with AVX-512, so code that leaves its ``exp`` to
NumPy is fast on one machine and slow on the next.

The functions below are plain arithmetic, inlined into the loops that call them, which LLVM then
vectorizes (AVX2: four float64 lanes). All take and return float64; a float32 kernel converts on
load and rounds once on store.

``exp(x)`` for ``x <= 0`` (every caller needs only that half: the softmax of scores shifted by
their maximum, the Gaussian ``exp(-x^2/2)``, the sigmoid and tanh below, GELU's ``erfc``)::

    n = round(x / ln 2),  r = x - n ln 2             (|r| <= ln(2)/2; ln 2 in two pieces, so
                                                      r is exact: Cody and Waite)
    exp(x) = 2^n e^r,  e^r = 1 + expm1(r),  expm1(r) = r + r^2/2! + ... + r^13/13!
                                                     (the rest < 0.35^14/14! < 5e-18)
    2^n    = the float64 whose exponent bits are n + 1023, i.e. (n + 1023) << 52

Within 4e-16 relative of the exact value (tested against NumPy). ``exp_single`` stops the
polynomial at degree 7 (within 6e-9, for results stored in float32: 40 % less work), and
``exp_for(x, array)`` picks one of the two by ``array``'s dtype when the caller is compiled. ``x`` below ``-708`` is taken
as ``-708`` (``exp(-708)`` ~ 3e-308, the smallest power of two kept normal): 0 would be exact,
3e-308 is as good next to any sum it enters. ``x = nan`` gives nan.

Numba's on-disk cache (``cache=True``) of a kernel that inlines these functions does not notice
when this file changes: after editing it, delete the ``__pycache__`` folder beside the kernels.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

__all__ = ["exp_parts", "exp", "exp_single", "exp_for", "sigmoid", "tanh"]

_LOG2_E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 = _LN2_HI + _LN2_LO; _LN2_HI has 32 significant
_LN2_LO = 1.90821492927058770002e-10  # bits, so n * _LN2_HI is exact for |n| < 2^21 (fdlibm)
_EXP_MIN = -708.0  # exp(-708) ~ 3e-308, the smallest power kept normal; below, clamped
# Adding 1.5 * 2^52 rounds a float64 of magnitude below 2^51 to an integer n, which then sits in
# the low bits of the sum: the sum's bits minus the constant's bits are n, as an int64. (A
# float64 -> int64 conversion has no AVX2 instruction; this is one add and one integer subtract.)
_ROUNDER = 6755399441055744.0
_ROUNDER_BITS = int(np.float64(_ROUNDER).view(np.int64))

_INLINE = dict(cache=True, inline="always", error_model="numpy")


@njit(**_INLINE)
def _reduce(x):
    """``(2^n, r)`` with ``x = n ln 2 + r``, ``n = round(x / ln 2)``, ``|r| <= ln(2)/2`` (``x``
    clamped below at -708; a nan comes out as -708's): the reduction both polynomials share."""
    clamped = max(x, _EXP_MIN)
    shifted = clamped * _LOG2_E + _ROUNDER
    n = shifted - _ROUNDER  # round(clamped / ln 2), as a float64
    r = (clamped - n * _LN2_HI) - n * _LN2_LO
    scale = np.int64((np.float64(shifted).view(np.int64) - _ROUNDER_BITS + 1023) << 52).view(np.float64)
    return scale, r


@njit(**_INLINE)
def exp_parts(x):
    """``(2^n, expm1(r))`` with ``exp(x) = 2^n (1 + expm1(r))``, for ``x <= 0`` (float64): the
    two parts separately, so that ``expm1(x) = (2^n - 1) + 2^n expm1(r)`` can be formed without
    the cancellation of ``exp(x) - 1`` (:func:`tanh` needs it). A nan ``x`` gives nan parts."""
    scale, r = _reduce(x)
    q = 1.0 / 6227020800.0  # 1/13!
    q = 1.0 / 479001600.0 + r * q
    q = 1.0 / 39916800.0 + r * q
    q = 1.0 / 3628800.0 + r * q
    q = 1.0 / 362880.0 + r * q
    q = 1.0 / 40320.0 + r * q
    q = 1.0 / 5040.0 + r * q
    q = 1.0 / 720.0 + r * q
    q = 1.0 / 120.0 + r * q
    q = 1.0 / 24.0 + r * q
    q = 1.0 / 6.0 + r * q
    q = 0.5 + r * q
    q = r + r * (r * q)
    if x != x:  # _reduce turned a nan into -708; hand it on instead (a select, no branch)
        q = x
    return scale, q


@njit(**_INLINE)
def exp(x):
    """``exp(x)`` for ``x <= 0`` (float64), as the module docstring says."""
    scale, q = exp_parts(x)
    return scale + scale * q


@njit(**_INLINE)
def exp_single(x):
    """``exp(x)`` for ``x <= 0`` to single precision, for a result stored in float32: the same
    reduction as :func:`exp`, the Taylor polynomial to degree 7 (the rest is below
    ``0.35^8/8! < 6e-9`` relative, a tenth of float32's rounding), float64 arithmetic. About 40 %
    less work than :func:`exp`. ``x = nan`` gives nan."""
    scale, r = _reduce(x)
    q = 1.0 / 5040.0
    q = 1.0 / 720.0 + r * q
    q = 1.0 / 120.0 + r * q
    q = 1.0 / 24.0 + r * q
    q = 1.0 / 6.0 + r * q
    q = 0.5 + r * q
    q = r + r * (r * q)
    if x != x:
        q = x
    return scale + scale * q


def exp_for(x, array):
    """``exp(x)`` (``x <= 0``, float64) to the precision of ``array``'s dtype: :func:`exp_single`
    for float32, :func:`exp` otherwise. Only callable from Numba-compiled code, where the choice
    is made when the caller is compiled for its array types."""
    raise NotImplementedError("vector_math.exp_for is for Numba-compiled code")


@overload(exp_for, inline="always")
def _exp_for(x, array):
    if isinstance(array, types.Array) and array.dtype == types.float32:
        return lambda x, array: exp_single(x)
    return lambda x, array: exp(x)


@njit(**_INLINE)
def sigmoid(z):
    """``1 / (1 + exp(-z))`` from ``e = exp(-|z|)``: ``1/(1 + e)`` for ``z >= 0``, ``e/(1 + e)``
    below (never an overflow, never a cancellation)."""
    e = exp(-abs(z))
    s = 1.0 / (1.0 + e)
    return s if z >= 0 else e * s


@njit(**_INLINE)
def tanh(z):
    """``sign(z) (1 - e)/(1 + e)`` with ``e = exp(-2|z|)``, the numerator ``-expm1(-2|z|)``
    computed as such (``1 - e`` would cancel for small ``z``)."""
    scale, q = exp_parts(-2.0 * abs(z))
    em1 = (scale - 1.0) + scale * q  # expm1(-2|z|), in (-1, 0]
    t = -em1 / (2.0 + em1)
    return t if z >= 0 else -t
