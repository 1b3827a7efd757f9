"""Every layer and every model on the GPU (CuPy arrays), against the CPU and against calculus.

* The float64 central-difference gradient checks of ``tests/test_layers.py``, through the same
  helper (``tests/gradcheck.py``), with the input, the parameters and the buffers on the GPU.
* Every model (hsicnn, hsicnn_bn, resnet8), built with the same seed on the CPU and on the
  GPU, gives the same logits, loss, parameter gradients and batch-norm statistics: to 2e-5 of
  each tensor's largest magnitude in float32 (float32 rounding alone is ~1e-6 there) and to
  1e-10 in float64.
* Layers keep float32 float32 and leave their results on the device; the kernel dispatch
  sends CuPy arrays to ``mpidl.kernels.cuda``; ``select_device`` binds CuPy and Numba to the
  same GPU.

Skipped, with the reason, without CuPy or a CUDA device. ``MPIDL_GPU_TESTS_ON_CPU=1`` runs the
module with the CPU standing in for the GPU (a check of this test code, see conftest.py).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from mpidl.engine.backend import gpu_unavailable_reason

_ON_CPU = os.environ.get("MPIDL_GPU_TESTS_ON_CPU", "").strip() == "1"
_REASON = None if _ON_CPU else gpu_unavailable_reason()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from gradcheck import check_backward, check_loss_backward  # noqa: E402 - tests/ is on sys.path (conftest.py)

from mpidl import kernels  # noqa: E402
from mpidl.engine.backend import get_backend, is_device_array, select_device, to_host  # noqa: E402
from mpidl.engine.models import MODELS, build_model  # noqa: E402
from mpidl.engine.nn import (  # noqa: E402
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
from mpidl.engine.params import FlatParameters  # noqa: E402

pytestmark = pytest.mark.gpu

#: CPU-vs-GPU agreement, relative to each tensor's largest magnitude
AGREEMENT = {"float32": 2e-5, "float64": 1e-10}


# --------------------------------------------------------------------------------------------
# inputs (drawn on the host, so the CPU and the GPU see the same numbers)
# --------------------------------------------------------------------------------------------


def normal(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def away_from_zero(shape, seed=0):
    """Normal values pushed at least 0.1 away from 0, the kink of ReLU-like functions."""
    x = normal(shape, seed)
    return x + 0.1 * np.sign(x)


def distinct_values(shape, seed=0):
    """All-different values spaced >= 1e-3 apart: no max-pooling ties within eps."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    values = rng.permutation(size) * 1e-2 + rng.uniform(0, 1e-3, size=size)
    return (values - values.mean()).reshape(shape)


def on_device(module, device: str, dtype: str = "float64", seed: int = 1):
    """Bind ``module``'s parameters to flat storage on ``device`` and move its buffers there
    (``check_backward`` would otherwise bind them on the CPU)."""
    backend = get_backend(device, dtype)
    named = module.named_parameters()
    if named:
        FlatParameters(named, backend, seed)
    module.to(backend)
    return backend


def gradcheck_on(device, module, x_host, **kwargs):
    """``check_backward`` with the module and its float64 input on ``device``."""
    backend = on_device(module, device)
    check_backward(module, backend.asarray(x_host, dtype=np.float64), **kwargs)


# --------------------------------------------------------------------------------------------
# float64 gradient checks of every layer, on the device
# --------------------------------------------------------------------------------------------

CONV_CASES = [
    *itertools.product([(2, 3, 5, 5)], [1, 3], [1, 2], [0, 1], [True]),
    ((1, 2, 6, 4), 3, 2, 1, False),
]


@pytest.mark.parametrize("shape, k, stride, pad, bias", CONV_CASES)
def test_conv2d_gradcheck(device, shape, k, stride, pad, bias):
    gradcheck_on(device, Conv2d(shape[1], 3, k, stride=stride, padding=pad, bias=bias), normal(shape))


@pytest.mark.parametrize("shape, k, pad", [((2, 3, 5, 5), 3, 1), ((1, 2, 8, 8), 3, 1), ((1, 2, 6, 4), 3, 0)])
def test_conv2d_winograd_gradcheck(device, shape, k, pad):
    # Winograd on CuPy arrays: the Numba CUDA transforms and cuBLAS batched products.
    gradcheck_on(device, Conv2d(shape[1], 3, k, padding=pad, algorithm="winograd"), normal(shape))


POOL_CASES = [(2, 2, 0), (3, 2, 1), (2, 1, 1), (3, 1, 0)]  # (k, stride, pad)


@pytest.mark.parametrize("k, stride, pad", POOL_CASES)
def test_maxpool_gradcheck(device, k, stride, pad):
    gradcheck_on(device, MaxPool2d(k, stride, pad), distinct_values((2, 2, 5, 5)))


@pytest.mark.parametrize("k, stride, pad", POOL_CASES)
def test_avgpool_gradcheck(device, k, stride, pad):
    gradcheck_on(device, AvgPool2d(k, stride, pad), normal((2, 2, 5, 5)))


def test_global_avgpool_gradcheck(device):
    gradcheck_on(device, GlobalAvgPool2d(), normal((2, 3, 4, 3)))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck(device, bias):
    gradcheck_on(device, Linear(5, 4, bias=bias), normal((3, 5)))


@pytest.mark.parametrize("layer", [ReLU, lambda: LeakyReLU(0.1)], ids=["relu", "leaky"])
def test_activation_gradcheck(device, layer):
    gradcheck_on(device, layer(), away_from_zero((2, 2, 3, 3)))


def test_flatten_gradcheck(device):
    gradcheck_on(device, Flatten(), normal((2, 3, 2, 2)))


def test_dropout_gradcheck_with_a_fixed_mask(device):
    drop = Dropout(0.4, seed=3)
    # Reseeded before every forward, so every evaluation of L sees the same mask.
    gradcheck_on(device, drop, normal((3, 6)), before_forward=lambda: drop.reseed(5))


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_gradcheck(device, training):
    channels = 3
    bn = BatchNorm2d(channels)
    backend = on_device(bn, device)
    # non-trivial scale, shift and running statistics (written into the device arrays in place)
    bn.weight.data[...] = backend.asarray(np.linspace(0.5, 1.5, channels))
    bn.bias.data[...] = backend.asarray(np.linspace(-0.3, 0.3, channels))
    bn.running_mean[...] = backend.asarray(np.linspace(-0.2, 0.2, channels))
    bn.running_var[...] = backend.asarray(np.linspace(0.5, 2.0, channels))
    bn.train(training)
    check_backward(bn, backend.asarray(normal((4, channels, 2, 2), seed=2) * 2 + 1))


def test_residual_identity_gradcheck(device):
    body = Sequential(Conv2d(2, 2, 3, padding=1), LeakyReLU(0.2), Conv2d(2, 2, 3, padding=1))
    gradcheck_on(device, Residual(body), normal((2, 2, 4, 4)))


def test_residual_projection_gradcheck(device):
    body = Sequential(Conv2d(2, 3, 3, stride=2, padding=1), BatchNorm2d(3))
    shortcut = Sequential(Conv2d(2, 3, 1, stride=2), BatchNorm2d(3))
    gradcheck_on(device, Residual(body, shortcut), normal((2, 2, 5, 5)))


def test_sequential_gradcheck(device):
    net = Sequential(Conv2d(2, 3, 3, padding=1), ReLU(), MaxPool2d(2), Flatten(), Linear(3 * 2 * 2, 4))
    gradcheck_on(device, net, distinct_values((2, 2, 4, 4)))


@pytest.mark.parametrize("n, k", [(4, 3), (1, 5)])
def test_softmax_cross_entropy_gradcheck(device, n, k):
    backend = get_backend(device, "float64")
    labels = np.random.default_rng(n).integers(0, k, size=n)
    check_loss_backward(SoftmaxCrossEntropy(), backend.asarray(normal((n, k), seed=n) * 3), labels)


# --------------------------------------------------------------------------------------------
# dtype and placement of every layer's results
# --------------------------------------------------------------------------------------------

LAYERS_4D = {
    "conv": lambda: Conv2d(3, 4, 3, padding=1),
    "conv-strided": lambda: Conv2d(3, 4, 3, stride=2, padding=1, bias=False),
    "maxpool": lambda: MaxPool2d(2),
    "avgpool": lambda: AvgPool2d(3, 2, 1),
    "global-avgpool": lambda: GlobalAvgPool2d(),
    "batchnorm": lambda: BatchNorm2d(3),
    "relu": lambda: ReLU(),
    "leaky-relu": lambda: LeakyReLU(0.1),
    "dropout": lambda: Dropout(0.5, seed=1),
    "flatten": lambda: Flatten(),
    "residual": lambda: Residual(Sequential(Conv2d(3, 3, 3, padding=1), BatchNorm2d(3))),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(LAYERS_4D))
def test_layers_keep_the_dtype_and_the_device(device, name, dtype):
    """A float32 layer must not silently compute in float64 (a Python scalar or a NumPy
    float64 constant can promote CuPy arrays), nor hand back host arrays."""
    layer = LAYERS_4D[name]()
    backend = on_device(layer, device, dtype)
    x = backend.asarray(normal((2, 3, 6, 6)))
    y = layer.forward(x)
    dx = layer.backward(backend.asarray(normal(y.shape, seed=1)))
    for what, array in (("output", y), ("input gradient", dx)):
        assert array.dtype == np.dtype(dtype), f"{name}: {what} is {array.dtype}, expected {dtype}"
        assert is_device_array(array) == (device == "gpu"), f"{name}: {what} is a {type(array)}"
    for buffer_name, buffer in layer.named_buffers():
        assert buffer.dtype == np.dtype(dtype) and is_device_array(buffer) == (device == "gpu"), buffer_name


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linear_and_loss_keep_the_dtype_and_the_device(device, dtype):
    linear = Linear(6, 3)
    backend = on_device(linear, device, dtype)
    logits = linear.forward(backend.asarray(normal((4, 6))))
    loss_fn = SoftmaxCrossEntropy()
    loss = loss_fn.forward(logits, np.array([0, 2, 1, 2]))
    dlogits = loss_fn.backward()
    dx = linear.backward(dlogits)
    assert isinstance(loss, float)
    for array in (logits, dlogits, dx):
        assert array.dtype == np.dtype(dtype) and is_device_array(array) == (device == "gpu")


# --------------------------------------------------------------------------------------------
# every model: CPU and GPU agree
# --------------------------------------------------------------------------------------------

#: name -> (input_shape, batch): the real shapes (156-band 9x9 patches, 3x32x32 images)
MODEL_INPUTS = {
    "hsicnn": ((156, 9, 9), 8),
    "hsicnn_bn": ((156, 9, 9), 8),
    "resnet8": ((3, 32, 32), 4),
    "mlp": ((156, 9, 9), 8),
    "spectral_lstm": ((156, 7, 7), 8),
    "vit": ((156, 7, 7), 4),
}
NUM_CLASSES = 5


def test_every_registered_model_is_covered():
    assert set(MODEL_INPUTS) == set(MODELS)


def _assert_agree(actual, expected, tol: float, what: str) -> None:
    actual, expected = to_host(actual).astype(np.float64), to_host(expected).astype(np.float64)
    assert actual.shape == expected.shape, what
    scale = max(float(np.abs(expected).max()), 1e-30)
    error = float(np.abs(actual - expected).max()) / scale
    assert error <= tol, f"{what}: CPU and GPU differ by {error:.3g} of the largest value (tolerance {tol:g})"


def _one_step(name: str, device: str, dtype: str, x, y):
    """Forward (training mode), loss, backward, then an evaluation-mode forward."""
    shape, _ = MODEL_INPUTS[name]
    model = build_model(name, shape, NUM_CLASSES, backend=get_backend(device, dtype), seed=1)
    loss_fn = SoftmaxCrossEntropy()
    logits = model.forward(x)
    loss = loss_fn.forward(logits, y)
    model.backward(loss_fn.backward())
    grads = {name_: to_host(p.grad).copy() for name_, p in model.params.named_parameters()}
    buffers = model.buffers_host()
    eval_logits = to_host(model.eval().forward(x)).copy()
    return loss, to_host(logits).copy(), grads, buffers, eval_logits


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(MODEL_INPUTS))
def test_model_forward_and_backward_agree_with_the_cpu(device, name, dtype):
    shape, batch = MODEL_INPUTS[name]
    x = normal((batch, *shape), seed=3)
    y = np.random.default_rng(4).integers(0, NUM_CLASSES, size=batch)
    tol = AGREEMENT[dtype]
    cpu = _one_step(name, "cpu", dtype, x, y)
    dev = _one_step(name, device, dtype, x, y)
    loss_cpu, loss_dev = cpu[0], dev[0]
    assert abs(loss_dev - loss_cpu) <= tol * abs(loss_cpu), f"loss: CPU {loss_cpu!r}, GPU {loss_dev!r}"
    _assert_agree(dev[1], cpu[1], tol, "logits")
    assert dev[2].keys() == cpu[2].keys()
    for param_name in cpu[2]:
        _assert_agree(dev[2][param_name], cpu[2][param_name], tol, f"gradient of {param_name}")
    assert dev[3].keys() == cpu[3].keys()
    for buffer_name in cpu[3]:
        _assert_agree(dev[3][buffer_name], cpu[3][buffer_name], tol, f"buffer {buffer_name}")
    _assert_agree(dev[4], cpu[4], tol, "evaluation-mode logits")


# --------------------------------------------------------------------------------------------
# kernel dispatch and device selection (meaningful on a real GPU only)
# --------------------------------------------------------------------------------------------

KERNEL_FUNCTIONS = (
    "im2col", "col2im", "maxpool2d_forward", "maxpool2d_backward", "avgpool2d_forward", "avgpool2d_backward",
)


def test_dispatch_sends_cupy_arrays_to_the_cuda_kernels(only_on_gpu, monkeypatch, mpidl_settings):
    import cupy  # noqa: PLC0415

    from mpidl.kernels import cuda as kcuda  # noqa: PLC0415

    mpidl_settings()  # no MPIDL_KERNELS: the dispatch a real run gets
    assert kernels.implementation_for(cupy.zeros((1, 1, 4, 4), dtype=cupy.float32)) is kcuda
    assert kernels.implementation_for(np.zeros((1, 1, 4, 4), dtype=np.float32)) is not kcuda

    # The layers go through the dispatch: every CUDA kernel runs in one forward + backward.
    called = set()

    def counting(function_name):
        original = getattr(kcuda, function_name)

        def wrapper(*args, **kwargs):
            called.add(function_name)
            return original(*args, **kwargs)

        return wrapper

    for function_name in KERNEL_FUNCTIONS:
        monkeypatch.setattr(kcuda, function_name, counting(function_name))
    net = Sequential(Conv2d(2, 3, 3, padding=1), ReLU(), MaxPool2d(2), AvgPool2d(2))
    backend = on_device(net, "gpu", "float32")
    y = net.forward(backend.asarray(normal((2, 2, 8, 8))))
    dx = net.backward(cupy.ones_like(y))
    assert isinstance(y, cupy.ndarray) and isinstance(dx, cupy.ndarray)
    assert called == set(KERNEL_FUNCTIONS)


def test_select_device_binds_cupy_and_numba_to_the_same_gpu(only_on_gpu):
    import cupy  # noqa: PLC0415
    from numba import cuda as numba_cuda  # noqa: PLC0415

    count = cupy.cuda.runtime.getDeviceCount()
    assert select_device(3, "cpu") is None
    try:
        for local_rank in range(count + 1):  # one more rank than GPUs: wraps around
            ordinal = select_device(local_rank)
            assert ordinal == local_rank % count
            assert cupy.cuda.Device().id == ordinal
            assert numba_cuda.get_current_device().id == ordinal
            # a kernel launched now runs on that device, on CuPy's arrays
            cols = kernels.im2col(cupy.ones((1, 1, 3, 3), dtype=cupy.float32), 2, 2)
            assert cols.device.id == ordinal and float(cols.sum()) == 16.0
    finally:
        select_device(0)


def test_cpu_backend_takes_device_arrays(only_on_gpu):
    import cupy  # noqa: PLC0415

    host = get_backend("cpu", "float64").asarray(cupy.arange(3, dtype=cupy.float32))
    assert isinstance(host, np.ndarray) and host.dtype == np.float64
    np.testing.assert_array_equal(host, [0.0, 1.0, 2.0])
