"""Residual connection: y = body(x) + shortcut(x)."""

from __future__ import annotations

from mpidl import kernels
from mpidl.engine.nn.module import Module

__all__ = ["Residual"]


class Residual(Module):
    """Add a block's output to its (possibly projected) input.

    Parameters
    ----------
    body : Module, ``x -> F(x)``
    shortcut : Module or None; ``None`` is the identity (then ``F(x)`` must have x's shape),
        otherwise e.g. a strided 1x1 convolution + batch norm when the shape changes

    Notes
    -----
    ``y = F(x) + S(x)``; since the sum passes its gradient unchanged to both terms,
    ``dL/dx = F'(dL/dy) + S'(dL/dy)`` (``S' = identity`` for the identity shortcut).
    The activation that usually follows the sum (as in ResNet) is a separate layer;
    ``build_model`` fuses the pair into :class:`mpidl.engine.nn.fused.FusedResidual` (same values).
    """

    def __init__(self, body: Module, shortcut: Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut

    def forward(self, x):
        y, skip = self._branches(x)
        return kernels.add(y, skip)

    def backward(self, dy):
        # The shortcut first: its parameters come after the body's in registration order, so
        # the gradients become final from the last parameter to the first, the order in which
        # an overlapped exchange sends the flat gradient (mpidl.distributed.extras.overlap).
        # The sum is the same either way (addition of two arrays commutes).
        skip = dy if self.shortcut is None else self.shortcut.backward(dy)
        return kernels.add(self.body.backward(dy), skip)

    def _branches(self, x):
        """``(F(x), S(x))``, checked to have one shape."""
        y = self.body.forward(x)
        skip = x if self.shortcut is None else self.shortcut.forward(x)
        if y.shape != skip.shape:
            raise ValueError(
                f"Residual: body output {tuple(y.shape)} and shortcut output {tuple(skip.shape)} differ; "
                f"give a projection shortcut"
            )
        return y, skip
