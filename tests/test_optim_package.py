"""The optimizer package itself (mpidl/engine/optim/): every name importable from the package,
each rule in its module, one ``repr`` for every optimizer, the moving averages the rules are
written with, and the package in the wheel's list.

The update rules are tested in test_optim.py (SGD, Adam, AdamW, schedules) and
test_optim_study.py (the other rules), each against its textbook equations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mpidl.engine.optim as optim
from mpidl.engine.optim import (LAMB, OPTIMIZERS, SCHEDULES, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW,
                                MomentEstimates, NAdam, Optimizer, RAdam, RMSprop, Schedule, build_optimizer,
                                make_schedule)
from mpidl.engine.optim import base, core, more, schedules

from test_optim import make_flat

ROOT = Path(__file__).resolve().parents[1]


def test_every_name_of_the_package_is_importable_from_it():
    # the names of the module optim.py was, plus the Adam family's base class
    assert set(optim.__all__) == {
        "Optimizer", "MomentEstimates", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "RAdam", "NAdam",
        "Adamax", "Adadelta", "LAMB", "OPTIMIZERS", "build_optimizer", "Schedule", "SCHEDULES", "make_schedule"}
    assert all(hasattr(optim, name) for name in optim.__all__)


def test_each_rule_lives_in_its_module():
    assert (Optimizer, MomentEstimates) == (base.Optimizer, base.MomentEstimates)
    assert {cls.__module__ for cls in (SGD, Adam, AdamW)} == {core.__name__}
    assert {cls.__module__ for cls in (RMSprop, Adagrad, RAdam, NAdam, Adamax, Adadelta, LAMB)} == {more.__name__}
    assert (Schedule, SCHEDULES, make_schedule) == (schedules.Schedule, schedules.SCHEDULES, schedules.make_schedule)
    assert build_optimizer.__module__ == optim.__name__
    assert all(issubclass(cls, Optimizer) for cls in OPTIMIZERS.values())
    # build_optimizer passes betas to exactly the Adam family
    assert {name for name, cls in OPTIMIZERS.items() if issubclass(cls, MomentEstimates)} == set(
        optim._BETA_OPTIMIZERS)


def test_the_package_is_in_the_wheel():
    # [tool.setuptools] packages is explicit: an editable install finds a package left out of
    # it, a wheel does not ship it.
    assert '"mpidl.engine.optim"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


#: (class, arguments, repr): the strings each class's own __repr__ gave before they became one
REPRS = [
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4),
     "SGD(lr=0.1, momentum=0.9, dampening=0, nesterov=True, weight_decay=0.0005)"),
    (SGD, dict(lr=0.05), "SGD(lr=0.05, momentum=0, dampening=0, nesterov=False, weight_decay=0)"),
    (Adam, dict(), "Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0)"),
    (AdamW, dict(weight_decay=0.05), "AdamW(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.05)"),
    (RMSprop, dict(momentum=0.5, centered=True),
     "RMSprop(lr=0.01, alpha=0.99, eps=1e-08, weight_decay=0, momentum=0.5, centered=True)"),
    (Adagrad, dict(lr_decay=0.1),
     "Adagrad(lr=0.01, lr_decay=0.1, weight_decay=0, initial_accumulator_value=0, eps=1e-10)"),
    (RAdam, dict(betas=(0.8, 0.9)), "RAdam(lr=0.001, betas=(0.8, 0.9), eps=1e-08, weight_decay=0)"),
    (NAdam, dict(), "NAdam(lr=0.002, betas=(0.9, 0.999), eps=1e-08, weight_decay=0, momentum_decay=0.004)"),
    (Adamax, dict(), "Adamax(lr=0.002, betas=(0.9, 0.999), eps=1e-08, weight_decay=0)"),
    (Adadelta, dict(), "Adadelta(lr=1, rho=0.9, eps=1e-06, weight_decay=0)"),
    (LAMB, dict(weight_decay=0.01), "LAMB(lr=0.001, betas=(0.9, 0.999), eps=1e-06, weight_decay=0.01)"),
]


@pytest.mark.parametrize("cls,options,expected", REPRS, ids=[r[2].partition("(")[0] for r in REPRS])
def test_repr_names_the_class_and_every_constructor_argument(cls, options, expected):
    optimizer = cls(make_flat(), **options)
    assert repr(optimizer) == expected
    optimizer.lr = 0.25  # a schedule's rate is what the repr shows
    assert repr(optimizer).startswith(f"{cls.__name__}(lr=0.25, ")


def test_one_repr_for_every_optimizer():
    assert {cls for cls, _, _ in REPRS} == set(OPTIMIZERS.values())
    assert [cls.__name__ for cls in OPTIMIZERS.values() if "__repr__" in vars(cls)] == []


def test_moving_averages_are_the_textbook_ones():
    rng = np.random.default_rng(0)
    avg, x = rng.standard_normal(1000), rng.standard_normal(1000)
    m = avg.copy()
    base.ema_(m, x, 0.9)
    np.testing.assert_allclose(m, 0.9 * avg + 0.1 * x, rtol=0, atol=1e-15)
    v, tmp = avg.copy(), np.empty_like(x)
    base.ema_square_(v, x, 0.99, tmp)
    np.testing.assert_allclose(v, 0.99 * avg + 0.01 * x * x, rtol=0, atol=1e-15)
    # the temporary may be x itself (a rule's scratch buffer holding g for its last use)
    w, x_copy = avg.copy(), x.copy()
    base.ema_square_(w, x_copy, 0.99, x_copy)
    np.testing.assert_array_equal(w, v)
