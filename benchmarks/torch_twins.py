"""PyTorch twins of mpidl's models, for ``benchmarks/step.py``: same layers, same parameter names.

``TWINS[name]`` describes how to benchmark the model ``name`` of ``mpidl.models.MODELS``: the
input shape and class count of the benchmark batch, and a builder ``build(build_args) ->
torch.nn.Module`` whose ``state_dict()`` keys equal mpidl's parameter and buffer names
(``model.net.named_parameters()`` / ``named_buffers()``: ``"0.weight"``,
``"3.0.body.1.running_mean"``, ...), so the twin starts from mpidl's initial weights by
``load_state_dict(..., strict=True)``. ``build_args`` is ``Model.build_args`` (the resolved
widths). A model without a twin is timed in mpidl only, and the table says so.

A session that adds a model to ``MODELS`` adds its twin here: one builder, one ``TWINS`` entry.

This module imports torch only inside the builders, and never imports mpidl: the PyTorch
worker process must see PyTorch's own default settings, not mpidl's thread policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Twin:
    """input_shape : (C, H, W) of one sample; num_classes : K; build : build_args -> torch module;
    kwargs : keyword arguments for ``build_model`` (widths), if any."""

    input_shape: tuple
    num_classes: int
    build: Callable[[dict], object]
    kwargs: dict = field(default_factory=dict)


def _torch_layers():
    """Small modules mpidl has and torch.nn spells differently (built on first use)."""
    import torch  # noqa: PLC0415

    class Residual(torch.nn.Module):
        """``body(x) + shortcut(x)`` (identity shortcut when None), as ``mpidl.nn.Residual``."""

        def __init__(self, body, shortcut=None):
            super().__init__()
            self.body = body
            self.shortcut = shortcut

        def forward(self, x):
            return self.body(x) + (x if self.shortcut is None else self.shortcut(x))

    class GlobalAvgPool2d(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    return torch.nn, Residual, GlobalAvgPool2d


def hsicnn(args: dict, batch_norm: bool = False):
    """conv3x3 -> [BN] -> ReLU -> conv3x3 -> [BN] -> ReLU -> maxpool 2 -> flatten -> linear ->
    ReLU -> [dropout] -> linear (``mpidl.models._hsicnn``)."""
    nn, _, _ = _torch_layers()
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
    nn, Residual, GlobalAvgPool2d = _torch_layers()
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
        return nn.Sequential(Residual(body, shortcut), nn.ReLU())

    return nn.Sequential(
        nn.Conv2d(channels, w0, 3, padding=1, bias=False), nn.BatchNorm2d(w0), nn.ReLU(),
        basic_block(w0, w0, 1), basic_block(w0, w1, 2), basic_block(w1, w2, 2),
        GlobalAvgPool2d(), nn.Linear(w2, args["num_classes"]),
    )


#: model name (of mpidl.models.MODELS) -> its benchmark batch and PyTorch twin
TWINS: dict[str, Twin] = {
    "hsicnn": Twin((156, 9, 9), 10, hsicnn),
    "hsicnn_bn": Twin((156, 9, 9), 10, lambda args: hsicnn(args, batch_norm=True)),
    "resnet8": Twin((3, 32, 32), 10, resnet8),
}
