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


def test_a_measurement_shows_its_spread_and_warns_when_the_machine_is_loaded():
    from mpidl.plan import StepMeasurement

    idle = StepMeasurement((0.0041, 0.0040, 0.0042, 0.0041, 0.0040), cpu_share=0.98, params=1000)
    assert idle.median_s == 0.0041 and (idle.low_s, idle.high_s) == (0.0040, 0.0042)
    assert idle.describe() == "median of 5 rounds 4.10 ms, range 4.00-4.20 ms (spread 5 %)"
    assert idle.warning() is None
    noisy = StepMeasurement((0.0040, 0.0043, 0.0116, 0.0141, 0.0120), cpu_share=0.97, params=1000)
    assert "the rounds differ by 87 % of their median" in noisy.warning()
    # uniformly slow rounds: a small spread, but the process waited for the CPU
    starved = StepMeasurement((0.116, 0.118, 0.117, 0.116, 0.119), cpu_share=0.04, params=1000)
    assert starved.warning().startswith("the machine looks loaded: this process had the CPU 4 % of the time")


@pytest.mark.parametrize("rounds, flips", [((0.001, 0.001, 0.0011, 0.0012, 0.0013), False),
                                           ((0.0005, 0.001, 0.2, 0.25, 0.3), True)])
def test_measure_prints_median_range_and_the_recommendation_at_both_ends(monkeypatch, capsys, rounds, flips):
    """Before: one number from one measurement, no spread, no warning."""
    import mpidl.plan as plan

    measured = plan.StepMeasurement(rounds, cpu_share=1.0, params=5_000_000)
    monkeypatch.setattr(plan, "measure_rounds", lambda *args, **kwargs: measured)
    assert main(["--measure", "--nodes", "1,64", "--sync-every", "10,50,200"]) == 0
    out = capsys.readouterr().out
    assert measured.describe() in out.splitlines()[0]
    assert "warning: the machine looks loaded: the rounds differ by" in out
    low, high = (plan.recommend(plan.Scenario(t, 5_000_000, 4, 64, plan.Link(1, 100), plan.Link(10, 25)),
                                [10, 50, 200])[0].label for t in (min(rounds), max(rounds)))
    assert (low != high) == flips
    if flips:
        assert (f"warning: the recommendation depends on the measured step: {low} at {1e3 * min(rounds):.2f} ms, "
                f"{high} at {1e3 * max(rounds):.2f} ms") in out
    else:
        assert "the same recommendation holds across the measured range" in out


def test_an_idle_measurement_gives_no_warning(monkeypatch, capsys):
    import mpidl.plan as plan

    measured = plan.StepMeasurement((0.0041, 0.0040, 0.0042), cpu_share=0.99, params=100_000)
    monkeypatch.setattr(plan, "measure_rounds", lambda *args, **kwargs: measured)
    assert main(["--nodes", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "median of 3 rounds 4.10 ms, range 4.00-4.20 ms (spread 5 %)" in out and "warning" not in out
