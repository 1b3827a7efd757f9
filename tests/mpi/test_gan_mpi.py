"""The GAN application under mpiexec: ``flat`` on P ranks equals one process (float64), every
strategy runs end to end through ``mpidl.gan.main`` and writes its metrics file, and the
replicas of G and D agree after the final sync. Run with 2 ranks, and with 4 ranks on 2
emulated nodes (MPIDL_RANKS_PER_NODE=2), like the rest of tests/mpi."""

import json
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpidl.distributed import Topology
from mpidl.gan import ConditionalGAN, GanConfig, load_spectra, main
from trainer_harness import all_agree

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
RANK = WORLD.Get_rank()


@pytest.fixture(scope="module")
def spectra():
    return load_spectra(None)


def run(spectra, comm, steps, **options):
    cfg = GanConfig(hidden=16, noise_dim=4, batch_size=4 * P + 2, dtype="float64", **options).validate(P)
    gan = ConditionalGAN(spectra, cfg, Topology.from_comm(comm))
    order = np.random.default_rng(3).permutation(len(spectra.train_y))
    for t in range(steps):
        gan.step(order[t * cfg.batch_size:(t + 1) * cfg.batch_size])
    gan.sync()
    return gan


def test_flat_on_p_ranks_equals_one_process_in_float64(spectra):
    distributed = run(spectra, WORLD, steps=6)
    reference = run(spectra, MPI.COMM_SELF, steps=6)
    diffs = [float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
             for a, b in ((distributed.g_params.data, reference.g_params.data),
                          (distributed.d_params.data, reference.d_params.data))]
    assert all_agree(WORLD, max(diffs) <= 1e-10), diffs


@pytest.mark.parametrize("strategy", ["flat", "hierarchical", "node"])
def test_every_strategy_runs_and_writes_its_metrics(strategy, tmp_path_factory):
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("gan")) if RANK == 0 else None, root=0)
    path = f"{folder}/{strategy}.jsonl"
    hook = sys.excepthook
    try:
        code = main(["--strategy", strategy, "--sync-every", "5", "--epochs", "2", "--hidden", "16",
                     "--batch-size", "256", "--eval-per-class", "16", "--metrics", path, "--quiet",
                     "--dtype", "float64", "--emulate-link", "50,1"])
    finally:
        sys.excepthook = hook
    ok = code == 0
    if RANK == 0:
        records = [json.loads(line) for line in open(path)]
        start, end = records[0], records[-1]
        ok = ok and [r["event"] for r in records] == ["start", "epoch", "epoch", "end"]
        ok = ok and start["world_size"] == P and start["config"]["strategy"] == strategy
        ok = ok and end["step"] == 16 and 0 <= end["gen_accuracy_mlp"] <= 1 and np.isfinite(end["sam_deg"])
        nodes = start["num_nodes"]
        # 8 steps in epoch 1. node: the inter-node level only at the K' = 5 syncs (one per
        # model); flat: one world Allreduce per step; hierarchical: one leaders' Allreduce.
        comm = records[1]["comm"]["g"]
        calls = {level: comm.get(level, {}).get("calls", 0) for level in ("inter", "world")}
        if strategy == "node":
            ok = ok and calls["world"] == 0 and calls["inter"] == (1 if nodes > 1 else 0)
        elif strategy == "flat" and P > 1:
            ok = ok and calls["world"] == 8
        elif nodes > 1:
            ok = ok and calls["inter"] == 8
    assert all_agree(WORLD, ok)


@pytest.mark.parametrize("strategy", ["hierarchical", "node"])
def test_replicas_agree_after_the_final_sync(spectra, strategy):
    gan = run(spectra, WORLD, steps=7, strategy=strategy, sync_every=3)
    same = all(len(set(WORLD.allgather(p.data.tobytes()))) == 1 for p in (gan.g_params, gan.d_params))
    assert all_agree(WORLD, same)
