"""Every benchmark script's ``--quick`` mode runs and writes its tables (subprocesses).

The numbers of a quick run mean nothing; what is checked is that each script runs end to end
(launching its own ``mpiexec`` jobs where it needs them) and writes its Markdown with the
expected sections and table headers, into a temporary folder (never into benchmarks/results).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MPIEXEC = launcher.default_mpiexec()

pytestmark = [pytest.mark.slow, pytest.mark.launcher]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _run(cmd, timeout=240):
    if not Path(MPIEXEC).exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def _table_rows(text: str, header_start: str) -> list[str]:
    """The data rows of the first Markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(row)
            return rows
    raise AssertionError(f"no table starting with {header_start!r} in:\n{text[:2000]}")


def test_experiments_quick_writes_every_table(tmp_path):
    _run([sys.executable, str(BENCH / "experiments.py"), "--quick", "--no-samson", "--out", str(tmp_path),
          "--work", str(tmp_path / "work"), "--only", "hdp", "balanced", "node",
          # unscaled slowdowns: the x12 rank's probe passes would take most of the run
          "--slowdown-scale", "1"])
    hdp = (tmp_path / "hdp_quick.md").read_text()
    mpi_name = "MPICH" if launcher.flavor(MPIEXEC) == launcher.MPICH else "Open MPI"
    assert "| machine |" in hdp and mpi_name in hdp and "EMULATION" in hdp
    rows = _table_rows(hdp, "| slowdown (relative)")
    assert any("CPU clock" in r for r in rows), rows
    assert len(rows) >= 4 and all("n/a" not in r.split("|")[5] for r in rows), rows  # epoch s measured
    # 2 ranks: 2 scenes x 4 rows (equal, measured, re-fitted, measured on the CPU clock)
    pair = _table_rows(hdp, "| setup | slowdown (EMULATED)")
    assert len(pair) == 8 and all("n/a" not in r.split("|")[5] for r in pair), pair
    assert {r.split("|")[1].split(",")[-1].strip() for r in pair} == {"32x7x7 (built-in)", "156x9x9"}
    balanced = (tmp_path / "balanced_quick.md").read_text()
    assert {r.split("|")[3].strip() for r in _table_rows(balanced, "| speeds | batch sizes")} == {"uniform", "balanced"}
    node = (tmp_path / "node_quick.md").read_text()
    traffic = _table_rows(node, "| strategy | steps/epoch")
    assert [r.split("|")[1].strip() for r in traffic] == [
        "flat", "hierarchical", "node K'=1", "node K'=10", "node K'=50", "node K'=200"]
    assert "(est.)" in traffic[0]  # flat's inter-node traffic is an estimate, and says so
    assert (tmp_path / "experiments_quick.json").is_file()


def test_comm_quick_writes_its_table(tmp_path):
    _run(launcher.mpiexec(2, [sys.executable, str(BENCH / "comm.py"), "--quick", "--no-torch",
                              "--out", str(tmp_path)], exe=MPIEXEC))
    text = (tmp_path / "comm_quick.md").read_text()
    rows = _table_rows(text, "| buffer |")
    assert [r.split("|")[1].strip() for r in rows] == ["4 KiB", "64 KiB", "256 KiB"]
    assert "MPI_Allreduce" in text and "hierarchical" in text and "node step" in text


def test_scaling_quick_writes_its_table(tmp_path):
    _run([sys.executable, str(BENCH / "scaling.py"), "--quick", "--ranks", "1", "2", "--out", str(tmp_path),
          "--work", str(tmp_path / "work")])
    rows = _table_rows((tmp_path / "scaling_quick.md").read_text(), "| model | ranks")
    assert len(rows) == 6 and not any("failed" in r for r in rows), rows  # 1 rank twice: default and 1 thread


def test_peers_quick_writes_its_table(tmp_path):
    # With PyTorch installed the torch columns are filled; without it they say "skipped".
    _run([sys.executable, str(BENCH / "peers_torch.py"), "--quick", "--out", str(tmp_path),
          "--work", str(tmp_path / "work")])
    text = (tmp_path / "peers_quick.md").read_text()
    rows = _table_rows(text, "| configuration | mpidl ms/step")
    assert [r.split("|")[1].strip() for r in rows][0] == "flat" and len(rows) == 3


def test_families_quick_writes_its_tables(tmp_path):
    # Through experiments.py --only families: the CNN and the GAN rows and one row per
    # optimizer, each with both strategies' numbers (--quick leaves LSTM and ViT out).
    from mpidl.engine.optim import OPTIMIZERS

    _run([sys.executable, str(BENCH / "experiments.py"), "--quick", "--no-samson", "--out", str(tmp_path),
          "--work", str(tmp_path / "work"), "--only", "families"], timeout=600)
    text = (tmp_path / "families_quick.md").read_text()
    families = _table_rows(text, "| family | model")
    assert [r.split("|")[1].strip() for r in families] == ["CNN", "GAN"]
    optimizers = _table_rows(text, "| optimizer | lr")
    assert [r.split("|")[1].strip() for r in optimizers] == list(OPTIMIZERS)
    for row in families + optimizers:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert "n/a" not in cells[2:8], row
    assert "EMULATED 50 us / 1 Gbit/s" in text and "Failed runs: none" in text
def test_families_only_runs_just_those_rows(tmp_path):
    # --only LSTM ViT: those two families under both strategies, no GAN, no optimizer table.
    _run([sys.executable, str(BENCH / "families.py"), "--quick", "--only", "LSTM", "ViT",
          "--out", str(tmp_path), "--work", str(tmp_path / "work")], timeout=300)
    text = (tmp_path / "families_quick.md").read_text()
    families = _table_rows(text, "| family | model")
    assert [r.split("|")[1].strip() for r in families] == ["LSTM", "ViT"]
    for row in families:
        assert "n/a" not in [c.strip() for c in row.split("|")[1:-1]][3:8], row
    assert "| optimizer | lr" not in text and "mpidl.gan" not in text
    assert "`--only LSTM ViT`" in text and "Failed runs: none" in text


def test_node_variants_quick_writes_its_table(tmp_path):
    # blocking and --sync-overlap 1 under node K'=50, each with its OA (--compress bf16 acts on
    # the hierarchical strategy only since the redesign: that row is gone).
    _run([sys.executable, str(BENCH / "node_variants.py"), "--quick", "--out", str(tmp_path),
          "--work", str(tmp_path / "work")], timeout=300)
    text = (tmp_path / "node_variants_quick.md").read_text()
    rows = _table_rows(text, "| scene | variant")
    assert [r.split("|")[2].strip() for r in rows] == ["blocking", "sync-overlap"]
    for row in rows:
        assert "n/a" not in row, row
    assert "Failed runs: none" in text


def test_twins_quick_writes_its_table(tmp_path):
    pytest.importorskip("torch")  # the twins are PyTorch modules; nothing to compare without it
    _run([sys.executable, str(BENCH / "twins_torch.py"), "--quick", "--models", "mlp,spectral_lstm",
          "--out", str(tmp_path), "--work", str(tmp_path / "work")])
    rows = _table_rows((tmp_path / "twins_quick.md").read_text(), "| model | parameters")
    assert [r.split("|")[1].strip() for r in rows] == ["`mlp`", "`spectral_lstm`"]


def test_conv_benchmark_prints_every_contender():
    # Tiny settings: one round of one step at batch 4, no PyTorch column.
    proc = _run([sys.executable, "benchmarks/conv.py", "--repeats", "1", "--steps", "1", "--warmup", "1",
                 "--batch", "4", "--models", "hsicnn", "--threads", "1", "--no-torch"])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("hsicnn ")]
    contenders = {tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows}
    assert contenders == {(a, k) for a in ("im2col", "winograd") for k in ("reference", "cpu")}, proc.stdout
    assert "Winograd's GEMMs do" in proc.stdout and "sgemm peak" in proc.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")]
        assert float(cells[3]) > 0  # step ms
        assert cells[-1] == "" and cells[-2] == ""  # no torch column with --no-torch


def test_comm_shm_quick_writes_its_table(tmp_path):
    _run([MPIEXEC, "-n", "2", "-launcher", "fork", sys.executable, str(BENCH / "comm.py"), "--shm", "--quick",
          "--out", str(tmp_path)])
    rows = _table_rows((tmp_path / "comm_shm_quick.md").read_text(), "| model |")
    assert [r.split("|")[1].strip() for r in rows] == ["4 KiB", "64 KiB", "256 KiB"]


def test_overlap_quick_writes_its_table(tmp_path):
    _run([MPIEXEC, "-n", "4", "-ppn", "2", "-hosts", "localhost,127.0.0.1", "-launcher", "fork", sys.executable,
          str(BENCH / "overlap.py"), "--quick", "--out", str(tmp_path)], timeout=600)
    rows = _table_rows((tmp_path / "overlap_quick.md").read_text(), "| contender |")
    assert [r.split("|")[1].strip() for r in rows] == [
        "compute (no exchange)", "flat blocking", "flat overlap", "hierarchical blocking", "hierarchical overlap"]


def test_step_benchmark_runs_the_mpidl_kinds(tmp_path):
    """benchmarks/step.py with the two mpidl kinds (PyTorch is no test dependency)."""
    out = tmp_path / "results"
    _run([sys.executable, str(BENCH / "step.py"), "--rounds", "1", "--steps", "1", "--warmup", "0",
          "--models", "hsicnn", "--kinds", "api,cli", "--out", str(out)], timeout=600)
    text = (out / "step.md").read_text()
    rows = _table_rows(text, "| model | input | api step ms | cli step ms |")
    assert len(rows) == 1 and rows[0].startswith("| `hsicnn` | 156x9x9 |"), text


def test_homogeneous_starts_reports_the_split_of_identical_ranks(tmp_path):
    """benchmarks/homogeneous_starts.py: one start of 2 identical ranks, its three jobs, the JSON."""
    out = tmp_path / "homogeneous.json"
    proc = _run([sys.executable, str(BENCH / "homogeneous_starts.py"), "--starts", "1", "--ranks", "2",
                 "--epochs", "2", "--json", str(out)], timeout=600)
    result = json.loads(out.read_text())
    assert result["starts"] == 1 and len(result["rows"]) == 1
    row = result["rows"][0]
    assert sum(row["split"]) == 64 and len(row["split"]) == 2
    assert row["auto_vs_none"] > 0 and row["control_vs_none"] > 0
    assert f"in {result['equal']} of 1 starts" in proc.stdout


def test_every_model_has_a_torch_twin_that_computes_its_logits():
    """Every model of MODELS has a twin, and at the benchmark's sample shape and widths the twin
    with mpidl's weights (``twin_of``) computes mpidl's logits (float32, training mode)."""
    torch = pytest.importorskip("torch")
    import numpy as np

    sys.path.insert(0, str(BENCH))
    from torch_twins import TWINS, twin_of

    from mpidl.engine.models import MODELS, build_model

    assert sorted(TWINS) == sorted(MODELS)
    for name, twin in TWINS.items():
        model = build_model(name, twin.input_shape, twin.num_classes, seed=0, **twin.kwargs)
        net = twin_of(model).train()
        x = np.random.default_rng(0).standard_normal((4, *twin.input_shape)).astype(np.float32)
        expected = model.forward(x)
        got = net(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4, err_msg=name)


def test_plan_quick_validates_every_strategy_and_tabulates_the_scale(tmp_path):
    # One EMULATED link: flat, hierarchical and one node K', each predicted from its own
    # strategy's link-free calibration run; then the at-scale tables of both models.
    out = tmp_path / "plan_quick.md"
    _run([sys.executable, str(BENCH / "plan.py"), "--quick", "--out", str(out)], timeout=600)
    text = out.read_text()
    calibration = _table_rows(text, "| calibration group")
    assert [r.split("|")[2].strip() for r in calibration] == ["flat", "hierarchical", "node K'=32"]
    rows = _table_rows(text, "| strategy | EMULATED link")
    assert [r.split("|")[1].strip() for r in rows] == ["flat", "hierarchical", "node K'=8"]
    for row in rows:
        predicted, error = float(row.split("|")[4]), row.split("|")[6].strip()
        assert predicted > 0 and error.endswith("%"), row
    assert "Largest error" in text and "### resnet8" in text and "**Goal: node K'=50 at 128 nodes" in text


def test_the_fitted_intra_latency_reproduces_the_calibration_run():
    # The fit inverts the model: predicting the calibration run back with its fitted latency
    # gives the communication per step it was fitted to.
    sys.path.insert(0, str(BENCH))
    try:
        import plan as bench_plan
    finally:
        sys.path.remove(str(BENCH))
    from mpidl.plan import Link, Scenario, predict

    for strategy, k in (("flat", None), ("hierarchical", None), ("node", 32)):
        rest = 2.0e-3
        alpha = bench_plan.fit_intra_latency(strategy, k, 6e-3, rest, 129796, 32, 1)
        sc = Scenario(6e-3, 129796, 2, 2, Link(alpha * 1e6, bench_plan.INTRA_GBIT), bench_plan.NO_LINK,
                      steps=32, algorithm="ring", emulated=True, epoch=1)
        assert predict(sc, strategy, k).comm_step_s == pytest.approx(rest, rel=1e-9), strategy
        assert alpha > 0


def test_the_ideal_ratio_is_split_times_variation_times_rest():
    sys.path.insert(0, str(BENCH))
    try:
        from common import ideal_epoch_s, ideal_ratio_factors
    finally:
        sys.path.remove(str(BENCH))

    def record(steps_per_rank, time_s):  # what the trainer logs, from per-step compute times
        slowest = [max(step) for step in zip(*steps_per_rank)]
        return {"comp_s": [sum(s) for s in steps_per_rank], "time_s": time_s,
                "idle_s": [sum(m - c for m, c in zip(slowest, s)) for s in steps_per_rank]}

    # equal totals (32 each; rank 1 EMULATED 2x slower), but each step waits for its own
    # slowest rank: 10 + 14 + 10 = 34; 2 s of exchange on top
    balanced = record([[10, 12, 10], [10, 14, 8]], time_s=36.0)
    assert ideal_epoch_s(balanced, (1.0, 2.0)) == pytest.approx(32.0)
    assert ideal_ratio_factors(balanced, (1.0, 2.0)) == pytest.approx((1.0, 34 / 32, 36 / 34))
    # unequal totals, no variation: ideal (20 + 28 / 2) / 1.5
    skewed = record([[10, 10], [14, 14]], time_s=30.0)
    split, variation, rest = ideal_ratio_factors(skewed, (1.0, 2.0))
    assert (split, variation, rest) == pytest.approx((28 / (34 / 1.5), 1.0, 30 / 28))
    assert split * variation * rest == pytest.approx(30.0 / ideal_epoch_s(skewed, (1.0, 2.0)))
