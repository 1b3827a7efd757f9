"""The recurrent, attention and normalization layers on the GPU (CuPy arrays): the float64
gradient checks of ``tests/test_layers_sequence.py`` with input, parameters and buffers on the
device, and float32 / float64 results that stay on the device in their dtype.

Skipped, with the reason, without CuPy or a CUDA device; ``MPIDL_GPU_TESTS_ON_CPU=1`` runs it
with the CPU standing in for the GPU (a check of this test code, see conftest.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpidl.engine.backend import gpu_unavailable_reason

_ON_CPU = os.environ.get("MPIDL_GPU_TESTS_ON_CPU", "").strip() == "1"
_REASON = None if _ON_CPU else gpu_unavailable_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from gradcheck import check_backward  # noqa: E402 - tests/ is on sys.path (conftest.py)
from test_layers_sequence import ATOL, LAYERS, RTOL  # noqa: E402

from mpidl.engine.backend import get_backend, is_device_array  # noqa: E402
from mpidl.engine.nn import BatchNorm1d, BatchNorm2d  # noqa: E402
from mpidl.engine.params import FlatParameters  # noqa: E402

pytestmark = pytest.mark.gpu


def normal(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def on_device(module, device: str, dtype: str = "float64", seed: int = 1):
    backend = get_backend(device, dtype)
    named = module.named_parameters()
    if named:
        FlatParameters(named, backend, seed)
    module.to(backend)
    return backend


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradcheck(device, name):
    make, shape = LAYERS[name]
    module = make()
    backend = on_device(module, device)
    check_backward(module, backend.asarray(normal(shape, seed=len(name))), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers_keep_the_dtype_and_the_device(device, name, dtype):
    make, shape = LAYERS[name]
    layer = make()
    backend = on_device(layer, device, dtype)
    y = layer.forward(backend.asarray(normal(shape)))
    dx = layer.backward(backend.asarray(normal(y.shape, seed=1)))
    for what, array in (("output", y), ("input gradient", dx)):
        assert array.dtype == np.dtype(dtype), f"{name}: {what} is {array.dtype}, expected {dtype}"
        assert is_device_array(array) == (device == "gpu"), f"{name}: {what} is a {type(array)}"
    for param_name, param in layer.named_parameters():
        assert param.grad.dtype == np.dtype(dtype), param_name


@pytest.mark.parametrize("layer, shape", [(BatchNorm2d, (64, 8, 7, 7)), (BatchNorm1d, (3136, 8))])
def test_batchnorm_float32_statistics_on_a_large_mean(device, layer, shape):
    rng = np.random.default_rng(0)
    x, dy = 1000 + 3 * rng.standard_normal(shape), rng.standard_normal(shape)
    grads = {}
    for dtype in ("float64", "float32"):
        bn = layer(shape[1])
        backend = on_device(bn, device, dtype)
        bn.forward(backend.asarray(x))
        bn.backward(backend.asarray(dy))
        grads[dtype] = backend.to_host(bn.weight.grad).astype(np.float64)
    error = np.abs(grads["float32"] - grads["float64"]).max() / np.abs(grads["float64"]).max()
    assert error < 1e-5, f"weight gradient {error:.2e} off the float64 reference"
