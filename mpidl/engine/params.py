"""Parameters: every weight and gradient of a model lives in ONE flat buffer.

A layer declares what it needs in ``__init__`` (``Parameter(shape, init)``) and never allocates
the arrays itself. When the model is built, :class:`FlatParameters` allocates one contiguous
1-D ``data`` buffer and one ``grad`` buffer of the same size, and hands every parameter two
views into them::

    flat.data = [ conv1.weight | conv1.bias | conv2.weight | ... | fc.bias ]
                  ^ p.data is a reshaped view of this slice (no copy)

So the reducer allreduces ``flat.grad`` with one MPI call and the optimizer updates
``flat.data`` with a few array operations, while each layer keeps reading and writing its
own ``p.data`` / ``p.grad`` with their natural shapes.

The gradient buffer is the head of a slightly longer one, ``flat.message``::

    flat.message = [ flat.grad (size scalars) | count | stop | nonfinite ]

The distributed step (:class:`mpidl.distributed.DataParallel`) sends ``message`` whole, so
the sample count that weights a rank's gradient and the flags of the collective decisions
travel in the same MPI message as the gradient, and never need one of their own. Every update must therefore be in
place (``p.grad[...] = ...``, ``flat.data -= lr * flat.grad``): rebinding ``p.data`` or
``flat.data`` to a new array would silently break the sharing.

The order of the parameters in the buffer is the registration order (the order in which the
model's layers declare them), so it is the same on every rank, which is what lets ranks
exchange whole buffers (chainermn / PyTorch DDP rely on the same invariant).

Initial values are drawn on the host from ``np.random.default_rng(seed)``, parameter after
parameter in registration order, then copied to the device once: the same seed gives
bitwise the same model on every rank and on CPU and GPU alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol, Sequence

import numpy as np

from mpidl.engine.backend import Backend, get_backend, to_host

__all__ = [
    "MESSAGE_SLOTS",
    "Initializer",
    "Parameter",
    "FlatParameters",
    "he_normal",
    "kaiming_uniform",
    "normal",
    "uniform",
    "zeros",
    "ones",
]


#: scalars that follow the gradients in ``FlatParameters.message``: count, stop, nonfinite
MESSAGE_SLOTS = 3

# --------------------------------------------------------------------------------------------
# initializers
# --------------------------------------------------------------------------------------------


class Initializer(Protocol):
    """Draws initial values: ``init(rng, shape) -> float64 np.ndarray of that shape``."""

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray: ...


@dataclass(frozen=True)
class _Normal:
    std: float

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape) * self.std


@dataclass(frozen=True)
class _Uniform:
    bound: float

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.uniform(-self.bound, self.bound, size=shape)


@dataclass(frozen=True)
class _Constant:
    value: float

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        # Draws nothing, so constant-initialized parameters do not shift the random stream.
        return np.full(shape, self.value, dtype=np.float64)


def _check_fan_in(fan_in: int) -> None:
    if fan_in < 1:
        raise ValueError(f"fan_in must be >= 1, got {fan_in}")


def he_normal(fan_in: int) -> Initializer:
    """He et al. (2015) normal initialization for layers followed by a ReLU.

    Notes
    -----
    ``w ~ N(0, std^2)`` with ``std = sqrt(2 / fan_in)``, which keeps the variance of the
    activations constant from layer to layer through ReLUs. ``fan_in = C*kh*kw`` for a
    convolution, ``in_features`` for a linear layer.
    """
    _check_fan_in(fan_in)
    return _Normal(math.sqrt(2.0 / fan_in))


def kaiming_uniform(fan_in: int, a: float = math.sqrt(5.0)) -> Initializer:
    """Kaiming uniform initialization; with the default ``a = sqrt(5)`` it is PyTorch's default
    for ``nn.Conv2d`` / ``nn.Linear`` weights.

    Notes
    -----
    ``w ~ U(-bound, bound)`` with ``bound = sqrt(6 / ((1 + a^2) * fan_in))``; for ``a = sqrt(5)``
    that is ``bound = 1 / sqrt(fan_in)``.
    """
    _check_fan_in(fan_in)
    return _Uniform(math.sqrt(6.0 / ((1.0 + a * a) * fan_in)))


def uniform(bound: float) -> Initializer:
    """``w ~ U(-bound, bound)``; ``uniform(1 / sqrt(fan_in))`` is PyTorch's default bias init."""
    if bound < 0:
        raise ValueError(f"bound must be >= 0, got {bound}")
    return _Uniform(float(bound))


def normal(std: float) -> Initializer:
    """``w ~ N(0, std^2)`` (e.g. ``normal(0.02)`` for a transformer's class token and
    positional embedding)."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return _Normal(float(std))


def zeros() -> Initializer:
    """All zeros (biases, batch-norm shift)."""
    return _Constant(0.0)


def ones() -> Initializer:
    """All ones (batch-norm scale)."""
    return _Constant(1.0)


# --------------------------------------------------------------------------------------------
# Parameter
# --------------------------------------------------------------------------------------------


class Parameter:
    """A trainable tensor declared by a layer; its storage is bound later by FlatParameters.

    Attributes
    ----------
    shape : tuple of int
    init : Initializer used to draw the initial values
    name : dotted path in the model (e.g. ``"net.0.weight"``), set when bound
    data, grad : ``xp`` arrays of ``shape``, views into the flat buffers (reading them before
        the parameter is bound raises ``RuntimeError``)
    """

    __slots__ = ("shape", "init", "name", "_data", "_grad")

    def __init__(self, shape: Sequence[int], init: Initializer):
        shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in shape):
            raise ValueError(f"parameter shape must be positive, got {shape}")
        self.shape = shape
        self.init = init
        self.name: str | None = None
        self._data = None
        self._grad = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def bound(self) -> bool:
        return self._data is not None

    @property
    def data(self):
        if self._data is None:
            raise RuntimeError(
                f"parameter {self.name or self.shape} is not bound to storage yet; "
                f"build FlatParameters(module.named_parameters(), backend, seed) first"
            )
        return self._data

    @property
    def grad(self):
        if self._grad is None:
            raise RuntimeError(f"parameter {self.name or self.shape} is not bound to storage yet")
        return self._grad

    def bind(self, name: str, data, grad) -> None:
        """Attach the storage views (called by FlatParameters only)."""
        if tuple(data.shape) != self.shape or tuple(grad.shape) != self.shape:
            raise ValueError(f"views for {name} must have shape {self.shape}")
        self.name, self._data, self._grad = name, data, grad

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape})"


# --------------------------------------------------------------------------------------------
# FlatParameters
# --------------------------------------------------------------------------------------------


class FlatParameters:
    """One contiguous data buffer and one gradient buffer for all parameters of a model.

    Parameters
    ----------
    named_params : list of (name, Parameter), in registration order (``module.named_parameters()``)
    backend : Backend (device and dtype of the buffers); default CPU float32
    seed : seed of ``np.random.default_rng`` used to draw the initial values

    Attributes
    ----------
    data, grad : 1-D ``xp`` arrays of ``size`` elements, backend dtype
    message : 1-D ``xp`` array of ``size + MESSAGE_SLOTS`` elements whose head is ``grad``
    size : total number of scalars; nbytes : bytes of ONE buffer (``size * itemsize``)
    names, shapes, offsets : per parameter, in registration order; parameter ``k`` occupies
        ``data[offsets[k] : offsets[k] + prod(shapes[k])]``
    """

    def __init__(self, named_params: Sequence[tuple[str, Parameter]], backend: Backend | None = None, seed: int = 0):
        self.backend = backend if backend is not None else get_backend()
        named_params = list(named_params)
        names = [name for name, _ in named_params]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate parameter names: {duplicates}")
        seen: set[int] = set()
        for name, param in named_params:
            if param.bound or id(param) in seen:
                raise ValueError(f"parameter {name} is already bound to a FlatParameters (shared parameters are not supported)")
            seen.add(id(param))

        self._params = [param for _, param in named_params]
        self.names = names
        self.shapes = [param.shape for param in self._params]
        self.offsets = []
        offset = 0
        for param in self._params:
            self.offsets.append(offset)
            offset += param.size
        self.size = offset

        # Draw on the host in float64 from ONE generator in registration order, round once to
        # the backend dtype, then make a single host->device copy.
        rng = np.random.default_rng(seed)
        host = np.empty(self.size, dtype=self.backend.dtype)
        for param, start in zip(self._params, self.offsets):
            values = np.asarray(param.init(rng, param.shape), dtype=np.float64)
            if values.shape != param.shape:
                raise ValueError(f"initializer of {param.name} returned shape {values.shape}, expected {param.shape}")
            host[start : start + param.size] = values.ravel()
        self.data = self.backend.asarray(host)
        self.message = self.backend.zeros(self.size + MESSAGE_SLOTS)
        self.grad = self.message[: self.size]  # a contiguous view: the head of the message

        for name, param, start in zip(self.names, self._params, self.offsets):
            stop = start + param.size
            # A slice of a contiguous 1-D array reshaped is a view, never a copy.
            param.bind(name, self.data[start:stop].reshape(param.shape), self.grad[start:stop].reshape(param.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer (``data`` or ``grad``): ``size * dtype.itemsize``."""
        return int(self.data.nbytes)

    @property
    def dtype(self):
        return self.data.dtype

    def __len__(self) -> int:
        return len(self._params)

    def __iter__(self) -> Iterator[Parameter]:
        return iter(self._params)

    def __getitem__(self, name: str) -> Parameter:
        try:
            return self._params[self.names.index(name)]
        except ValueError:
            raise KeyError(f"no parameter named {name!r}") from None

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return list(zip(self.names, self._params))

    def rebind(self, data, message, copy: bool = True) -> None:
        """Move the storage onto other memory (e.g. a node-shared MPI window,
        :mod:`mpidl.distributed.shm`): ``data`` becomes the parameter buffer, ``message`` the
        message buffer (``grad`` its head), and every parameter's views are re-made on them.

        ``data`` : 1-D array of ``size`` elements; ``message`` : 1-D array of
        ``size + MESSAGE_SLOTS`` elements; both of this buffer's dtype. With ``copy`` the
        current values of ``data`` and ``message`` are copied in first. Views taken before the
        call (``p.data`` held elsewhere) keep pointing at the old memory.
        """
        for what, array, size in (("data", data, self.size), ("message", message, self.size + MESSAGE_SLOTS)):
            if getattr(array, "ndim", None) != 1 or array.shape[0] != size or array.dtype != self.dtype:
                raise ValueError(f"rebind: {what} must be 1-D of {size} {self.dtype} elements, got "
                                 f"{getattr(array, 'shape', None)} {getattr(array, 'dtype', None)}")
        if copy:
            data[...] = self.data
            message[...] = self.message
        self.data = data
        self.message = message
        self.grad = message[: self.size]
        for name, param, start in zip(self.names, self._params, self.offsets):
            stop = start + param.size
            param.bind(name, self.data[start:stop].reshape(param.shape), self.grad[start:stop].reshape(param.shape))

    def zero_grad(self) -> None:
        """Set every gradient to zero (layers overwrite their grads, so training does not need this)."""
        self.grad.fill(0)

    def state_dict_host(self) -> dict[str, np.ndarray]:
        """A host copy of every parameter: ``{name: np.ndarray of its shape}``."""
        flat = to_host(self.data).copy()
        return {
            name: flat[start : start + param.size].reshape(param.shape)
            for name, param, start in zip(self.names, self._params, self.offsets)
        }

    def load_host(self, mapping: Mapping[str, np.ndarray]) -> None:
        """Copy values into the buffers in place (the views stay valid).

        Raises ``KeyError`` naming missing or unexpected parameters and ``ValueError`` on a
        shape mismatch; nothing is written unless every entry matches.
        """
        missing = [n for n in self.names if n not in mapping]
        unexpected = [n for n in mapping if n not in self.names]
        if missing or unexpected:
            raise KeyError(f"parameter names do not match: missing {missing}, unexpected {unexpected}")
        for name, param in zip(self.names, self._params):
            value = np.asarray(to_host(mapping[name]))
            if value.shape != param.shape:
                raise ValueError(f"parameter {name}: got shape {value.shape}, expected {param.shape}")
        host = np.empty(self.size, dtype=self.backend.dtype)
        for name, param, start in zip(self.names, self._params, self.offsets):
            host[start : start + param.size] = np.asarray(to_host(mapping[name])).ravel()
        self.data[...] = self.backend.asarray(host)

    def __repr__(self) -> str:
        return f"FlatParameters({len(self)} tensors, {self.size} scalars, {self.dtype}, {self.backend.device})"
