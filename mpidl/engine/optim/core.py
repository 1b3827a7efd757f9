"""The rules of the papers: SGD (momentum, Nesterov, L2 weight decay), Adam and AdamW, on the
flat buffers. Each class's docstring states its update; ``_update`` applies it in place."""

from __future__ import annotations

import math
from typing import Any

from mpidl.engine.backend import get_array_module
from mpidl.engine.optim.base import MomentEstimates, Optimizer, _check_number, ema_, ema_square_


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

    ``_update`` is these lines, in place: ``g`` is ``grad`` itself or formed in the scratch
    buffer, and Nesterov's ``lr * d`` is subtracted a term at a time, so no second temporary
    is needed. With dampening, ``(1 - tau) g`` may overwrite ``g`` in the scratch buffer: only
    Nesterov reads ``g`` again, and it needs ``tau = 0``.
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
        lr, mu, tau = self.lr, self.momentum, self.dampening
        g = self._l2_gradient(p, grad, scratch, self.weight_decay)  # g = grad + lambda p
        if mu == 0:
            p -= xp.multiply(g, lr, out=scratch)                    # p <- p - lr g
            return
        b = self.momentum_buffer
        if self.step_count == 1:
            xp.copyto(b, g)                                         # b_1 = g
        else:                                                       # b_t = mu b_{t-1} + (1 - tau) g
            b *= mu
            b += g if tau == 0 else xp.multiply(g, 1.0 - tau, out=scratch)
        if self.nesterov:                                           # p <- p - lr (g + mu b_t)
            p -= xp.multiply(g, lr, out=scratch)
            p -= xp.multiply(b, lr * mu, out=scratch)
        else:
            p -= xp.multiply(b, lr, out=scratch)                    # p <- p - lr b_t


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
    ``m_1 / (1 - beta1) = g`` exactly). ``_update`` is these lines, in place: ``g``, then
    ``(1 - beta2) g^2``, then the denominator ``d`` and the step take turns in the one scratch
    buffer.
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
        (beta1, beta2), t, lr = self.betas, self.step_count, self.lr
        m, v = self.exp_avg, self.exp_avg_sq
        if self.decoupled_weight_decay:                   # AdamW: p <- p - lr lambda p, g = grad
            if self.weight_decay != 0:
                p *= 1.0 - lr * self.weight_decay
            g = grad
        else:                                             # Adam: g = grad + lambda p
            g = self._l2_gradient(p, grad, scratch, self.weight_decay)
        ema_(m, g, beta1)                                 # m_t = beta1 m_{t-1} + (1 - beta1) g
        ema_square_(v, g, beta2, scratch)                 # v_t = beta2 v_{t-1} + (1 - beta2) g^2
        d = xp.sqrt(v, out=scratch)                       # d = sqrt(v_t) / sqrt(1 - beta2^t) + eps
        d /= math.sqrt(1.0 - beta2 ** t)
        d += self.eps
        step = xp.divide(m, d, out=scratch)               # p <- p - lr / (1 - beta1^t) * m_t / d
        step *= lr / (1.0 - beta1 ** t)
        p -= step


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
