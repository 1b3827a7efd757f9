"""Optimizers and learning-rate schedules that work on the model's flat parameter buffer.

A model keeps all its weights in ONE 1-D array ``params.data`` and all their gradients in ONE
1-D array ``params.grad`` (see :mod:`mpidl.engine.params`); every layer's ``weight`` is a view into
them. So an optimizer step is a handful of whole-buffer, in-place ``xp`` operations, the same
on NumPy and CuPy, and the optimizer state (momentum, Adam moments) is a few more flat
buffers of the same size, which a reducer can average with one collective each
(:meth:`Optimizer.state_buffers`).

The package, in reading order:

* :mod:`~mpidl.engine.optim.base`: :class:`Optimizer` (the buffers, ``lr``, the step count,
  the state, the one ``repr``), the in-place moving averages the rules are written with,
  :class:`MomentEstimates` (the Adam family's constructor) and the argument checks;
* :mod:`~mpidl.engine.optim.core`: SGD, Adam and AdamW;
* :mod:`~mpidl.engine.optim.more`: RMSprop, Adagrad, RAdam, NAdam, Adamax, Adadelta, LAMB;
* :mod:`~mpidl.engine.optim.schedules`: the learning-rate schedules;
* here: :data:`OPTIMIZERS` and :func:`build_optimizer` (the command line's ``--optimizer``).

Memory discipline
-----------------
Every parameter-sized buffer is allocated once, in ``__init__``: the state buffers and ONE
scratch buffer. :meth:`Optimizer.step` then only runs ufuncs with ``out=`` or augmented
assignments (``p -= s``), so a step allocates nothing the size of the model. Two
consequences of having a single scratch buffer are visible in the code:

* the weight-decayed gradient ``g = grad + wd * p`` is formed in the scratch buffer, never in
  ``params.grad``, so the reduced gradient stays inspectable after the step;
* a few updates are written in an algebraically equal form that needs no second temporary
  (every moving average ``m = beta1 * m + (1 - beta1) * g`` as ``m = g + beta1 * (m - g)``,
  :func:`~mpidl.engine.optim.base.ema_`; Nesterov's step as two subtractions). They round
  differently from the textbook form only in the last bit.

Some rules need g, a moment and a denominator at once (RMSprop and Adagrad with weight
decay, NAdam, Adadelta): those allocate a second scratch buffer, also in ``__init__``.

The semantics follow ``torch.optim`` (SGD, Adam, AdamW, RMSprop, Adagrad, RAdam, NAdam,
Adamax, Adadelta) exactly, so results can be compared with PyTorch on the same numbers;
LAMB follows You et al. (2020), Algorithm 2 (PyTorch has no LAMB).
"""

from __future__ import annotations

from typing import Any

from mpidl.engine.optim.base import MomentEstimates, Optimizer
from mpidl.engine.optim.core import SGD, Adam, AdamW
from mpidl.engine.optim.more import LAMB, Adadelta, Adagrad, Adamax, NAdam, RAdam, RMSprop
from mpidl.engine.optim.schedules import SCHEDULES, Schedule, make_schedule

__all__ = [
    "Optimizer",
    "MomentEstimates",
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
