"""mpidl.plan: the alpha-beta formulas, the node strategy's sync count, predictions,
recommendations and the command line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from mpidl.distributed.emulation import LinkModel
from mpidl.plan import (Link, Scenario, allreduce, main, predict, recommend, ring_allreduce,
                        syncs_per_epoch, tree_allreduce, tree_bcast)

ROOT = Path(__file__).resolve().parents[1]
SHM, NET = Link(1, 100), Link(10, 25)


def test_formulas():
    n = 4e6
    assert ring_allreduce(n, 1, NET) == 0 and tree_allreduce(n, 1, NET) == 0
    assert ring_allreduce(n, 4, NET) == pytest.approx(6 * (10e-6 + n / (4 * 25e9 / 8)))
    assert tree_allreduce(n, 5, NET) == pytest.approx(2 * 3 * (10e-6 + n / (25e9 / 8)))
    assert tree_bcast(n, 2, NET) == pytest.approx(10e-6 + n / (25e9 / 8))
    assert allreduce(n, 64, NET) == min(ring_allreduce(n, 64, NET), tree_allreduce(n, 64, NET))
    # the emulation sleeps exactly the model's ring time
    assert LinkModel(10, 25).allreduce_seconds(int(n), 7) == pytest.approx(ring_allreduce(n, 7, NET))


@pytest.mark.parametrize("steps, k", [(32, 8), (32, 50), (7, 3), (100, 1), (10, 10)])
def test_syncs_per_epoch_follow_the_trainer_rule(steps, k):
    """A sync after every global step that is a multiple of K', and at the end of an epoch
    whose last step did not just sync: counted step by step."""
    for epoch in range(4):
        expected = sum((t % k == 0) for t in range(epoch * steps + 1, (epoch + 1) * steps + 1))
        expected += ((epoch + 1) * steps) % k != 0
        assert syncs_per_epoch(steps, k, epoch) == expected


def test_predictions_on_one_and_many_nodes():
    sc = Scenario(0.01, 200_000, 4, 1, SHM, NET, samples=1_000_000, local_batch=16)
    flat = predict(sc, "flat")
    assert flat.comm_step_s == pytest.approx(allreduce(8e5, 4, SHM))
    assert predict(sc, "node", 50).step_s == pytest.approx(flat.step_s)  # one node: node = flat
    assert sc.steps_per_epoch == math.ceil(1e6 / 64)
    big = Scenario(0.01, 200_000, 4, 128, SHM, NET, samples=1_000_000, local_batch=16)
    f, h, n50, n200 = (predict(big, "flat"), predict(big, "hierarchical"), predict(big, "node", 50),
                       predict(big, "node", 200))
    assert n200.step_s <= n50.step_s < h.step_s
    assert f.efficiency < n50.efficiency <= 1
    assert n50.epoch_s == pytest.approx(n50.step_s * big.steps_per_epoch)
    choice, why = recommend(big, [1, 10, 50, 200])
    assert choice.strategy == "node" and "faster" in why
    slow = Scenario(10.0, 200_000, 4, 2, SHM, NET)  # compute dominates: stay exact
    assert recommend(slow)[0].strategy in ("flat", "hierarchical")


def test_emulated_mode_adds_the_modelled_link_to_the_real_collectives():
    sc = Scenario(0.01, 100_000, 2, 2, SHM, Link(50, 1), steps=32, algorithm="ring", emulated=True)
    g = 4e5
    assert predict(sc, "flat").comm_step_s == pytest.approx(ring_allreduce(g, 4, SHM) + ring_allreduce(g, 4, Link(50, 1)))
    hier = predict(sc, "hierarchical")
    assert hier.comm_step_s == pytest.approx(2 * tree_bcast(g, 2, SHM) + ring_allreduce(g, 2, SHM)
                                             + ring_allreduce(g, 2, Link(50, 1)))


def test_cli(capsys):
    assert main(["--step-time", "0.01", "--params", "200000", "--nodes", "1,128", "--sync-every", "10,50"]) == 0
    out = capsys.readouterr().out
    assert "node K'=50" in out and "at 128 nodes: use" in out
    assert main(["--step-time", "0.01", "--inter", "10"]) == 2
    assert "--inter" in capsys.readouterr().err
    assert main(["--step-time", "-1"]) == 2


def test_module_entry_point_measures_a_step():
    proc = subprocess.run([sys.executable, "-m", "mpidl.plan", "--model", "hsicnn", "--input-shape", "8,5,5",
                           "--classes", "3", "--nodes", "1,4", "--sync-every", "50"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "measured here" in proc.stdout


@pytest.mark.slow
def test_read_benchmark_quick(tmp_path):
    out = tmp_path / "read.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "read.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "| variant | ranks P |" in text and "| scene | 4 |" in text
