"""Batch norm (+ ReLU) kernels: the Numba CPU kernels against the reference, the reference
against the separate BatchNorm2d + ReLU layers, and the fused layer's gradients (float64)."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import bind_parameters, check_backward
from mpidl.kernels import batchnorm_cpu, batchnorm_reference
from mpidl.engine.nn import BatchNorm2d, ReLU, Sequential
from mpidl.engine.nn.fused import FusedAway, FusedBatchNorm2d, fuse_batchnorm_relu

SHAPES = [(4, 3, 5, 5), (2, 1, 3, 7), (1, 2, 1, 2)]


def _inputs(shape, dtype, seed=0, offset=1.0):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + offset).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma = np.linspace(0.5, 1.5, c).astype(dtype)
    beta = np.linspace(-0.3, 0.3, c).astype(dtype)
    return x, dy, gamma, beta


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("batch_stats", [True, False])
def test_cpu_kernels_equal_reference(shape, dtype, relu, batch_stats):
    x, dy, gamma, beta = _inputs(shape, dtype)
    stats = None if batch_stats else (np.linspace(-0.2, 0.2, shape[1]), np.linspace(0.5, 2.0, shape[1]))
    y_ref, mean_ref, var_ref = batchnorm_reference.batchnorm_forward(x, gamma, beta, 1e-5, relu, stats)
    y, mean, var = batchnorm_cpu.batchnorm_forward(x, gamma, beta, 1e-5, relu, stats)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    assert y.dtype == x.dtype
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(var, var_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y, y_ref, rtol=rtol, atol=rtol)
    ref = batchnorm_reference.batchnorm_backward(dy, x, y_ref, gamma, mean, var, 1e-5, relu, batch_stats)
    got = batchnorm_cpu.batchnorm_backward(dy, x, y, gamma, mean, var, 1e-5, relu, batch_stats)
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, ref):
        np.testing.assert_allclose(a, b, rtol=rtol * 10, atol=rtol * 10, err_msg=name)
    assert got[0].dtype == dy.dtype


def test_statistics_of_an_input_with_a_large_mean_are_float64_accurate():
    """1000 + 3 N(0, 1) in float32: the two-pass float64 statistics lose nothing."""
    x = (1000 + 3 * np.random.default_rng(1).standard_normal((64, 4, 8, 8))).astype(np.float32)
    _, mean, var = batchnorm_cpu.batchnorm_forward(x, np.ones(4, np.float32), np.zeros(4, np.float32), 1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2, 3)), rtol=1e-14)
    np.testing.assert_allclose(var, x64.var(axis=(0, 2, 3)), rtol=1e-10)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_reference_equals_the_separate_layers(relu, training):
    shape = (4, 3, 5, 5)
    x, dy, gamma, beta = _inputs(shape, np.float64, seed=3)
    layers = [BatchNorm2d(3)] + ([ReLU()] if relu else [])
    net = Sequential(*layers)
    bind_parameters(net)
    net[0].weight.data[...] = gamma
    net[0].bias.data[...] = beta
    net[0].running_mean[...] = np.linspace(-0.2, 0.2, 3)
    net[0].running_var[...] = np.linspace(0.5, 2.0, 3)
    net.train(training)
    stats = None if training else (net[0].running_mean.copy(), net[0].running_var.copy())
    y = net.forward(x)
    dx = net.backward(dy)
    y_ref, mean, var = batchnorm_reference.batchnorm_forward(x, gamma, beta, 1e-5, relu, stats)
    dx_ref, dgamma, dbeta = batchnorm_reference.batchnorm_backward(dy, x, y_ref, gamma, mean, var, 1e-5, relu, training)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(net[0].weight.grad, dgamma, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(net[0].bias.grad, dbeta, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_fused_layer_gradcheck(relu, training):
    bn = FusedBatchNorm2d(3, relu=relu)
    bind_parameters(bn, seed=1)
    bn.weight.data[...] = np.linspace(0.5, 1.5, 3)
    bn.bias.data[...] = np.linspace(-0.3, 0.3, 3)
    bn.running_mean[...] = np.linspace(-0.2, 0.2, 3)
    bn.running_var[...] = np.linspace(0.5, 2.0, 3)
    bn.train(training)
    x = np.random.default_rng(2).standard_normal((4, 3, 3, 3)) * 2 + 0.5
    # Running statistics move with every training forward; the loss must not see that.
    means, variances = bn.running_mean.copy(), bn.running_var.copy()

    def reset():
        bn.running_mean[...] = means
        bn.running_var[...] = variances

    check_backward(bn, x, before_forward=reset)


def test_fuse_keeps_names_and_replaces_the_relu():
    net = Sequential(BatchNorm2d(2), ReLU(), Sequential(BatchNorm2d(2)), ReLU())
    names = [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
    fuse_batchnorm_relu(net)
    assert [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()] == names
    assert isinstance(net[0], FusedBatchNorm2d) and net[0].relu
    assert isinstance(net[1], FusedAway)
    assert isinstance(net[2][0], FusedBatchNorm2d) and not net[2][0].relu  # its ReLU is outside
    assert type(net[3]) is ReLU
