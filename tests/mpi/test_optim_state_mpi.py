"""The optimizer study's state under DataParallel: ``--sync-optimizer-state`` averages every
state buffer of every rule at the node strategy's syncs, and checkpoints carry it.

Same tiny float64 ``hsicnn`` and loop as test_data_parallel.py; 1 rank per emulated node, so
that with 2 or more ranks the nodes train apart between syncs.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed.checkpoint import load_state_dict, state_dict
from mpidl.engine.optim import OPTIMIZERS
from test_data_parallel import P, WORLD, make, rel_diff, train
from trainer_harness import all_agree

pytestmark = pytest.mark.mpi

STUDY = ["rmsprop", "adagrad", "radam", "nadam", "adamax", "adadelta", "lamb"]


def optimizer_factory(name):
    cls = OPTIMIZERS[name]
    options = {"momentum": 0.5, "centered": True} if name == "rmsprop" else {}
    return lambda params, lr: cls(params, lr=1.0 if name == "adadelta" else 0.01, weight_decay=1e-3, **options)


def identical_everywhere(arrays) -> bool:
    return all(len(set(WORLD.allgather(np.ascontiguousarray(a).tobytes()))) == 1 for a in arrays)


@pytest.mark.parametrize("name", STUDY)
def test_synced_state_is_the_node_average_and_identical_on_every_rank(name):
    kwargs = dict(strategy="node", ranks_per_node=1, sync_every=100, optimizer=optimizer_factory(name))
    model, dp = make(sync_optimizer_state=True, **kwargs)
    train(model, dp, steps=3)
    # Before the sync: each node's own state. Its sample-weighted mean is what the sync must give.
    own = [np.array(b) for b in dp.optimizer.state_buffers()]
    weight = dp.exchange.weight_since_sync
    total = WORLD.allreduce(weight)
    expected = [WORLD.allreduce(weight * b) / total for b in own]
    differs = P > 1 and not identical_everywhere(own)
    dp.sync()
    state = dp.optimizer.state_buffers()
    ok = identical_everywhere(state) and identical_everywhere([model.params.data])
    ok = ok and all(rel_diff(s, e) <= 1e-12 for s, e in zip(state, expected) if np.any(e))
    assert all_agree(WORLD, ok and (differs or P == 1))

    model, dp = make(sync_optimizer_state=False, **kwargs)
    train(model, dp, steps=3)
    dp.sync()
    apart = not identical_everywhere(dp.optimizer.state_buffers())
    assert all_agree(WORLD, identical_everywhere([model.params.data]) and (apart or P == 1))


@pytest.mark.parametrize("name", ["rmsprop", "lamb", "nadam"])
@pytest.mark.parametrize("sync_state", [True, False])
def test_state_dict_then_load_continues_exactly(name, sync_state):
    kwargs = dict(strategy="node", ranks_per_node=1, sync_every=4, optimizer=optimizer_factory(name),
                  sync_optimizer_state=sync_state)
    model, dp = make(**kwargs)
    train(model, dp, steps=6)
    reference = train(model, dp, steps=3, seed=1)

    model, dp = make(**kwargs)
    train(model, dp, steps=6)
    state = WORLD.bcast(state_dict(dp), root=0)
    fresh_model, fresh_dp = make(**kwargs)
    load_state_dict(fresh_dp, state)
    resumed = train(fresh_model, fresh_dp, steps=3, seed=1)
    ok = rel_diff(resumed, reference) <= 1e-12 and fresh_dp.optimizer.step_count == 9
    assert all_agree(WORLD, ok), rel_diff(resumed, reference)
