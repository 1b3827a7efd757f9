"""The Numba CUDA kernels (mpidl.kernels.cuda) against the reference, under the CUDA simulator.

Run as ``NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cudasim`` (the simulator is chosen when
Numba is first imported, so it needs its own process). The simulator runs every GPU thread
as Python, so the shapes here are small. On a machine with a real GPU and without the
simulator the same tests run on the device with Numba device arrays; with neither, the module
is skipped.

Every kernel adds in the reference's order, so results agree to the bit; the float sums are
still compared with rtol 1e-6 (float32) / 1e-12 (float64), and im2col and argmax exactly.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

SIMULATING = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"

from numba import cuda  # noqa: E402 - after reading the environment, which numba reads too

if not SIMULATING and not cuda.is_available():
    pytest.skip(
        "needs the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1) or a CUDA GPU; neither is here",
        allow_module_level=True,
    )

from mpidl import kernels  # noqa: E402
from mpidl.kernels import cuda as kcuda  # noqa: E402
from mpidl.kernels import reference, winograd_cuda, winograd_reference  # noqa: E402

RTOL = {np.float32: 1e-6, np.float64: 1e-12}
DTYPES = (np.float32, np.float64)
# (N, C, H, W) and (k, stride, pad): small, square and not, padded and not.
SHAPES = ((1, 2, 5, 5), (2, 1, 6, 7))
GEOMETRIES = ((1, 1, 0), (2, 2, 0), (3, 1, 1), (3, 2, 1), (2, 2, 1))

# How an input reaches the kernels: a Numba device array (as on a real GPU), and under the
# simulator also a plain NumPy array.
TRANSFERS = ["device"] + (["numpy"] if SIMULATING else [])


def _cases(max_pool=False):
    cases = []
    for shape, (k, stride, pad), dtype in itertools.product(SHAPES, GEOMETRIES, DTYPES):
        if max_pool and pad > k // 2:
            continue
        cases.append(pytest.param(shape, k, stride, pad, dtype, id=f"{shape}-k{k}s{stride}p{pad}-{np.dtype(dtype).name}"))
    return cases


def _random(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _to(transfer, a):
    return cuda.to_device(a) if transfer == "device" else a


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _assert_close(actual, expected, dtype):
    actual = _host(actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases())
def test_im2col_col2im(transfer, shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    cols = kcuda.im2col(_to(transfer, x), k, k, stride, pad)
    np.testing.assert_array_equal(_host(cols), reference.im2col(x, k, k, stride, pad))

    dcols = _random(cols.shape, dtype, seed=1)
    _assert_close(
        kcuda.col2im(_to(transfer, dcols), shape, k, k, stride, pad),
        reference.col2im(dcols, shape, k, k, stride, pad),
        dtype,
    )


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases(max_pool=True))
def test_maxpool(transfer, shape, k, stride, pad, dtype):
    # Integer-valued floats: many ties, which must go to the same (first) winner.
    x = np.random.default_rng(2).integers(0, 4, size=shape).astype(dtype)
    y, argmax = kcuda.maxpool2d_forward(_to(transfer, x), k, stride, pad)
    y_ref, argmax_ref = reference.maxpool2d_forward(x, k, stride, pad)
    assert _host(argmax).dtype == np.int32
    np.testing.assert_array_equal(_host(argmax), argmax_ref)
    np.testing.assert_array_equal(_host(y), y_ref)

    dy = _random(y_ref.shape, dtype, seed=3)
    _assert_close(
        kcuda.maxpool2d_backward(_to(transfer, dy), argmax, shape, k, stride, pad),
        reference.maxpool2d_backward(dy, argmax_ref, shape, k, stride, pad),
        dtype,
    )


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases())
def test_avgpool(transfer, shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    y = kcuda.avgpool2d_forward(_to(transfer, x), k, stride, pad)
    _assert_close(y, reference.avgpool2d_forward(x, k, stride, pad), dtype)
    dy = _random(y.shape, dtype, seed=4)
    _assert_close(
        kcuda.avgpool2d_backward(_to(transfer, dy), shape, k, stride, pad),
        reference.avgpool2d_backward(dy, shape, k, stride, pad),
        dtype,
    )


def test_out_workspaces_are_filled_and_reused():
    shape, k, stride, pad = (1, 2, 5, 4), 3, 1, 1
    cols_ws = cuda.to_device(np.full((2 * 9, 5 * 4), np.nan, np.float32))
    dx_ws = cuda.to_device(np.full(shape, np.nan, np.float32))
    for seed in range(2):
        x = _random(shape, np.float32, seed=seed)
        cols = kcuda.im2col(cuda.to_device(x), k, k, stride, pad, out=cols_ws)
        assert cols is cols_ws
        expected_cols = reference.im2col(x, k, k, stride, pad)
        np.testing.assert_array_equal(_host(cols), expected_cols)
        dx = kcuda.col2im(cols, shape, k, k, stride, pad, out=dx_ws)
        assert dx is dx_ws
        _assert_close(dx, reference.col2im(expected_cols, shape, k, k, stride, pad), np.float32)


def test_bad_arguments_are_refused(mpidl_settings):
    """Through the dispatcher, which sends Numba device arrays to these kernels: it checks the
    arguments; the dtype is the CUDA kernels' own check."""
    mpidl_settings()  # no MPIDL_KERNELS: the array decides
    x = cuda.to_device(_random((1, 2, 4, 4), np.float32))
    assert kernels.implementation_for(x) is kcuda
    with pytest.raises(ValueError, match="out has shape"):
        kernels.im2col(x, 3, 3, 1, 1, out=cuda.to_device(np.empty((18, 15), np.float32)))  # wrong shape
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.im2col(x, 3, 3, 1, 1, out=cuda.to_device(np.empty((16, 18), np.float32)).T)  # strided
    with pytest.raises(ValueError):
        kernels.maxpool2d_forward(x, 2, 2, 2)  # pad > k // 2
    with pytest.raises(ValueError):
        kernels.avgpool2d_forward(x, 5, 1, 0)  # empty output
    with pytest.raises(ValueError, match="float32 or float64"):
        kernels.im2col(cuda.to_device(np.zeros((1, 1, 4, 4), np.int32)), 3, 3, 1, 1)  # not a float dtype


def test_launch_geometry():
    assert kcuda.THREADS_PER_BLOCK == 256
    assert kcuda.blocks_for(1) == 1
    assert kcuda.blocks_for(256) == 1
    assert kcuda.blocks_for(257) == 2
    assert kcuda.blocks_for(0) == 1  # an empty grid is not a valid launch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, k, stride, pad", [((2, 3, 7, 7), 3, 1, 1), ((1, 2, 8, 6), 3, 2, 1), ((2, 4, 5, 5), 1, 2, 0)])
def test_conv2d_composes_im2col_and_col2im(shape, k, stride, pad, dtype):
    # Host arrays: the products go through NumPy here (CuPy's on a real device).
    x, weight, bias = _random(shape, dtype), _random((3, shape[1], k, k), dtype, seed=1), _random(3, dtype, seed=2)
    y, cols = kcuda.conv2d_forward(x, weight, bias, stride, pad)
    expected_y, expected_cols = reference.conv2d_forward(x, weight, bias, stride, pad)
    _assert_scaled_close(y, expected_y, dtype)
    dy = _random(expected_y.shape, dtype, seed=3)
    dw, dx = kcuda.conv2d_backward(dy, weight, cols, shape, stride, pad)
    expected_dw, expected_dx = reference.conv2d_backward(dy, weight, expected_cols, shape, stride, pad)
    _assert_scaled_close(dw, expected_dw, dtype)
    _assert_scaled_close(dx, expected_dx, dtype)


# Winograd F(m x m, r x r): (N, C, H, W), m, r, pad -- an exact tiling, tiles sticking out, 2x2 filters.
WINOGRAD_CASES = [((2, 2, 5, 5), 3, 3, 1), ((1, 2, 6, 5), 2, 3, 0), ((2, 1, 6, 6), 4, 3, 1), ((1, 1, 5, 4), 3, 2, 1)]


def _assert_scaled_close(actual, expected, dtype):
    # Each thread sums in its own order (in float64), so compare relative to the array's scale.
    actual = _host(actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=RTOL[dtype] * float(np.abs(expected).max()))


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, m, r, pad", WINOGRAD_CASES)
def test_winograd_transforms(transfer, shape, m, r, pad, dtype):
    n, _, h, w = shape
    x = _random(shape, dtype)
    v = winograd_cuda.winograd_input(_to(transfer, x), m, r, pad)
    expected_v = winograd_reference.winograd_input(x, m, r, pad)
    _assert_scaled_close(v, expected_v, dtype)

    dv = _random(expected_v.shape, dtype, seed=1)
    _assert_scaled_close(winograd_cuda.winograd_input_adjoint(_to(transfer, dv), shape, m, r, pad),
                         winograd_reference.winograd_input_adjoint(dv, shape, m, r, pad), dtype)

    f, oh, ow = 2, h + 2 * pad - r + 1, w + 2 * pad - r + 1
    mt, bias = _random((f, *expected_v.shape[1:]), dtype, seed=2), _random(f, dtype, seed=3)
    _assert_scaled_close(winograd_cuda.winograd_output(_to(transfer, mt), (n, f, oh, ow), m, r, bias=_to(transfer, bias)),
                         winograd_reference.winograd_output(mt, (n, f, oh, ow), m, r, bias=bias), dtype)
    dy = _random((n, f, oh, ow), dtype, seed=4)
    _assert_scaled_close(winograd_cuda.winograd_output_adjoint(_to(transfer, dy), m, r),
                         winograd_reference.winograd_output_adjoint(dy, m, r), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, m, r, pad", WINOGRAD_CASES)
def test_winograd_convolution_composes_the_transforms(shape, m, r, pad, dtype):
    # Host arrays: the products go through NumPy here (CuPy's on a real device).
    c, alpha, f = shape[1], m + r - 1, 2
    x, u, bias = _random(shape, dtype), _random((alpha * alpha, f, c), dtype, seed=1), _random(f, dtype, seed=2)
    y, v = winograd_cuda.winograd_conv_forward(x, u, m, r, pad, bias)
    expected_y, expected_v = winograd_reference.winograd_conv_forward(x, u, m, r, pad, bias)
    _assert_scaled_close(y, expected_y, dtype)
    dy = _random(expected_y.shape, dtype, seed=3)
    du, dx = winograd_cuda.winograd_conv_backward(dy, u, v, shape, m, r, pad)
    expected_du, expected_dx = winograd_reference.winograd_conv_backward(dy, u, expected_v, shape, m, r, pad)
    _assert_scaled_close(du, expected_du, dtype)
    _assert_scaled_close(dx, expected_dx, dtype)


def test_winograd_refuses_bad_arguments(mpidl_settings):
    mpidl_settings()  # no MPIDL_KERNELS: the array decides
    x = cuda.to_device(_random((1, 2, 5, 5), np.float32))
    with pytest.raises(ValueError, match="m \\+ r - 1 <= 8"):
        kernels.winograd_input(x, 7, 3, 1)  # alpha = 9 > the kernels' local arrays (their own check)
    with pytest.raises(ValueError, match="expected"):
        kernels.winograd_output(cuda.to_device(np.zeros((2, 5, 5, 3), np.float32)), (1, 2, 5, 5), 3, 3)
