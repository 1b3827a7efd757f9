"""MPI tests of mpidl.data: with N ranks, each rank reads only its own share of the file.

mpiexec -n 4 python -m pytest --with-mpi -q tests/mpi/test_data_mpi.py

Rank 0 writes a small layout file into a fresh folder and broadcasts its path; every rank
opens it read-only on its own. Every check is computed on every rank and gathered before
anything is asserted, so a failing rank never leaves the others waiting in a collective.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.data import apply_dihedral, dihedral_codes, open_dataset
from mpidl.data.layout import write_layout

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N_TRAIN, C, P = 37, 2, 3  # 37: not a multiple of any world size the suite runs


@pytest.fixture(scope="module")
def shared_file():
    """A layout whose sample i holds the value i everywhere (plus a pattern for augmentation)."""
    path = None
    if WORLD.Get_rank() == 0:
        folder = tempfile.mkdtemp(prefix="mpidl-data-mpi-")
        pattern = np.arange(C * P * P, dtype=np.float32).reshape(1, C, P, P) / 100
        x = np.arange(N_TRAIN, dtype=np.float32).reshape(-1, 1, 1, 1) + pattern
        y = np.arange(N_TRAIN) % 2
        path = f"{folder}/shared.h5"
        write_layout(path, {"train": (x, y), "test": (x[:5], y[:5])}, ["even", "odd"])
    path = WORLD.bcast(path, root=0)
    yield path
    WORLD.Barrier()  # everyone has closed the file before it is removed
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path.rsplit("/", 1)[0], ignore_errors=True)


def failures_anywhere(checks: dict) -> dict:
    failed = [name for name, ok in checks.items() if not ok]
    return {r: f for r, f in enumerate(WORLD.allgather(failed)) if f}


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_each_rank_reads_only_its_share(shared_file, layout):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if layout == "strided":
        share = np.arange(rank, N_TRAIN, size)
    else:
        share = np.array_split(np.arange(N_TRAIN), size)[rank]
    checks = {}
    try:
        ds = open_dataset(shared_file, normalize=False)
        order = np.random.default_rng(rank).permutation(share)
        values = []
        for start in range(0, order.size, 4):  # batches of 4 in a random order
            x, y = ds.read(order[start:start + 4])
            values.append(x[:, 0, 0, 0])
            checks["labels"] = checks.get("labels", True) and np.array_equal(y, order[start:start + 4] % 2)
        got = np.concatenate(values) if values else np.empty(0)
        checks["right samples"] = np.array_equal(np.rint(got).astype(int), order)
        checks["count == own share"] = ds.samples_read == share.size
        ds.close()
    except Exception as exc:  # report, do not leave the other ranks in the collective
        checks[f"raised {exc!r}"] = False
    everyone = WORLD.allgather(share.tolist())
    checks["shares disjoint and complete"] = sorted(sum(everyone, [])) == list(range(N_TRAIN))
    assert failures_anywhere(checks) == {}


def test_augmentation_does_not_depend_on_the_number_of_ranks(shared_file):
    """The samples N ranks produce together equal what one reader produces alone."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    share = np.arange(rank, N_TRAIN, size)
    checks = {}
    ds = open_dataset(shared_file, normalize=False, augment=True, augment_seed=11)
    ds.set_epoch(4)
    x, _ = ds.read(share[::-1])
    pieces = WORLD.gather((share[::-1], x), root=0)
    if rank == 0:
        alone = open_dataset(shared_file, normalize=False)
        raw, _ = alone.read(np.arange(N_TRAIN))
        expected = apply_dihedral(raw, dihedral_codes(11, 4, np.arange(N_TRAIN)))
        together = np.empty_like(expected)
        for idx, xs in pieces:
            together[idx] = xs
        checks["same as one reader"] = np.array_equal(together, expected)
        alone.close()
    ds.close()
    assert failures_anywhere(checks) == {}
