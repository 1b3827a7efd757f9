"""The Numba CPU kernels (mpidl.kernels.cpu) against the NumPy reference (mpidl.kernels.reference).

Every kernel is compared on a product of shapes (square and not, N = 1 and more), kernel
sizes, strides, paddings and both float dtypes. im2col copies values and argmax is an index,
so both must match exactly; the float sums must agree to rtol 1e-6 (float32) / 1e-12
(float64). (The kernels add in the reference's order, so in practice they agree to the bit.)
The whole convolution sums its products in BLAS's order and its weight gradient over blocks of
samples, so it is compared relative to each array's scale, with one block and with one block
per sample.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpidl import kernels
from mpidl.kernels import cpu, elementwise_cpu, elementwise_reference, reference

RTOL = {np.float32: 1e-6, np.float64: 1e-12}
DTYPES = (np.float32, np.float64)

# (N, C, H, W): square and non-square planes, one sample and several.
SHAPES = ((1, 1, 5, 5), (2, 3, 7, 5), (3, 2, 6, 9), (2, 4, 9, 9))
# (k, stride, pad)
GEOMETRIES = ((1, 1, 0), (2, 2, 0), (2, 2, 1), (3, 1, 0), (3, 1, 1), (3, 2, 1), (3, 3, 0), (5, 2, 2), (4, 3, 1))


def _cases(max_pool: bool = False):
    """All (shape, k, stride, pad, dtype) whose output is non-empty; max pooling also needs
    ``pad <= k // 2``."""
    cases = []
    for shape, (k, stride, pad), dtype in itertools.product(SHAPES, GEOMETRIES, DTYPES):
        _, _, h, w = shape
        if h + 2 * pad < k or w + 2 * pad < k:
            continue
        if max_pool and pad > k // 2:
            continue
        cases.append(pytest.param(shape, k, stride, pad, dtype, id=f"{shape}-k{k}s{stride}p{pad}-{np.dtype(dtype).name}"))
    return cases


def _random(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=RTOL[dtype], atol=0)


# --------------------------------------------------------------------------------------------
# im2col / col2im
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases())
def test_im2col_matches_reference(shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    np.testing.assert_array_equal(cpu.im2col(x, k, k, stride, pad), reference.im2col(x, k, k, stride, pad))


@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases())
def test_col2im_matches_reference(shape, k, stride, pad, dtype):
    n, c, h, w = shape
    oh, ow = cpu.conv_output_size(h, k, stride, pad), cpu.conv_output_size(w, k, stride, pad)
    cols = _random((c * k * k, n * oh * ow), dtype, seed=1)
    _assert_close(cpu.col2im(cols, shape, k, k, stride, pad), reference.col2im(cols, shape, k, k, stride, pad), dtype)


@pytest.mark.parametrize("kh, kw, stride, pad", [(3, 1, 1, 1), (1, 3, 2, 0), (2, 5, 1, 2)])
def test_rectangular_kernels(kh, kw, stride, pad):
    x = _random((2, 3, 8, 7), np.float64)
    cols = cpu.im2col(x, kh, kw, stride, pad)
    np.testing.assert_array_equal(cols, reference.im2col(x, kh, kw, stride, pad))
    dcols = _random(cols.shape, np.float64, seed=2)
    _assert_close(cpu.col2im(dcols, x.shape, kh, kw, stride, pad), reference.col2im(dcols, x.shape, kh, kw, stride, pad), np.float64)


def test_col2im_is_the_adjoint_of_im2col():
    """<im2col(x), cols> == <x, col2im(cols)> (what makes dx of the convolution right)."""
    x = _random((2, 3, 7, 6), np.float64)
    cols = _random((3 * 3 * 3, 2 * 4 * 3), np.float64, seed=3)
    lhs = np.vdot(cpu.im2col(x, 3, 3, 2, 1), cols)
    rhs = np.vdot(x, cpu.col2im(cols, x.shape, 3, 3, 2, 1))
    assert lhs == pytest.approx(rhs, rel=1e-12)


def test_out_workspace_is_filled_and_reused():
    """A layer passes the same workspace every step: it must be returned, fully overwritten
    (col2im included: it must not add onto what the buffer held before)."""
    shape, k, stride, pad = (2, 3, 6, 5), 3, 1, 1
    cols_ws = np.full((3 * 9, 2 * 6 * 5), np.nan, dtype=np.float32)
    dx_ws = np.full(shape, np.nan, dtype=np.float32)
    for seed in range(2):
        x = _random(shape, np.float32, seed=seed)
        cols = cpu.im2col(x, k, k, stride, pad, out=cols_ws)
        assert cols is cols_ws
        np.testing.assert_array_equal(cols, reference.im2col(x, k, k, stride, pad))
        dx = cpu.col2im(cols, shape, k, k, stride, pad, out=dx_ws)
        assert dx is dx_ws
        _assert_close(dx, reference.col2im(cols, shape, k, k, stride, pad), np.float32)


@pytest.mark.parametrize(
    "make_out",
    [
        lambda: np.empty((27, 61), np.float32),  # wrong shape
        lambda: np.empty((27, 60), np.float64),  # wrong dtype
        lambda: np.empty((60, 27), np.float32).T,  # right shape, not C-contiguous
        lambda: [[0.0] * 60] * 27,  # not an array
    ],
)
def test_bad_out_is_refused(make_out):
    x = _random((2, 3, 6, 5), np.float32)
    with kernels.use("cpu"), pytest.raises(ValueError):
        kernels.im2col(x, 3, 3, 1, 1, out=make_out())


def test_non_contiguous_input():
    x = _random((5, 6, 3, 2), np.float32).transpose(3, 2, 1, 0)  # (2, 3, 6, 5), a strided view
    assert not x.flags.c_contiguous
    np.testing.assert_array_equal(cpu.im2col(x, 3, 3, 1, 1), reference.im2col(x, 3, 3, 1, 1))
    y, argmax = cpu.maxpool2d_forward(x, 2, 2, 0)
    y_ref, argmax_ref = reference.maxpool2d_forward(x, 2, 2, 0)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(argmax, argmax_ref)


@pytest.fixture
def cpu_kernels():
    """The Numba CPU kernels for the whole test (the dispatch's argument checks, then cpu's)."""
    with kernels.use("cpu"):
        yield


def test_geometry_errors(cpu_kernels):
    x = _random((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError):
        kernels.im2col(x, 7, 7, 1, 1)  # window larger than the padded input
    with pytest.raises(ValueError):
        kernels.im2col(x[0], 3, 3, 1, 1)  # not 4-D
    with pytest.raises(ValueError):
        kernels.col2im(np.zeros((18, 5), np.float32), x.shape, 3, 3, 1, 1)  # cols does not fit x_shape
    with pytest.raises(ValueError):
        kernels.maxpool2d_forward(x, 2, 2, 2)  # pad > k // 2
    with pytest.raises(ValueError):
        kernels.avgpool2d_forward(x, 2, 0, 0)  # stride 0


# --------------------------------------------------------------------------------------------
# pooling
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# the whole im2col convolution
# --------------------------------------------------------------------------------------------


def _assert_scaled_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = float(np.abs(expected).max()) or 1.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=RTOL[dtype] * scale)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases())
def test_conv2d_matches_reference(shape, k, stride, pad, dtype, threads, monkeypatch):
    # threads: one block of samples, or as many blocks as the samples allow (up to 2)
    monkeypatch.setattr(cpu.numba, "get_num_threads", lambda: threads)
    n, c = shape[:2]
    x, weight, bias = _random(shape, dtype), _random((3, c, k, k), dtype, seed=1), _random(3, dtype, seed=2)
    for b in (None, bias):
        y, state = cpu.conv2d_forward(x, weight, b, stride, pad)
        expected_y, cols = reference.conv2d_forward(x, weight, b, stride, pad)
        _assert_scaled_close(y, expected_y, dtype)
    dy = _random(y.shape, dtype, seed=3)
    dw, dx = cpu.conv2d_backward(dy, weight, state, shape, stride, pad)
    expected_dw, expected_dx = reference.conv2d_backward(dy, weight, cols, shape, stride, pad)
    _assert_scaled_close(dw, expected_dw, dtype)
    _assert_scaled_close(dx, expected_dx, dtype)
    dw_only, no_dx = cpu.conv2d_backward(dy, weight, state, shape, stride, pad, input_grad=False)
    assert no_dx is None
    np.testing.assert_array_equal(dw_only, dw)


def test_reference_conv2d_is_a_convolution_and_its_backward_the_adjoint():
    x, weight, bias = _random((2, 3, 7, 6), np.float64), _random((4, 3, 3, 3), np.float64, seed=1), _random(4, np.float64, seed=2)
    y, cols = reference.conv2d_forward(x, weight, bias, 2, 1)
    x_padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    direct = np.empty_like(y)
    for oh, ow in itertools.product(range(y.shape[2]), range(y.shape[3])):
        window = x_padded[:, :, 2 * oh : 2 * oh + 3, 2 * ow : 2 * ow + 3]
        direct[:, :, oh, ow] = np.einsum("ncij,fcij->nf", window, weight) + bias
    np.testing.assert_allclose(y, direct, rtol=1e-12)
    dy = _random(y.shape, np.float64, seed=3)
    dw, dx = reference.conv2d_backward(dy, weight, cols, x.shape, 2, 1)
    # y - bias is bilinear in (x, weight): <y - b, dy> = <x, dx> = <weight, dw>
    inner = np.vdot(y - bias.reshape(1, 4, 1, 1), dy)
    assert inner == pytest.approx(np.vdot(x, dx), rel=1e-12)
    assert inner == pytest.approx(np.vdot(weight, dw), rel=1e-12)


def test_conv2d_is_dispatched_and_backward_follows_forward(mpidl_settings):
    x, weight = _random((2, 3, 7, 7), np.float32), _random((4, 3, 3, 3), np.float32, seed=1)
    mpidl_settings()  # no MPIDL_KERNELS: the array decides
    y, saved = kernels.conv2d_forward(x, weight, None, 1, 1)
    assert saved[0] is cpu
    dy = _random(y.shape, np.float32, seed=2)
    with kernels.use("reference"):
        dw, dx = kernels.conv2d_backward(dy, weight, saved, 1, 1)  # still the CPU kernels: they kept x
        assert kernels.conv2d_forward(x, weight, None, 1, 1)[1][0] is reference
    expected_dw, expected_dx = reference.conv2d_backward(dy, weight, reference.im2col(x, 3, 3, 1, 1), x.shape, 1, 1)
    _assert_scaled_close(dw, expected_dw, np.float32)
    _assert_scaled_close(dx, expected_dx, np.float32)


def test_conv2d_dispatch_refuses_bad_arguments():
    x, weight = _random((2, 3, 7, 7), np.float32), _random((4, 3, 3, 3), np.float32, seed=1)
    with pytest.raises(ValueError, match=r"weight has shape \(4, 2, 3, 3\), expected \(F, 3, kh, kw\)"):
        kernels.conv2d_forward(x, weight[:, :2], None, 1, 1)
    with pytest.raises(ValueError, match="weight must be a numpy array of dtype float32"):
        kernels.conv2d_forward(x, weight.astype(np.float64), None, 1, 1)
    with pytest.raises(ValueError, match="bias has shape"):
        kernels.conv2d_forward(x, weight, np.zeros(3, np.float32), 1, 1)
    with pytest.raises(ValueError):
        kernels.conv2d_forward(x, _random((4, 3, 9, 9), np.float32), None, 1, 0)  # empty output
    y, saved = kernels.conv2d_forward(x, weight, None, 1, 1)
    with pytest.raises(ValueError, match="dy has shape"):
        kernels.conv2d_backward(y[:, :3], weight, saved, 1, 1)


def test_conv2d_hands_other_dtypes_to_the_reference():
    x, weight = _random((1, 2, 5, 5), np.float16), _random((3, 2, 3, 3), np.float16, seed=1)
    y, cols = cpu.conv2d_forward(x, weight, None, 1, 1)
    expected_y, expected_cols = reference.conv2d_forward(x, weight, None, 1, 1)
    np.testing.assert_array_equal(y, expected_y)
    dy = _random(y.shape, np.float16, seed=2)
    for actual, expected in zip(cpu.conv2d_backward(dy, weight, cols, x.shape, 1, 1),
                                reference.conv2d_backward(dy, weight, expected_cols, x.shape, 1, 1)):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases(max_pool=True))
def test_maxpool_matches_reference(shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    y, argmax = cpu.maxpool2d_forward(x, k, stride, pad)
    y_ref, argmax_ref = reference.maxpool2d_forward(x, k, stride, pad)
    assert argmax.dtype == np.int32
    np.testing.assert_array_equal(argmax, argmax_ref)
    np.testing.assert_array_equal(y, y_ref)

    dy = _random(y.shape, dtype, seed=4)
    _assert_close(
        cpu.maxpool2d_backward(dy, argmax, shape, k, stride, pad),
        reference.maxpool2d_backward(dy, argmax_ref, shape, k, stride, pad),
        dtype,
    )


@pytest.mark.parametrize("fill", ["ties", "-inf", "constant"])
def test_maxpool_ties_go_to_the_first_maximum(fill):
    """Many equal values (ReLU outputs are full of zeros): the winner must be the first in
    row-major window order, exactly as in the reference, or gradients land elsewhere."""
    rng = np.random.default_rng(5)
    if fill == "ties":
        x = rng.integers(0, 3, size=(2, 3, 7, 8)).astype(np.float32)
    elif fill == "-inf":
        x = np.where(rng.random((2, 3, 7, 8)) < 0.7, -np.inf, 1.0).astype(np.float32)
    else:
        x = np.zeros((2, 3, 7, 8), np.float32)
    for k, stride, pad in ((2, 2, 0), (3, 1, 1), (3, 2, 1)):
        y, argmax = cpu.maxpool2d_forward(x, k, stride, pad)
        y_ref, argmax_ref = reference.maxpool2d_forward(x, k, stride, pad)
        np.testing.assert_array_equal(argmax, argmax_ref)
        np.testing.assert_array_equal(y, y_ref)


def test_maxpool_backward_checks_its_inputs(cpu_kernels):
    x = _random((1, 2, 4, 4), np.float32)
    y, argmax = kernels.maxpool2d_forward(x, 2, 2, 0)
    with pytest.raises(ValueError):
        kernels.maxpool2d_backward(y[:, :1], argmax, x.shape, 2, 2, 0)  # dy of the wrong shape
    with pytest.raises(ValueError, match="outside"):
        kernels.maxpool2d_backward(y, argmax + 16, x.shape, 2, 2, 0)  # indices outside the plane (cpu's own check)
    with pytest.raises(ValueError):
        kernels.maxpool2d_backward(y, argmax.astype(np.float32), x.shape, 2, 2, 0)  # not integers


@pytest.mark.parametrize("shape, k, stride, pad, dtype", _cases())
def test_avgpool_matches_reference(shape, k, stride, pad, dtype):
    x = _random(shape, dtype)
    y = cpu.avgpool2d_forward(x, k, stride, pad)
    _assert_close(y, reference.avgpool2d_forward(x, k, stride, pad), dtype)
    dy = _random(y.shape, dtype, seed=6)
    _assert_close(
        cpu.avgpool2d_backward(dy, shape, k, stride, pad), reference.avgpool2d_backward(dy, shape, k, stride, pad), dtype
    )


def test_avgpool_backward_checks_dy_shape(cpu_kernels):
    with pytest.raises(ValueError):
        kernels.avgpool2d_backward(np.zeros((1, 2, 3, 3), np.float32), (1, 2, 4, 4), 2, 2, 0)


# --------------------------------------------------------------------------------------------
# dtypes and dispatch
# --------------------------------------------------------------------------------------------


def test_other_dtypes_are_handed_to_the_reference():
    """Only float32/float64 are compiled; anything else gets the reference's result."""
    x = np.random.default_rng(7).integers(-5, 5, size=(2, 2, 5, 5)).astype(np.int64)
    np.testing.assert_array_equal(cpu.im2col(x, 3, 3, 1, 1), reference.im2col(x, 3, 3, 1, 1))
    x16 = x.astype(np.float16)
    y, argmax = cpu.maxpool2d_forward(x16, 2, 2, 0)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(argmax, reference.maxpool2d_forward(x16, 2, 2, 0)[1])


def test_dispatch_picks_the_cpu_kernels_for_numpy(mpidl_settings):
    x = _random((1, 1, 4, 4), np.float32)
    mpidl_settings()
    assert kernels.implementation_for(x) is cpu
    with kernels.use("reference"):
        assert kernels.implementation_for(x) is reference
        with kernels.use("cpu"):
            assert kernels.implementation_for(x) is cpu
            np.testing.assert_array_equal(kernels.im2col(x, 3, 3, 1, 1), reference.im2col(x, 3, 3, 1, 1))
        assert kernels.implementation_for(x) is reference  # the outer block's again
    assert kernels.implementation_for(x) is cpu


def test_the_environment_variable_forces_a_family_and_use_wins(mpidl_settings):
    """``MPIDL_KERNELS`` (read once, into mpidl.settings.SETTINGS) forces a family for the
    whole run; ``kernels.use`` wins over it, ``"auto"`` included; a malformed value and a
    family that cannot take the array are refused, naming where the choice came from."""
    x = _random((1, 1, 4, 4), np.float32)
    mpidl_settings(MPIDL_KERNELS="reference")
    assert kernels.implementation_for(x) is reference
    with kernels.use("auto"):
        assert kernels.implementation_for(x) is cpu
    with kernels.use("cpu"):
        assert kernels.implementation_for(x) is cpu
    mpidl_settings(MPIDL_KERNELS="cuda")
    with pytest.raises(ValueError, match="MPIDL_KERNELS=cuda needs device arrays"):
        kernels.implementation_for(x)
    mpidl_settings(MPIDL_KERNELS="fast")
    with pytest.raises(ValueError, match="MPIDL_KERNELS must be one of reference, cpu, cuda, got 'fast'"):
        kernels.im2col(x, 3, 3, 1, 1)
    mpidl_settings()
    with kernels.use("cuda"), pytest.raises(ValueError, match=r"kernels.use\('cuda'\) needs device arrays"):
        kernels.im2col(x, 3, 3, 1, 1)
    with pytest.raises(ValueError, match="family must be one of"):
        with kernels.use("numba"):
            pass


# One bad call of each kind the dispatcher refuses, on x : (1, 2, 4, 4) float32.
_X = np.zeros((1, 2, 4, 4), np.float32)
_Y = np.zeros((1, 2, 2, 2), np.float32)
_ARGMAX = np.zeros((1, 2, 2, 2), np.int32)
BAD_CALLS = {
    "not-4d": lambda: kernels.im2col(_X[0], 3, 3, 1, 1),
    "window-larger-than-input": lambda: kernels.im2col(_X, 7, 7, 1, 1),
    "stride-0": lambda: kernels.avgpool2d_forward(_X, 2, 0, 0),
    "out-shape": lambda: kernels.im2col(_X, 3, 3, 1, 1, out=np.empty((18, 15), np.float32)),
    "out-dtype": lambda: kernels.im2col(_X, 3, 3, 1, 1, out=np.empty((18, 16), np.float64)),
    "out-not-contiguous": lambda: kernels.im2col(_X, 3, 3, 1, 1, out=np.empty((16, 18), np.float32).T),
    "out-not-an-array": lambda: kernels.im2col(_X, 3, 3, 1, 1, out=[[0.0] * 16] * 18),
    "cols-do-not-fit": lambda: kernels.col2im(np.zeros((18, 5), np.float32), _X.shape, 3, 3, 1, 1),
    "maxpool-pad": lambda: kernels.maxpool2d_forward(_X, 2, 2, 2),
    "maxpool-dy-shape": lambda: kernels.maxpool2d_backward(_Y[:, :1], _ARGMAX, _X.shape, 2, 2, 0),
    "argmax-not-integers": lambda: kernels.maxpool2d_backward(_Y, _ARGMAX.astype(np.float32), _X.shape, 2, 2, 0),
    "avgpool-dy-shape": lambda: kernels.avgpool2d_backward(np.zeros((1, 2, 3, 3), np.float32), _X.shape, 2, 2, 0),
    "winograd-m-0": lambda: kernels.winograd_input(_X, 0, 3, 1),
    "winograd-out-shape": lambda: kernels.winograd_input(_X, 2, 3, 1, out=np.empty((2, 4, 4, 3), np.float32)),
    "winograd-M-for-another-m": lambda: kernels.winograd_output(np.zeros((2, 5, 5, 4), np.float32), (1, 2, 4, 4), 2, 3),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_a_bad_call_is_refused_with_one_message_by_every_backend(call):
    """The dispatcher checks the arguments once, before choosing an implementation: the
    reference and the Numba kernels refuse the same call with the same message."""
    messages = {}
    for backend in ("reference", "cpu"):
        with kernels.use(backend), pytest.raises(ValueError) as refused:
            call()
        messages[backend] = str(refused.value)
    assert messages["reference"] == messages["cpu"]


# ---------------------------------------------------------------------------- all_finite (elementwise_cpu)


@pytest.mark.parametrize("dtype", (np.float16, np.float32, np.float64))
@pytest.mark.parametrize("bad", (None, np.nan, np.inf, -np.inf))
@pytest.mark.parametrize("where", (0, 4099, -1))
def test_all_finite_finds_one_nonfinite_element_anywhere(dtype, bad, where):
    # float16 goes to the reference; the large finite values must not overflow a sum.
    x = np.full(10_000, np.finfo(dtype).max, dtype)
    x[1::2] = -1.5
    if bad is not None:
        x[where] = bad
    expected = bad is None
    assert elementwise_cpu.all_finite(x) is expected
    assert elementwise_reference.all_finite(x) is expected
    assert kernels.all_finite(x) is expected


def test_all_finite_takes_any_shape_and_layout():
    x = np.ones((4, 5, 6), np.float32)
    assert kernels.all_finite(x) and kernels.all_finite(x[:, ::2]) and kernels.all_finite(x[:0])
    x[3, 1, 4] = np.nan
    assert not kernels.all_finite(x)
    assert not kernels.all_finite(x[:, 1:2].transpose(2, 0, 1))  # non-contiguous: the reference
    assert kernels.all_finite(x[:3])
