"""Every layer: float64 gradient checks (tests/gradcheck.py) and nested-loop references.

The kernels run through the ``mpidl.kernels`` dispatch (Numba CPU kernels when available;
``with kernels.use("reference")`` forces the NumPy reference).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gradcheck import bind_parameters, check_backward, check_loss_backward
from loop_reference import (
    avgpool_loops,
    conv2d_backward_loops,
    conv2d_loops,
    linear_loops,
    maxpool_loops,
    softmax_cross_entropy_loops,
)
from mpidl import kernels
from mpidl.engine.backend import get_backend
from mpidl.engine.nn import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    LeakyReLU,
    Linear,
    MaxPool2d,
    ReLU,
    Residual,
    Sequential,
    SoftmaxCrossEntropy,
)


def normal(shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def away_from_zero(shape, seed=0):
    """Normal values pushed at least 0.1 away from 0, the kink of ReLU-like functions."""
    x = normal(shape, seed)
    return x + 0.1 * np.sign(x)


def distinct_values(shape, seed=0, dtype=np.float64):
    """All-different values spaced >= 1e-3 apart: no max-pooling ties within eps."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    values = rng.permutation(size) * 1e-2 + rng.uniform(0, 1e-3, size=size)
    return (values - values.mean()).reshape(shape).astype(dtype)


# --------------------------------------------------------------------------------------------
# Conv2d
# --------------------------------------------------------------------------------------------

CONV_CASES = list(
    itertools.product(
        [(2, 3, 5, 5), (1, 2, 6, 4)],  # x : (N, C, H, W)
        [1, 3],  # kernel
        [1, 2],  # stride
        [0, 1],  # padding
        [True, False],  # bias
    )
)


@pytest.mark.parametrize("shape, k, stride, pad, bias", CONV_CASES)
def test_conv2d_gradcheck(shape, k, stride, pad, bias):
    conv = Conv2d(shape[1], 3, k, stride=stride, padding=pad, bias=bias, algorithm="im2col")
    check_backward(conv, normal(shape))


# Winograd: stride 1, tiles m = 2, 3, 4 (chosen by the output size), filters 2x2 to 5x5.
WINOGRAD_CASES = [
    ((2, 3, 5, 5), 3, 1, True),  # 5x5 output: m = 3 (two tile rows, the second sticking out)
    ((1, 2, 6, 4), 3, 0, False),  # 4x2 output: m = 2
    ((2, 2, 8, 8), 3, 1, True),  # 8x8 output: m = 4
    ((1, 2, 6, 7), 2, 1, True),
    ((1, 2, 7, 7), 5, 2, True),
]


@pytest.mark.parametrize("shape, k, pad, bias", WINOGRAD_CASES)
def test_conv2d_winograd_gradcheck(shape, k, pad, bias):
    conv = Conv2d(shape[1], 3, k, padding=pad, bias=bias, algorithm="winograd")
    check_backward(conv, normal(shape))


@pytest.mark.parametrize("kernel_set", ["reference", "cpu"])
@pytest.mark.parametrize("shape, k, pad, bias", WINOGRAD_CASES)
def test_conv2d_winograd_equals_im2col_in_float32(kernel_set, shape, k, pad, bias):
    x = normal(shape, seed=1, dtype=np.float32)
    results = []
    for algorithm in ("im2col", "winograd"):
        conv = Conv2d(shape[1], 4, k, padding=pad, bias=bias, algorithm=algorithm)
        bind_parameters(conv, seed=2, dtype="float32")
        with kernels.use(kernel_set):
            y = conv.forward(x)
            dx = conv.backward(normal(y.shape, seed=3, dtype=np.float32))
        results.append((y, dx, conv.weight.grad.copy()))
    for im2col_result, winograd_result in zip(*results):
        assert winograd_result.dtype == np.float32
        # The transforms round differently from a direct sum: a few float32 ulps of the scale.
        np.testing.assert_allclose(winograd_result, im2col_result, rtol=0, atol=1e-5 * np.abs(im2col_result).max())


@pytest.mark.parametrize("out_size, tile", [(9, 3), (32, 4), (16, 4), (8, 4), (4, 4), (6, 3), (5, 3), (2, 2), (1, 2)])
def test_conv2d_winograd_tile_minimizes_multiplications(out_size, tile):
    assert Conv2d(8, 2, 3, padding=1).winograd_tile(out_size, out_size) == tile


def test_conv2d_algorithm_choice(mpidl_settings):
    mpidl_settings()  # MPIDL_CONV_ALGORITHM unset
    assert Conv2d(8, 2, 3, padding=1).winograd_tile(9, 9) == 3  # auto: 3x3, stride 1, >= 8 channels
    assert Conv2d(7, 2, 3, padding=1).winograd_tile(9, 9) is None  # auto: few channels, im2col
    assert Conv2d(3, 2, 3, padding=1, algorithm="winograd").winograd_tile(9, 9) == 3  # unless asked
    assert Conv2d(8, 2, 3, stride=2, padding=1).winograd_tile(9, 9) is None
    assert Conv2d(2, 2, 1).winograd_tile(9, 9) is None  # auto keeps im2col for other kernels
    assert Conv2d(2, 2, 1, algorithm="winograd").winograd_tile(9, 9) == 3  # 1x1 is allowed if asked for
    assert Conv2d(2, 2, 3, algorithm="im2col").winograd_tile(9, 9) is None
    assert Conv2d(8, 2, 3, padding=1).winograd_tile(9, 9, on_gpu=True) is None  # auto: im2col on the GPU
    assert Conv2d(2, 2, 3, padding=1, algorithm="winograd").winograd_tile(9, 9, on_gpu=True) == 3
    # MPIDL_CONV_ALGORITHM (read once, into mpidl.settings.SETTINGS) overrides "auto" only
    mpidl_settings(MPIDL_CONV_ALGORITHM="im2col")
    assert Conv2d(8, 2, 3, padding=1).winograd_tile(9, 9) is None
    assert Conv2d(2, 2, 3, padding=1, algorithm="winograd").winograd_tile(9, 9) == 3  # explicit wins
    mpidl_settings(MPIDL_CONV_ALGORITHM="winograd")
    assert Conv2d(2, 2, 1).winograd_tile(9, 9) == 3
    assert Conv2d(2, 2, 3, stride=2).winograd_tile(9, 9) is None  # never for stride 2
    assert Conv2d(2, 2, 7, padding=3).winograd_tile(9, 9) is None  # nor for kernels above 5x5
    assert Conv2d(2, 2, 3, padding=1, algorithm="im2col").winograd_tile(9, 9) is None  # explicit wins
    mpidl_settings(MPIDL_CONV_ALGORITHM="fast")  # refused where it is used, naming the variable
    with pytest.raises(ValueError, match="MPIDL_CONV_ALGORITHM must be one of im2col, winograd, got 'fast'"):
        Conv2d(2, 2, 3).winograd_tile(9, 9)
    assert Conv2d(2, 2, 3, algorithm="winograd").winograd_tile(9, 9) == 3  # not read for an explicit one


def test_conv2d_rejects_bad_algorithms():
    with pytest.raises(ValueError, match="one of auto, im2col, winograd"):
        Conv2d(2, 2, 3, algorithm="fft")
    with pytest.raises(ValueError, match="stride 1"):
        Conv2d(2, 2, 3, stride=2, algorithm="winograd")
    with pytest.raises(ValueError, match="kernel_size <= 5"):
        Conv2d(2, 2, 7, padding=3, algorithm="winograd")


def test_conv2d_switching_algorithm_between_steps():
    # The backward pass follows the forward pass it belongs to, whatever the algorithm now.
    conv = Conv2d(2, 3, 3, padding=1)
    bind_parameters(conv)
    x, dy = normal((2, 2, 5, 5), seed=1), normal((2, 3, 5, 5), seed=2)
    grads = []
    for first, second in (("winograd", "im2col"), ("im2col", "winograd")):
        conv.algorithm = first
        conv.forward(x)
        conv.algorithm = second
        grads.append((conv.backward(dy), conv.weight.grad.copy()))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["im2col", "auto"])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-4), (np.float64, 1e-10)])
@pytest.mark.parametrize("stride, pad", [(1, 0), (2, 1), (1, 2)])
def test_conv2d_matches_loops(dtype, tol, stride, pad, algorithm):
    x = normal((2, 3, 6, 5), seed=1, dtype=dtype)
    conv = Conv2d(3, 4, 3, stride=stride, padding=pad, algorithm=algorithm)
    bind_parameters(conv, seed=2, dtype=np.dtype(dtype).name)
    y = conv.forward(x)
    assert y.dtype == dtype and y.flags.c_contiguous
    np.testing.assert_allclose(y, conv2d_loops(x, conv.weight.data, conv.bias.data, stride, pad), rtol=tol, atol=tol)

    dy = normal(y.shape, seed=3, dtype=dtype)
    dx = conv.backward(dy)
    dx_loops, dw_loops, db_loops = conv2d_backward_loops(x, conv.weight.data, dy, stride, pad)
    np.testing.assert_allclose(dx, dx_loops, rtol=tol, atol=tol)
    np.testing.assert_allclose(conv.weight.grad, dw_loops, rtol=tol, atol=tol)
    np.testing.assert_allclose(conv.bias.grad, db_loops, rtol=tol, atol=tol)


def test_conv2d_reuses_its_workspaces_and_stays_correct():
    conv = Conv2d(2, 3, 3, padding=1)
    bind_parameters(conv)
    conv.forward(normal((2, 2, 4, 4), seed=1))
    conv.backward(normal((2, 3, 4, 4), seed=2))
    first = {key: buffer for key, buffer in conv._workspaces.items()}
    x2 = normal((2, 2, 4, 4), seed=3)
    y2 = conv.forward(x2)
    conv.backward(normal((2, 3, 4, 4), seed=4))
    assert all(conv._workspaces[key] is buffer for key, buffer in first.items())
    np.testing.assert_allclose(y2, conv2d_loops(x2, conv.weight.data, conv.bias.data, 1, 1), atol=1e-12)


def test_conv2d_backward_overwrites_gradients_and_can_skip_the_input_gradient():
    conv = Conv2d(2, 3, 3)
    bind_parameters(conv)
    y = conv.forward(normal((2, 2, 5, 5)))
    dy = normal(y.shape, seed=1)
    conv.backward(dy)
    first = conv.weight.grad.copy()
    conv.backward(dy)
    np.testing.assert_array_equal(conv.weight.grad, first)  # overwritten, not accumulated

    conv.compute_input_grad = False
    conv.weight.grad.fill(0)
    assert conv.backward(dy) is None
    np.testing.assert_array_equal(conv.weight.grad, first)


def test_conv2d_rejects_wrong_channels():
    conv = Conv2d(3, 4, 3)
    bind_parameters(conv)
    with pytest.raises(ValueError, match="3"):
        conv.forward(np.zeros((1, 2, 5, 5)))


# --------------------------------------------------------------------------------------------
# pooling
# --------------------------------------------------------------------------------------------

POOL_CASES = list(itertools.product([(2, 2, 5, 5), (1, 3, 6, 4)], [2, 3], [1, 2], [0, 1]))


@pytest.mark.parametrize("shape, k, stride, pad", POOL_CASES)
def test_maxpool_gradcheck(shape, k, stride, pad):
    check_backward(MaxPool2d(k, stride, pad), distinct_values(shape))


@pytest.mark.parametrize("shape, k, stride, pad", POOL_CASES)
def test_avgpool_gradcheck(shape, k, stride, pad):
    check_backward(AvgPool2d(k, stride, pad), normal(shape))


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (1, 2, 3, 5)])
def test_global_avgpool_gradcheck(shape):
    pool = GlobalAvgPool2d()
    x = normal(shape)
    np.testing.assert_allclose(pool.forward(x), x.mean(axis=(2, 3)))
    check_backward(pool, x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k, stride, pad", [(2, None, 0), (3, 2, 1), (2, 1, 1)])
def test_pooling_layers_match_loops(dtype, k, stride, pad):
    x = distinct_values((2, 3, 7, 6), dtype=dtype)
    s = k if stride is None else stride
    y, argmax = maxpool_loops(x, k, s, pad)
    np.testing.assert_array_equal(MaxPool2d(k, stride, pad).forward(x), y)
    np.testing.assert_allclose(AvgPool2d(k, stride, pad).forward(x), avgpool_loops(x, k, s, pad), rtol=1e-5, atol=1e-6)


def test_maxpool_floors_odd_sizes():
    assert MaxPool2d(2).forward(normal((1, 1, 9, 9))).shape == (1, 1, 4, 4)


# --------------------------------------------------------------------------------------------
# Linear, Flatten, activations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, d, k, bias", list(itertools.product([1, 3], [1, 4], [2, 5], [True, False])))
def test_linear_gradcheck(n, d, k, bias):
    check_backward(Linear(d, k, bias=bias), normal((n, d)))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_linear_matches_loops(dtype, tol):
    layer = Linear(4, 3)
    bind_parameters(layer, dtype=np.dtype(dtype).name)
    x = normal((5, 4), dtype=dtype)
    y = layer.forward(x)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, linear_loops(x, layer.weight.data, layer.bias.data), rtol=tol, atol=tol)


def test_flatten_gradcheck_and_order():
    x = normal((2, 3, 2, 2))
    y = Flatten().forward(x)
    np.testing.assert_array_equal(y[1, 4:8], x[1, 1].ravel())  # C-order: feature (c*H + h)*W + w
    check_backward(Flatten(), x)


@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 3, 3)])
@pytest.mark.parametrize("layer", [ReLU, lambda: LeakyReLU(0.1)], ids=["relu", "leaky"])
def test_activation_gradcheck(layer, shape):
    check_backward(layer(), away_from_zero(shape))


def test_relu_and_leaky_relu_values():
    x = np.array([-2.0, -0.5, 0.0, 1.5])
    np.testing.assert_array_equal(ReLU().forward(x), [0.0, 0.0, 0.0, 1.5])
    np.testing.assert_allclose(LeakyReLU(0.1).forward(x), [-0.2, -0.05, 0.0, 1.5])


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------


def test_dropout_is_the_identity_in_eval_mode():
    drop = Dropout(0.5, seed=1).eval()
    x = normal((4, 5))
    np.testing.assert_array_equal(drop.forward(x), x)
    dy = normal((4, 5), seed=2)
    np.testing.assert_array_equal(drop.backward(dy), dy)


def test_dropout_drops_and_rescales():
    p = 0.25
    drop = Dropout(p, seed=3)
    x = np.ones((200, 100))
    y = drop.forward(x)
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1.0 / (1.0 - p))  # inverted scaling
    assert abs(1.0 - kept.mean() - p) < 0.02
    assert abs(y.mean() - 1.0) < 0.03  # E[y] = x
    np.testing.assert_allclose(drop.backward(np.ones_like(x)), y)  # same mask, same scale


def test_dropout_masks_are_reproducible_from_the_seed():
    a, b = Dropout(0.5, seed=7), Dropout(0.5, seed=7)
    x = np.ones((10, 10))
    first = a.forward(x)
    np.testing.assert_array_equal(first, b.forward(x))
    assert not np.array_equal(first, a.forward(x))  # a new mask on every call
    a.reseed(7)
    np.testing.assert_array_equal(a.forward(x), first)


def test_dropout_gradcheck_with_a_fixed_mask():
    drop = Dropout(0.4, seed=5)
    check_backward(drop, normal((3, 6)), before_forward=lambda: drop.reseed(5))


def test_dropout_rejects_bad_p():
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError):
            Dropout(p)


# --------------------------------------------------------------------------------------------
# BatchNorm2d
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 3, 2, 2), (2, 2, 3, 1)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_gradcheck(shape, training):
    bn = BatchNorm2d(shape[1])
    bind_parameters(bn, seed=1)
    # non-trivial scale, shift and running statistics
    bn.weight.data[...] = np.linspace(0.5, 1.5, shape[1])
    bn.bias.data[...] = np.linspace(-0.3, 0.3, shape[1])
    bn.running_mean[...] = np.linspace(-0.2, 0.2, shape[1])
    bn.running_var[...] = np.linspace(0.5, 2.0, shape[1])
    bn.train(training)
    check_backward(bn, normal(shape, seed=2) * 2 + 1)


def test_batchnorm_training_normalizes_and_updates_running_stats():
    bn = BatchNorm2d(3, momentum=0.1)
    bind_parameters(bn)
    x = normal((8, 3, 4, 4), seed=1) * np.array([1.0, 2.0, 3.0])[None, :, None, None] + 5.0
    y = bn.forward(x)
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), 1.0, rtol=1e-3)
    count = 8 * 4 * 4
    np.testing.assert_allclose(bn.running_mean, 0.1 * x.mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(bn.running_var, 0.9 + 0.1 * x.var(axis=(0, 2, 3)) * count / (count - 1))


def test_batchnorm_eval_uses_running_stats_and_leaves_them_alone():
    bn = BatchNorm2d(2)
    bind_parameters(bn)
    bn.running_mean[...] = [1.0, -1.0]
    bn.running_var[...] = [4.0, 0.25]
    bn.eval()
    x = normal((3, 2, 2, 2))
    y = bn.forward(x)
    expected = (x - np.array([1.0, -1.0])[None, :, None, None]) / np.sqrt(np.array([4.0, 0.25]) + bn.eps)[None, :, None, None]
    np.testing.assert_allclose(y, expected)
    np.testing.assert_array_equal(bn.running_mean, [1.0, -1.0])
    # training mode normalizes with the batch instead, so the outputs differ
    assert not np.allclose(bn.train().forward(x), y)


def test_batchnorm_buffers_are_listed_updated_in_place_and_moved_by_to():
    net = Sequential(Conv2d(2, 3, 1), BatchNorm2d(3))
    bind_parameters(net, dtype="float32")
    names = [name for name, _ in net.named_buffers()]
    assert names == ["1.running_mean", "1.running_var"]
    held = dict(net.named_buffers())
    assert all(buffer.dtype == np.float32 for buffer in held.values())
    net.forward(normal((4, 2, 3, 3), dtype=np.float32))
    assert held["1.running_mean"] is net[1].running_mean  # in-place update
    assert np.any(held["1.running_mean"] != 0)
    net.to(get_backend("cpu", "float64"))
    assert net[1].running_var.dtype == np.float64


def test_batchnorm_refuses_a_single_value_per_channel_in_training():
    bn = BatchNorm2d(2)
    bind_parameters(bn)
    with pytest.raises(ValueError, match="more than one value"):
        bn.forward(np.zeros((1, 2, 1, 1)))
    bn.eval().forward(np.zeros((1, 2, 1, 1)))  # fine in evaluation


# --------------------------------------------------------------------------------------------
# containers
# --------------------------------------------------------------------------------------------


def test_residual_identity_gradcheck():
    body = Sequential(Conv2d(2, 2, 3, padding=1), LeakyReLU(0.2), Conv2d(2, 2, 3, padding=1))
    check_backward(Residual(body), normal((2, 2, 4, 4)))


def test_residual_projection_gradcheck():
    body = Sequential(Conv2d(2, 3, 3, stride=2, padding=1), BatchNorm2d(3))
    shortcut = Sequential(Conv2d(2, 3, 1, stride=2), BatchNorm2d(3))
    check_backward(Residual(body, shortcut), normal((2, 2, 5, 5)))


def test_residual_shape_mismatch_is_reported():
    residual = Residual(Conv2d(2, 3, 1))
    bind_parameters(residual)
    with pytest.raises(ValueError, match="shortcut"):
        residual.forward(normal((1, 2, 3, 3)))


def test_sequential_gradcheck_and_parameter_names():
    net = Sequential(Conv2d(2, 3, 3, padding=1), ReLU(), MaxPool2d(2), Flatten(), Linear(3 * 2 * 2, 4))
    assert [name for name, _ in net.named_parameters()] == ["0.weight", "0.bias", "4.weight", "4.bias"]
    check_backward(net, distinct_values((2, 2, 4, 4)))


def test_train_and_eval_propagate_to_every_layer():
    net = Sequential(Residual(Sequential(BatchNorm2d(2))), Dropout(0.5))
    net.eval()
    assert not any(module.training for module in net.modules())
    net.train()
    assert all(module.training for module in net.modules())


def test_unbound_parameters_give_a_clear_error():
    with pytest.raises(RuntimeError, match="not bound"):
        Linear(2, 3).forward(np.zeros((1, 2)))


# --------------------------------------------------------------------------------------------
# SoftmaxCrossEntropy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(1, 2), (4, 3), (6, 5)])
def test_softmax_cross_entropy_gradcheck(n, k):
    rng = np.random.default_rng(n * k)
    check_loss_backward(SoftmaxCrossEntropy(), normal((n, k), seed=n) * 3, rng.integers(0, k, size=n))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_softmax_cross_entropy_matches_loops(dtype, tol):
    logits = normal((5, 4), dtype=dtype) * 2
    labels = np.array([0, 3, 1, 1, 2])
    loss_fn = SoftmaxCrossEntropy()
    loss = loss_fn.forward(logits, labels)
    dlogits = loss_fn.backward()
    loss_loops, grad_loops = softmax_cross_entropy_loops(logits, labels)
    assert isinstance(loss, float)
    assert loss == pytest.approx(loss_loops, rel=tol)
    assert dlogits.dtype == dtype
    np.testing.assert_allclose(dlogits, grad_loops, rtol=tol, atol=tol)


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    loss_fn = SoftmaxCrossEntropy()
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 1e4, 1e4]], dtype=np.float32)
    loss = loss_fn.forward(logits, np.array([0, 1]))
    assert np.isfinite(loss) and loss == pytest.approx(np.log(2) / 2, rel=1e-5)
    assert np.all(np.isfinite(loss_fn.backward()))


def test_softmax_cross_entropy_rejects_bad_labels():
    loss_fn = SoftmaxCrossEntropy()
    with pytest.raises(ValueError, match="labels"):
        loss_fn.forward(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="labels"):
        loss_fn.forward(np.zeros((2, 3)), np.array([0.0, 1.0]))


@pytest.mark.parametrize("kernel_set", ["reference", "cpu"])
@pytest.mark.parametrize("algorithm", ["im2col", "winograd"])
def test_conv2d_empty_batch(kernel_set, algorithm):
    # A rank whose share of the global batch is 0 samples still gets well-formed results.
    conv = Conv2d(3, 4, 3, padding=1, algorithm=algorithm)
    bind_parameters(conv, dtype="float32")
    with kernels.use(kernel_set):
        y = conv.forward(np.zeros((0, 3, 9, 9), np.float32))
        assert y.shape == (0, 4, 9, 9)
        conv.weight.grad.fill(1)
        dx = conv.backward(np.zeros(y.shape, np.float32))
    assert dx.shape == (0, 3, 9, 9)
    np.testing.assert_array_equal(conv.weight.grad, 0)
    np.testing.assert_array_equal(conv.bias.grad, 0)
