"""The optimizer package itself (mpidl/engine/optim/): one ``repr`` for every optimizer.

The update rules are tested in test_optim.py (SGD, Adam, AdamW, schedules) and
test_optim_study.py (the other rules), each against its textbook equations.
"""

from __future__ import annotations

import pytest

from mpidl.engine.optim import (LAMB, OPTIMIZERS, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, NAdam, RAdam,
                                RMSprop)

from test_optim import make_flat

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
