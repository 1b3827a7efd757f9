"""Learning-rate schedules: constant, step and cosine, each with a linear warm-up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from mpidl.engine.optim.base import _check_int, _check_number

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
