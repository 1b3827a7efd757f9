"""PyTorch twins of every model of mpidl: the same layers, starting from mpidl's weights.

``TWINS[name]``, for every model ``name`` of ``mpidl.engine.models.MODELS``, holds the benchmark
sample shape and class count (``benchmarks/step.py`` times a batch of 64 of them) and a
builder ``build(build_args) -> torch.nn.Module``; ``build_args`` is ``Model.build_args`` (the
resolved widths), so a twin needs no mpidl object to be built.

One rule gives a twin mpidl's weights, :func:`load_weights`: mpidl's parameters pair with
``net.named_parameters()`` and mpidl's buffers with ``net.named_buffers()`` (less BatchNorm's
``num_batches_tracked``, which mpidl does not keep) **in registration order**, every shape
checked; a count or shape that differs raises. The names need not match (``nn.LSTM`` calls
mpidl's ``weight_ih`` ``weight_ih_l0``); where torch allows it the twins use mpidl's names
(the CNNs' and mlp's ``state_dict`` keys are mpidl's). Two same-shaped values swapped would
pass the shape check: ``tests/test_twins.py`` catches that, checking every twin's loss and
gradients against mpidl's in float64. :func:`twin_of` builds the twin of an mpidl Model with
its current weights.

Used by ``benchmarks/step.py`` (one training step; its PyTorch worker builds the twin from
weights an mpidl worker saved), ``benchmarks/twins_torch.py`` (training to test accuracy) and
the tests. A session that adds a model to ``MODELS`` adds its twin here: one builder, one
``TWINS`` entry.

This module imports torch (and NumPy) only inside its functions, and never imports mpidl:
step.py's PyTorch worker must see PyTorch's own default settings, not mpidl's thread policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable


@dataclass(frozen=True)
class Twin:
    """input_shape : (C, H, W) of one benchmark sample; num_classes : K; build : build_args ->
    torch module; kwargs : keyword arguments for ``build_model`` (widths), if any."""

    input_shape: tuple
    num_classes: int
    build: Callable[[dict], object]
    kwargs: dict = field(default_factory=dict)


def _torch_layers():
    """``torch.nn`` and the small modules mpidl has and torch.nn spells differently (built on
    first use)."""
    import torch  # noqa: PLC0415

    class Residual(torch.nn.Module):
        """``body(x) + shortcut(x)`` (identity shortcut when None), as ``mpidl.engine.nn.Residual``."""

        def __init__(self, body, shortcut=None):
            super().__init__()
            self.body = body
            self.shortcut = shortcut

        def forward(self, x):
            return self.body(x) + (x if self.shortcut is None else self.shortcut(x))

    class GlobalAvgPool2d(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    class CenterPixel(torch.nn.Module):
        """(N, C, H, W) -> (N, C): the centre pixel's spectrum, as ``mpidl.engine.nn.CenterPixel``."""

        def forward(self, x):
            return x[:, :, x.shape[2] // 2, x.shape[3] // 2]

    return SimpleNamespace(nn=torch.nn, Residual=Residual, GlobalAvgPool2d=GlobalAvgPool2d, CenterPixel=CenterPixel)


def hsicnn(args: dict, batch_norm: bool = False):
    """conv3x3 -> [BN] -> ReLU -> conv3x3 -> [BN] -> ReLU -> maxpool 2 -> flatten -> linear ->
    ReLU -> [dropout] -> linear (``mpidl.engine.models._hsicnn``)."""
    nn = _torch_layers().nn
    bands, height, width = args["input_shape"]
    c1, c2 = args["channels"]

    def block(c_in, c_out):
        layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm)]
        if batch_norm:
            layers.append(nn.BatchNorm2d(c_out))
        return layers + [nn.ReLU()]

    head = [nn.Flatten(), nn.Linear(c2 * (height // 2) * (width // 2), args["hidden"]), nn.ReLU()]
    if args.get("dropout", 0.0) > 0:
        head.append(nn.Dropout(args["dropout"]))
    head.append(nn.Linear(args["hidden"], args["num_classes"]))
    return nn.Sequential(*block(bands, c1), *block(c1, c2), nn.MaxPool2d(2), *head)


def resnet8(args: dict):
    """conv3x3 + BN + ReLU, three basic blocks, global average pool, linear (``_resnet8``)."""
    t = _torch_layers()
    nn = t.nn
    channels = args["input_shape"][0]
    w0, w1, w2 = args["widths"]

    def basic_block(c_in, c_out, stride):
        body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
        )
        shortcut = None
        if stride != 1 or c_in != c_out:
            shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        return nn.Sequential(t.Residual(body, shortcut), nn.ReLU())

    return nn.Sequential(
        nn.Conv2d(channels, w0, 3, padding=1, bias=False), nn.BatchNorm2d(w0), nn.ReLU(),
        basic_block(w0, w0, 1), basic_block(w0, w1, 2), basic_block(w1, w2, 2),
        t.GlobalAvgPool2d(), nn.Linear(w2, args["num_classes"]),
    )


def mlp(args: dict):
    """centre pixel -> [linear -> ReLU] per hidden width -> linear (``_mlp``; mpidl's names)."""
    t = _torch_layers()
    nn = t.nn
    layers, width = [t.CenterPixel()], args["input_shape"][0]
    for h in args["hidden"]:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, args["num_classes"]))


def spectral_lstm(args: dict):
    """centre pixel -> zero-padded groups of ``group`` bands as steps -> ``nn.LSTM``
    (batch_first) -> last hidden state -> linear (``_spectral_lstm``)."""
    t = _torch_layers()
    nn = t.nn
    bands, group, hidden = args["input_shape"][0], args["group"], args["hidden"]
    steps = -(-bands // group)

    class BandGroups(nn.Module):
        def forward(self, s):
            return nn.functional.pad(s, (0, steps * group - bands)).reshape(s.shape[0], steps, group)

    class LastHidden(nn.LSTM):
        """``nn.LSTM`` returning the last step's hidden state (its parameters are nn.LSTM's)."""

        def forward(self, s):
            return super().forward(s)[0][:, -1]

    return nn.Sequential(t.CenterPixel(), BandGroups(), LastHidden(group, hidden, batch_first=True),
                         nn.Linear(hidden, args["num_classes"]))


def vit(args: dict):
    """p x p sub-patch tokens -> linear embedding -> class token + positional embedding ->
    pre-norm blocks (``nn.MultiheadAttention``, GELU MLP) -> LayerNorm -> class token ->
    linear (``_vit``)."""
    import torch  # noqa: PLC0415

    nn = torch.nn
    c, h, w = args["input_shape"]
    p, dim, heads, mlp_dim = args["patch"], args["dim"], args["heads"], args["mlp_dim"]
    tokens = (h // p) * (w // p)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim)
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
            self.norm2 = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, mlp_dim)
            self.fc2 = nn.Linear(mlp_dim, dim)

        def forward(self, x):
            u = self.norm1(x)
            x = x + self.attn(u, u, u, need_weights=False)[0]
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))

    class Tokens(nn.Module):
        """The class token and the positional embedding (a module of their own, so that they
        come right after the embedding in registration order, as in mpidl)."""

        def __init__(self):
            super().__init__()
            self.cls = nn.Parameter(torch.zeros(dim))
            self.pos = nn.Parameter(torch.zeros(tokens + 1, dim))

        def forward(self, t):
            return torch.cat([self.cls.expand(t.shape[0], 1, dim), t], dim=1) + self.pos

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(c * p * p, dim)
            self.tokens = Tokens()
            self.blocks = nn.Sequential(*[Block() for _ in range(args["depth"])])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, args["num_classes"])

        def forward(self, x):
            n = x.shape[0]
            t = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, tokens, c * p * p)
            t = self.tokens(self.embed(t))
            return self.head(self.norm(self.blocks(t))[:, 0])

    return ViT()


#: Samson as the README converts it (``python -m mpidl.data_tools hsi ... --patch 7``): 156
#: bands, 7x7 patches, 3 endmembers; the sample shape of the spectral and attention models'
#: runs (vit's default sub-patch there is 1: 49 pixel tokens and the class token)
SAMSON_SAMPLE, SAMSON_CLASSES = (156, 7, 7), 3

#: model name (of mpidl.engine.models.MODELS) -> its benchmark batch and PyTorch twin
TWINS: dict[str, Twin] = {
    "hsicnn": Twin((156, 9, 9), 10, hsicnn),
    "hsicnn_bn": Twin((156, 9, 9), 10, lambda args: hsicnn(args, batch_norm=True)),
    "resnet8": Twin((3, 32, 32), 10, resnet8),
    "mlp": Twin(SAMSON_SAMPLE, SAMSON_CLASSES, mlp),
    "spectral_lstm": Twin(SAMSON_SAMPLE, SAMSON_CLASSES, spectral_lstm),
    "vit": Twin(SAMSON_SAMPLE, SAMSON_CLASSES, vit),
}


def load_weights(net, parameters, buffers=()):
    """Copy mpidl's weights into the twin ``net`` in place and return ``net``.

    parameters, buffers : sequences of (name, array) in mpidl's registration order (those of
    ``model.net.named_parameters()``, ``model.net.named_buffers()``); they pair with
    ``net.named_parameters()`` and ``net.named_buffers()`` (less ``num_batches_tracked``)
    position by position, and the values take the twin's dtype. RuntimeError, listing both
    layouts, when the counts or any shape differ."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    pairs = []
    for kind, ours, theirs in (
        ("parameters", list(parameters), list(net.named_parameters())),
        ("buffers", list(buffers), [(n, b) for n, b in net.named_buffers() if not n.endswith("num_batches_tracked")]),
    ):
        if len(ours) != len(theirs) or any(np.shape(a) != tuple(b.shape) for (_, a), (_, b) in zip(ours, theirs)):
            raise RuntimeError(f"{type(net).__name__}: the {kind} differ: mpidl {[(n, np.shape(a)) for n, a in ours]}, "
                               f"torch {[(n, tuple(b.shape)) for n, b in theirs]}")
        pairs += [(a, b) for (_, a), (_, b) in zip(ours, theirs)]
    with torch.no_grad():
        for value, tensor in pairs:
            tensor.copy_(torch.from_numpy(np.asarray(value)))
    return net


def twin_of(model):
    """The twin of the mpidl ``Model`` ``model`` (on the CPU backend), holding its current weights."""
    net = TWINS[model.name].build(model.build_args)
    return load_weights(net, [(n, p.data) for n, p in model.net.named_parameters()], model.net.named_buffers())

