"""Named architectures and the Model wrapper that ties a network to its flat parameters.

=============  ======================================================================  ===========================
name           architecture                                                            meant for
=============  ======================================================================  ===========================
``hsicnn``     conv3x3 -> ReLU -> conv3x3 -> ReLU -> maxpool 2x2 -> flatten ->         hyperspectral patches
               linear -> ReLU -> (dropout) -> linear; no batch norm                    (C bands x P x P, P >= 2)
``hsicnn_bn``  the same with BatchNorm2d after each convolution                        the same
``resnet8``    conv3x3(16)+BN+ReLU, three basic residual blocks (16, 32/2, 64/2),     small images (3 x 32 x 32)
               global average pool, linear
``mlp``        the centre pixel's C-band spectrum -> linear(128) -> ReLU ->            hyperspectral patches
               linear(128) -> ReLU -> linear                                            (any P; a spectral baseline)
``spectral_    the centre pixel's spectrum read as T = ceil(C / 12) steps of 12        hyperspectral patches
lstm``         bands (the last zero-padded) -> LSTM(64), last hidden state -> linear
``vit``        p x p sub-patches as tokens (C*p*p values) -> linear(64) -> class      hyperspectral patches
               token + learned positional embedding -> 2 pre-norm encoder blocks      (p = 1: one token per
               (4 heads, MLP 128, GELU) -> LayerNorm -> class token -> linear         pixel) and images
=============  ======================================================================  ===========================

The width arguments of every model can be passed from the command line as a JSON object,
``--model-args '{"patch": 2}'``.

:func:`build_model` is the only entry point: it checks the input shape, builds the network,
binds every parameter into one :class:`~mpidl.engine.params.FlatParameters` (deterministic from
``seed``) and moves the buffers to the backend. ``Model.build_args`` is a JSON-serializable
dict with which ``build_model(**build_args)`` rebuilds the same architecture (checkpoints
store it).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from mpidl.engine.backend import Backend, get_backend, to_host
from mpidl.engine.nn import (
    LSTM,
    BandGroups,
    BatchNorm2d,
    CenterPixel,
    ClassToken,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool2d,
    LayerNorm,
    Linear,
    MaxPool2d,
    Module,
    Patchify,
    PositionalEmbedding,
    ReLU,
    Residual,
    SelectToken,
    Sequential,
    Tokenwise,
    TransformerEncoderBlock,
)
from mpidl.engine.nn.fused import fuse_batchnorm_relu, fuse_residual_relu
from mpidl.engine.params import FlatParameters

__all__ = ["MODELS", "Model", "build_model", "check_model_args", "default_vit_patch"]


# --------------------------------------------------------------------------------------------
# architectures: builder(input_shape, num_classes, seed, **widths) -> (net, resolved widths)
# --------------------------------------------------------------------------------------------


def _hsicnn(
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int,
    *,
    channels: Sequence[int] = (64, 64),
    hidden: int = 128,
    dropout: float = 0.0,
    batch_norm: bool = False,
    name: str = "hsicnn",
) -> tuple[Module, dict]:
    bands, height, width = input_shape
    if height < 2 or width < 2:
        raise ValueError(
            f"{name} needs patches of at least 2x2 pixels (it max-pools 2x2), got input_shape {tuple(input_shape)}"
        )
    channels = [int(c) for c in channels]
    if len(channels) != 2 or min(channels) < 1 or hidden < 1:
        raise ValueError(f"{name}: channels must be two positive ints and hidden >= 1, got {channels}, {hidden}")

    def conv_block(c_in: int, c_out: int) -> list[Module]:
        # Batch norm cancels a conv bias (it subtracts the channel mean), so drop the bias then.
        layers: list[Module] = [Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm)]
        if batch_norm:
            layers.append(BatchNorm2d(c_out))
        layers.append(ReLU())
        return layers

    # 3x3 convolutions with padding 1 keep H x W; the 2x2 max pool floors odd sizes (9 -> 4).
    flat_features = channels[1] * (height // 2) * (width // 2)
    head: list[Module] = [Flatten(), Linear(flat_features, hidden), ReLU()]
    if dropout > 0:
        head.append(Dropout(dropout, seed=seed))
    head.append(Linear(hidden, num_classes))
    net = Sequential(
        *conv_block(bands, channels[0]),
        *conv_block(channels[0], channels[1]),
        MaxPool2d(2),
        *head,
    )
    return net, {"channels": channels, "hidden": int(hidden), "dropout": float(dropout)}


def _hsicnn_bn(
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int,
    *,
    channels: Sequence[int] = (64, 64),
    hidden: int = 128,
    dropout: float = 0.0,
) -> tuple[Module, dict]:
    return _hsicnn(
        input_shape, num_classes, seed, channels=channels, hidden=hidden, dropout=dropout, batch_norm=True, name="hsicnn_bn"
    )


def _basic_block(c_in: int, c_out: int, stride: int) -> Module:
    """ResNet basic block: ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; the shortcut
    is a strided 1x1 convolution + batch norm when the shape changes, else the identity."""
    body = Sequential(
        Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        BatchNorm2d(c_out),
        ReLU(),
        Conv2d(c_out, c_out, 3, padding=1, bias=False),
        BatchNorm2d(c_out),
    )
    shortcut = None
    if stride != 1 or c_in != c_out:
        shortcut = Sequential(Conv2d(c_in, c_out, 1, stride=stride, bias=False), BatchNorm2d(c_out))
    return Sequential(Residual(body, shortcut), ReLU())


def _resnet8(
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int,
    *,
    widths: Sequence[int] = (16, 32, 64),
) -> tuple[Module, dict]:
    channels, height, width = input_shape
    if height < 8 or width < 8:
        raise ValueError(
            f"resnet8 halves the resolution twice and needs inputs of at least 8x8 pixels, "
            f"got input_shape {tuple(input_shape)}"
        )
    widths = [int(w) for w in widths]
    if len(widths) != 3 or min(widths) < 1:
        raise ValueError(f"resnet8: widths must be three positive ints, got {widths}")
    net = Sequential(
        Conv2d(channels, widths[0], 3, padding=1, bias=False),
        BatchNorm2d(widths[0]),
        ReLU(),
        _basic_block(widths[0], widths[0], stride=1),
        _basic_block(widths[0], widths[1], stride=2),
        _basic_block(widths[1], widths[2], stride=2),
        GlobalAvgPool2d(),
        Linear(widths[2], num_classes),
    )
    return net, {"widths": widths}


def _mlp(
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int,
    *,
    hidden: Sequence[int] = (128, 128),
) -> tuple[Module, dict]:
    bands = input_shape[0]
    hidden = [int(h) for h in hidden]
    if not hidden or min(hidden) < 1:
        raise ValueError(f"mlp: hidden must be one or more positive ints, got {hidden}")
    layers: list[Module] = [CenterPixel()]
    width = bands
    for h in hidden:
        layers += [Linear(width, h), ReLU()]
        width = h
    layers.append(Linear(width, num_classes))
    return Sequential(*layers), {"hidden": hidden}


def _spectral_lstm(
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int,
    *,
    group: int = 12,
    hidden: int = 64,
) -> tuple[Module, dict]:
    bands = input_shape[0]
    group, hidden = int(group), int(hidden)
    if group < 1 or hidden < 1:
        raise ValueError(f"spectral_lstm: group and hidden must be positive, got group={group}, hidden={hidden}")
    if group > bands:
        raise ValueError(
            f"spectral_lstm: a group of {group} bands is more than the {bands} bands of input_shape "
            f"{tuple(input_shape)}; pass --model-args '{{\"group\": {max(1, bands // 4)}}}' (at most {bands})"
        )
    net = Sequential(CenterPixel(), BandGroups(bands, group), LSTM(group, hidden), Linear(hidden, num_classes))
    return net, {"group": group, "hidden": hidden}


def default_vit_patch(height: int, width: int, max_tokens: int = 64) -> int:
    """The sub-patch size ``vit`` uses when none is given: the smallest p dividing both H and
    W with at most ``max_tokens`` tokens ``(H/p)*(W/p)`` (1 for a 7x7 patch, 4 for 32x32)."""
    for p in range(1, min(height, width) + 1):
        if height % p == 0 and width % p == 0 and (height // p) * (width // p) <= max_tokens:
            return p
    return 1


def _vit(
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int,
    *,
    patch: int | None = None,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
    mlp_dim: int = 128,
) -> tuple[Module, dict]:
    channels, height, width = input_shape
    patch = default_vit_patch(height, width) if patch is None else int(patch)
    if patch < 1 or height % patch or width % patch:
        fits = [p for p in range(1, min(height, width) + 1) if height % p == 0 and width % p == 0]
        raise ValueError(
            f"vit: sub-patch {patch} does not divide the {height}x{width} pixels of input_shape "
            f"{tuple(input_shape)}; pass --model-args '{{\"patch\": P}}' with P one of {fits}, "
            f"or convert the data with a patch size that is a multiple of {patch}"
        )
    dim, depth, heads, mlp_dim = int(dim), int(depth), int(heads), int(mlp_dim)
    if min(dim, depth, heads, mlp_dim) < 1 or dim % heads:
        raise ValueError(
            f"vit: dim, depth, heads and mlp_dim must be positive with heads dividing dim, "
            f"got dim={dim}, depth={depth}, heads={heads}, mlp_dim={mlp_dim}"
        )
    tokens = (height // patch) * (width // patch)
    net = Sequential(
        Patchify(patch),
        Tokenwise(Linear(channels * patch * patch, dim)),
        ClassToken(dim),
        PositionalEmbedding(tokens + 1, dim),
        *[TransformerEncoderBlock(dim, heads, mlp_dim) for _ in range(depth)],
        LayerNorm(dim),
        SelectToken(0),
        Linear(dim, num_classes),
    )
    return net, {"patch": patch, "dim": dim, "depth": depth, "heads": heads, "mlp_dim": mlp_dim}


#: name -> builder(input_shape, num_classes, seed, **widths) -> (net, resolved widths)
MODELS: dict[str, Callable[..., tuple[Module, dict]]] = {
    "hsicnn": _hsicnn,
    "hsicnn_bn": _hsicnn_bn,
    "resnet8": _resnet8,
    "mlp": _mlp,
    "spectral_lstm": _spectral_lstm,
    "vit": _vit,
}

# The keyword arguments a caller may pass to each builder (the internal ones of _hsicnn
# excluded), each with its kind: "ints" a list of integers, "int" an integer, "int?" an
# integer or null (the builder's default), "fraction" a number in [0, 1).
_PUBLIC_KWARGS = {
    "hsicnn": {"channels": "ints", "hidden": "int", "dropout": "fraction"},
    "hsicnn_bn": {"channels": "ints", "hidden": "int", "dropout": "fraction"},
    "resnet8": {"widths": "ints"},
    "mlp": {"hidden": "ints"},
    "spectral_lstm": {"group": "int", "hidden": "int"},
    "vit": {"patch": "int?", "dim": "int", "depth": "int", "heads": "int", "mlp_dim": "int"},
}
_KIND_WORDS = {"ints": "a list of integers such as [64, 64]", "int": "an integer such as 64",
               "int?": "an integer such as 2, or null for the default",
               "fraction": "a number in [0, 1) such as 0.5"}


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _fits(kind: str, value) -> bool:
    if kind == "ints":
        return isinstance(value, (list, tuple)) and all(_is_int(v) for v in value)
    if kind == "int?":
        return value is None or _is_int(value)
    if kind == "int":
        return _is_int(value)
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and 0 <= value < 1)


def check_model_args(name: str, kwargs: Mapping) -> None:
    """Check the width arguments of model ``name`` (``--model-args``): every name is one the
    model takes and every value has its kind; raises ValueError naming the argument, the
    kind expected and the value given."""
    allowed = _PUBLIC_KWARGS[name]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"model {name!r} takes no argument(s) {unknown}; it takes {list(allowed)}")
    for key, value in kwargs.items():
        if not _fits(allowed[key], value):
            raise ValueError(f"model {name!r}: argument {key!r} (--model-args) must be "
                             f"{_KIND_WORDS[allowed[key]]}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class Model:
    """A network, its flat parameters and how to rebuild it.

    Attributes
    ----------
    name : registry name; build_args : JSON-serializable dict for ``build_model(**build_args)``
    net : the root Module; params : FlatParameters (``params.data`` / ``params.grad``)
    backend : Backend; input_shape : (C, H, W); num_classes : K

    Notes
    -----
    ``forward`` runs in whatever mode was last set with :meth:`train` / :meth:`eval` (a new
    model is in training mode); it never switches the mode itself. ``backward`` overwrites
    ``params.grad`` with ``dL/dparams`` for the last forward, so no ``zero_grad`` is needed.
    The layers up to the first with parameters do not compute their input gradient (nobody
    needs ``dL/dx`` of the data).
    """

    def __init__(self, name: str, build_args: dict, net: Module, backend: Backend, seed: int):
        self.name = name
        self.build_args = build_args
        self.net = net
        self.backend = backend
        self.input_shape = tuple(build_args["input_shape"])
        self.num_classes = int(build_args["num_classes"])
        # Batch norm + ReLU, and a residual sum + ReLU, as one kernel pair each
        # (mpidl/engine/nn/fused.py): same names, same results.
        fuse_batchnorm_relu(net)
        fuse_residual_relu(net)
        self.params = FlatParameters(net.named_parameters(), backend, seed)
        net.to(backend)
        # Nobody needs dL/dx of the data: the layers up to the first one with parameters
        # (spectral_lstm: CenterPixel, BandGroups, LSTM) are told not to compute it.
        for layer in net.layers if isinstance(net, Sequential) else ():
            if hasattr(layer, "compute_input_grad"):
                layer.compute_input_grad = False
            if layer.named_parameters():
                break

    @property
    def training(self) -> bool:
        return self.net.training

    def train(self, mode: bool = True) -> "Model":
        self.net.train(mode)
        return self

    def eval(self) -> "Model":
        return self.train(False)

    def forward(self, x):
        """``x : (N, C, H, W)`` (host or device array) -> ``logits : (N, K)`` on the backend's device."""
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.name} expects input (N, {', '.join(map(str, self.input_shape))}), got {tuple(x.shape)}")
        # A no-op for arrays already on the backend's device in its dtype.
        return self.net.forward(self.backend.asarray(x))

    __call__ = forward

    def backward(self, dlogits) -> None:
        """``dlogits : (N, K)`` -> fills ``params.grad``."""
        self.net.backward(self.backend.asarray(dlogits))

    def named_buffers(self) -> list[tuple[str, object]]:
        return self.net.named_buffers()

    def buffers_host(self) -> dict[str, np.ndarray]:
        """Host copies of the non-trainable state (batch-norm running statistics)."""
        return {name: to_host(buffer).copy() for name, buffer in self.net.named_buffers()}

    def load_buffers_host(self, mapping: Mapping[str, np.ndarray]) -> None:
        """Copy buffer values in place. KeyError naming missing / unexpected names, ValueError on shapes."""
        buffers = dict(self.net.named_buffers())
        missing = [n for n in buffers if n not in mapping]
        unexpected = [n for n in mapping if n not in buffers]
        if missing or unexpected:
            raise KeyError(f"buffer names do not match: missing {missing}, unexpected {unexpected}")
        for name, buffer in buffers.items():
            if tuple(np.shape(mapping[name])) != tuple(buffer.shape):
                raise ValueError(f"buffer {name}: got shape {np.shape(mapping[name])}, expected {tuple(buffer.shape)}")
        for name, buffer in buffers.items():
            buffer[...] = self.backend.asarray(to_host(mapping[name]), dtype=buffer.dtype)

    def __repr__(self) -> str:
        return f"Model({self.name!r}, input_shape={self.input_shape}, num_classes={self.num_classes}, params={self.params.size})"


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    backend: Backend | None = None,
    seed: int = 0,
    **kwargs,
) -> Model:
    """Build a registered architecture with its flat parameters.

    Parameters
    ----------
    name : one of ``MODELS`` (hsicnn, hsicnn_bn, resnet8, mlp, spectral_lstm, vit)
    input_shape : (C, H, W) of one sample
    num_classes : K >= 2
    backend : device and dtype (default CPU float32)
    seed : initial values are drawn from ``np.random.default_rng(seed)``
    **kwargs : widths of the architecture (hsicnn: ``channels=(64, 64)``, ``hidden=128``,
        ``dropout=0.0``; resnet8: ``widths=(16, 32, 64)``; mlp: ``hidden=(128, 128)``;
        spectral_lstm: ``group=12``, ``hidden=64``; vit: ``patch=None`` (see
        :func:`default_vit_patch`), ``dim=64``, ``depth=2``, ``heads=4``, ``mlp_dim=128``)

    Raises
    ------
    ValueError
        Unknown name (the message lists the known ones), bad input shape or widths, or an input
        shape the model cannot take (the message names the model, the shape and the fix).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    input_shape = tuple(int(s) for s in input_shape)
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ValueError(f"input_shape must be three positive ints (C, H, W), got {input_shape}")
    if int(num_classes) < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    check_model_args(name, kwargs)
    backend = backend if backend is not None else get_backend()
    net, widths = MODELS[name](input_shape, int(num_classes), int(seed), **kwargs)
    build_args = {
        "name": name,
        "input_shape": list(input_shape),
        "num_classes": int(num_classes),
        "seed": int(seed),
        **widths,
    }
    return Model(name, build_args, net, backend, int(seed))
