"""Optimizers on the flat buffers and learning-rate schedules (mpidl/engine/optim.py).

The optimizers are checked against a straightforward reference written here, one parameter
tensor at a time in the textbook form of each rule, and against ``torch.optim`` on the same
numbers when PyTorch is installed (skipped otherwise).
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from mpidl.engine.backend import get_backend, gpu_unavailable_reason
from mpidl.engine.optim import SGD, Adam, AdamW, Schedule, build_optimizer, make_schedule
from mpidl.engine.params import FlatParameters, Parameter, he_normal, uniform

SHAPES = [(4, 3, 3, 3), (4,), (5, 36), (5,)]  # a conv weight/bias and a linear weight/bias
STEPS = 6


def make_flat(dtype: str = "float64", seed: int = 0) -> FlatParameters:
    params = [(f"p{k}", Parameter(shape, he_normal(max(1, math.prod(shape[1:])))
                                  if len(shape) > 1 else uniform(0.5)))
              for k, shape in enumerate(SHAPES)]
    return FlatParameters(params, get_backend("cpu", dtype), seed=seed)


def gradient_sequence(flat: FlatParameters, steps: int = STEPS, seed: int = 1) -> list[np.ndarray]:
    """Per step, a flat gradient (P,) drawn once, so every optimizer sees the same numbers."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(flat.size).astype(flat.dtype) for _ in range(steps)]


def run_flat(optimizer, flat: FlatParameters, grads: list[np.ndarray]) -> None:
    for g in grads:
        flat.grad[...] = g  # the layers' backward writes the grad in place the same way
        optimizer.step()


def split(flat: FlatParameters, vector: np.ndarray) -> list[np.ndarray]:
    """A flat (P,) vector -> one array per parameter (copies), in registration order."""
    return [vector[o:o + math.prod(s)].reshape(s).copy() for o, s in zip(flat.offsets, flat.shapes)]


# --------------------------------------------------------------------------------------
# per-parameter references (textbook form, one tensor at a time, fresh arrays everywhere)
# --------------------------------------------------------------------------------------


def reference_sgd(params, grads_per_step, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    params = [p.copy() for p in params]
    buffers = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, grad) in enumerate(zip(params, grads)):
            g = grad + weight_decay * p
            if momentum != 0:
                if buffers[i] is None:
                    buffers[i] = g.copy()
                else:
                    buffers[i] = momentum * buffers[i] + (1 - dampening) * g
                g = g + momentum * buffers[i] if nesterov else buffers[i]
            params[i] = p - lr * g
    return params


def reference_adam(params, grads_per_step, lr, betas, eps, weight_decay, decoupled):
    beta1, beta2 = betas
    params = [p.copy() for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, grad in enumerate(grads):
            p = params[i]
            if decoupled:
                p = p - lr * weight_decay * p
                g = grad
            else:
                g = grad + weight_decay * p
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1 ** t)
            v_hat = v[i] / (1 - beta2 ** t)
            params[i] = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return params


SGD_CASES = [
    dict(momentum=0.0),
    dict(momentum=0.0, weight_decay=1e-2),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.3),
    dict(momentum=0.9, dampening=0.3, weight_decay=5e-3),
    dict(momentum=0.8, nesterov=True),
    dict(momentum=0.8, nesterov=True, weight_decay=1e-2),
]


@pytest.mark.parametrize("options", SGD_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_sgd_matches_reference(options):
    flat = make_flat()
    grads = gradient_sequence(flat)
    start = split(flat, flat.data)
    expected = reference_sgd(start, [split(flat, g) for g in grads], lr=0.05, **options)

    optimizer = SGD(flat, lr=0.05, **options)
    run_flat(optimizer, flat, grads)

    for name, param, want in zip(flat.names, flat, expected):
        np.testing.assert_allclose(param.data, want, rtol=1e-12, atol=1e-14, err_msg=name)
    assert optimizer.step_count == STEPS


ADAM_CASES = [
    (Adam, dict()),
    (Adam, dict(weight_decay=1e-2)),
    (Adam, dict(betas=(0.5, 0.9), eps=1e-6, weight_decay=1e-3)),
    (Adam, dict(betas=(0.0, 0.99))),
    (AdamW, dict()),  # PyTorch's default decay 1e-2
    (AdamW, dict(weight_decay=0.1, betas=(0.8, 0.95))),
]


@pytest.mark.parametrize("cls,options", ADAM_CASES, ids=lambda c: c.__name__ if isinstance(c, type) else str(c))
def test_adam_matches_reference(cls, options):
    flat = make_flat()
    grads = gradient_sequence(flat)
    start = split(flat, flat.data)
    optimizer = cls(flat, lr=1e-2, **options)
    expected = reference_adam(start, [split(flat, g) for g in grads], lr=1e-2, betas=optimizer.betas,
                              eps=optimizer.eps, weight_decay=optimizer.weight_decay,
                              decoupled=cls is AdamW)
    run_flat(optimizer, flat, grads)
    for name, param, want in zip(flat.names, flat, expected):
        np.testing.assert_allclose(param.data, want, rtol=1e-11, atol=1e-14, err_msg=name)


def test_adam_first_step_is_bias_corrected():
    # At t = 1, m_hat = g and v_hat = g^2 exactly, so every parameter moves by lr * g / (|g| + eps):
    # by about lr, whatever the gradient's scale. Without the correction the step would be
    # (1 - beta1) / sqrt(1 - beta2) ~ 3.16 times larger.
    flat = make_flat()
    before = flat.data.copy()
    flat.grad[...] = np.random.default_rng(3).standard_normal(flat.size) * 1e-3
    Adam(flat, lr=0.01, eps=0.0).step()
    np.testing.assert_allclose(before - flat.data, 0.01 * np.sign(flat.grad), rtol=1e-12)


def test_adamw_decay_is_decoupled_from_the_moments():
    # With a zero gradient AdamW only shrinks p by the factor (1 - lr*wd) and its moments stay 0;
    # Adam's L2 decay enters the moments instead and moves every p by about lr (normalised step).
    flat_w, flat_l2 = make_flat(), make_flat()
    p0 = flat_w.data.copy()
    adamw = AdamW(flat_w, lr=0.1, weight_decay=0.5)
    adam = Adam(flat_l2, lr=0.1, weight_decay=0.5, eps=0.0)
    adamw.step()
    adam.step()
    np.testing.assert_allclose(flat_w.data, p0 * (1 - 0.1 * 0.5), rtol=1e-15)
    assert not adamw.exp_avg.any() and not adamw.exp_avg_sq.any()
    np.testing.assert_allclose(flat_l2.data, p0 - 0.1 * np.sign(p0), rtol=1e-12)


def test_sgd_weight_decay_and_nesterov_by_hand():
    # One scalar: p = 1, grad = 1, lr = 0.1, wd = 0.5, momentum 0.5, nesterov.
    #   t=1: g = 1.5, b = 1.5, d = 1.5 + 0.5*1.5 = 2.25, p = 1 - 0.225 = 0.775
    #   t=2: g = 1 + 0.3875 = 1.3875, b = 0.75 + 1.3875 = 2.1375, d = 1.3875 + 1.06875 = 2.45625,
    #        p = 0.775 - 0.245625 = 0.529375
    flat = _Scalar(1.0, grad=1.0)
    optimizer = SGD(flat, lr=0.1, momentum=0.5, nesterov=True, weight_decay=0.5)
    optimizer.step()
    assert flat.data[0] == pytest.approx(0.775, abs=1e-15)
    optimizer.step()
    assert flat.data[0] == pytest.approx(0.529375, abs=1e-15)
    assert optimizer.momentum_buffer[0] == pytest.approx(2.1375, abs=1e-15)


class _Scalar:
    """A one-scalar stand-in for FlatParameters (the optimizer needs only .data and .grad)."""

    def __init__(self, value: float, grad: float):
        self.data = np.array([value])
        self.grad = np.array([grad])


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_dtype_float32_is_kept(cls):
    flat = make_flat("float32")
    optimizer = cls(flat, lr=0.01, weight_decay=1e-3) if cls is not SGD else \
        SGD(flat, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3)
    run_flat(optimizer, flat, gradient_sequence(flat, steps=2))
    assert flat.data.dtype == np.float32
    assert all(buffer.dtype == np.float32 for buffer in optimizer.state_buffers())


# --------------------------------------------------------------------------------------
# PyTorch on the same numbers (only where torch is installed)
# --------------------------------------------------------------------------------------

TORCH_CASES = [
    ("sgd", dict(momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("adam", dict(weight_decay=1e-2)),
    ("adamw", dict(weight_decay=1e-1)),
]


@pytest.mark.parametrize("name,options", TORCH_CASES)
def test_against_torch_optim(name, options):
    torch = pytest.importorskip("torch")
    flat = make_flat()
    grads = gradient_sequence(flat)
    tensors = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in split(flat, flat.data)]
    torch_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    ours_cls = {"sgd": SGD, "adam": Adam, "adamw": AdamW}[name]
    theirs = torch_cls(tensors, lr=0.01, **options)
    ours = ours_cls(flat, lr=0.01, **options)
    for g in grads:
        for tensor, part in zip(tensors, split(flat, g)):
            tensor.grad = torch.tensor(part, dtype=torch.float64)
        theirs.step()
    run_flat(ours, flat, grads)
    for param, tensor in zip(flat, tensors):
        np.testing.assert_allclose(param.data, tensor.detach().numpy(), rtol=1e-10, atol=1e-13)


# --------------------------------------------------------------------------------------
# flat-buffer invariants and memory discipline
# --------------------------------------------------------------------------------------


def all_optimizers(flat):
    return [
        SGD(flat, lr=0.01),
        SGD(flat, lr=0.01, momentum=0.9, dampening=0.2, weight_decay=1e-3),
        SGD(flat, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3),
        Adam(flat, lr=1e-3, weight_decay=1e-3),
        AdamW(flat, lr=1e-3),
    ]


@pytest.mark.parametrize("index", range(5))
def test_buffers_keep_their_identity_and_grad_is_untouched(index):
    flat = make_flat()
    optimizer = all_optimizers(flat)[index]
    data, grad = flat.data, flat.grad
    data_address = data.__array_interface__["data"][0]
    state_ids = [id(b) for b in optimizer.state_buffers()]
    scratch = optimizer._scratch
    for g in gradient_sequence(flat, steps=20):
        flat.grad[...] = g
        optimizer.step()
        # The reducer's gradient must survive the step (weight decay goes to scratch, not grad).
        np.testing.assert_array_equal(flat.grad, g)
    assert flat.data is data and flat.grad is grad
    assert flat.data.__array_interface__["data"][0] == data_address
    assert [id(b) for b in optimizer.state_buffers()] == state_ids
    assert optimizer._scratch is scratch
    # Every layer's view still reads the updated buffer.
    for param in flat:
        assert np.shares_memory(param.data, flat.data)


@pytest.mark.parametrize("index", range(5))
def test_step_allocates_no_parameter_sized_array(index):
    # tracemalloc sees NumPy's data allocations, so the peak of traced memory during a step
    # bounds whatever the step allocated; a single temporary of the parameter size would be
    # flat.nbytes. Large enough (8 MB) that small Python objects cannot be confused with it.
    size = 1 << 20

    class Big:
        data = np.random.default_rng(0).standard_normal(size)
        grad = np.random.default_rng(1).standard_normal(size)

    flat = Big()
    optimizer = all_optimizers(flat)[index]
    optimizer.step()  # the first step of SGD momentum takes its own branch: measure both
    tracemalloc.start()
    try:
        for _ in range(2):
            tracemalloc.reset_peak()
            optimizer.step()
            _, peak = tracemalloc.get_traced_memory()
            assert peak < flat.data.nbytes // 16, f"{optimizer!r} allocated {peak} bytes in step()"
    finally:
        tracemalloc.stop()


def test_first_sgd_step_allocates_nothing_either():
    size = 1 << 20
    flat = _Scalar(0.0, 0.0)
    flat.data = np.ones(size)
    flat.grad = np.ones(size)
    optimizer = SGD(flat, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    tracemalloc.start()
    try:
        optimizer.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < flat.data.nbytes // 16


def test_state_buffers_per_optimizer():
    flat = make_flat()
    assert SGD(flat, lr=0.1).state_buffers() == []
    (buf,) = SGD(flat, lr=0.1, momentum=0.9).state_buffers()
    assert buf.shape == (flat.size,)
    m, v = Adam(flat).state_buffers()
    assert m.shape == v.shape == (flat.size,) and m is not v


# --------------------------------------------------------------------------------------
# learning rate attribute, state dict
# --------------------------------------------------------------------------------------


def test_lr_is_settable_and_zero_lr_freezes():
    flat = make_flat()
    optimizer = SGD(flat, lr=0.1, momentum=0.9)
    optimizer.lr = 0.0
    before = flat.data.copy()
    run_flat(optimizer, flat, gradient_sequence(flat, steps=2))
    np.testing.assert_array_equal(flat.data, before)
    optimizer.lr = 0.5
    assert optimizer.lr == 0.5
    with pytest.raises(ValueError, match="lr"):
        optimizer.lr = -1e-3
    with pytest.raises(ValueError, match="lr"):
        optimizer.lr = float("nan")


@pytest.mark.parametrize("index", range(5))
def test_state_dict_round_trip(index):
    grads = gradient_sequence(make_flat(), steps=8)
    flat_a = make_flat()
    a = all_optimizers(flat_a)[index]
    run_flat(a, flat_a, grads[:4])
    saved_params = flat_a.state_dict_host()
    saved = a.state_dict_host()
    assert saved["step_count"] == 4 and saved["name"] == a.name

    # Saved arrays are copies: continuing to train does not change them.
    run_flat(a, flat_a, grads[4:])
    for key, buffer in a.named_state():
        assert not np.shares_memory(saved[key], buffer)

    flat_b = make_flat(seed=99)
    b = all_optimizers(flat_b)[index]
    ids = [id(buf) for buf in b.state_buffers()]
    flat_b.load_host(saved_params)
    b.load_state_dict_host(saved)
    assert [id(buf) for buf in b.state_buffers()] == ids
    assert b.step_count == 4
    run_flat(b, flat_b, grads[4:])
    np.testing.assert_array_equal(flat_b.data, flat_a.data)
    for x, y in zip(a.state_buffers(), b.state_buffers()):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("index", range(5))
def test_checkpoint_form_round_trip(index):
    # The checkpoint stores the state as a positional list of state_buffers() plus the step.
    grads = gradient_sequence(make_flat(), steps=6)
    flat_a = make_flat()
    a = all_optimizers(flat_a)[index]
    run_flat(a, flat_a, grads[:3])
    saved = {"state": [np.array(b) for b in a.state_buffers()], "step_count": np.int64(a.step_count)}
    saved_params = flat_a.state_dict_host()
    run_flat(a, flat_a, grads[3:])

    flat_b = make_flat(seed=7)
    b = all_optimizers(flat_b)[index]
    flat_b.load_host(saved_params)
    b.lr = a.lr
    b.load_state_dict_host(saved)
    assert b.step_count == 3
    run_flat(b, flat_b, grads[3:])
    np.testing.assert_array_equal(flat_b.data, flat_a.data)


def test_load_state_dict_refuses_mismatches():
    flat = make_flat()
    adam = Adam(flat)
    state = adam.state_dict_host()
    with pytest.raises(ValueError, match="'adam', not 'sgd'"):
        SGD(flat, lr=0.1, momentum=0.9).load_state_dict_host(state)
    with pytest.raises(KeyError, match="exp_avg_sq"):
        adam.load_state_dict_host({k: v for k, v in state.items() if k != "exp_avg_sq"})
    bad = dict(state, exp_avg=np.zeros(3))
    with pytest.raises(ValueError, match=r"exp_avg.*shape"):
        adam.load_state_dict_host(bad)
    with pytest.raises(ValueError, match="has 2 state buffers, the state list holds 1"):
        adam.load_state_dict_host({"state": [state["exp_avg"]], "step_count": 1})
    with pytest.raises(KeyError, match="step_count"):
        adam.load_state_dict_host({"state": [state["exp_avg"], state["exp_avg_sq"]]})
    with pytest.raises(ValueError, match=r"exp_avg_sq.*shape"):
        adam.load_state_dict_host({"state": [state["exp_avg"], np.zeros(2)], "step_count": 1})
    # nothing was written by the refused loads
    assert adam.step_count == 0 and not adam.exp_avg.any()


# --------------------------------------------------------------------------------------
# build_optimizer and argument errors
# --------------------------------------------------------------------------------------


def test_build_optimizer_names():
    flat = make_flat()
    sgd = build_optimizer("sgd", flat, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    assert isinstance(sgd, SGD) and sgd.nesterov and sgd.momentum == 0.9 and sgd.weight_decay == 5e-4
    adam = build_optimizer("adam", flat, lr=1e-3, betas=(0.8, 0.99), eps=1e-7)
    assert type(adam) is Adam and adam.betas == (0.8, 0.99) and adam.eps == 1e-7
    adamw = build_optimizer("AdamW", flat, lr=1e-3, weight_decay=0.05)
    assert type(adamw) is AdamW and adamw.weight_decay == 0.05
    with pytest.raises(ValueError, match="unknown optimizer 'adabelief'; choose one of sgd, adam, adamw, rmsprop"):
        build_optimizer("adabelief", flat, lr=0.1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="sgd", lr=0.0), r"lr must be in \(0, inf\)"),
    (dict(name="sgd", lr=-0.1), "lr must be"),
    (dict(name="adam", lr=0.0), "lr must be"),
    (dict(name="sgd", lr=0.1, momentum=1.0), r"momentum must be in \[0, 1\)"),
    (dict(name="sgd", lr=0.1, momentum=-0.1), "momentum must be"),
    (dict(name="sgd", lr=0.1, weight_decay=-1e-4), "weight_decay must be"),
    (dict(name="adamw", lr=0.1, weight_decay=-1e-4), "weight_decay must be"),
    (dict(name="sgd", lr=0.1, momentum=0.0, nesterov=True), "nesterov=True requires momentum > 0"),
    (dict(name="adam", lr=0.1, nesterov=True), "nesterov applies to 'sgd' only"),
    (dict(name="adam", lr=0.1, betas=(0.9, 1.0)), r"betas\[1\] must be"),
    (dict(name="adam", lr=0.1, betas=0.9), "betas must be a pair"),
    (dict(name="adam", lr=0.1, eps=-1.0), "eps must be"),
    (dict(name="sgd", lr="fast"), "lr must be a number"),
])
def test_build_optimizer_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(params=make_flat(), **kwargs)


def test_sgd_refuses_nesterov_with_dampening_and_bad_params():
    flat = make_flat()
    with pytest.raises(ValueError, match="dampening = 0"):
        SGD(flat, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="flat 'data' and 'grad'"):
        SGD(object(), lr=0.1)
    bad = _Scalar(0.0, 0.0)
    bad.data = np.zeros((2, 2))
    with pytest.raises(ValueError, match="1-D"):
        SGD(bad, lr=0.1)
    bad = _Scalar(0.0, 0.0)
    bad.grad = np.zeros(1, dtype=np.float32)
    with pytest.raises(ValueError, match="one floating dtype"):
        SGD(bad, lr=0.1)


# --------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------


def test_constant_schedule_with_warmup():
    schedule = make_schedule("constant", 0.4, total_steps=100, warmup_steps=4)
    assert isinstance(schedule, Schedule)
    assert [schedule(t) for t in range(6)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert schedule(10_000) == 0.4
    assert make_schedule("constant", 0.4, total_steps=10)(0) == 0.4


def test_step_schedule_boundaries():
    schedule = make_schedule("step", 1.0, total_steps=90, gamma=0.5)  # step_size = 30
    assert schedule.step_size == 30
    assert schedule(0) == 1.0 and schedule(29) == 1.0
    assert schedule(30) == 0.5 and schedule(59) == 0.5
    assert schedule(60) == 0.25 and schedule(89) == 0.25
    warm = make_schedule("step", 0.1, total_steps=100, warmup_steps=5, step_size=10, gamma=0.1)
    assert warm(0) == pytest.approx(0.02) and warm(4) == pytest.approx(0.1)
    assert warm(5) == pytest.approx(0.1) and warm(9) == pytest.approx(0.1)
    assert warm(10) == pytest.approx(0.01) and warm(20) == pytest.approx(0.001)


def test_cosine_schedule_values():
    schedule = make_schedule("cosine", 0.1, total_steps=100, min_lr=0.001)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(50) == pytest.approx(0.001 + 0.099 * 0.5)  # half-way: mean of the ends
    assert schedule(100) == pytest.approx(0.001)
    assert schedule(150) == pytest.approx(0.001)   # stays at min_lr after the end
    values = [schedule(t) for t in range(101)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay

    warm = make_schedule("cosine", 0.1, total_steps=110, warmup_steps=10)
    assert warm(0) == pytest.approx(0.01) and warm(9) == pytest.approx(0.1)
    assert warm(10) == pytest.approx(0.1)                     # cosine starts after warm-up
    assert warm(60) == pytest.approx(0.05)                    # half of the 100 decay steps
    assert warm(110) == pytest.approx(0.0, abs=1e-15)


def test_schedule_drives_the_optimizer():
    flat = make_flat()
    optimizer = SGD(flat, lr=1.0, momentum=0.9)
    schedule = make_schedule("cosine", 1.0, total_steps=10, warmup_steps=2)
    for t in range(10):
        optimizer.lr = schedule(t)
        flat.grad[...] = 0.0
        optimizer.step()
    assert optimizer.lr == pytest.approx(schedule(9))


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="linear"), "unknown schedule 'linear'; choose one of constant, step, cosine"),
    (dict(base_lr=0.0), "base_lr must be"),
    (dict(total_steps=0), "total_steps must be >= 1"),
    (dict(total_steps=10.5), "total_steps must be an integer"),
    (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
    (dict(warmup_steps=100), r"warmup_steps \(100\) must be < total_steps \(100\)"),
    (dict(name="step", step_size=0), "step_size must be >= 1"),
    (dict(name="step", step_size=5, warmup_steps=6), r"must be <= step_size"),
    (dict(name="step", gamma=0.0), "gamma must be"),
    (dict(name="step", gamma=1.5), "gamma must be"),
    (dict(min_lr=-1.0), "min_lr must be"),
    (dict(min_lr=0.2), "min_lr must be"),
])
def test_make_schedule_refuses_bad_arguments(kwargs, match):
    arguments = dict(name="cosine", base_lr=0.1, total_steps=100) | kwargs
    with pytest.raises(ValueError, match=match):
        make_schedule(**arguments)


def test_schedule_refuses_negative_step():
    with pytest.raises(ValueError, match="step must be >= 0"):
        make_schedule("constant", 0.1, total_steps=10)(-1)


# --------------------------------------------------------------------------------------
# the same code path on CuPy buffers (only where a GPU is available)
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason=str(gpu_unavailable_reason()))
@pytest.mark.parametrize("index", range(5))
def test_device_buffers_match_host(index):
    import cupy

    flat_host = make_flat()
    flat_device = FlatParameters([(n, Parameter(s, uniform(0.0))) for n, s in zip(flat_host.names, SHAPES)],
                                 get_backend("gpu", "float64"))
    flat_device.data[...] = cupy.asarray(flat_host.data)
    data_pointer = flat_device.data.data.ptr
    host, device = all_optimizers(flat_host)[index], all_optimizers(flat_device)[index]
    for g in gradient_sequence(flat_host):
        flat_host.grad[...] = g
        flat_device.grad[...] = cupy.asarray(g)
        host.step()
        device.step()
    assert flat_device.data.data.ptr == data_pointer
    np.testing.assert_allclose(cupy.asnumpy(flat_device.data), flat_host.data, rtol=1e-12, atol=1e-14)
    state = device.state_dict_host()
    assert all(isinstance(state[k], np.ndarray) for k, _ in device.named_state())
    device.load_state_dict_host(host.state_dict_host())
    for x, y in zip(device.state_buffers(), host.state_buffers()):
        np.testing.assert_array_equal(cupy.asnumpy(x), y)
