"""The Numba CUDA kernels on a real GPU, on CuPy arrays, against the reference run by CuPy.

Realistic layer shapes (the hsicnn and resnet8 convolutions and pools at batch 64). Skipped,
with the reason, where CuPy or a CUDA device is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpidl.engine.backend import gpu_unavailable_reason

_REASON = gpu_unavailable_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

import cupy  # noqa: E402
from numba import cuda  # noqa: E402

if not cuda.is_available():
    pytest.skip("Numba cannot use the CUDA device here (numba.cuda.is_available() is False)", allow_module_level=True)


from mpidl import kernels  # noqa: E402
from mpidl.kernels import cuda as kcuda  # noqa: E402
from mpidl.kernels import reference, winograd_cuda, winograd_reference  # noqa: E402

pytestmark = pytest.mark.gpu

RTOL = {np.float32: 1e-6, np.float64: 1e-12}

# (x shape, k, stride, pad): the layers of hsicnn (156-band 9x9 patches) and resnet8 (3x32x32).
CONV_LAYERS = [
    pytest.param((64, 156, 9, 9), 3, 1, 1, id="hsicnn-conv1"),
    pytest.param((64, 64, 9, 9), 3, 1, 1, id="hsicnn-conv2"),
    pytest.param((64, 3, 32, 32), 3, 1, 1, id="resnet8-stem"),
    pytest.param((64, 16, 32, 32), 3, 2, 1, id="resnet8-down"),
    pytest.param((64, 16, 32, 32), 1, 2, 0, id="resnet8-shortcut"),
]
POOLS = [
    pytest.param((64, 64, 9, 9), 2, 2, 0, id="hsicnn-maxpool"),
    pytest.param((64, 32, 16, 16), 3, 2, 1, id="overlapping"),
    pytest.param((64, 64, 8, 8), 8, 8, 0, id="global"),
]


def _random(shape, dtype, seed=0):
    return cupy.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _assert_close(actual, expected, dtype):
    assert isinstance(actual, cupy.ndarray)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_allclose(cupy.asnumpy(actual), cupy.asnumpy(expected), rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, k, stride, pad", CONV_LAYERS)
def test_im2col_col2im(shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    cols = kcuda.im2col(x, k, k, stride, pad)
    assert isinstance(cols, cupy.ndarray)
    cupy.testing.assert_array_equal(cols, reference.im2col(x, k, k, stride, pad))
    dcols = _random(cols.shape, dtype, seed=1)
    _assert_close(kcuda.col2im(dcols, shape, k, k, stride, pad), reference.col2im(dcols, shape, k, k, stride, pad), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, k, stride, pad", CONV_LAYERS)
def test_conv2d(shape, k, stride, pad, dtype):
    x, weight, bias = _random(shape, dtype), _random((8, shape[1], k, k), dtype, seed=1), _random((8,), dtype, seed=2)
    y, cols = kcuda.conv2d_forward(x, weight, bias, stride, pad)
    expected_y, expected_cols = reference.conv2d_forward(x, weight, bias, stride, pad)
    _assert_scaled_close(y, expected_y, dtype)
    dy = _random(y.shape, dtype, seed=3)
    dw, dx = kcuda.conv2d_backward(dy, weight, cols, shape, stride, pad)
    expected_dw, expected_dx = reference.conv2d_backward(dy, weight, expected_cols, shape, stride, pad)
    _assert_scaled_close(dw, expected_dw, dtype)
    _assert_scaled_close(dx, expected_dx, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, k, stride, pad", POOLS)
def test_pooling(shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    y, argmax = kcuda.maxpool2d_forward(x, k, stride, pad)
    y_ref, argmax_ref = reference.maxpool2d_forward(x, k, stride, pad)
    cupy.testing.assert_array_equal(argmax, argmax_ref)
    cupy.testing.assert_array_equal(y, y_ref)
    dy = _random(y.shape, dtype, seed=2)
    _assert_close(
        kcuda.maxpool2d_backward(dy, argmax, shape, k, stride, pad),
        reference.maxpool2d_backward(dy, argmax_ref, shape, k, stride, pad),
        dtype,
    )
    _assert_close(kcuda.avgpool2d_forward(x, k, stride, pad), reference.avgpool2d_forward(x, k, stride, pad), dtype)
    _assert_close(
        kcuda.avgpool2d_backward(dy, shape, k, stride, pad), reference.avgpool2d_backward(dy, shape, k, stride, pad), dtype
    )


def test_out_workspaces_on_a_non_default_stream():
    """Kernels launch on CuPy's current stream, so work queued around them stays ordered."""
    shape, k = (64, 64, 9, 9), 3
    with cupy.cuda.Stream(non_blocking=True) as stream:
        cols_ws = cupy.full((64 * 9, 64 * 81), cupy.nan, dtype=cupy.float32)
        dx_ws = cupy.full(shape, cupy.nan, dtype=cupy.float32)
        for seed in range(2):
            x = _random(shape, np.float32, seed=seed) * 2  # a CuPy op on this stream right before
            cols = kcuda.im2col(x, k, k, 1, 1, out=cols_ws)
            dx = kcuda.col2im(cols, shape, k, k, 1, 1, out=dx_ws)
            assert cols is cols_ws and dx is dx_ws
            expected = reference.col2im(reference.im2col(x, k, k, 1, 1), shape, k, k, 1, 1)
            _assert_close(dx, expected, np.float32)
        stream.synchronize()


def test_dispatch_picks_the_cuda_kernels_for_cupy(mpidl_settings):
    mpidl_settings()  # no MPIDL_KERNELS: the array decides
    x = _random((2, 3, 5, 5), np.float32)
    assert kernels.implementation_for(x) is kcuda
    cupy.testing.assert_array_equal(kernels.im2col(x, 3, 3, 1, 1), reference.im2col(x, 3, 3, 1, 1))


# Winograd transforms at the hsicnn (9x9: m = 3) and resnet8 (32x32: m = 4) shapes.
WINOGRAD_LAYERS = [
    pytest.param((64, 156, 9, 9), 3, 1, id="hsicnn-conv1"),
    pytest.param((64, 64, 9, 9), 3, 1, id="hsicnn-conv2"),
    pytest.param((64, 16, 32, 32), 4, 1, id="resnet8-block"),
]


def _assert_scaled_close(actual, expected, dtype):
    assert isinstance(actual, cupy.ndarray)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = float(cupy.abs(expected).max())
    np.testing.assert_allclose(cupy.asnumpy(actual), cupy.asnumpy(expected), rtol=0, atol=RTOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, m, pad", WINOGRAD_LAYERS)
def test_winograd_transforms(shape, m, pad, dtype):
    n, c, h, w = shape
    x = _random(shape, dtype)
    v = winograd_cuda.winograd_input(x, m, 3, pad)
    _assert_scaled_close(v, winograd_reference.winograd_input(x, m, 3, pad), dtype)
    dv = _random(v.shape, dtype, seed=1)
    _assert_scaled_close(winograd_cuda.winograd_input_adjoint(dv, shape, m, 3, pad),
                         winograd_reference.winograd_input_adjoint(dv, shape, m, 3, pad), dtype)
    f, oh, ow = 32, h + 2 * pad - 2, w + 2 * pad - 2
    mt, bias = _random((f, *v.shape[1:]), dtype, seed=2), _random((f,), dtype, seed=3)
    _assert_scaled_close(winograd_cuda.winograd_output(mt, (n, f, oh, ow), m, 3, bias=bias),
                         winograd_reference.winograd_output(mt, (n, f, oh, ow), m, 3, bias=bias), dtype)
    dy = _random((n, f, oh, ow), dtype, seed=4)
    _assert_scaled_close(winograd_cuda.winograd_output_adjoint(dy, m, 3), winograd_reference.winograd_output_adjoint(dy, m, 3), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, m, pad", WINOGRAD_LAYERS)
def test_winograd_convolution(shape, m, pad, dtype):
    c, alpha, f = shape[1], m + 2, 32
    x, u, bias = _random(shape, dtype), _random((alpha * alpha, f, c), dtype, seed=1), _random((f,), dtype, seed=2)
    y, v = winograd_cuda.winograd_conv_forward(x, u, m, 3, pad, bias)
    expected_y, expected_v = winograd_reference.winograd_conv_forward(x, u, m, 3, pad, bias)
    _assert_scaled_close(y, expected_y, dtype)
    dy = _random(y.shape, dtype, seed=3)
    du, dx = winograd_cuda.winograd_conv_backward(dy, u, v, shape, m, 3, pad)
    expected_du, expected_dx = winograd_reference.winograd_conv_backward(dy, u, expected_v, shape, m, 3, pad)
    _assert_scaled_close(du, expected_du, dtype)
    _assert_scaled_close(dx, expected_dx, dtype)
