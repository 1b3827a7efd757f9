"""Inverted dropout with its own seeded random generator."""

from __future__ import annotations

from mpidl.engine.backend import get_array_module
from mpidl.engine.nn.module import Module

__all__ = ["Dropout"]


class Dropout(Module):
    """Zero each element with probability ``p`` during training; identity in evaluation.

    Parameters
    ----------
    p : drop probability, ``0 <= p < 1``
    seed : seed of the layer's own generator (``xp.random.default_rng(seed)``, created on the
        first forward on the input's device), so masks do not depend on any global state

    Notes
    -----
    Inverted scaling: ``y = x * m / (1 - p)`` with ``m ~ Bernoulli(1 - p)``, so
    ``E[y] = x`` and evaluation needs no rescaling. ``dL/dx = dL/dy * m / (1 - p)``; only the
    scaled mask is saved for backward. The mask sequence depends on the device (NumPy and CuPy
    generators differ), not on the process: give each rank its own seed if the masks should differ.
    """

    def __init__(self, p: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = float(p)
        self.seed = int(seed)
        self._rng = None
        self._rng_xp = None  # the array module the generator belongs to
        self._scaled_mask = None

    def reseed(self, seed: int) -> None:
        """Restart the mask sequence from ``seed``."""
        self.seed = int(seed)
        self._rng = None

    def forward(self, x):
        if not self.training or self.p == 0.0:
            self._scaled_mask = None
            return x
        xp = get_array_module(x)
        if self._rng is None or self._rng_xp is not xp:
            self._rng, self._rng_xp = xp.random.default_rng(self.seed), xp
        keep = self._rng.random(x.shape, dtype=x.dtype) >= self.p
        self._scaled_mask = keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))
        return x * self._scaled_mask

    def backward(self, dy):
        # Evaluation mode (or p = 0) was the identity, so is its gradient.
        if self._scaled_mask is None:
            return dy
        return dy * self._scaled_mask

    def _drop_workspaces(self) -> None:
        self._rng = None

    def extra_repr(self) -> str:
        return f"p={self.p}, seed={self.seed}"
