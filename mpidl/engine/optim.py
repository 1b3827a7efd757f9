"""Optimizers and learning-rate schedules that work on the model's flat parameter buffer.

A model keeps all its weights in ONE 1-D array ``params.data`` and all their gradients in ONE
1-D array ``params.grad`` (see :mod:`mpidl.engine.params`); every layer's ``weight`` is a view into
them. So an optimizer step is a handful of whole-buffer, in-place ``xp`` operations, the same
on NumPy and CuPy, and the optimizer state (momentum, Adam moments) is a few more flat
buffers of the same size, which a reducer can average with one collective each
(:meth:`Optimizer.state_buffers`).

Memory discipline
-----------------
Every parameter-sized buffer is allocated once, in ``__init__``: the state buffers and ONE
scratch buffer. :meth:`Optimizer.step` then only runs ufuncs with ``out=`` or augmented
assignments (``p -= s``), so a step allocates nothing the size of the model. Two
consequences of having a single scratch buffer are visible in the code:

* the weight-decayed gradient ``g = grad + wd * p`` is formed in the scratch buffer, never in
  ``params.grad``, so the reduced gradient stays inspectable after the step;
* a few updates are written in an algebraically equal form that needs no second temporary
  (Adam's first moment as ``m = g + beta1 * (m - g)``, Nesterov's step as two subtractions).
  They round differently from the textbook form only in the last bit.

Some rules need g, a moment and a denominator at once (RMSprop and Adagrad with weight
decay, NAdam, Adadelta): those allocate a second scratch buffer, also in ``__init__``.

The semantics follow ``torch.optim`` (SGD, Adam, AdamW, RMSprop, Adagrad, RAdam, NAdam,
Adamax, Adadelta) exactly, so results can be compared with PyTorch on the same numbers;
LAMB follows You et al. (2020), Algorithm 2 (PyTorch has no LAMB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mpidl.engine.backend import get_array_module, to_host

__all__ = [
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "Adagrad",
    "RAdam",
    "NAdam",
    "Adamax",
    "Adadelta",
    "LAMB",
    "OPTIMIZERS",
    "build_optimizer",
    "Schedule",
    "SCHEDULES",
    "make_schedule",
]


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


# --------------------------------------------------------------------------------------
# optimizers
# --------------------------------------------------------------------------------------


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
    :meth:`_update` and :meth:`named_state`.
    """

    name: str = "optimizer"
    #: True when the update of element ``j`` reads and writes only element ``j`` of the
    #: parameters, the gradient and every state buffer (SGD, Adam): then the optimizer over
    #: a slice ``[lo, hi)`` of them (views) updates that slice alone, as the node-shared
    #: buffers need (:mod:`mpidl.distributed.shm`). Layer-wise rules (norms over a tensor)
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


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay,
    with the semantics of ``torch.optim.SGD``.

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0
    momentum : float in [0, 1)
    dampening : float in [0, 1]
    nesterov : bool (needs momentum > 0 and dampening = 0)
    weight_decay : float >= 0

    Notes
    -----
    With ``p`` the parameters, ``grad`` their gradient, ``mu`` the momentum, ``tau`` the
    dampening, ``lambda`` the weight decay and ``t = 1, 2, ...`` the step::

        g   = grad + lambda * p                      (L2 penalty lambda/2 * |p|^2)
        b_1 = g                                      (first step: buffer initialised to g)
        b_t = mu * b_{t-1} + (1 - tau) * g           (t > 1)
        d   = g + mu * b_t    if nesterov
              b_t             otherwise              (d = g when mu = 0)
        p  <- p - lr * d
    """

    name = "sgd"
    elementwise = True

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(params, lr)
        self.momentum = _check_number("momentum", momentum, low=0.0, high=1.0)
        self.dampening = _check_number("dampening", dampening, low=0.0, high=1.0, high_open=False)
        self.weight_decay = _check_number("weight_decay", weight_decay, low=0.0)
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("nesterov=True requires momentum > 0 and dampening = 0")
        xp = get_array_module(params.data)
        self.momentum_buffer = xp.zeros_like(params.data) if self.momentum > 0 else None

    def named_state(self):
        return [] if self.momentum_buffer is None else [("momentum_buffer", self.momentum_buffer)]

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        g = self._l2_gradient(p, grad, scratch, self.weight_decay)  # grad, or scratch
        if self.momentum == 0:
            xp.multiply(g, self.lr, out=scratch)
            p -= scratch
            return

        buf = self.momentum_buffer
        if self.step_count == 1:
            xp.copyto(buf, g)
        else:
            buf *= self.momentum
            if self.dampening != 0:
                # Overwriting g (possibly scratch itself) is safe: Nesterov, the only rule
                # that reads g again below, is refused with dampening.
                xp.multiply(g, 1.0 - self.dampening, out=scratch)
                buf += scratch
            else:
                buf += g

        if self.nesterov:
            # d = g + mu * b needs g and b side by side, i.e. a second temporary; applying the
            # two terms one after the other gives the same p with no extra buffer.
            xp.multiply(g, self.lr, out=scratch)
            p -= scratch
            xp.multiply(buf, self.lr * self.momentum, out=scratch)
            p -= scratch
        else:
            xp.multiply(buf, self.lr, out=scratch)
            p -= scratch

    def __repr__(self) -> str:
        return (f"SGD(lr={self.lr:g}, momentum={self.momentum:g}, dampening={self.dampening:g}, "
                f"nesterov={self.nesterov}, weight_decay={self.weight_decay:g})")


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


class Adam(MomentEstimates):
    """Adam with bias correction and L2 weight decay added to the gradient, with the
    semantics of ``torch.optim.Adam`` (``amsgrad=False``).

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0
    betas : (float, float), each in [0, 1)
    eps : float >= 0
    weight_decay : float >= 0

    Notes
    -----
    With ``t = 1, 2, ...`` the step and ``m_0 = v_0 = 0``::

        g   = grad + lambda * p                       (Adam: L2 into the gradient)
        m_t = beta1 * m_{t-1} + (1 - beta1) * g
        v_t = beta2 * v_{t-1} + (1 - beta2) * g^2
        p  <- p - lr / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)

    The factors ``1 - beta^t`` undo the bias of the zero-initialised moments (at t = 1,
    ``m_1 / (1 - beta1) = g`` exactly).
    """

    name = "adam"
    elementwise = True
    #: False: weight decay is an L2 term in g (Adam); True: it shrinks p directly (AdamW).
    decoupled_weight_decay = False

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr, betas, eps, weight_decay)

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        beta1, beta2 = self.betas
        t = self.step_count
        if self.decoupled_weight_decay:
            if self.weight_decay != 0:
                p *= 1.0 - self.lr * self.weight_decay
            g = grad
        else:
            g = self._l2_gradient(p, grad, scratch, self.weight_decay)  # grad, or scratch

        m, v = self.exp_avg, self.exp_avg_sq
        # m = beta1*m + (1-beta1)*g, written as m = g + beta1*(m - g): the same value, but it
        # needs no temporary while g may itself occupy the scratch buffer.
        m -= g
        m *= beta1
        m += g
        # g is not needed after this point, so the scratch buffer can hold (1-beta2)*g^2.
        xp.multiply(g, g, out=scratch)
        scratch *= 1.0 - beta2
        v *= beta2
        v += scratch

        bias_correction1 = 1.0 - beta1 ** t
        bias_correction2 = 1.0 - beta2 ** t
        xp.sqrt(v, out=scratch)
        scratch /= math.sqrt(bias_correction2)
        scratch += self.eps                      # denominator
        xp.divide(m, scratch, out=scratch)
        scratch *= self.lr / bias_correction1
        p -= scratch

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(lr={self.lr:g}, betas=({self.betas[0]:g}, {self.betas[1]:g}), "
                f"eps={self.eps:g}, weight_decay={self.weight_decay:g})")


class AdamW(Adam):
    """Adam with decoupled weight decay, with the semantics of ``torch.optim.AdamW``.

    Same parameters as :class:`Adam`; ``weight_decay`` defaults to PyTorch's 1e-2.

    Notes
    -----
    The decay shrinks the parameters directly instead of entering the moments::

        p  <- p - lr * lambda * p                     (i.e. p *= 1 - lr * lambda)
        g   = grad
        then the Adam update of :class:`Adam` with this g.
    """

    name = "adamw"
    decoupled_weight_decay = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _check_betas(betas) -> tuple[float, float]:
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    return (_check_number("betas[0]", beta1, low=0.0, high=1.0),
            _check_number("betas[1]", beta2, low=0.0, high=1.0))


class RMSprop(Optimizer):
    """RMSprop (Hinton's lecture 6e), with the semantics of ``torch.optim.RMSprop``.

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0 (default 1e-2)
    alpha : float in [0, 1), the smoothing of the squared gradient (default 0.99)
    eps : float >= 0 (default 1e-8), added to the root (not under it)
    weight_decay : float >= 0 (L2, into the gradient)
    momentum : float in [0, 1) (default 0)
    centered : bool, divide by the estimated standard deviation instead of the RMS

    Notes
    -----
    With ``v_0 = gbar_0 = b_0 = 0`` and ``t = 1, 2, ...``::

        g      = grad + lambda * p
        v_t    = alpha * v_{t-1} + (1 - alpha) * g^2
        gbar_t = alpha * gbar_{t-1} + (1 - alpha) * g          (centered only)
        d      = sqrt(v_t - gbar_t^2) + eps    if centered
                 sqrt(v_t) + eps               otherwise
        b_t    = mu * b_{t-1} + g / d                          (momentum mu > 0)
        p     <- p - lr * b_t     if mu > 0
                 p - lr * g / d   otherwise

    State: ``square_avg`` (v), ``momentum_buffer`` (b, if mu > 0), ``grad_avg`` (gbar, if
    centered). With weight decay the decayed gradient occupies a second scratch buffer.
    """

    name = "rmsprop"

    def __init__(self, params: Any, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False):
        super().__init__(params, lr)
        self.alpha = _check_number("alpha", alpha, low=0.0, high=1.0)
        self.eps = _check_number("eps", eps, low=0.0)
        self.weight_decay = _check_number("weight_decay", weight_decay, low=0.0)
        self.momentum = _check_number("momentum", momentum, low=0.0, high=1.0)
        self.centered = bool(centered)
        xp = get_array_module(params.data)
        self.square_avg = xp.zeros_like(params.data)
        self.momentum_buffer = xp.zeros_like(params.data) if self.momentum > 0 else None
        self.grad_avg = xp.zeros_like(params.data) if self.centered else None
        self._scratch2 = xp.zeros_like(params.data) if self.weight_decay != 0 else None

    def named_state(self):
        state = [("square_avg", self.square_avg)]
        if self.momentum_buffer is not None:
            state.append(("momentum_buffer", self.momentum_buffer))
        if self.grad_avg is not None:
            state.append(("grad_avg", self.grad_avg))
        return state

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        g = self._l2_gradient(p, grad, self._scratch2, self.weight_decay)  # grad, or scratch2
        alpha, v = self.alpha, self.square_avg
        xp.multiply(g, g, out=scratch)
        scratch *= 1.0 - alpha
        v *= alpha
        v += scratch
        if self.centered:
            gbar = self.grad_avg
            gbar -= g                # gbar = g + alpha * (gbar - g), no temporary
            gbar *= alpha
            gbar += g
            xp.multiply(gbar, gbar, out=scratch)
            xp.subtract(v, scratch, out=scratch)
            xp.sqrt(scratch, out=scratch)
        else:
            xp.sqrt(v, out=scratch)
        scratch += self.eps                      # d
        xp.divide(g, scratch, out=scratch)       # g / d
        if self.momentum > 0:
            b = self.momentum_buffer
            b *= self.momentum
            b += scratch
            xp.multiply(b, self.lr, out=scratch)
        else:
            scratch *= self.lr
        p -= scratch

    def __repr__(self) -> str:
        return (f"RMSprop(lr={self.lr:g}, alpha={self.alpha:g}, eps={self.eps:g}, "
                f"weight_decay={self.weight_decay:g}, momentum={self.momentum:g}, centered={self.centered})")


class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011), with the semantics of ``torch.optim.Adagrad``.

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0 (default 1e-2)
    lr_decay : float >= 0 (default 0)
    weight_decay : float >= 0 (L2, into the gradient)
    initial_accumulator_value : float >= 0 (default 0), ``s_0``
    eps : float >= 0 (default 1e-10)

    Notes
    -----
    With ``s_0 = initial_accumulator_value`` and ``t = 1, 2, ...``::

        g    = grad + lambda * p
        lr_t = lr / (1 + (t - 1) * lr_decay)
        s_t  = s_{t-1} + g^2
        p   <- p - lr_t * g / (sqrt(s_t) + eps)

    State: ``sum`` (s). Averaging it over nodes (``--sync-optimizer-state``) keeps its scale,
    since every node's sum grew by the same number of steps.
    """

    name = "adagrad"

    def __init__(self, params: Any, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10):
        super().__init__(params, lr)
        self.lr_decay = _check_number("lr_decay", lr_decay, low=0.0)
        self.weight_decay = _check_number("weight_decay", weight_decay, low=0.0)
        self.initial_accumulator_value = _check_number(
            "initial_accumulator_value", initial_accumulator_value, low=0.0)
        self.eps = _check_number("eps", eps, low=0.0)
        xp = get_array_module(params.data)
        self.sum = xp.full_like(params.data, self.initial_accumulator_value)
        self._scratch2 = xp.zeros_like(params.data) if self.weight_decay != 0 else None

    def named_state(self):
        return [("sum", self.sum)]

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        g = self._l2_gradient(p, grad, self._scratch2, self.weight_decay)
        clr = self.lr / (1.0 + (self.step_count - 1) * self.lr_decay)
        xp.multiply(g, g, out=scratch)
        self.sum += scratch
        xp.sqrt(self.sum, out=scratch)
        scratch += self.eps
        xp.divide(g, scratch, out=scratch)
        scratch *= clr
        p -= scratch

    def __repr__(self) -> str:
        return (f"Adagrad(lr={self.lr:g}, lr_decay={self.lr_decay:g}, weight_decay={self.weight_decay:g}, "
                f"initial_accumulator_value={self.initial_accumulator_value:g}, eps={self.eps:g})")


class RAdam(MomentEstimates):
    """Rectified Adam (Liu et al., 2020), with the semantics of ``torch.optim.RAdam``
    (L2 weight decay into the gradient, ``decoupled_weight_decay=False``).

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0 (default 1e-3)
    betas : (float, float), each in [0, 1)
    eps : float >= 0 (default 1e-8)
    weight_decay : float >= 0

    Notes
    -----
    With ``m_0 = v_0 = 0``, ``t = 1, 2, ...`` and ``rho_inf = 2 / (1 - beta2) - 1``::

        g     = grad + lambda * p
        m_t   = beta1 * m_{t-1} + (1 - beta1) * g
        v_t   = beta2 * v_{t-1} + (1 - beta2) * g^2
        mhat  = m_t / (1 - beta1^t)
        rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
        if rho_t > 5:
            r  = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))
            p <- p - lr * r * mhat * sqrt(1 - beta2^t) / (sqrt(v_t) + eps)
        else:                                   (the variance is not yet tractable)
            p <- p - lr * mhat                  (SGD with momentum)

    Note where ``eps`` sits: added to ``sqrt(v_t)``, not to ``sqrt(v_t / (1 - beta2^t))`` as
    in Adam. State: ``exp_avg`` (m), ``exp_avg_sq`` (v).
    """

    name = "radam"

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr, betas, eps, weight_decay)

    def rectification(self, t: int) -> float | None:
        """``r`` at step ``t``, or None while ``rho_t <= 5`` (the un-adapted step)."""
        beta2 = self.betas[1]
        rho_inf = 2.0 / (1.0 - beta2) - 1.0
        bias_correction2 = 1.0 - beta2 ** t
        rho_t = rho_inf - 2.0 * t * beta2 ** t / bias_correction2
        if rho_t <= 5.0:
            return None
        return math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        beta1, beta2 = self.betas
        t = self.step_count
        g = self._l2_gradient(p, grad, scratch, self.weight_decay)
        m, v = self.exp_avg, self.exp_avg_sq
        m -= g
        m *= beta1
        m += g
        xp.multiply(g, g, out=scratch)   # g is not needed after this point
        scratch *= 1.0 - beta2
        v *= beta2
        v += scratch
        bias_correction1 = 1.0 - beta1 ** t
        rect = self.rectification(t)
        if rect is None:
            xp.multiply(m, self.lr / bias_correction1, out=scratch)
        else:
            xp.sqrt(v, out=scratch)
            scratch += self.eps
            xp.divide(m, scratch, out=scratch)
            scratch *= self.lr * rect * math.sqrt(1.0 - beta2 ** t) / bias_correction1
        p -= scratch

    def __repr__(self) -> str:
        return (f"RAdam(lr={self.lr:g}, betas=({self.betas[0]:g}, {self.betas[1]:g}), "
                f"eps={self.eps:g}, weight_decay={self.weight_decay:g})")


class NAdam(MomentEstimates):
    """Adam with Nesterov momentum (Dozat, 2016), with the semantics of ``torch.optim.NAdam``
    (L2 weight decay into the gradient).

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0 (default 2e-3)
    betas : (float, float), each in [0, 1)
    eps : float >= 0 (default 1e-8)
    weight_decay : float >= 0
    momentum_decay : float >= 0 (default 4e-3), ``psi``

    Notes
    -----
    With ``m_0 = v_0 = 0``, ``t = 1, 2, ...``, ``mu_t = beta1 (1 - 0.5 * 0.96^(t psi))`` and
    ``Pi_t = mu_1 mu_2 ... mu_t``::

        g   = grad + lambda * p
        m_t = beta1 * m_{t-1} + (1 - beta1) * g
        v_t = beta2 * v_{t-1} + (1 - beta2) * g^2
        d   = sqrt(v_t / (1 - beta2^t)) + eps
        p  <- p - lr (1 - mu_t) / (1 - Pi_t) * g / d - lr mu_{t+1} / (1 - Pi_t mu_{t+1}) * m_t / d

    ``Pi_t`` is a function of ``t`` alone, so it is recomputed from the step count (cached)
    instead of being state. State: ``exp_avg`` (m), ``exp_avg_sq`` (v). A second scratch
    buffer holds g, since the update reads g, m and d together.
    """

    name = "nadam"

    def __init__(self, params: Any, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum_decay: float = 4e-3):
        super().__init__(params, lr, betas, eps, weight_decay)
        self.momentum_decay = _check_number("momentum_decay", momentum_decay, low=0.0)
        self._scratch2 = get_array_module(params.data).zeros_like(params.data)
        self._mu_product = (0, 1.0)  # (t, Pi_t)

    def mu(self, t: int) -> float:
        return self.betas[0] * (1.0 - 0.5 * 0.96 ** (t * self.momentum_decay))

    def mu_product(self, t: int) -> float:
        """``Pi_t = mu_1 ... mu_t`` (1 at t = 0), multiplied in order as PyTorch does."""
        cached_t, value = self._mu_product
        if cached_t > t:
            cached_t, value = 0, 1.0
        for i in range(cached_t + 1, t + 1):
            value *= self.mu(i)
        self._mu_product = (t, value)
        return value

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        beta1, beta2 = self.betas
        t = self.step_count
        # g goes to the second scratch buffer in every case: the update needs g, m and d at once.
        g = self._scratch2
        if self.weight_decay != 0:
            xp.multiply(p, self.weight_decay, out=g)
            g += grad
        else:
            xp.copyto(g, grad)
        m, v = self.exp_avg, self.exp_avg_sq
        m -= g
        m *= beta1
        m += g
        xp.multiply(g, g, out=scratch)
        scratch *= 1.0 - beta2
        v *= beta2
        v += scratch
        mu, mu_next = self.mu(t), self.mu(t + 1)
        product = self.mu_product(t)
        xp.sqrt(v, out=scratch)
        scratch /= math.sqrt(1.0 - beta2 ** t)
        scratch += self.eps                          # d
        c1 = self.lr * (1.0 - mu) / (1.0 - product)
        c2 = self.lr * mu_next / (1.0 - product * mu_next)
        # p -= (c1 g + c2 m) / d, formed in g's buffer as c2 * ((c1 / c2) g + m) / d.
        if c2 != 0:
            g *= c1 / c2
            g += m
            g /= scratch
            g *= c2
        else:                                        # beta1 = 0: no momentum term
            g /= scratch
            g *= c1
        p -= g

    def __repr__(self) -> str:
        return (f"NAdam(lr={self.lr:g}, betas=({self.betas[0]:g}, {self.betas[1]:g}), eps={self.eps:g}, "
                f"weight_decay={self.weight_decay:g}, momentum_decay={self.momentum_decay:g})")


class Adamax(MomentEstimates):
    """Adamax, Adam with the infinity norm (Kingma & Ba, 2015, section 7.1), with the
    semantics of ``torch.optim.Adamax``.

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0 (default 2e-3)
    betas : (float, float), each in [0, 1)
    eps : float >= 0 (default 1e-8)
    weight_decay : float >= 0 (L2, into the gradient)

    Notes
    -----
    With ``m_0 = u_0 = 0`` and ``t = 1, 2, ...``::

        g   = grad + lambda * p
        m_t = beta1 * m_{t-1} + (1 - beta1) * g
        u_t = max(beta2 * u_{t-1}, |g| + eps)
        p  <- p - lr / (1 - beta1^t) * m_t / u_t

    State: ``exp_avg`` (m), ``exp_inf`` (u).
    """

    name = "adamax"
    second_moment = "exp_inf"

    def __init__(self, params: Any, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr, betas, eps, weight_decay)

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        beta1, beta2 = self.betas
        g = self._l2_gradient(p, grad, scratch, self.weight_decay)
        m, u = self.exp_avg, self.exp_inf
        m -= g
        m *= beta1
        m += g
        xp.abs(g, out=scratch)           # g is not needed after this point
        scratch += self.eps
        u *= beta2
        xp.maximum(u, scratch, out=u)
        xp.divide(m, u, out=scratch)
        scratch *= self.lr / (1.0 - beta1 ** self.step_count)
        p -= scratch

    def __repr__(self) -> str:
        return (f"Adamax(lr={self.lr:g}, betas=({self.betas[0]:g}, {self.betas[1]:g}), "
                f"eps={self.eps:g}, weight_decay={self.weight_decay:g})")


class Adadelta(Optimizer):
    """Adadelta (Zeiler, 2012), with the semantics of ``torch.optim.Adadelta``.

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,))
    lr : float, > 0 (default 1.0, a factor on the step)
    rho : float in [0, 1) (default 0.9)
    eps : float >= 0 (default 1e-6), under both roots
    weight_decay : float >= 0 (L2, into the gradient)

    Notes
    -----
    With ``v_0 = a_0 = 0`` and ``t = 1, 2, ...``::

        g   = grad + lambda * p
        v_t = rho * v_{t-1} + (1 - rho) * g^2
        dx  = sqrt(a_{t-1} + eps) / sqrt(v_t + eps) * g
        a_t = rho * a_{t-1} + (1 - rho) * dx^2
        p  <- p - lr * dx

    State: ``square_avg`` (v), ``acc_delta`` (a). A second scratch buffer holds dx.
    """

    name = "adadelta"

    def __init__(self, params: Any, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, lr)
        self.rho = _check_number("rho", rho, low=0.0, high=1.0)
        self.eps = _check_number("eps", eps, low=0.0)
        self.weight_decay = _check_number("weight_decay", weight_decay, low=0.0)
        xp = get_array_module(params.data)
        self.square_avg = xp.zeros_like(params.data)
        self.acc_delta = xp.zeros_like(params.data)
        self._scratch2 = xp.zeros_like(params.data)

    def named_state(self):
        return [("square_avg", self.square_avg), ("acc_delta", self.acc_delta)]

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        rho, v, a = self.rho, self.square_avg, self.acc_delta
        g = self._l2_gradient(p, grad, scratch, self.weight_decay)   # grad, or scratch
        dx = self._scratch2
        xp.multiply(g, g, out=dx)
        dx *= 1.0 - rho
        v *= rho
        v += dx
        xp.add(a, self.eps, out=dx)
        xp.sqrt(dx, out=dx)
        dx *= g                               # g (maybe in scratch) is last read here
        xp.add(v, self.eps, out=scratch)
        xp.sqrt(scratch, out=scratch)
        dx /= scratch                         # dx
        xp.multiply(dx, dx, out=scratch)
        scratch *= 1.0 - rho
        a *= rho
        a += scratch
        dx *= self.lr
        p -= dx

    def __repr__(self) -> str:
        return (f"Adadelta(lr={self.lr:g}, rho={self.rho:g}, eps={self.eps:g}, "
                f"weight_decay={self.weight_decay:g})")


class LAMB(MomentEstimates):
    """LAMB, layer-wise adaptive moments (You et al., 2020, Algorithm 2), with bias
    correction and decoupled weight decay.

    Parameters
    ----------
    params : FlatParameters (``data``, ``grad`` : (P,)); its ``offsets`` / ``shapes`` give
        the layers (one segment per parameter tensor). Anything without them is one segment.
    lr : float, > 0 (default 1e-3)
    betas : (float, float), each in [0, 1)
    eps : float >= 0 (default 1e-6)
    weight_decay : float >= 0 (default 0)

    Notes
    -----
    With ``m_0 = v_0 = 0``, ``t = 1, 2, ...`` and ``p_l`` the parameters of segment ``l``::

        m_t  = beta1 * m_{t-1} + (1 - beta1) * grad
        v_t  = beta2 * v_{t-1} + (1 - beta2) * grad^2
        u    = (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps) + lambda * p
        r_l  = |p_l| / |u_l|   if |p_l| > 0 and |u_l| > 0, else 1      (trust ratio, phi = id)
        p_l <- p_l - lr * r_l * u_l

    ``|u_l|^2`` is formed as ``|a_l|^2 + 2 lambda a_l.p_l + lambda^2 |p_l|^2`` with ``a`` the
    Adam direction, so no buffer for ``u`` is needed. The step is NOT elementwise: each
    segment's update depends on its norms (:attr:`elementwise` is False), so it cannot be
    applied to an arbitrary slice of the buffer. State: ``exp_avg`` (m), ``exp_avg_sq`` (v).
    """

    name = "lamb"
    elementwise = False

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, lr, betas, eps, weight_decay)
        offsets = getattr(params, "offsets", None)
        shapes = getattr(params, "shapes", None)
        if offsets is None or shapes is None:
            self.segments = [(0, int(params.data.size))]
        else:
            self.segments = [(int(o), int(o) + math.prod(s)) for o, s in zip(offsets, shapes)]

    def _update(self, p, grad, scratch) -> None:
        xp = get_array_module(p)
        beta1, beta2 = self.betas
        t = self.step_count
        m, v = self.exp_avg, self.exp_avg_sq
        m -= grad
        m *= beta1
        m += grad
        xp.multiply(grad, grad, out=scratch)
        scratch *= 1.0 - beta2
        v *= beta2
        v += scratch
        xp.sqrt(v, out=scratch)
        scratch /= math.sqrt(1.0 - beta2 ** t)
        scratch += self.eps
        xp.divide(m, scratch, out=scratch)
        scratch /= 1.0 - beta1 ** t              # a, the Adam direction
        wd = self.weight_decay
        for lo, hi in self.segments:
            a, w = scratch[lo:hi], p[lo:hi]
            w_norm = xp.sqrt(xp.dot(w, w))
            u_sq = xp.dot(a, a)
            if wd != 0:
                u_sq = u_sq + 2.0 * wd * xp.dot(a, w) + wd * wd * xp.dot(w, w)
            u_norm = xp.sqrt(xp.maximum(u_sq, 0.0))
            # 0-d arrays throughout: on a GPU no norm travels to the host.
            ratio = xp.where((w_norm > 0) & (u_norm > 0), w_norm / xp.where(u_norm > 0, u_norm, 1.0), 1.0)
            step = ratio * self.lr
            if wd != 0:
                w *= 1.0 - step * wd
            a *= step
            w -= a

    def __repr__(self) -> str:
        return (f"LAMB(lr={self.lr:g}, betas=({self.betas[0]:g}, {self.betas[1]:g}), "
                f"eps={self.eps:g}, weight_decay={self.weight_decay:g})")


OPTIMIZERS: dict[str, type[Optimizer]] = {
    "sgd": SGD, "adam": Adam, "adamw": AdamW, "rmsprop": RMSprop, "adagrad": Adagrad,
    "radam": RAdam, "nadam": NAdam, "adamax": Adamax, "adadelta": Adadelta, "lamb": LAMB,
}

#: the optimizers whose moments are Adam-like: they take ``betas``
_BETA_OPTIMIZERS = ("adam", "adamw", "radam", "nadam", "adamax", "lamb")


def build_optimizer(name: str, params: Any, lr: float, momentum: float = 0.9,
                    weight_decay: float = 0.0, nesterov: bool = False,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float | None = None) -> Optimizer:
    """Build an optimizer by name (the command line's ``--optimizer``).

    ============  =======================================================================
    name          when to use it
    ============  =======================================================================
    ``sgd``       SGD + momentum (optionally Nesterov) and L2 decay: the usual choice for
                  CNNs trained with a step or cosine schedule; uses ``momentum``, ``nesterov``.
    ``adam``      Adam with L2 decay in the gradient: fast start, little tuning.
    ``adamw``     Adam with decoupled decay: prefer it to ``adam`` when weight decay matters.
    ``rmsprop``   per-weight step scaled by the RMS of recent gradients (no momentum here).
    ``adagrad``   per-weight step shrinking with the sum of all squared gradients.
    ``radam``     Adam whose adaptive step is switched on gradually (no warm-up needed).
    ``nadam``     Adam with Nesterov momentum.
    ``adamax``    Adam with the infinity norm in place of the RMS.
    ``adadelta``  unit-free steps (``lr`` is a factor, 1.0 by default in its class).
    ``lamb``      Adam direction rescaled per layer by ``|p_l| / |u_l|`` (large batches).
    ============  =======================================================================

    ``momentum`` and ``nesterov`` apply to ``sgd`` only (``nesterov=True`` with another is
    refused); ``betas`` to the Adam family (``adam``, ``adamw``, ``radam``, ``nadam``,
    ``adamax``, ``lamb``); ``eps`` to every optimizer but ``sgd`` (None: each class's
    default, e.g. 1e-8 for Adam, 1e-10 for Adagrad, 1e-6 for Adadelta and LAMB). Every
    argument out of range is refused.
    """
    key = str(name).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if key == "sgd":
        return SGD(params, lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    if nesterov:
        raise ValueError(f"nesterov applies to 'sgd' only, not {key!r}")
    options: dict[str, Any] = {"weight_decay": weight_decay}
    if eps is not None:
        options["eps"] = eps
    if key in _BETA_OPTIMIZERS:
        options["betas"] = betas
    return OPTIMIZERS[key](params, lr, **options)


# --------------------------------------------------------------------------------------
# learning-rate schedules
# --------------------------------------------------------------------------------------

SCHEDULES = ("constant", "step", "cosine")


@dataclass(frozen=True)
class Schedule:
    """A learning rate as a function of the (0-based) global step: ``lr = schedule(t)``.

    Build it with :func:`make_schedule`, which validates the arguments.

    Notes
    -----
    With ``w`` warm-up steps, ``T`` total steps, ``lr_0`` the base rate::

        warm-up (t < w):  lr(t) = lr_0 * (t + 1) / w
        constant:         lr(t) = lr_0
        step:             lr(t) = lr_0 * gamma ** floor(t / step_size)
                          (boundaries at absolute steps step_size, 2*step_size, ...)
        cosine:           lr(t) = min_lr + (lr_0 - min_lr) * (1 + cos(pi * s)) / 2,
                          s = min(1, (t - w) / (T - w))
                          (starts at lr_0 right after warm-up, reaches min_lr at t = T and
                          stays there)
    """

    name: str
    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    step_size: int = 1
    gamma: float = 0.1
    min_lr: float = 0.0

    def __call__(self, step: int) -> float:
        t = _check_int("step", step, low=0)
        if t < self.warmup_steps:
            return self.base_lr * (t + 1) / self.warmup_steps
        if self.name == "constant":
            return self.base_lr
        if self.name == "step":
            return self.base_lr * self.gamma ** (t // self.step_size)
        # cosine
        progress = min(1.0, (t - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_schedule(name: str, base_lr: float, total_steps: int, warmup_steps: int = 0,
                  step_size: int | None = None, gamma: float = 0.1,
                  min_lr: float = 0.0) -> Callable[[int], float]:
    """Build a :class:`Schedule` (see its Notes for the formulas).

    Parameters
    ----------
    name : 'constant' | 'step' | 'cosine'
    base_lr : float > 0
    total_steps : int >= 1, the steps of the whole run
    warmup_steps : int in [0, total_steps), linear warm-up length
    step_size : int >= 1 ('step' only), default ``max(1, total_steps // 3)``; must be
        >= warmup_steps, or the warm-up would climb to a rate the decay has already left
    gamma : float in (0, 1] ('step' only), the factor at each boundary
    min_lr : float in [0, base_lr] ('cosine' only), the final rate
    """
    key = str(name).lower()
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    base_lr = _check_number("base_lr", base_lr, low=0.0, low_open=True)
    total_steps = _check_int("total_steps", total_steps, low=1)
    warmup_steps = _check_int("warmup_steps", warmup_steps, low=0)
    if warmup_steps >= total_steps and warmup_steps > 0:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be < total_steps ({total_steps})")
    step_size = max(1, total_steps // 3) if step_size is None else _check_int("step_size", step_size, low=1)
    if key == "step" and warmup_steps > step_size:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be <= step_size ({step_size})")
    gamma = _check_number("gamma", gamma, low=0.0, high=1.0, low_open=True, high_open=False)
    min_lr = _check_number("min_lr", min_lr, low=0.0, high=base_lr, high_open=False)
    return Schedule(key, base_lr, total_steps, warmup_steps, step_size, gamma, min_lr)
