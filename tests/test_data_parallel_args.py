"""DataParallel's arguments, checked on one process (``MPI.COMM_SELF``) before any collective:
every rank of a job gets the same arguments, so every rank refuses them alike."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed import DataParallel, FixedSplit, Flat, Topology
from mpidl.engine.optim import SGD
from mpidl.engine.params import FlatParameters, Parameter, zeros


def one_rank(**kwargs):
    params = FlatParameters([("w", Parameter((3,), zeros()))])
    return DataParallel(params, SGD(params, lr=0.1), exchange=Flat(Topology.from_comm(MPI.COMM_SELF)), **kwargs)


def test_a_split_of_another_number_of_ranks_is_refused():
    """Before: a one-rank DataParallel given a two-rank split took half of every global batch."""
    with pytest.raises(ValueError, match="the split shares the batch among 2 ranks, the exchange's topology has 1"):
        one_rank(batch_size=64, split=FixedSplit(64, 2))
    with pytest.raises(ValueError, match="the split is of a global batch of 32, not 64"):
        one_rank(batch_size=64, split=FixedSplit(32, 1))
    dp = one_rank(batch_size=64, split=FixedSplit(64, 1))
    assert len(dp.local_indices(np.arange(64))) == 64
