"""The shared float64 gradient check (central differences), used by every layer and model test.

Like Chainer's ``gradient_check.check_backward``: the layer's output ``y`` is reduced to the
scalar ``L = sum(y * w)`` with fixed random weights ``w``, so ``dL/dy = w`` exercises every
output element with a different weight. The analytic gradients (``backward(w)``: the input
gradient it returns and the parameter gradients it writes) are compared with

    dL/dz_i ~ (L(z + eps e_i) - L(z - eps e_i)) / (2 eps)

for every element ``z_i`` of the input and of every parameter. Central differences have an
error of order ``eps^2``; in float64 with ``eps = 1e-6`` that leaves about 1e-8 of agreement
on O(1) quantities, far below any real bug. Inputs should keep away from kinks (ReLU at 0,
ties in max pooling) by more than ``eps``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mpidl.engine.backend import get_array_module, get_backend, to_host
from mpidl.engine.params import FlatParameters

__all__ = ["numerical_gradient", "bind_parameters", "check_backward", "check_loss_backward"]


def numerical_gradient(f: Callable[[], float], array, eps: float = 1e-6, indices=None) -> np.ndarray:
    """Central-difference gradient of the scalar ``f()`` with respect to ``array``.

    ``array`` is perturbed IN PLACE, one element at a time, and restored; it must be the very
    array ``f`` reads (a parameter view, an input), float64 and contiguous. With ``indices``
    (flat positions) only those elements are perturbed and a 1-D array of their partial
    derivatives is returned (for spot checks of whole models).
    """
    if array.dtype != np.float64:
        raise ValueError(f"gradient checks run in float64, got {array.dtype}")
    if not array.flags.c_contiguous:
        # reshape(-1) would then be a copy, and the perturbations would never reach f.
        raise ValueError("array must be C-contiguous so that perturbations reach it")
    flat = array.reshape(-1)
    positions = range(flat.size) if indices is None else [int(i) for i in indices]
    grad = np.empty(len(positions))
    for k, i in enumerate(positions):
        original = float(flat[i])
        flat[i] = original + eps
        f_plus = f()
        flat[i] = original - eps
        f_minus = f()
        flat[i] = original
        grad[k] = (f_plus - f_minus) / (2.0 * eps)
    return grad.reshape(array.shape) if indices is None else grad


def bind_parameters(module, seed: int = 0, dtype: str = "float64") -> FlatParameters:
    """Give a stand-alone layer its flat parameter storage (CPU backend) and move its buffers."""
    backend = get_backend("cpu", dtype)
    flat = FlatParameters(module.named_parameters(), backend, seed)
    module.to(backend)
    return flat


def _assert_close(analytic, numeric, what: str, atol: float, rtol: float) -> None:
    analytic, numeric = to_host(analytic), np.asarray(numeric)
    if analytic.shape != numeric.shape:
        raise AssertionError(f"{what}: analytic gradient has shape {analytic.shape}, numeric {numeric.shape}")
    np.testing.assert_allclose(analytic, numeric, atol=atol, rtol=rtol, err_msg=f"gradient of {what}")


def check_backward(
    module,
    x,
    *,
    seed: int = 0,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    check_input: bool = True,
    before_forward: Callable[[], None] | None = None,
) -> None:
    """Check ``module.backward`` against central differences, for the input and every parameter.

    Parameters
    ----------
    module : a Module; bound to float64 storage here if its parameters are not bound yet
    x : float64 input array (perturbed in place during the check, restored afterwards)
    check_input : compare the returned input gradient too (False for a layer that returns None)
    before_forward : called before every forward (e.g. to reseed a Dropout so that every
        evaluation of ``L`` sees the same mask)

    Raises
    ------
    AssertionError naming the input or the parameter whose gradient disagrees.
    """
    named = module.named_parameters()
    if named and not named[0][1].bound:
        bind_parameters(module, seed=seed + 1)
    rng = np.random.default_rng(seed)
    xp = get_array_module(x)

    def run_forward():
        if before_forward is not None:
            before_forward()
        return module.forward(x)

    y = run_forward()
    weights = xp.asarray(rng.standard_normal(y.shape))
    dx = module.backward(weights.copy())
    analytic_dx = None if dx is None else to_host(dx).copy()
    analytic_params = {name: to_host(p.grad).copy() for name, p in named}

    def loss() -> float:
        return float((run_forward() * weights).sum())

    if check_input:
        if analytic_dx is None:
            raise AssertionError("backward returned None but check_input=True")
        _assert_close(analytic_dx, numerical_gradient(loss, x, eps), "the input", atol, rtol)
    for name, param in named:
        _assert_close(analytic_params[name], numerical_gradient(loss, param.data, eps), f"parameter {name}", atol, rtol)


def check_loss_backward(loss_fn, logits, labels, *, eps: float = 1e-6, atol: float = 1e-7, rtol: float = 1e-5) -> None:
    """Check ``loss_fn.backward()`` (``dL/dlogits``) against central differences of the scalar
    ``loss_fn.forward(logits, labels)``."""
    loss_fn.forward(logits, labels)
    analytic = to_host(loss_fn.backward()).copy()
    numeric = numerical_gradient(lambda: loss_fn.forward(logits, labels), logits, eps)
    _assert_close(analytic, numeric, "the logits", atol, rtol)
