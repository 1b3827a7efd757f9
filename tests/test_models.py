"""The model registry: every architecture builds, trains a little, and reports bad requests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradcheck import numerical_gradient
from mpidl.engine.backend import get_backend
from mpidl.engine.models import MODELS, build_model
from mpidl.engine.nn import BatchNorm2d, Conv2d, SoftmaxCrossEntropy

DEFAULT_SHAPES = {"hsicnn": (156, 9, 9), "hsicnn_bn": (156, 7, 7), "resnet8": (3, 32, 32),
                  "mlp": (156, 9, 9), "spectral_lstm": (156, 7, 7), "vit": (156, 7, 7)}
# Narrow versions for the slower checks.
TINY = {
    "hsicnn": dict(input_shape=(3, 5, 5), channels=(3, 4), hidden=6),
    "hsicnn_bn": dict(input_shape=(3, 4, 4), channels=(2, 3), hidden=5),
    "resnet8": dict(input_shape=(2, 8, 8), widths=(2, 3, 4)),
    "mlp": dict(input_shape=(5, 3, 3), hidden=(4, 3)),
    "spectral_lstm": dict(input_shape=(7, 3, 3), group=3, hidden=4),
    "vit": dict(input_shape=(3, 4, 4), patch=2, dim=4, depth=2, heads=2, mlp_dim=6),
}


def batch(input_shape, n=4, num_classes=3, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *input_shape)).astype(dtype), np.arange(n) % num_classes


def test_registry_names():
    assert set(MODELS) == {"hsicnn", "hsicnn_bn", "resnet8", "mlp", "spectral_lstm", "vit"}


@pytest.mark.parametrize("name", sorted(DEFAULT_SHAPES))
def test_builds_with_default_shapes_forward_and_backward(name):
    model = build_model(name, DEFAULT_SHAPES[name], num_classes=5)
    x, y = batch(DEFAULT_SHAPES[name], n=2, num_classes=5)
    logits = model.forward(x)
    assert logits.shape == (2, 5) and logits.dtype == np.float32
    loss_fn = SoftmaxCrossEntropy()
    loss_fn.forward(logits, y)
    model.params.grad.fill(np.nan)  # backward must overwrite every gradient
    model.backward(loss_fn.backward())
    assert np.all(np.isfinite(model.params.grad))
    for param in model.params:
        assert np.any(param.grad != 0), f"{param.name} got no gradient"


def test_hsicnn_has_no_batch_norm_and_hsicnn_bn_has():
    plain = build_model("hsicnn", (8, 7, 7), 3)
    assert not any(isinstance(m, BatchNorm2d) for m in plain.net.modules())
    assert plain.buffers_host() == {}
    with_bn = build_model("hsicnn_bn", (8, 7, 7), 3)
    assert sum(isinstance(m, BatchNorm2d) for m in with_bn.net.modules()) == 2


def test_hsicnn_default_widths_and_odd_patch():
    model = build_model("hsicnn", (156, 9, 9), 4)
    assert model.build_args["channels"] == [64, 64] and model.build_args["hidden"] == 128
    # 9x9 -> pool -> 4x4, so the first linear layer has 64 * 4 * 4 inputs
    assert model.params["6.weight"].shape == (128, 64 * 4 * 4)


@pytest.mark.parametrize("name", sorted(TINY))
def test_build_args_are_json_and_rebuild_the_same_model(name):
    model = build_model(name, num_classes=3, seed=5, **TINY[name])
    args = json.loads(json.dumps(model.build_args))
    assert args["name"] == name and args["num_classes"] == 3
    again = build_model(**args)
    assert again.params.names == model.params.names
    assert again.params.data.tobytes() == model.params.data.tobytes()


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="hsicnn.*resnet8"):
        build_model("vgg99", (3, 32, 32), 10)


@pytest.mark.parametrize(
    "name, shape, kwargs, match",
    [
        ("hsicnn", (10, 1, 1), {}, "2x2"),
        ("hsicnn_bn", (10, 1, 9), {}, "2x2"),
        ("resnet8", (3, 4, 4), {}, "8x8"),
        ("hsicnn", (10, 5), {}, "three"),
        ("hsicnn", (10, 5, 5), {"widths": (1, 2, 3)}, "widths"),
        ("resnet8", (3, 8, 8), {"widths": (4, 8)}, "three"),
        ("mlp", (10, 5, 5), {"hidden": 5},
         r"model 'mlp': argument 'hidden' \(--model-args\) must be a list of integers such as \[64, 64\], got 5"),
        ("spectral_lstm", (3, 32, 32), {}, r"spectral_lstm.*12 bands.*\(3, 32, 32\).*--model-args"),
        ("vit", (156, 7, 7), {"patch": 2}, r"vit: sub-patch 2.*7x7.*\(156, 7, 7\).*--model-args.*\[1, 7\]"),
        ("vit", (3, 8, 8), {"dim": 6, "heads": 4}, "heads dividing dim"),
    ],
)
def test_bad_requests_are_clear(name, shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, 3, **kwargs)


def test_bad_input_and_class_count():
    with pytest.raises(ValueError, match="num_classes"):
        build_model("hsicnn", (4, 5, 5), 1)
    model = build_model("hsicnn", (4, 5, 5), 3)
    with pytest.raises(ValueError, match=r"\(N, 4, 5, 5\)"):
        model.forward(np.zeros((2, 4, 6, 6), np.float32))


def test_first_layer_skips_its_input_gradient():
    model = build_model("resnet8", (3, 8, 8), 3)
    assert isinstance(model.net[0], Conv2d) and not model.net[0].compute_input_grad
    for name in ("mlp", "spectral_lstm", "vit"):
        model = build_model(name, num_classes=3, **TINY[name])
        assert not model.net[0].compute_input_grad
        x, y = batch(TINY[name]["input_shape"])
        loss_fn = SoftmaxCrossEntropy()
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())  # the first layer returns None: no error


def test_vit_tokens_for_patches_and_images():
    # one token per pixel of a 7x7 patch; 4x4 sub-patches of a 32x32 image (64 tokens)
    assert build_model("vit", (156, 7, 7), 3).build_args["patch"] == 1
    image = build_model("vit", (3, 32, 32), 10)
    assert image.build_args["patch"] == 4
    assert image.params["3.weight"].shape == (64 + 1, 64)  # positional embedding incl. the class token
    x, _ = batch((3, 32, 32), n=2)
    assert image.forward(x).shape == (2, 10)


def test_spectral_lstm_reads_the_centre_spectrum_in_band_groups():
    model = build_model("spectral_lstm", (30, 5, 5), 3, group=8)  # 4 steps, the last padded
    assert model.net[1].steps == 4 and model.params["2.weight_ih"].shape == (4 * 64, 8)
    x, _ = batch((30, 5, 5), n=2)
    y = model.forward(x)
    x2 = x.copy()
    x2[:, :, 0, 0] += 10.0  # a pixel off the centre changes nothing
    np.testing.assert_array_equal(model.forward(x2), y)


@pytest.mark.parametrize("name", sorted(TINY))
def test_parameter_gradients_of_whole_models_in_float64(name):
    """End to end: d(mean loss)/d(params) against central differences, on a random sample of
    coordinates that includes every parameter tensor (each layer is checked fully on its own)."""
    kwargs = dict(TINY[name])
    model = build_model(name, num_classes=3, seed=1, backend=get_backend("cpu", "float64"), **kwargs)
    x, y = batch(kwargs["input_shape"], n=3, dtype=np.float64)
    loss_fn = SoftmaxCrossEntropy()
    loss_fn.forward(model.forward(x), y)
    model.backward(loss_fn.backward())
    rng = np.random.default_rng(0)
    # two coordinates of every tensor, plus a random sample of all of them
    coords = [start + rng.integers(0, p.size, size=2) for p, start in zip(model.params, model.params.offsets)]
    coords = np.unique(np.concatenate(coords + [rng.integers(0, model.params.size, size=40)]))
    numeric = numerical_gradient(lambda: loss_fn.forward(model.forward(x), y), model.params.data, indices=coords)
    np.testing.assert_allclose(model.params.grad[coords], numeric, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_few_sgd_steps_reduce_the_loss(name):
    kwargs = dict(TINY[name])
    model = build_model(name, num_classes=3, seed=0, **kwargs)
    x, y = batch(kwargs["input_shape"], n=6, seed=2)
    loss_fn = SoftmaxCrossEntropy()
    losses = []
    for _ in range(4):
        losses.append(loss_fn.forward(model.forward(x), y))
        model.backward(loss_fn.backward())
        model.params.data -= 0.1 * model.params.grad
    assert losses[-1] < losses[0]


def test_train_eval_and_buffers_round_trip():
    kwargs = dict(TINY["resnet8"])
    model = build_model("resnet8", num_classes=3, **kwargs)
    x, _ = batch(kwargs["input_shape"], n=4)
    assert model.training
    model.forward(x)  # updates the running statistics
    saved = model.buffers_host()
    assert all(isinstance(v, np.ndarray) for v in saved.values()) and len(saved) == 2 * 9  # stem, 2 per block, 1 per projection shortcut
    model.eval()
    assert not model.training
    eval_logits = model.forward(x)
    np.testing.assert_array_equal(model.forward(x), eval_logits)  # deterministic in eval

    fresh = build_model("resnet8", num_classes=3, **kwargs).eval()
    assert not np.allclose(fresh.forward(x), eval_logits)
    fresh.load_buffers_host(saved)
    np.testing.assert_array_equal(fresh.forward(x), eval_logits)
    with pytest.raises(KeyError):
        fresh.load_buffers_host({})


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_first_layer_with_parameters_computes_no_input_gradient(name):
    """Nobody needs dL/dx of the data (PyTorch's autograd does not compute it either): the
    first layer with parameters (hsicnn's convolution, mlp's Linear, spectral_lstm's LSTM,
    vit's token embedding) is told not to compute it, backward stops there, and the parameter
    gradients are those of a model that computes every input gradient."""
    model = build_model(name, num_classes=3, **TINY[name])
    first = next(layer for layer in model.net.layers if layer.named_parameters())
    assert first.compute_input_grad is False
    x, y = batch(TINY[name]["input_shape"])
    loss_fn = SoftmaxCrossEntropy()
    loss_fn.forward(model.forward(x), y)
    assert model.net.backward(model.backend.asarray(loss_fn.backward())) is None
    skipped = np.array(model.params.grad, copy=True)
    for layer in model.net.layers:
        if hasattr(layer, "compute_input_grad"):
            layer.compute_input_grad = True
    loss_fn.forward(model.forward(x), y)
    assert model.net.backward(model.backend.asarray(loss_fn.backward())) is not None
    np.testing.assert_allclose(skipped, model.params.grad, rtol=1e-6, atol=1e-7)
