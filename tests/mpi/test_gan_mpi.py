"""The GAN application under mpiexec: ``flat`` on P ranks equals one process (float64), every
strategy runs end to end through ``mpidl.gan.main`` and writes its metrics file, the replicas
of G and D agree after the final sync (each model with its own exchange over the one
topology), and ``--ranks-per-node`` / ``MPIDL_RANKS_PER_NODE`` (through mpidl.settings) cut
the nodes. Run with 2 ranks, and with 4 ranks on 2 emulated nodes (MPIDL_RANKS_PER_NODE=2),
like the rest of tests/mpi."""

import json
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpidl import settings
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
    # G and D: one topology, an exchange each (their own counters), of the chosen strategy
    own = gan.dp_g.exchange is not gan.dp_d.exchange and gan.dp_g.topology is gan.dp_d.topology
    own = own and gan.dp_g.exchange.name == gan.dp_d.exchange.name == strategy
    calls = [{level: c["calls"] for level, c in dp.counters.items()} for dp in (gan.dp_g, gan.dp_d)]
    own = own and calls[0] == calls[1] and gan.dp_g.steps == gan.dp_d.steps == 7
    assert all_agree(WORLD, same and own)


def start_record(tmp_path_factory, argv, name):
    """``main`` with ``argv`` (a quick run); the metrics' start record, on every rank."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("gan")) if RANK == 0 else None, root=0)
    path = f"{folder}/{name}.jsonl"
    hook = sys.excepthook
    try:
        code = main(["--epochs", "1", "--hidden", "8", "--batch-size", "256", "--eval-per-class", "8",
                     "--quiet", "--strategy", "node", "--metrics", path, *argv])
    finally:
        sys.excepthook = hook
    start = json.loads(open(path).readline()) if RANK == 0 and code == 0 else None
    return code, WORLD.bcast(start, root=0)


def test_ranks_per_node_option_and_environment(tmp_path_factory, monkeypatch):
    """--ranks-per-node K cuts nodes of K ranks; without it MPIDL_RANKS_PER_NODE does (as
    mpidl.settings read it); the option wins over the environment."""
    code, option = start_record(tmp_path_factory, ["--ranks-per-node", "1"], "option")
    monkeypatch.setattr(settings, "SETTINGS", settings.Settings.from_environ({"MPIDL_RANKS_PER_NODE": "1"}))
    code_env, environment = start_record(tmp_path_factory, [], "environment")
    code_both, both = start_record(tmp_path_factory, ["--ranks-per-node", str(P)], "both")
    ok = (code, code_env, code_both) == (0, 0, 0)
    ok = ok and option["num_nodes"] == P and option["node_sizes"] == [1] * P
    ok = ok and environment["num_nodes"] == P and environment["config"]["ranks_per_node"] is None
    ok = ok and both["num_nodes"] == 1 and both["node_sizes"] == [P]
    assert all_agree(WORLD, ok), (option, environment, both)
