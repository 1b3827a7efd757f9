"""A residual sum fused with the ReLU after it (mpidl.engine.nn.fused.FusedResidual) and its kernels.

The Numba kernels (``add_relu``, ``relu_backward``, ``add`` in mpidl.kernels.cpu) must give the
reference's values to the bit, signed zeros and NaN included; the fused block must give the
separate Residual + ReLU's forward and backward to the bit, pass a float64 gradient check, and
the rewrite must keep every parameter and buffer name.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import bind_parameters, check_backward
from mpidl import kernels
from mpidl.kernels import elementwise_cpu as cpu
from mpidl.kernels import elementwise_reference as reference
from mpidl.engine.models import build_model
from mpidl.engine.nn import BatchNorm2d, Conv2d, ReLU, Residual, Sequential
from mpidl.engine.nn.fused import FusedAway, FusedResidual, fuse_residual_relu

DTYPES = (np.float32, np.float64)
# The operands hold inf + -inf on purpose (a NaN sum).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _same_bits(a, b) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


def _operands(dtype, shape=(3, 4, 5, 6)):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    a.flat[:4] = [np.nan, -0.0, 0.0, np.inf]
    b.flat[:4] = [1.0, 0.0, -0.0, -np.inf]  # a + b: NaN, +0, +0, NaN
    a.flat[4], b.flat[4] = -2.0, 1.0  # a negative sum: -1 * 0 = -0.0, as NumPy's mask gives
    return a, b


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernels_equal_the_reference_to_the_bit(dtype):
    a, b = _operands(dtype)
    y = reference.add_relu(a, b)
    _same_bits(cpu.add_relu(a, b), y)
    dy = np.random.default_rng(1).standard_normal(a.shape).astype(dtype)
    dy.flat[5] = np.nan  # masked or not, NaN stays NaN (dy * 0)
    _same_bits(cpu.relu_backward(dy, y), reference.relu_backward(dy, y))
    _same_bits(cpu.add(a, b), reference.add(a, b))


def test_the_reference_is_the_separate_relu():
    a, b = _operands(np.float64)
    relu = ReLU()
    _same_bits(reference.add_relu(a, b), relu.forward(a + b))
    dy = np.random.default_rng(2).standard_normal(a.shape)
    _same_bits(reference.relu_backward(dy, reference.add_relu(a, b)), relu.backward(dy))


def test_non_contiguous_and_other_dtypes_take_the_reference():
    a, b = _operands(np.float32, (4, 6))
    _same_bits(cpu.add_relu(a[:, ::2], b[:, ::2]), reference.add_relu(a[:, ::2], b[:, ::2]))
    h = a.astype(np.float16)
    _same_bits(cpu.add(h, h), reference.add(h, h))


@pytest.mark.parametrize("name", ["add_relu", "relu_backward", "add"])
def test_the_dispatcher_refuses_arrays_that_do_not_match(name):
    a = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=f"{name}: the arrays must have one shape and dtype"):
        getattr(kernels, name)(a, np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match=f"{name}: the arrays must have one shape and dtype"):
        getattr(kernels, name)(a, np.ones((2, 3), np.float64))


def _block(projection: bool) -> Sequential:
    body = Sequential(Conv2d(2, 3 if projection else 2, 3, padding=1, stride=2 if projection else 1),
                      BatchNorm2d(3 if projection else 2))
    shortcut = Sequential(Conv2d(2, 3, 1, stride=2), BatchNorm2d(3)) if projection else None
    return Sequential(Residual(body, shortcut), ReLU())


@pytest.mark.parametrize("projection", [False, True], ids=["identity", "projection"])
def test_fused_block_equals_the_separate_layers_to_the_bit(projection):
    separate, fused = _block(projection), _block(projection)
    fuse_residual_relu(fused)
    assert isinstance(fused[0], FusedResidual) and isinstance(fused[1], FusedAway)
    bind_parameters(separate, seed=3)
    bind_parameters(fused, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 2, 6, 6))
    _same_bits(fused.forward(x), separate.forward(x))
    dy = np.random.default_rng(5).standard_normal(separate.forward(x).shape)
    fused.forward(x)
    _same_bits(fused.backward(dy), separate.backward(dy))
    for (_, p), (_, q) in zip(fused.named_parameters(), separate.named_parameters()):
        _same_bits(p.grad, q.grad)


@pytest.mark.parametrize("projection", [False, True], ids=["identity", "projection"])
def test_fused_block_gradcheck(projection):
    block = fuse_residual_relu(_block(projection))
    bind_parameters(block, seed=6)
    block.eval()  # running statistics: the loss is a smooth function of x away from the kinks
    check_backward(block, np.random.default_rng(7).standard_normal((2, 2, 6, 6)))


def test_fuse_keeps_names_and_fuses_only_a_residual_followed_by_a_relu():
    net = Sequential(_block(False), Sequential(Residual(Sequential(BatchNorm2d(2)))), ReLU())
    names = [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
    fuse_residual_relu(net)
    assert [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()] == names
    assert isinstance(net[0][0], FusedResidual)
    assert type(net[1][0]) is Residual  # no ReLU after it inside its Sequential
    assert type(net[2]) is ReLU


def test_resnet8_is_built_with_its_blocks_fused():
    model = build_model("resnet8", (3, 8, 8), 4)
    blocks = [m for m in model.net.modules() if isinstance(m, Residual)]
    assert len(blocks) == 3 and all(isinstance(b, FusedResidual) for b in blocks)
