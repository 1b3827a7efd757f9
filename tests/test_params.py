"""FlatParameters: one buffer, views that stay views, registration order, deterministic init."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcheck import bind_parameters
from mpidl.engine.backend import get_backend
from mpidl.engine.nn import BatchNorm2d, Conv2d, Linear, ReLU, Sequential
from mpidl.engine.params import FlatParameters, Parameter, he_normal, kaiming_uniform, ones, uniform, zeros


def small_net():
    return Sequential(Conv2d(2, 3, 3, padding=1), BatchNorm2d(3), ReLU(), Linear(3, 4))


def flat_for(net, seed=0, dtype="float32"):
    return FlatParameters(net.named_parameters(), get_backend("cpu", dtype), seed)


def test_parameters_are_views_that_stay_views_after_in_place_updates():
    net = small_net()
    flat = flat_for(net)
    flat.grad[...] = np.arange(flat.size, dtype=flat.dtype)
    flat.data -= 0.1 * flat.grad  # an optimizer step
    flat.data *= 0.5
    for param, start in zip(flat, flat.offsets):
        assert np.shares_memory(param.data, flat.data) and np.shares_memory(param.grad, flat.grad)
        np.testing.assert_array_equal(param.data.ravel(), flat.data[start : start + param.size])
    # and the other way round: a layer's write to its grad lands in the flat buffer
    net[3].weight.grad[...] = 7.0
    start = flat.offsets[flat.names.index("3.weight")]
    assert np.all(flat.grad[start : start + 12] == 7.0)


def test_registration_order_names_shapes_and_offsets():
    flat = flat_for(small_net())
    assert flat.names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert flat.shapes == [(3, 2, 3, 3), (3,), (3,), (3,), (4, 3), (4,)]
    sizes = [math.prod(s) for s in flat.shapes]
    assert flat.offsets == list(np.cumsum([0] + sizes[:-1]))
    assert flat.size == sum(sizes) == 54 + 3 + 3 + 3 + 12 + 4
    assert [p.name for p in flat] == flat.names
    assert flat["1.weight"] is list(flat)[2]
    with pytest.raises(KeyError):
        flat["nope"]


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float64", 8)])
def test_size_nbytes_and_dtype(dtype, itemsize):
    flat = flat_for(small_net(), dtype=dtype)
    assert flat.data.dtype == flat.grad.dtype == np.dtype(dtype)
    assert flat.data.ndim == flat.grad.ndim == 1
    assert flat.nbytes == flat.size * itemsize
    assert np.all(flat.grad == 0)


def test_initialization_is_deterministic():
    a, b, c = flat_for(small_net(), seed=3), flat_for(small_net(), seed=3), flat_for(small_net(), seed=4)
    assert a.data.tobytes() == b.data.tobytes()
    assert not np.array_equal(a.data, c.data)
    # float32 is the float64 draw rounded once: the same model at both precisions
    d = flat_for(small_net(), seed=3, dtype="float64")
    np.testing.assert_array_equal(d.data.astype(np.float32), a.data)


def test_batchnorm_and_bias_initial_values():
    flat = flat_for(small_net())
    np.testing.assert_array_equal(flat["1.weight"].data, 1.0)
    np.testing.assert_array_equal(flat["1.bias"].data, 0.0)
    bound = 1.0 / math.sqrt(2 * 3 * 3)
    assert np.all(np.abs(flat["0.bias"].data) <= bound)


def test_initializer_statistics():
    rng = np.random.default_rng(0)
    w = he_normal(50)(rng, (400, 50))
    assert w.std() == pytest.approx(math.sqrt(2 / 50), rel=0.02)
    u = kaiming_uniform(50)(rng, (400, 50))  # PyTorch's default: bound 1/sqrt(fan_in)
    assert np.abs(u).max() <= 1 / math.sqrt(50) and np.abs(u).max() > 0.95 / math.sqrt(50)
    assert np.all(uniform(0.3)(rng, (100,)) <= 0.3)
    np.testing.assert_array_equal(zeros()(rng, (2, 2)), 0.0)
    np.testing.assert_array_equal(ones()(rng, (3,)), 1.0)
    with pytest.raises(ValueError):
        he_normal(0)


def test_state_dict_host_copies_and_load_host_keeps_views():
    net = small_net()
    flat = flat_for(net, seed=1)
    state = flat.state_dict_host()
    assert list(state) == flat.names
    state["0.weight"][...] = 0  # a copy: the model is untouched
    assert np.any(net[0].weight.data != 0)

    other = flat_for(small_net(), seed=2).state_dict_host()
    view = net[0].weight.data
    flat.load_host(other)
    assert net[0].weight.data is view and np.shares_memory(view, flat.data)
    for name, value in other.items():
        np.testing.assert_array_equal(flat[name].data, value)


def test_load_host_rejects_mismatches_without_writing():
    flat = flat_for(small_net())
    before = flat.data.copy()
    state = flat.state_dict_host()
    del state["3.bias"]
    with pytest.raises(KeyError, match="3.bias"):
        flat.load_host(state)
    state = flat.state_dict_host()
    state["0.weight"] = np.zeros((3, 2, 3, 4)) + 5
    state["0.bias"] = state["0.bias"] + 1
    with pytest.raises(ValueError, match="0.weight"):
        flat.load_host(state)
    np.testing.assert_array_equal(flat.data, before)


def test_zero_grad():
    flat = flat_for(small_net())
    flat.grad += 3
    flat.zero_grad()
    assert np.all(flat.grad == 0)


def test_binding_errors():
    layer = Linear(2, 2)
    with pytest.raises(RuntimeError, match="not bound"):
        layer.weight.data
    bind_parameters(layer)
    with pytest.raises(ValueError, match="already bound"):
        FlatParameters(layer.named_parameters())
    p = Parameter((2,), zeros())
    with pytest.raises(ValueError, match="duplicate"):
        FlatParameters([("a", p), ("a", Parameter((2,), zeros()))])
    with pytest.raises(ValueError):
        Parameter((0, 3), zeros())


def test_a_model_without_parameters_has_empty_buffers():
    flat = FlatParameters([], get_backend(), seed=0)
    assert flat.size == 0 and flat.nbytes == 0 and len(flat) == 0
