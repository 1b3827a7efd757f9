"""The NumPy reference kernels (kernels/reference.py) against their loop definitions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loop_reference import (
    avgpool_backward_loops,
    avgpool_loops,
    im2col_loops,
    maxpool_backward_loops,
    maxpool_loops,
)
from mpidl import kernels
from mpidl.kernels import reference as ref

# (N, C, H, W) x (kh, kw) x stride x pad, as a product; combinations whose output would be
# empty are dropped.
SHAPES = [(1, 1, 4, 4), (2, 3, 5, 6)]
KERNELS = [(1, 1), (3, 3), (2, 3)]
STRIDES = [1, 2]
PADS = [0, 1, 2]
IM2COL_CASES = [
    case
    for case in itertools.product(SHAPES, KERNELS, STRIDES, PADS)
    if (case[0][2] + 2 * case[3] - case[1][0]) >= 0 and (case[0][3] + 2 * case[3] - case[1][1]) >= 0
]
POOL_CASES = [(shape, k, s, p) for shape, k, s, p in itertools.product(SHAPES, [1, 2, 3], [1, 2, 3], [0, 1]) if p <= k // 2]


def distinct_values(shape, seed=0, dtype=np.float64):
    """Random values that are all different (no ties in max pooling), spaced >= 1e-3 apart."""
    rng = np.random.default_rng(seed)
    values = rng.permutation(int(np.prod(shape))) * 1e-2 + rng.uniform(0, 1e-3, size=int(np.prod(shape)))
    return (values - values.mean()).reshape(shape).astype(dtype)


@pytest.mark.parametrize("shape, kernel, stride, pad", IM2COL_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_im2col_matches_loops(shape, kernel, stride, pad, dtype):
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    cols = ref.im2col(x, *kernel, stride, pad)
    assert cols.dtype == dtype
    np.testing.assert_array_equal(cols, im2col_loops(x, *kernel, stride, pad))


@pytest.mark.parametrize("shape, kernel, stride, pad", IM2COL_CASES)
def test_col2im_is_the_adjoint_of_im2col(shape, kernel, stride, pad):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape)
    cols = rng.standard_normal(ref.im2col(x, *kernel, stride, pad).shape)
    lhs = np.vdot(ref.im2col(x, *kernel, stride, pad), cols)
    rhs = np.vdot(x, ref.col2im(cols, shape, *kernel, stride, pad))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


def test_im2col_and_col2im_fill_the_out_buffer():
    x = np.random.default_rng(3).standard_normal((2, 3, 5, 5)).astype(np.float32)
    out = np.full((27, 2 * 5 * 5), np.nan, dtype=np.float32)
    assert ref.im2col(x, 3, 3, 1, 1, out=out) is out
    np.testing.assert_array_equal(out, ref.im2col(x, 3, 3, 1, 1))

    dx_out = np.full(x.shape, np.nan, dtype=np.float32)
    assert ref.col2im(out, x.shape, 3, 3, 1, 1, out=dx_out) is dx_out
    np.testing.assert_array_equal(dx_out, ref.col2im(out, x.shape, 3, 3, 1, 1))


@pytest.mark.parametrize(
    "bad_out",
    [np.empty((27, 49), np.float32), np.empty((27, 50), np.float64), np.empty((50, 27), np.float32).T],
    ids=["shape", "dtype", "not-contiguous"],
)
def test_im2col_rejects_a_bad_out_buffer(bad_out):
    x = np.zeros((2, 3, 5, 5), np.float32)
    with kernels.use("reference"), pytest.raises(ValueError):
        kernels.im2col(x, 3, 3, 1, 1, out=bad_out)


def test_conv_output_size():
    assert ref.conv_output_size(9, 3, 1, 1) == 9
    assert ref.conv_output_size(9, 2, 2, 0) == 4  # floor: the last row is dropped
    assert ref.conv_output_size(32, 3, 2, 1) == 16
    assert ref.conv_output_size(1, 3, 1, 1) == 1
    with pytest.raises(ValueError, match="empty"):
        ref.conv_output_size(2, 3, 1, 0)
    for bad in [(5, 0, 1, 0), (5, 3, 0, 0), (5, 3, 1, -1)]:
        with pytest.raises(ValueError):
            ref.conv_output_size(*bad)


@pytest.mark.parametrize("shape, k, stride, pad", POOL_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maxpool_matches_loops(shape, k, stride, pad, dtype):
    if shape[2] + 2 * pad < k:
        pytest.skip("window larger than the padded input")
    x = distinct_values(shape, dtype=dtype)
    y, argmax = ref.maxpool2d_forward(x, k, stride, pad)
    y_loops, argmax_loops = maxpool_loops(x, k, stride, pad)
    assert y.dtype == dtype and argmax.dtype == np.int32
    np.testing.assert_array_equal(y, y_loops)
    np.testing.assert_array_equal(argmax, argmax_loops)

    dy = np.random.default_rng(4).standard_normal(y.shape).astype(dtype)
    dx = ref.maxpool2d_backward(dy, argmax, shape, k, stride, pad)
    assert dx.dtype == dtype
    np.testing.assert_allclose(dx, maxpool_backward_loops(dy, argmax, shape), rtol=1e-6, atol=1e-6)


def test_maxpool_ties_go_to_the_first_pixel_of_the_window():
    x = np.ones((1, 1, 4, 4))
    _, argmax = ref.maxpool2d_forward(x, 2, 2, 0)
    np.testing.assert_array_equal(argmax[0, 0], [[0, 2], [8, 10]])


def test_maxpool_window_of_minus_infinity_points_inside_the_input():
    x = np.full((1, 1, 3, 3), -np.inf)
    y, argmax = ref.maxpool2d_forward(x, 3, 1, 1)
    assert np.all(y == -np.inf)
    assert argmax.min() >= 0 and argmax.max() < 9


def test_maxpool_rejects_too_much_padding():
    with kernels.use("reference"), pytest.raises(ValueError, match="pad"):
        kernels.maxpool2d_forward(np.zeros((1, 1, 4, 4)), 2, 2, 2)


@pytest.mark.parametrize("shape, k, stride, pad", POOL_CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_avgpool_matches_loops(shape, k, stride, pad, dtype):
    if shape[2] + 2 * pad < k:
        pytest.skip("window larger than the padded input")
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(dtype)
    y = ref.avgpool2d_forward(x, k, stride, pad)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, avgpool_loops(x, k, stride, pad), rtol=1e-5, atol=1e-6)

    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = ref.avgpool2d_backward(dy, shape, k, stride, pad)
    assert dx.dtype == dtype
    np.testing.assert_allclose(dx, avgpool_backward_loops(dy, shape, k, stride, pad), rtol=1e-5, atol=1e-6)
    # backward is the adjoint of forward (forward is linear)
    assert np.vdot(y, dy) == pytest.approx(np.vdot(x, dx), rel=1e-4, abs=1e-4)


def test_avgpool_counts_the_padding():
    y = ref.avgpool2d_forward(np.ones((1, 1, 2, 2)), 2, 2, 1)
    np.testing.assert_allclose(y[0, 0], [[0.25, 0.25], [0.25, 0.25]])
