"""Module: the forward / backward contract every layer follows, and Sequential.

A layer is an object with two methods side by side:

* ``forward(x)`` computes the output and saves what ``backward`` will need (and nothing more);
* ``backward(dy)`` takes ``dL/dy``, OVERWRITES the gradients of the layer's own parameters
  (``p.grad[...] = dL/dp``, never ``+=``, never a rebinding) and returns ``dL/dx``.

``backward`` always refers to the most recent ``forward``. It never updates a weight: the
gradient reduction across ranks and the optimizer step happen after it, on the flat buffers
(see :mod:`mpidl.engine.params`).

Registration order. A module's parameters, buffers and sub-modules are found by walking its
attributes in the order they were assigned in ``__init__`` (Python dicts keep insertion
order). That order is the order of the flat parameter buffer, identical on every rank.

Buffers are non-trainable state that must travel with a checkpoint (batch norm's running
statistics). A layer lists their attribute names in the class attribute ``buffer_names``;
they are plain ``xp`` arrays owned by the layer and updated in place, so references taken
through :meth:`Module.named_buffers` stay valid.
"""

from __future__ import annotations

from typing import Iterator

from mpidl.engine.backend import Backend, get_array_module
from mpidl.engine.params import Parameter

__all__ = ["Module", "Sequential"]


class Module:
    """Base class of all layers and containers."""

    #: attribute names of this layer's buffers (non-trainable state saved in checkpoints)
    buffer_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.training = True

    # -- computation -------------------------------------------------------------------------

    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)

    # -- structure ---------------------------------------------------------------------------

    def _members(self) -> Iterator[tuple[str, object]]:
        """(name, value) of the attributes in assignment order; containers override this."""
        return iter(vars(self).items())

    def children(self) -> list[tuple[str, "Module"]]:
        """The direct sub-modules as (name, module), in registration order."""
        return [(name, value) for name, value in self._members() if isinstance(value, Module)]

    def parameters(self) -> list[Parameter]:
        """This module's OWN parameters (not its children's), in registration order."""
        return [value for _, value in self._members() if isinstance(value, Parameter)]

    def named_parameters(self, prefix: str = "") -> list[tuple[str, Parameter]]:
        """All parameters of this module and its descendants as (dotted name, Parameter),
        in registration order (a depth-first walk of the attributes)."""
        result: list[tuple[str, Parameter]] = []
        for name, value in self._members():
            if isinstance(value, Parameter):
                result.append((prefix + name, value))
            elif isinstance(value, Module):
                result.extend(value.named_parameters(prefix + name + "."))
        return result

    def named_buffers(self, prefix: str = "") -> list[tuple[str, object]]:
        """All buffers of this module and its descendants as (dotted name, xp array)."""
        result = [(prefix + name, getattr(self, name)) for name in self.buffer_names]
        for name, child in self.children():
            result.extend(child.named_buffers(prefix + name + "."))
        return result

    def buffers(self) -> list[object]:
        return [buffer for _, buffer in self.named_buffers()]

    def modules(self) -> Iterator["Module"]:
        """This module and all its descendants, depth first."""
        yield self
        for _, child in self.children():
            yield from child.modules()

    # -- gradient reports --------------------------------------------------------------------

    def watch_gradients(self, on_final) -> list["Module"]:
        """Call ``on_final(module)`` right after every ``backward`` of every module of this
        tree that owns parameters; returns those modules (depth first).

        Why this is exact: by the contract above, a module's ``backward`` OVERWRITES the
        gradients of its own parameters, so when it returns they are final for this backward
        pass, wherever the module sits (inside a residual block, a transformer block, a
        Sequential of a Sequential) and whichever container called it. A distributed step
        uses this to send each part of the gradient as soon as it is final, per parameter
        rather than per top-level layer (``mpidl.distributed.extras.overlap``). The layers
        know nothing about it: the module's ``backward`` is wrapped on the instance (an
        instance attribute is found before the class's method). :meth:`unwatch_gradients`
        removes it.
        """
        watched = []
        for module in self.modules():
            if module.parameters():
                if "backward" in vars(module):
                    raise RuntimeError(f"{type(module).__name__}: its backward is already watched")
                module.backward = _BackwardThenReport(module, on_final)
                watched.append(module)
        return watched

    def unwatch_gradients(self) -> None:
        """Undo :meth:`watch_gradients` on every module of this tree (the class's backward again)."""
        for module in self.modules():
            if isinstance(vars(module).get("backward"), _BackwardThenReport):
                del module.backward

    # -- mode and device ---------------------------------------------------------------------

    def train(self, mode: bool = True) -> "Module":
        """Set training mode (batch statistics, dropout on) recursively; returns self."""
        for module in self.modules():
            module.training = bool(mode)
        return self

    def eval(self) -> "Module":
        """Evaluation mode (running statistics, dropout off); returns self."""
        return self.train(False)

    def to(self, backend: Backend) -> "Module":
        """Move every buffer to ``backend``'s device and dtype (parameters live in
        FlatParameters and are placed there); returns self."""
        for module in self.modules():
            for name in module.buffer_names:
                setattr(module, name, backend.asarray(getattr(module, name)))
            module._drop_workspaces()
        return self

    def _drop_workspaces(self) -> None:
        """Forget cached scratch buffers (they may live on the old device); layers override."""

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        children = self.children()
        if not children:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"{type(self).__name__}("]
        for name, child in children:
            lines.extend(f"  ({name}): " + line if k == 0 else "  " + line for k, line in enumerate(repr(child).splitlines()))
        lines.append(")")
        return "\n".join(lines)


class Sequential(Module):
    """Layers applied one after the other; children are named ``"0"``, ``"1"``, ...

    Notes
    -----
    ``y = f_L(... f_2(f_1(x)))``; backward runs the chain rule in reverse:
    ``dx = f_1'(... f_L'(dy))``. If a layer returns ``None`` from backward (an input layer told
    not to compute its input gradient), the chain stops there and ``None`` is returned.
    """

    def __init__(self, *layers: Module):
        super().__init__()
        for k, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential item {k} is a {type(layer).__name__}, not a Module")
        self.layers = list(layers)

    def _members(self):
        return ((str(k), layer) for k, layer in enumerate(self.layers))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> Module:
        return self.layers[index]

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy):
        """Back through the layers, last first. A layer may return None (it was told not to
        compute its input gradient) only if no layer before it has parameters: those layers
        are then skipped, as nothing upstream needs a gradient."""
        for k in range(len(self.layers) - 1, -1, -1):
            dy = self.layers[k].backward(dy)
            if dy is None and k > 0:
                if any(layer.named_parameters() for layer in self.layers[:k]):
                    # The layers before it would keep stale gradients: a silent training bug.
                    raise RuntimeError(f"layer {k} returned no input gradient but layers before it have parameters")
                return None
        return dy


class _BackwardThenReport:
    """A module's own ``backward``, then ``on_final(module)``: installed on the instance by
    :meth:`Module.watch_gradients`."""

    __slots__ = ("module", "backward", "on_final")

    def __init__(self, module: Module, on_final) -> None:
        self.module, self.on_final = module, on_final
        self.backward = type(module).backward.__get__(module)

    def __call__(self, dy):
        dx = self.backward(dy)
        self.on_final(self.module)
        return dx


def workspace(cache: dict, key: str, shape: tuple, like):
    """A scratch array of ``shape`` with ``like``'s dtype and device, reused across calls.

    Training runs the same shapes step after step, so the large im2col matrices are
    allocated once instead of every step (allocation of a few hundred MB per step is a
    measurable cost on the CPU and fragments the GPU memory pool).
    """
    xp = get_array_module(like)
    buffer = cache.get(key)
    if buffer is None or buffer.shape != shape or buffer.dtype != like.dtype or get_array_module(buffer) is not xp:
        buffer = xp.empty(shape, dtype=like.dtype)
        cache[key] = buffer
    return buffer
