"""The distributed strategies reproduce single-rank training (docs/design.md, "The three ideas").

float64, ``hsicnn`` (no batch norm), uneven speeds 1, 2, ..., P so the ranks' batches differ,
and a dataset whose size is not a multiple of the global batch so the last, smaller batch is
split too. The reference is the same trainer on ``MPI.COMM_SELF`` (one rank, same global batch).
"""

import numpy as np
import pytest
from mpi4py import MPI

from trainer_harness import all_agree, run, speeds_for, tiny_dataset

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
BASE = ["--batch-size", "20", "--epochs", "2", "--lr", "0.1", "--schedule", "constant", "--seed", "3"]
PLAIN_SGD = ["--momentum", "0", "--weight-decay", "0"]


def rel_diff(a, b) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.fixture(scope="module")
def reference():
    """One-rank run, computed on every rank (cheap), with momentum and weight decay."""
    trainer, _ = run(MPI.COMM_SELF, BASE + ["--speeds", "1"])
    return trainer.params.data.copy()


@pytest.fixture(scope="module")
def reference_plain():
    trainer, _ = run(MPI.COMM_SELF, BASE + PLAIN_SGD + ["--speeds", "1"])
    return trainer.params.data.copy()


@pytest.mark.mpi
@pytest.mark.parametrize("strategy, ranks_per_node", [("flat", None), ("hierarchical", None),
                                                      ("hierarchical", max(1, (P + 1) // 2))],
                         ids=["flat", "hierarchical", "hierarchical-two-nodes"])
def test_exact_strategies_equal_single_rank(strategy, ranks_per_node, reference):
    # the launch's nodes, and (hierarchical) two emulated nodes: 2+2, 2+1, 1+1 ranks
    trainer, end = run(WORLD, BASE + ["--strategy", strategy, "--speeds", speeds_for(P)],
                       ranks_per_node=ranks_per_node)
    assert end["step"] == 6  # 50 samples / B=20 -> 3 steps per epoch (the last of 10 samples)
    diff = rel_diff(trainer.params.data, reference)
    assert all_agree(WORLD, diff <= 1e-10), f"{strategy}: relative difference {diff:.3e}"


@pytest.mark.mpi
@pytest.mark.parametrize("model", ["mlp", "spectral_lstm", "vit"])
def test_recurrent_attention_and_mlp_models_equal_single_rank(model):
    # no batch statistics in these models, so the flat reduction is exact for them too
    argv = BASE + ["--epochs", "1"]
    single, _ = run(MPI.COMM_SELF, argv + ["--speeds", "1"], model=model)
    trainer, _ = run(WORLD, argv + ["--strategy", "flat", "--speeds", speeds_for(P)], model=model)
    diff = rel_diff(trainer.params.data, single.params.data)
    assert all_agree(WORLD, diff <= 1e-10), f"{model}: relative difference {diff:.3e}"


@pytest.mark.mpi
def test_node_strategy_with_one_node_equals_flat(reference):
    trainer, _ = run(WORLD, BASE + ["--strategy", "node", "--sync-every", "4", "--speeds", speeds_for(P)],
                     ranks_per_node=P)
    assert trainer.dp.counters["inter"]["calls"] == 0
    diff = rel_diff(trainer.params.data, reference)
    assert all_agree(WORLD, diff <= 1e-10), f"relative difference {diff:.3e}"


@pytest.mark.mpi
def test_node_strategy_sync_every_step_plain_sgd_equals_flat(reference_plain):
    # one rank per node: the most inter-node exchange there can be
    trainer, _ = run(WORLD, BASE + PLAIN_SGD + ["--strategy", "node", "--sync-every", "1",
                                                "--speeds", speeds_for(P)], ranks_per_node=1)
    diff = rel_diff(trainer.params.data, reference_plain)
    assert all_agree(WORLD, diff <= 1e-10), f"relative difference {diff:.3e}"


@pytest.mark.mpi(min_size=2)
def test_uniform_weighting_with_uneven_batches_is_not_the_large_batch_gradient(reference):
    trainer, _ = run(WORLD, BASE + ["--weighting", "uniform", "--speeds", speeds_for(P)])
    diff = rel_diff(trainer.params.data, reference)
    # 1/P averaging over-weights the small batches: a real, not a rounding, difference
    assert all_agree(WORLD, diff > 1e-6), f"uniform unexpectedly matched (diff {diff:.3e})"


@pytest.mark.mpi
def test_uniform_equals_balanced_with_equal_batches():
    # 3 full global batches of 4P samples, equal speeds: every b_i = 4, so b_i/B = 1/P
    train = tiny_dataset(n=12 * P)
    equal = ["--speeds", ",".join(["1"] * P), "--batch-size", str(4 * P)]
    a, _ = run(WORLD, BASE + equal + ["--weighting", "uniform"], train=train)
    b, _ = run(WORLD, BASE + equal + ["--weighting", "balanced"], train=train)
    assert a.dp.batch_sizes == [4] * P
    diff = rel_diff(a.params.data, b.params.data)
    assert all_agree(WORLD, diff <= 1e-12), f"relative difference {diff:.3e}"


@pytest.mark.mpi
@pytest.mark.parametrize("strategy,extra", [("flat", []), ("hierarchical", []),
                                            ("node", ["--sync-every", "4"])])
def test_replicas_bitwise_identical_after_training(strategy, extra):
    trainer, _ = run(WORLD, BASE + ["--strategy", strategy, "--speeds", speeds_for(P),
                                    "--check-replicas"] + extra)
    digests = WORLD.allgather(trainer.params.data.tobytes())
    assert all(d == digests[0] for d in digests)
