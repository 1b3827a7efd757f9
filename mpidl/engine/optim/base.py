"""The optimizer base class on the model's flat buffers, and what the rules share: the
argument checks (the schedules use them too), the in-place moving averages and the Adam
family's constructor.

:class:`Optimizer` owns what every rule shares: the flat buffers ``params.data`` /
``params.grad`` (P,), the learning rate ``lr``, the step count ``t``, the one scratch buffer,
the state as named flat buffers (:meth:`~Optimizer.named_state`,
:meth:`~Optimizer.state_buffers`, the host state dict) and one ``repr``. A rule adds its
state buffers in ``__init__`` and its update in ``_update``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np

from mpidl.engine.backend import get_array_module, to_host

# --------------------------------------------------------------------------------------
# argument checks (shared by the optimizers and the schedules)
# --------------------------------------------------------------------------------------


def _check_number(name: str, value: Any, *, low: float, high: float | None = None,
                  low_open: bool = False, high_open: bool = True) -> float:
    """``float(value)`` if it is a finite number inside the given interval, else ValueError."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    too_low = number <= low if low_open else number < low
    too_high = high is not None and (number >= high if high_open else number > high)
    if not math.isfinite(number) or too_low or too_high:
        interval = ("(" if low_open else "[") + f"{low:g}, " + (
            "inf)" if high is None else f"{high:g}" + (")" if high_open else "]"))
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return number


def _check_int(name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _check_flat_params(params: Any) -> None:
    """The optimizer needs ``params.data`` and ``params.grad``: 1-D float arrays of one shape
    and dtype (the flat buffers of :class:`mpidl.engine.params.FlatParameters`)."""
    data = getattr(params, "data", None)
    grad = getattr(params, "grad", None)
    if data is None or grad is None:
        raise ValueError(
            "params must have flat 'data' and 'grad' arrays (a FlatParameters); "
            f"got {type(params).__name__}"
        )
    if data.ndim != 1 or grad.shape != data.shape:
        raise ValueError(
            f"params.data and params.grad must be 1-D of one shape; got {data.shape} and {grad.shape}"
        )
    if data.dtype != grad.dtype or data.dtype.kind != "f":
        raise ValueError(
            f"params.data and params.grad must share one floating dtype; got {data.dtype} and {grad.dtype}"
        )


def _check_betas(betas) -> tuple[float, float]:
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    return (_check_number("betas[0]", beta1, low=0.0, high=1.0),
            _check_number("betas[1]", beta2, low=0.0, high=1.0))


# --------------------------------------------------------------------------------------
# the moving averages every rule is written with (in place, no temporary of their own)
# --------------------------------------------------------------------------------------


def ema_(avg, x, beta: float) -> None:
    """``avg <- beta * avg + (1 - beta) * x`` in place: an exponential moving average.

    Applied as ``avg <- x + beta * (avg - x)``, the same value up to the last bit, with no
    temporary, so ``x`` may occupy the scratch buffer; ``x`` is only read.
    """
    avg -= x
    avg *= beta
    avg += x


def ema_square_(avg, x, beta: float, tmp) -> None:
    """``avg <- beta * avg + (1 - beta) * x^2`` in place; ``tmp`` (overwritten; it may be ``x``
    itself, when ``x`` is not needed afterwards) holds ``(1 - beta) * x^2``."""
    get_array_module(x).multiply(x, x, out=tmp)
    tmp *= 1.0 - beta
    avg *= beta
    avg += tmp


# --------------------------------------------------------------------------------------
# the base class, and the Adam family's constructor
# --------------------------------------------------------------------------------------


def _format(value: Any) -> str:
    """A hyperparameter as :meth:`Optimizer.__repr__` shows it: a number as ``:g``, a pair as
    ``(a, b)``, a flag as ``True`` / ``False``."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_format(v) for v in value) + ")"
    return f"{value:g}"


class Optimizer:
    """Base class: the flat buffers, the learning rate, the step count and the state.

    Parameters
    ----------
    params : FlatParameters (anything with ``data`` and ``grad`` : (P,) xp arrays)
        The model's flat parameter and gradient buffers. ``step()`` updates ``params.data``
        in place and never writes ``params.grad``.
    lr : float
        Learning rate, > 0. The attribute ``lr`` may be reassigned at any time (a schedule
        does so before each step); it must then be >= 0.

    Subclasses set ``name``, allocate their state buffers in ``__init__`` and implement
    :meth:`_update` and :meth:`named_state`. They keep each constructor argument in the
    attribute of the same name, which is what :meth:`__repr__` shows.
    """

    name: str = "optimizer"
    #: True when the update of element ``j`` reads and writes only element ``j`` of the
    #: parameters, the gradient and every state buffer (SGD, Adam): then the optimizer over
    #: a slice ``[lo, hi)`` of them (views) updates that slice alone, as the node-shared
    #: buffers need (:mod:`mpidl.distributed.extras.shm`). Layer-wise rules (norms over a tensor)
    #: leave it False.
    elementwise: bool = False

    def __init__(self, params: Any, lr: float):
        _check_flat_params(params)
        self.params = params
        self._lr = _check_number("lr", lr, low=0.0, low_open=True)
        self.step_count = 0
        # The one temporary every update may use; allocated here so that step() never
        # allocates a parameter-sized array.
        self._scratch = get_array_module(params.data).zeros_like(params.data)

    # -- learning rate ------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        # 0 is allowed here (a cosine schedule ends at min_lr, which may be 0).
        self._lr = _check_number("lr", value, low=0.0)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> None:
        """Apply one update to ``params.data`` from ``params.grad`` (in place)."""
        if self._scratch.shape != self.params.data.shape:  # the parameters were rebound
            self._scratch = get_array_module(self.params.data).zeros_like(self.params.data)
        # Counted before the update so that the first step is t = 1, as in the formulas.
        self.step_count += 1
        self._update(self.params.data, self.params.grad, self._scratch)

    def _update(self, p, grad, scratch) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _l2_gradient(self, p, grad, scratch, weight_decay: float):
        """``g = grad + weight_decay * p`` formed in ``scratch`` (``grad`` itself when the
        decay is 0), so that ``params.grad`` keeps the reduced gradient untouched."""
        if weight_decay == 0:
            return grad
        xp = get_array_module(p)
        xp.multiply(p, weight_decay, out=scratch)
        scratch += grad
        return scratch

    def __repr__(self) -> str:
        """``Name(lr=..., ...)``: the constructor's arguments after ``params``, in their order,
        read back from the attributes of the same names (numbers as ``:g``)."""
        names = list(inspect.signature(type(self).__init__).parameters)[2:]  # after self, params
        arguments = ", ".join(f"{name}={_format(getattr(self, name))}" for name in names)
        return f"{type(self).__name__}({arguments})"

    # -- state --------------------------------------------------------------------------

    def named_state(self) -> list[tuple[str, Any]]:
        """``[(name, flat state buffer), ...]`` in a fixed order (empty when stateless); each
        name is the attribute that holds the buffer."""
        return []

    def state_buffers(self) -> list:
        """The flat state buffers (P,) (e.g. to average them across replicas); the scratch
        buffer is not state and is not included."""
        return [buffer for _, buffer in self.named_state()]

    def state_dict_host(self) -> dict[str, Any]:
        """A host copy of the state: ``name`` (str), ``step_count`` (int), ``lr`` (float)
        and one NumPy array (P,) per state buffer."""
        state: dict[str, Any] = {"name": self.name, "step_count": self.step_count, "lr": self.lr}
        for key, buffer in self.named_state():
            state[key] = np.array(to_host(buffer), copy=True)
        return state

    def load_state_dict_host(self, state: dict[str, Any]) -> None:
        """Restore state in place: the state buffers keep their identity (a reducer or a view
        may hold them), only their values change. Two forms are accepted:

        * what :meth:`state_dict_host` returned (buffers by name, ``name`` checked, ``lr`` restored);
        * the checkpoint form ``{"state": [arrays in state_buffers() order], "step_count": int}``
          (``lr`` is left alone: the schedule sets it before the next step).

        Nothing is written unless every buffer matches (``ValueError`` / ``KeyError`` otherwise).
        """
        named = self.named_state()
        checkpoint_form = "state" in state
        if checkpoint_form:
            required = ["step_count"]
        else:
            if state.get("name") != self.name:
                raise ValueError(f"state dict is for optimizer {state.get('name')!r}, not {self.name!r}")
            required = ["step_count", "lr"] + [key for key, _ in named]
        missing = [key for key in required if key not in state]
        if missing:
            raise KeyError(f"optimizer state dict lacks {', '.join(missing)}")
        values = list(state["state"]) if checkpoint_form else [state[key] for key, _ in named]
        if len(values) != len(named):
            raise ValueError(f"{self.name} has {len(named)} state buffers, the state list holds {len(values)}")
        for (key, buffer), value in zip(named, values):
            if np.shape(value) != buffer.shape:
                raise ValueError(
                    f"optimizer state {key!r} has shape {np.shape(value)}, expected {buffer.shape}"
                )
        step_count = _check_int("step_count", state["step_count"], low=0)
        lr = self.lr if checkpoint_form else _check_number("lr", state["lr"], low=0.0)

        xp = get_array_module(self.params.data)
        for (_, buffer), value in zip(named, values):
            xp.copyto(buffer, xp.asarray(value, dtype=buffer.dtype))
        self.step_count = step_count
        self.lr = lr


class MomentEstimates(Optimizer):
    """Base of the Adam family: ``betas``, ``eps`` and ``weight_decay`` checked once, the first
    moment ``exp_avg`` (m) and a second one (``exp_avg_sq`` v, or Adamax's ``exp_inf`` u)."""

    #: the attribute name of the second moment
    second_moment = "exp_avg_sq"

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float):
        super().__init__(params, lr)
        self.betas = _check_betas(betas)
        self.eps = _check_number("eps", eps, low=0.0)
        self.weight_decay = _check_number("weight_decay", weight_decay, low=0.0)
        xp = get_array_module(params.data)
        self.exp_avg = xp.zeros_like(params.data)
        setattr(self, self.second_moment, xp.zeros_like(params.data))

    def named_state(self):
        return [("exp_avg", self.exp_avg), (self.second_moment, getattr(self, self.second_moment))]
