"""Layers: each a forward / backward pair written once against ``xp`` (NumPy or CuPy).

See :mod:`mpidl.engine.nn.module` for the contract (backward overwrites parameter gradients and
returns the input gradient; parameters are views into one flat buffer).
"""

from mpidl.engine.nn.activation import GELU, LeakyReLU, ReLU, Sigmoid, Tanh
from mpidl.engine.nn.attention import (
    ClassToken,
    MultiHeadSelfAttention,
    PositionalEmbedding,
    SelectToken,
    Tokenwise,
    TransformerEncoderBlock,
)
from mpidl.engine.nn.conv import Conv2d
from mpidl.engine.nn.dropout import Dropout
from mpidl.engine.nn.linear import Flatten, Linear
from mpidl.engine.nn.loss import BCEWithLogits, MSELoss, SoftmaxCrossEntropy
from mpidl.engine.nn.module import Module, Sequential
from mpidl.engine.nn.norm import BatchNorm1d, BatchNorm2d, LayerNorm
from mpidl.engine.nn.pool import AvgPool2d, GlobalAvgPool2d, MaxPool2d
from mpidl.engine.nn.recurrent import GRU, LSTM
from mpidl.engine.nn.residual import Residual
from mpidl.engine.nn.tokens import BandGroups, CenterPixel, Patchify

__all__ = [
    "Module",
    "Sequential",
    "Conv2d",
    "MaxPool2d",
    "AvgPool2d",
    "GlobalAvgPool2d",
    "Linear",
    "Flatten",
    "ReLU",
    "LeakyReLU",
    "Dropout",
    "BatchNorm2d",
    "Residual",
    "SoftmaxCrossEntropy",
    "BCEWithLogits",
    "MSELoss",
    "GELU",
    "Tanh",
    "Sigmoid",
    "BatchNorm1d",
    "LayerNorm",
    "LSTM",
    "GRU",
    "MultiHeadSelfAttention",
    "PositionalEmbedding",
    "ClassToken",
    "SelectToken",
    "Tokenwise",
    "TransformerEncoderBlock",
    "CenterPixel",
    "BandGroups",
    "Patchify",
]
