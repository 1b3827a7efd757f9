"""GELU, layer normalization and softmax as Numba CPU kernels: the same functions as
:mod:`mpidl.kernels.transformer_reference` (the math is there), in one to three passes over
the data where the reference makes five to ten, each with a temporary array.

Why kernels and not NumPy: the costs here are passes over memory and one thread. NumPy's
GELU forward is SciPy's ``erf`` (a scalar loop, about 7 ns an element, one thread) plus three
element-wise passes; layer normalization and the softmax are reductions along a short last
axis (64 features, 50 keys for ``vit``), where NumPy's per-row overhead dominates, followed by
several broadcasting passes. The kernels below read each input once per pass, and a
``prange`` spreads the rows (or elements) over Numba's threads (the count :mod:`mpidl.engine.threads`
sets).

The transcendental functions decide the rest. Numba calls libm's ``exp`` and ``erf`` one
element at a time (no vector math library is linked), which stops the loop from vectorizing.
NumPy's ``np.exp`` between two call-free kernels is no cure everywhere: it is vectorized for
float64 only with AVX-512 (about 8 ns an element on an AVX2 CPU, as slow as libm). So every
``exp`` here is from :mod:`mpidl.kernels.vector_math`, plain arithmetic that LLVM vectorizes
(``exp_for``: within 4e-16 relative for float64 arrays, 6e-9 for float32 ones, whose rounding
is 6e-8), inlined in the one kernel that needs it: the softmax is one pass for
each row's maximum, one for ``exp`` and the sum, one to divide; GELU's backward takes
``exp(-x^2 / 2)`` in its single pass. ``python benchmarks/profile_layers.py --model vit``
times these layers.

``erf`` has no NumPy twin (SciPy's is a scalar loop too). In float64 GELU's forward calls
libm's ``erf`` (within an ulp or two; the float64 twins of PyTorch depend on it). In
float32 it uses a fit of ``erfc`` instead, ``erfc(z) = t * exp(-z^2 + P(t))`` with
``t = 1/(1 + z/2)`` and ``P`` of degree 9 (Numerical Recipes' ``erfcc``, fractional error below
1.2e-7), evaluated in float64 in one call-free kernel: ``Phi(x)`` comes
out within 1.7e-7 relative and 7.1e-8 absolute of its exact value for every float32 ``x``
(the reference's float32 ``(1 + erf(x/sqrt 2))/2`` is off by up to 6.0e-8 absolute, and by
100 % relative in the left tail, where ``1 + erf`` cancels).

Who owns what, so that no two threads write the same element:

=====================  =============================  ===================================
kernel                 one ``prange`` iteration owns  reads
=====================  =============================  ===================================
gelu forward/backward  one element of ``y`` / ``dx``  the same element of each input
layernorm forward      one row of ``y``               that row of ``x``
layernorm backward     a block of rows of ``dx`` and  those rows of ``dy, x``
                       the block's partial sums of
                       ``dgamma, dbeta``
softmax (each kernel)  one row of ``a`` / ``ds``      that row of the inputs
=====================  =============================  ===================================

Layer norm's ``dgamma, dbeta`` are sums over every row: each block of ``_ROWS_PER_BLOCK`` rows
adds into its own row of a ``(blocks, D)`` partial-sum array, summed afterwards. The blocks
do not depend on the thread count, so neither does the result. Statistics and sums are
float64 for float32 inputs too (as :mod:`mpidl.kernels.batchnorm_cpu`), with reassociation
allowed (``fastmath={"reassoc"}``) so the sums vectorize.

Only float32 and float64 are compiled (``cache=True`` keeps the machine code in
``__pycache__``); the dispatcher (:mod:`mpidl.kernels`) sends other dtypes to the reference.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .vector_math import exp_for, exp_single

__all__ = ["gelu_forward", "gelu_backward", "layernorm_forward", "layernorm_backward",
           "softmax_forward", "softmax_backward"]

_SUM = {"reassoc", "contract"}
_ROWS_PER_BLOCK = 64
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@njit(parallel=True, cache=True, fastmath={"contract"})
def _gelu_forward(x, y, cdf):
    """``cdf = (1 + erf(x / sqrt 2)) / 2``, ``y = x * cdf`` on flat arrays, in x's dtype, with
    libm's erf: the float64 path (float32 takes the erfc fit below)."""
    inv_sqrt2 = x.dtype.type(_INV_SQRT2)
    one = x.dtype.type(1.0)
    half = x.dtype.type(0.5)
    for i in prange(x.size):
        v = x[i]
        p = (math.erf(v * inv_sqrt2) + one) * half
        cdf[i] = p
        y[i] = v * p


# float32 GELU: erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2) for z >= 0, with P the
# degree-9 Chebyshev fit of Numerical Recipes' ``erfcc`` (Press et al., 2nd ed., section 6.2),
# constant term first: fractional error below 1.2e-7 for every z >= 0 (1.06e-7 measured).
_ERFC_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
             0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


@njit(parallel=True, cache=True, fastmath={"contract"}, error_model="numpy")
def _gelu_from_erfc(x, y, cdf):
    """``Phi(x) = erfc(z)/2`` for ``x < 0``, ``1 - erfc(z)/2`` otherwise, ``z = |x| / sqrt 2``,
    ``erfc(z) = t * exp(-z^2 + P(t))``, ``t = 1 / (1 + z/2)``; ``y = x * Phi(x)``. All in
    float64, stored in x's dtype (float32)."""
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9 = _ERFC_FIT
    for i in prange(x.size):
        v = np.float64(x[i])
        z = abs(v) * _INV_SQRT2
        t = 1.0 / (1.0 + 0.5 * z)
        p = c0 + t * (c1 + t * (c2 + t * (c3 + t * (c4 + t * (c5 + t * (c6 + t * (c7 + t * (c8 + t * c9))))))))
        half_erfc = 0.5 * t * exp_single(p - z * z)
        phi = half_erfc if v < 0 else 1.0 - half_erfc
        cdf[i] = phi
        y[i] = v * phi


@njit(parallel=True, cache=True, fastmath={"contract"}, error_model="numpy")
def _gelu_backward(dy, x, cdf, dx):
    """``dx = dy * (cdf + x * exp(-x^2 / 2) / sqrt(2 pi))`` on flat arrays, in float64."""
    for i in prange(x.size):
        v = np.float64(x[i])
        dx[i] = dy[i] * (cdf[i] + v * exp_for(-0.5 * v * v, dx) * _INV_SQRT_2PI)


@njit(parallel=True, cache=True, fastmath=_SUM)
def _layernorm_forward(x, gamma, beta, eps, y, mean, inv_std):
    """Rows of ``x : (R, D)``: float64 mean and ``1/sqrt(var + eps)``, ``y = gamma*xhat + beta``."""
    rows, d = x.shape
    for r in prange(rows):
        total = 0.0
        for j in range(d):
            total += np.float64(x[r, j])
        mu = total / d
        squares = 0.0
        for j in range(d):
            dev = np.float64(x[r, j]) - mu
            squares += dev * dev
        rs = 1.0 / math.sqrt(squares / d + eps)
        mean[r] = mu
        inv_std[r] = rs
        for j in range(d):
            y[r, j] = (np.float64(x[r, j]) - mu) * rs * gamma[j] + beta[j]


@njit(parallel=True, cache=True, fastmath=_SUM)
def _layernorm_backward(dy, x, gamma, mean, inv_std, dx, dgamma_blocks, dbeta_blocks):
    """Per row: ``dx = r * (g - mean(g) - xhat * mean(g * xhat))``, ``g = dy * gamma``; per
    block of rows: its sums of ``dy * xhat`` and ``dy`` into ``dgamma_blocks[b], dbeta_blocks[b]``."""
    rows, d = x.shape
    blocks = dgamma_blocks.shape[0]
    for b in prange(blocks):
        for j in range(d):
            dgamma_blocks[b, j] = 0.0
            dbeta_blocks[b, j] = 0.0
        for r in range(b * _ROWS_PER_BLOCK, min(rows, (b + 1) * _ROWS_PER_BLOCK)):
            mu = mean[r]
            rs = inv_std[r]
            sum_g = 0.0
            sum_gx = 0.0
            for j in range(d):
                g = np.float64(dy[r, j])
                xhat = (np.float64(x[r, j]) - mu) * rs
                dgamma_blocks[b, j] += g * xhat
                dbeta_blocks[b, j] += g
                g *= gamma[j]
                sum_g += g
                sum_gx += g * xhat
            mean_g = sum_g / d
            mean_gx = sum_gx / d
            for j in range(d):
                xhat = (np.float64(x[r, j]) - mu) * rs
                dx[r, j] = (np.float64(dy[r, j]) * gamma[j] - mean_g - xhat * mean_gx) * rs


@njit(parallel=True, cache=True, fastmath=_SUM, error_model="numpy")
def _softmax_forward(s, scale, a):
    """Rows of ``s : (R, K)``: ``z = scale * s``, ``a = exp(z - max(z)) / sum(exp(z - max(z)))``,
    in float64 (the sum too), stored in a's dtype."""
    rows, k = s.shape
    for r in prange(rows):
        top = np.float64(s[r, 0]) * scale
        for j in range(1, k):
            top = max(top, np.float64(s[r, j]) * scale)
        total = 0.0
        for j in range(k):
            e = exp_for(np.float64(s[r, j]) * scale - top, a)
            a[r, j] = e
            total += e
        inv_total = 1.0 / total
        for j in range(k):
            a[r, j] = np.float64(a[r, j]) * inv_total


@njit(parallel=True, cache=True, fastmath=_SUM)
def _softmax_backward(da, a, scale, ds):
    """Rows of ``a : (R, K)``: ``ds = scale * a * (da - sum(da * a))``, the sum in float64."""
    rows, k = a.shape
    for r in prange(rows):
        total = 0.0
        for j in range(k):
            total += np.float64(da[r, j]) * np.float64(a[r, j])
        shift = a.dtype.type(total)
        factor = a.dtype.type(scale)
        for j in range(k):
            ds[r, j] = factor * a[r, j] * (da[r, j] - shift)


def _contiguous(a):
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _rows(a):
    """``(..., D)`` -> ``(R, D)`` C-contiguous (a view unless ``a`` was strided)."""
    return _contiguous(a).reshape(-1, a.shape[-1])


def gelu_forward(x):
    x = _contiguous(x)
    y, cdf = np.empty_like(x), np.empty_like(x)
    if x.dtype == np.float32:  # the erfc fit (see above)
        _gelu_from_erfc(x.reshape(-1), y.reshape(-1), cdf.reshape(-1))
    else:
        _gelu_forward(x.reshape(-1), y.reshape(-1), cdf.reshape(-1))
    return y, cdf


def gelu_backward(dy, x, cdf):
    dy, x, cdf = _contiguous(dy), _contiguous(x), _contiguous(cdf)
    dx = np.empty_like(dy)
    _gelu_backward(dy.reshape(-1), x.reshape(-1), cdf.reshape(-1), dx.reshape(-1))
    return dx


def layernorm_forward(x, gamma, beta, eps: float):
    rows = _rows(x)
    y = np.empty_like(rows)
    mean, inv_std = np.empty(rows.shape[0]), np.empty(rows.shape[0])
    _layernorm_forward(rows, gamma.astype(np.float64), beta.astype(np.float64), float(eps), y, mean, inv_std)
    return y.reshape(x.shape), mean.reshape(x.shape[:-1]), inv_std.reshape(x.shape[:-1])


def layernorm_backward(dy, x, gamma, mean, inv_std):
    dy_rows, x_rows = _rows(dy), _rows(x)
    rows, d = x_rows.shape
    blocks = -(-rows // _ROWS_PER_BLOCK)
    dx = np.empty_like(dy_rows)
    dgamma_blocks, dbeta_blocks = np.empty((blocks, d)), np.empty((blocks, d))
    _layernorm_backward(dy_rows, x_rows, gamma.astype(np.float64),
                        np.ascontiguousarray(mean, dtype=np.float64).reshape(-1),
                        np.ascontiguousarray(inv_std, dtype=np.float64).reshape(-1),
                        dx, dgamma_blocks, dbeta_blocks)
    return dx.reshape(dy.shape), dgamma_blocks.sum(axis=0), dbeta_blocks.sum(axis=0)


def softmax_forward(s, scale: float = 1.0):
    rows = _rows(s)
    a = np.empty_like(rows)
    _softmax_forward(rows, float(scale), a)
    return a.reshape(s.shape)


def softmax_backward(da, a, scale: float = 1.0):
    da_rows, a_rows = _rows(da), _rows(a)
    ds = np.empty_like(a_rows)
    _softmax_backward(da_rows, a_rows, float(scale), ds)
    return ds.reshape(a.shape)
