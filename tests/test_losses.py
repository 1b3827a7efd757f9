"""Binary cross-entropy with logits and mean squared error (mpidl/engine/nn/loss.py): float64
gradient checks (CPU, and CuPy where a GPU is present), values against the textbook
formulas, numerical stability at large logits, and the shape checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcheck import check_loss_backward
from mpidl.engine.backend import get_backend, gpu_unavailable_reason, to_host
from mpidl.engine.nn import BCEWithLogits, MSELoss

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    gpu_unavailable_reason() is not None, reason=str(gpu_unavailable_reason())))]


def draw(shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 1), (4, 3), (2, 3, 4)])
def test_bce_gradcheck(device, shape):
    backend = get_backend(device, "float64")
    targets = np.random.default_rng(1).uniform(0, 1, size=shape)   # soft targets too
    check_loss_backward(BCEWithLogits(), backend.asarray(draw(shape, scale=3.0)), backend.asarray(targets),
                        atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 3, 4)])
def test_mse_gradcheck(device, shape):
    backend = get_backend(device, "float64")
    check_loss_backward(MSELoss(), backend.asarray(draw(shape)), backend.asarray(draw(shape, seed=2)),
                        atol=1e-9, rtol=1e-7)


def test_bce_equals_the_textbook_formula():
    z, y = draw((6, 2), scale=2.0), (np.arange(12).reshape(6, 2) % 2).astype(float)
    s = 1 / (1 + np.exp(-z))
    want = -np.mean(y * np.log(s) + (1 - y) * np.log(1 - s))
    loss = BCEWithLogits()
    assert loss.forward(z, y) == pytest.approx(want, rel=1e-13)
    np.testing.assert_allclose(loss.backward(), (s - y) / z.size, rtol=1e-13)
    # by hand: z = 0 gives log 2 whatever y
    assert BCEWithLogits().forward(np.zeros(3), np.array([0.0, 0.5, 1.0])) == pytest.approx(math.log(2), rel=1e-15)


def test_bce_is_stable_at_huge_logits():
    z = np.array([1000.0, -1000.0, 1000.0, -1000.0, 40.0])
    y = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    loss = BCEWithLogits()
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        value = loss.forward(z, y)
        grad = loss.backward()
    # right with confidence: ~0; wrong with confidence: |z|
    assert value == pytest.approx((1000.0 + 1000.0 + math.log1p(math.exp(-40.0))) / 5, rel=1e-14)
    np.testing.assert_allclose(grad, np.array([0.0, 0.0, 1.0, -1.0, -math.exp(-40.0) / (1 + math.exp(-40.0))]) / 5,
                               atol=1e-17, rtol=1e-12)  # 1 - s rounds to 0 at z = 40
    assert np.isfinite(grad).all()


def test_bce_float32_stays_float32():
    z = draw((4, 2)).astype(np.float32)
    loss = BCEWithLogits()
    loss.forward(z, np.ones((4, 2), np.float32))
    assert loss.backward().dtype == np.float32


def test_mse_by_hand():
    loss = MSELoss()
    assert loss.forward(np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.0, 6.0])) == pytest.approx(13 / 3, rel=1e-15)
    np.testing.assert_allclose(to_host(loss.backward()), [0.0, 4 / 3, -2.0], rtol=1e-15)


@pytest.mark.parametrize("cls", [BCEWithLogits, MSELoss])
def test_losses_refuse_bad_shapes_and_backward_before_forward(cls):
    with pytest.raises(ValueError, match=r"target of shape \(3,\) does not match the prediction's \(3, 1\)"):
        cls().forward(np.zeros((3, 1)), np.zeros(3))
    with pytest.raises(ValueError, match="non-empty float array"):
        cls().forward(np.zeros((0, 2)), np.zeros((0, 2)))
    with pytest.raises(RuntimeError, match="before forward"):
        cls().backward()
