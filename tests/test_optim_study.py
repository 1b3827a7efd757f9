"""The optimizer study's rules (RMSprop, Adagrad, RAdam, NAdam, Adamax, Adadelta, LAMB).

Each is checked against a reference written here in the textbook form of its equations, one
parameter tensor at a time with fresh arrays, and against numbers derived by hand on one
scalar, where PyTorch's equations are the reference (PyTorch is never needed). Their state
goes through ``state_dict_host`` / the checkpoint form and keeps its identity; a step
allocates no parameter-sized array.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from mpidl.engine.backend import gpu_unavailable_reason
from mpidl.engine.optim import (LAMB, OPTIMIZERS, Adadelta, Adagrad, Adamax, NAdam, RAdam, RMSprop,
                         build_optimizer)

from test_optim import _Scalar, gradient_sequence, make_flat, run_flat, split

STEPS = 8


# ------------------------------------------------------------------ textbook references
def ref_rmsprop(params, grads, lr, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False):
    params = [p.copy() for p in params]
    v = [np.zeros_like(p) for p in params]
    gbar = [np.zeros_like(p) for p in params]
    b = [np.zeros_like(p) for p in params]
    for step in grads:
        for i, grad in enumerate(step):
            g = grad + weight_decay * params[i]
            v[i] = alpha * v[i] + (1 - alpha) * g * g
            if centered:
                gbar[i] = alpha * gbar[i] + (1 - alpha) * g
                d = np.sqrt(v[i] - gbar[i] ** 2) + eps
            else:
                d = np.sqrt(v[i]) + eps
            if momentum > 0:
                b[i] = momentum * b[i] + g / d
                params[i] = params[i] - lr * b[i]
            else:
                params[i] = params[i] - lr * g / d
    return params


def ref_adagrad(params, grads, lr, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
    params = [p.copy() for p in params]
    s = [np.full_like(p, initial_accumulator_value) for p in params]
    for t, step in enumerate(grads, start=1):
        clr = lr / (1 + (t - 1) * lr_decay)
        for i, grad in enumerate(step):
            g = grad + weight_decay * params[i]
            s[i] = s[i] + g * g
            params[i] = params[i] - clr * g / (np.sqrt(s[i]) + eps)
    return params


def ref_radam(params, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    b1, b2 = betas
    params = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    rho_inf = 2 / (1 - b2) - 1
    for t, step in enumerate(grads, start=1):
        rho_t = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
        for i, grad in enumerate(step):
            g = grad + weight_decay * params[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat = m[i] / (1 - b1 ** t)
            if rho_t > 5:
                r = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                params[i] = params[i] - lr * r * mhat * math.sqrt(1 - b2 ** t) / (np.sqrt(v[i]) + eps)
            else:
                params[i] = params[i] - lr * mhat
    return params


def ref_nadam(params, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3):
    b1, b2 = betas
    params = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    mu = lambda t: b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))  # noqa: E731
    product = 1.0
    for t, step in enumerate(grads, start=1):
        product *= mu(t)
        for i, grad in enumerate(step):
            g = grad + weight_decay * params[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            d = np.sqrt(v[i] / (1 - b2 ** t)) + eps
            params[i] = (params[i] - lr * (1 - mu(t)) / (1 - product) * g / d
                         - lr * mu(t + 1) / (1 - product * mu(t + 1)) * m[i] / d)
    return params


def ref_adamax(params, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    b1, b2 = betas
    params = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    u = [np.zeros_like(p) for p in params]
    for t, step in enumerate(grads, start=1):
        for i, grad in enumerate(step):
            g = grad + weight_decay * params[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            u[i] = np.maximum(b2 * u[i], np.abs(g) + eps)
            params[i] = params[i] - lr / (1 - b1 ** t) * m[i] / u[i]
    return params


def ref_adadelta(params, grads, lr, rho=0.9, eps=1e-6, weight_decay=0.0):
    params = [p.copy() for p in params]
    v = [np.zeros_like(p) for p in params]
    a = [np.zeros_like(p) for p in params]
    for step in grads:
        for i, grad in enumerate(step):
            g = grad + weight_decay * params[i]
            v[i] = rho * v[i] + (1 - rho) * g * g
            dx = np.sqrt(a[i] + eps) / np.sqrt(v[i] + eps) * g
            a[i] = rho * a[i] + (1 - rho) * dx * dx
            params[i] = params[i] - lr * dx
    return params


def ref_lamb(params, grads, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
    b1, b2 = betas
    params = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, step in enumerate(grads, start=1):
        for i, grad in enumerate(step):
            m[i] = b1 * m[i] + (1 - b1) * grad
            v[i] = b2 * v[i] + (1 - b2) * grad * grad
            u = (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps) + weight_decay * params[i]
            w_norm, u_norm = np.linalg.norm(params[i]), np.linalg.norm(u)
            r = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            params[i] = params[i] - lr * r * u
    return params


CASES = [
    (RMSprop, ref_rmsprop, dict()),
    (RMSprop, ref_rmsprop, dict(weight_decay=1e-2)),
    (RMSprop, ref_rmsprop, dict(momentum=0.9, alpha=0.9)),
    (RMSprop, ref_rmsprop, dict(centered=True, momentum=0.5, weight_decay=1e-3, eps=1e-6)),
    (Adagrad, ref_adagrad, dict()),
    (Adagrad, ref_adagrad, dict(lr_decay=0.1, weight_decay=1e-2, initial_accumulator_value=0.1)),
    (RAdam, ref_radam, dict()),                         # rho_t > 5 from t = 6 on
    (RAdam, ref_radam, dict(betas=(0.8, 0.9), weight_decay=1e-2)),
    (NAdam, ref_nadam, dict()),
    (NAdam, ref_nadam, dict(betas=(0.8, 0.99), weight_decay=1e-2, momentum_decay=0.1)),
    (NAdam, ref_nadam, dict(betas=(0.0, 0.99))),
    (Adamax, ref_adamax, dict()),
    (Adamax, ref_adamax, dict(betas=(0.5, 0.9), weight_decay=1e-2)),
    (Adadelta, ref_adadelta, dict()),
    (Adadelta, ref_adadelta, dict(rho=0.5, weight_decay=1e-2)),
    (LAMB, ref_lamb, dict()),
    (LAMB, ref_lamb, dict(weight_decay=1e-2, betas=(0.8, 0.99))),
]


def _id(case):
    cls, _, options = case
    return cls.__name__ + ("-" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_the_textbook_equations(case):
    cls, reference, options = case
    lr = 0.5 if cls is Adadelta else 1e-2
    flat = make_flat()
    grads = gradient_sequence(flat, steps=STEPS)
    expected = reference(split(flat, flat.data), [split(flat, g) for g in grads], lr, **options)
    optimizer = cls(flat, lr=lr, **options)
    run_flat(optimizer, flat, grads)
    for name, param, want in zip(flat.names, flat, expected):
        np.testing.assert_allclose(param.data, want, rtol=1e-11, atol=1e-14, err_msg=name)
    assert optimizer.step_count == STEPS


def test_radam_switches_from_momentum_to_the_rectified_step():
    # beta2 = 0.999: rho_inf = 1999 and rho_t = 1999 - 2 t 0.999^t / (1 - 0.999^t), which is
    # ~ t - 1 for small t: rho_5 ~ 4.0 (no adaptation), rho_6 ~ 5.0025 (rectified).
    opt = RAdam(_Scalar(0.0, 0.0))
    assert opt.rectification(5) is None
    r6 = opt.rectification(6)
    rho_inf, rho6 = 1999.0, 1999.0 - 12 * 0.999 ** 6 / (1 - 0.999 ** 6)
    assert r6 == pytest.approx(math.sqrt((rho6 - 4) * (rho6 - 2) * rho_inf / (1995 * 1997 * rho6)), rel=1e-12)
    # First step with grad 2 at p = 1, lr 0.1: the momentum step p - lr * mhat = 1 - 0.1 * 2.
    flat = _Scalar(1.0, grad=2.0)
    RAdam(flat, lr=0.1).step()
    assert flat.data[0] == pytest.approx(0.8, abs=1e-15)


def test_by_hand_on_one_scalar():
    # RMSprop, p = 1, grad = 2, lr = 0.1, alpha = 0.9, eps = 0: v = 0.1 * 4 = 0.4,
    # p = 1 - 0.1 * 2 / sqrt(0.4) = 1 - 0.316227766...
    flat = _Scalar(1.0, grad=2.0)
    RMSprop(flat, lr=0.1, alpha=0.9, eps=0.0).step()
    assert flat.data[0] == pytest.approx(1 - 0.2 / math.sqrt(0.4), abs=1e-15)
    # Adagrad, twice with grad 2 at lr 1, eps 0: s = 4 then 8; p = 1 - 1 - 2/sqrt(8) = -0.7071...
    flat = _Scalar(1.0, grad=2.0)
    opt = Adagrad(flat, lr=1.0, eps=0.0)
    opt.step()
    assert flat.data[0] == pytest.approx(0.0, abs=1e-15)
    opt.step()
    assert flat.data[0] == pytest.approx(-1 / math.sqrt(2), abs=1e-15)
    # Adamax, grad -3, lr 0.1, eps 0: m = -0.3, u = 3, p = 1 - 0.1 / 0.1 * (-0.3 / 3) = 1.1
    flat = _Scalar(1.0, grad=-3.0)
    Adamax(flat, lr=0.1, eps=0.0).step()
    assert flat.data[0] == pytest.approx(1.1, abs=1e-15)
    # Adadelta, grad 2, rho 0.5, eps 1e-6, lr 1: v = 2, dx = sqrt(1e-6) / sqrt(2 + 1e-6) * 2
    flat = _Scalar(1.0, grad=2.0)
    opt = Adadelta(flat, lr=1.0, rho=0.5)
    opt.step()
    dx = 1e-3 / math.sqrt(2 + 1e-6) * 2
    assert flat.data[0] == pytest.approx(1 - dx, abs=1e-15)
    assert opt.acc_delta[0] == pytest.approx(0.5 * dx * dx, rel=1e-14)
    # NAdam, grad 2, lr 0.1, eps 0, t = 1: d = |g| = 2, m = 0.2, mu_1 = 0.9 (1 - 0.5 * 0.96^0.004)
    flat = _Scalar(1.0, grad=2.0)
    NAdam(flat, lr=0.1, eps=0.0).step()
    mu1 = 0.9 * (1 - 0.5 * 0.96 ** 0.004)
    mu2 = 0.9 * (1 - 0.5 * 0.96 ** 0.008)
    want = 1 - 0.1 * (1 - mu1) / (1 - mu1) * 1.0 - 0.1 * mu2 / (1 - mu1 * mu2) * 0.1
    assert flat.data[0] == pytest.approx(want, abs=1e-15)


def test_lamb_trust_ratio_is_per_layer():
    # Two layers, one 100 times the other: the first LAMB step moves every layer by lr times
    # its own norm (the Adam direction of one step is sign(g), so |u_l| = sqrt(n_l)).
    flat = make_flat()
    flat.data[:] = 1.0
    first = flat.shapes[0]
    flat.data[: math.prod(first)] = 100.0
    before = [p.data.copy() for p in flat]
    flat.grad[...] = np.random.default_rng(0).standard_normal(flat.size)
    LAMB(flat, lr=0.01, eps=0.0).step()
    for param, old in zip(flat, before):
        moved = np.linalg.norm(param.data - old)
        assert moved == pytest.approx(0.01 * np.linalg.norm(old), rel=1e-12)
    # Only elementwise optimizers can update a slice alone (--intra shm); LAMB never can.
    assert LAMB.elementwise is False
    assert {n for n in OPTIMIZERS if OPTIMIZERS[n].elementwise} == {"sgd", "adam", "adamw"}


def test_lamb_zero_parameters_take_a_ratio_of_one():
    flat = make_flat()
    flat.data[:] = 0.0
    flat.grad[...] = 1.0
    LAMB(flat, lr=0.01, eps=0.0).step()
    np.testing.assert_allclose(flat.data, -0.01, rtol=1e-12)


# ------------------------------------------------------------------ state and memory
def study_optimizers(flat):
    return [
        RMSprop(flat, lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-3),
        RMSprop(flat, lr=1e-2),
        Adagrad(flat, lr=1e-2, weight_decay=1e-3),
        RAdam(flat, lr=1e-2, weight_decay=1e-3),
        NAdam(flat, lr=1e-2, weight_decay=1e-3),
        Adamax(flat, lr=1e-2, weight_decay=1e-3),
        Adadelta(flat, lr=1.0, weight_decay=1e-3),
        LAMB(flat, lr=1e-2, weight_decay=1e-2),
    ]


N_STUDY = 8


@pytest.mark.parametrize("index", range(N_STUDY))
def test_state_round_trips_and_keeps_identity(index):
    grads = gradient_sequence(make_flat(), steps=10)
    flat_a = make_flat()
    a = study_optimizers(flat_a)[index]
    run_flat(a, flat_a, grads[:6])       # past RAdam's switch at t = 6
    saved_params, saved = flat_a.state_dict_host(), a.state_dict_host()
    checkpoint = {"state": [np.array(b) for b in a.state_buffers()], "step_count": a.step_count}
    run_flat(a, flat_a, grads[6:])
    for form in (saved, checkpoint):
        flat_b = make_flat(seed=5)
        b = study_optimizers(flat_b)[index]
        ids = [id(x) for x in b.state_buffers()]
        flat_b.load_host(saved_params)
        b.load_state_dict_host(form)
        assert [id(x) for x in b.state_buffers()] == ids and b.step_count == 6
        run_flat(b, flat_b, grads[6:])
        np.testing.assert_array_equal(flat_b.data, flat_a.data)
        for x, y in zip(a.state_buffers(), b.state_buffers()):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("index", range(N_STUDY))
def test_grad_untouched_float32_kept_and_no_allocation(index):
    flat = make_flat("float32")
    opt = study_optimizers(flat)[index]
    for g in gradient_sequence(flat, steps=3):
        flat.grad[...] = g
        opt.step()
        np.testing.assert_array_equal(flat.grad, g)
    assert flat.data.dtype == np.float32 and all(b.dtype == np.float32 for b in opt.state_buffers())
    assert all(b.shape == (flat.size,) for b in opt.state_buffers()) and opt.state_buffers()

    size = 1 << 20

    class Big:
        data = np.random.default_rng(0).standard_normal(size)
        grad = np.random.default_rng(1).standard_normal(size)

    big = Big()
    opt = study_optimizers(big)[index]
    opt.step()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        opt.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < big.data.nbytes // 16, f"{opt!r} allocated {peak} bytes in step()"


def test_build_optimizer_study_names_and_arguments():
    flat = make_flat()
    for name in ("rmsprop", "adagrad", "radam", "nadam", "adamax", "adadelta", "lamb"):
        opt = build_optimizer(name, flat, lr=1e-3, weight_decay=1e-4)
        assert type(opt) is OPTIMIZERS[name] and opt.name == name and opt.weight_decay == 1e-4
    assert build_optimizer("adagrad", flat, lr=1e-2).eps == 1e-10      # the class default
    assert build_optimizer("lamb", flat, lr=1e-2, betas=(0.8, 0.9)).betas == (0.8, 0.9)
    assert build_optimizer("rmsprop", flat, lr=1e-2, eps=1e-5).eps == 1e-5
    with pytest.raises(ValueError, match="nesterov applies to 'sgd' only, not 'rmsprop'"):
        build_optimizer("rmsprop", flat, lr=1e-2, nesterov=True)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\)"):
        RMSprop(flat, alpha=1.0)
    with pytest.raises(ValueError, match=r"rho must be in"):
        Adadelta(flat, rho=-0.1)
    with pytest.raises(ValueError, match="betas must be a pair"):
        LAMB(flat, betas=0.9)
    with pytest.raises(ValueError, match="lr_decay must be"):
        Adagrad(flat, lr_decay=-1.0)


@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason=str(gpu_unavailable_reason()))
@pytest.mark.parametrize("index", range(N_STUDY))
def test_device_buffers_match_host(index):
    import cupy

    from mpidl.engine.backend import get_backend
    from mpidl.engine.params import FlatParameters, Parameter, uniform
    from test_optim import SHAPES

    flat_host = make_flat()
    flat_device = FlatParameters([(n, Parameter(s, uniform(0.0))) for n, s in zip(flat_host.names, SHAPES)],
                                 get_backend("gpu", "float64"))
    flat_device.data[...] = cupy.asarray(flat_host.data)
    host, device = study_optimizers(flat_host)[index], study_optimizers(flat_device)[index]
    for g in gradient_sequence(flat_host):
        flat_host.grad[...] = g
        flat_device.grad[...] = cupy.asarray(g)
        host.step()
        device.step()
    np.testing.assert_allclose(cupy.asnumpy(flat_device.data), flat_host.data, rtol=1e-12, atol=1e-14)
    for x, y in zip(device.state_buffers(), host.state_buffers()):
        np.testing.assert_allclose(cupy.asnumpy(x), y, rtol=1e-12, atol=1e-14)
