"""The other rules, on the flat buffers: RMSprop, Adagrad, RAdam, NAdam, Adamax, Adadelta
(``torch.optim`` semantics) and LAMB (You et al., 2020). Each class's docstring states its
update; ``_update`` applies it in place."""

from __future__ import annotations

import math
from typing import Any

from mpidl.engine.backend import get_array_module
from mpidl.engine.optim.base import MomentEstimates, Optimizer, _check_number, ema_, ema_square_


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
        ema_square_(v, g, alpha, scratch)        # v_t = alpha v_{t-1} + (1 - alpha) g^2
        if self.centered:
            gbar = self.grad_avg
            ema_(gbar, g, alpha)                 # gbar_t = alpha gbar_{t-1} + (1 - alpha) g
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
        ema_(m, g, beta1)
        ema_square_(v, g, beta2, scratch)   # g is not needed after this point
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
        ema_(m, g, beta1)
        ema_square_(v, g, beta2, scratch)
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
        ema_(m, g, beta1)
        xp.abs(g, out=scratch)           # g is not needed after this point
        scratch += self.eps
        u *= beta2
        xp.maximum(u, scratch, out=u)
        xp.divide(m, u, out=scratch)
        scratch *= self.lr / (1.0 - beta1 ** self.step_count)
        p -= scratch


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
        ema_square_(v, g, rho, dx)            # v_t = rho v_{t-1} + (1 - rho) g^2
        xp.add(a, self.eps, out=dx)
        xp.sqrt(dx, out=dx)
        dx *= g                               # g (maybe in scratch) is last read here
        xp.add(v, self.eps, out=scratch)
        xp.sqrt(scratch, out=scratch)
        dx /= scratch                         # dx
        ema_square_(a, dx, rho, scratch)      # a_t = rho a_{t-1} + (1 - rho) dx^2
        dx *= self.lr
        p -= dx


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
        ema_(m, grad, beta1)
        ema_square_(v, grad, beta2, scratch)
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
