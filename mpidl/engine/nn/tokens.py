"""Layers that read a patch (N, C, H, W) as a vector or a sequence: the centre pixel's
spectrum, its bands in groups, and sub-patch tokens. No parameters."""

from __future__ import annotations

from mpidl.engine.backend import get_array_module
from mpidl.engine.nn.module import Module

__all__ = ["CenterPixel", "BandGroups", "Patchify"]


class CenterPixel(Module):
    """The centre pixel of each patch: ``y[n, c] = x[n, c, H // 2, W // 2]``.

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, C). For an even size the pixel right/below the centre.

    Notes
    -----
    Backward puts ``dy`` at the centre and zeros elsewhere. As the first layer of a model it
    is told not to compute its input gradient (``compute_input_grad = False``) and returns None.
    """

    def __init__(self) -> None:
        super().__init__()
        self.compute_input_grad = True
        self._shape: tuple | None = None

    def forward(self, x):
        if x.ndim != 4:
            raise ValueError(f"CenterPixel expects (N, C, H, W), got {tuple(x.shape)}")
        self._shape = tuple(x.shape)
        return x[:, :, x.shape[2] // 2, x.shape[3] // 2]

    def backward(self, dy):
        if self._shape is None:
            raise RuntimeError("CenterPixel.backward called before forward")
        if not self.compute_input_grad:
            return None
        dx = get_array_module(dy).zeros(self._shape, dtype=dy.dtype)
        dx[:, :, self._shape[2] // 2, self._shape[3] // 2] = dy
        return dx


class BandGroups(Module):
    """A spectrum read as a sequence of T groups of ``group`` consecutive bands.

    Shapes
    ------
    x : (N, C) -> y : (N, T, group), ``T = ceil(C / group)``: ``y[n, t, j] = x[n, t*group + j]``,
    zero where ``t*group + j >= C`` (the last group is padded with zeros).

    Notes
    -----
    Backward: ``dx[n, b] = dy[n, b // group, b % group]`` (the padding's gradient is dropped).
    """

    def __init__(self, num_bands: int, group: int) -> None:
        super().__init__()
        if num_bands < 1 or group < 1:
            raise ValueError(f"BandGroups needs positive sizes, got num_bands={num_bands}, group={group}")
        self.num_bands, self.group = int(num_bands), int(group)
        self.steps = -(-self.num_bands // self.group)

    def forward(self, x):
        if x.ndim != 2 or x.shape[1] != self.num_bands:
            raise ValueError(f"BandGroups expects (N, {self.num_bands}), got {tuple(x.shape)}")
        padded = self.steps * self.group
        if padded == self.num_bands:
            return x.reshape(x.shape[0], self.steps, self.group)
        y = get_array_module(x).zeros((x.shape[0], padded), dtype=x.dtype)
        y[:, : self.num_bands] = x
        return y.reshape(x.shape[0], self.steps, self.group)

    def backward(self, dy):
        return dy.reshape(dy.shape[0], -1)[:, : self.num_bands]

    def extra_repr(self) -> str:
        return f"num_bands={self.num_bands}, group={self.group}"


class Patchify(Module):
    """Cut each (C, H, W) patch into p x p sub-patches, each one token of C*p*p values.

    Shapes
    ------
    x : (N, C, H, W) -> y : (N, T, C*p*p), ``T = (H/p) * (W/p)``, p dividing H and W. Tokens in
    row-major order of the sub-patch grid; within a token the order is (c, i, j), the order of
    a ``Conv2d(C, E, p, stride=p)`` weight's flattened rows, so a Linear embedding of these
    tokens is that convolution.

    Notes
    -----
    ``y[n, a*(W/p) + b, (c*p + i)*p + j] = x[n, c, a*p + i, b*p + j]``: a reshape and a
    transpose; backward is the inverse permutation.
    """

    def __init__(self, patch: int) -> None:
        super().__init__()
        if patch < 1:
            raise ValueError(f"Patchify needs patch >= 1, got {patch}")
        self.patch = int(patch)
        self.compute_input_grad = True
        self._shape: tuple | None = None

    def forward(self, x):
        p = self.patch
        if x.ndim != 4 or x.shape[2] % p or x.shape[3] % p:
            raise ValueError(f"Patchify({p}) expects (N, C, H, W) with H and W multiples of {p}, got {tuple(x.shape)}")
        n, c, h, w = x.shape
        self._shape = tuple(x.shape)
        y = x.reshape(n, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
        return y.reshape(n, (h // p) * (w // p), c * p * p)

    def backward(self, dy):
        if self._shape is None:
            raise RuntimeError("Patchify.backward called before forward")
        if not self.compute_input_grad:
            return None
        n, c, h, w = self._shape
        p = self.patch
        dx = dy.reshape(n, h // p, w // p, c, p, p).transpose(0, 3, 1, 4, 2, 5)
        return dx.reshape(self._shape)

    def extra_repr(self) -> str:
        return f"patch={self.patch}"
