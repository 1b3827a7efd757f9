# python benchmarks/experiments.py [--quick] [--out benchmarks/results] [--only hdp balanced node comm scaling peers overlap families]
"""The papers' experiments, and the one command that regenerates every benchmark table and figure.

Three experiments, each on the built-in synthetic scene (the default data) and on the real
Samson scene (converted by ``python -m mpidl.data_tools hsi``; skipped, with a note, when
``../shared/data/samson`` is absent), 4 ranks, every emulation labelled:

1. **HDP** (IGARSS 2022): emulated rank slowdowns 1,1,1,2 and 1,1,2,4; epoch time and OA of
   an equal split (``--balance none``), measured speeds (``--speeds auto``) and measured speeds
   re-measured every epoch (``--rebalance``), against the ideal epoch time = total work / sum
   of the ranks' speeds.
2. **Balanced gradient** (GRSL 2022): uneven local batches (``--speeds 1,1,2,4`` and a more
   skewed split), ``--weighting uniform`` vs ``balanced``: OA / AA / kappa per epoch over
   several seeds, mean ± std.
3. **Node-based communication** (TNNLS 2023): 2 emulated nodes x 2 ranks (MPICH ``-hosts``),
   strategies flat, hierarchical and node with K' in {1, 10, 50, 200}: inter-node calls and
   bytes per epoch (the exchange's counters), epoch time under emulated inter-node links, OA
   after a fixed number of epochs, the accuracy cost of each K' next to its traffic saving.

Then, unless skipped: ``benchmarks/comm.py`` (1 node and 2 emulated nodes),
``benchmarks/scaling.py``, ``benchmarks/peers_torch.py`` (PyTorch DDP, when installed) and
``benchmarks/families.py`` (the model families and the optimizer study, flat vs node K'=50).

Each table row is one ``python -m mpidl.train`` run; the tables give the exact command of each
kind of row. The runs of one experiment and dataset execute one after another inside one
``mpiexec`` (``benchmarks/train_batch.py``, the same ``mpidl.train.main`` code path) after an
untimed warm-up run, and configurations are interleaved across repeats so that load from
other processes falls on all of them alike. ``--quick`` runs every experiment for a few steps
(the CI test runs only that; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (PYTHON, TrainBatch, epoch_samples, fmt_bytes, ideal_epoch_s, ideal_ratio_factors, md_table,  # noqa: E402
                    mean_std, med_spread, median, shown, timed_epochs, unslowed_cost_per_sample)

from mpidl.app.config import Config  # noqa: E402

EXPERIMENTS = ("hdp", "balanced", "node")
EXTERNAL = ("comm", "scaling", "peers", "overlap", "families")
SLOWDOWNS = ("1,1,1,2", "1,1,2,4")
REBALANCE_EVERY = Config.rebalance_every  # python -m mpidl.train's default --rebalance-every
HDP_CONFIGS = {  # name -> (options, what it means)
    "none": (["--balance", "none"], "equal split (`--balance none`)"),
    "auto": (["--speeds", "auto"], "measured speeds (`--speeds auto`)"),
    "rebalance": (["--speeds", "auto", "--rebalance"],
                  f"measured + re-fitted every {REBALANCE_EVERY} steps (`--speeds auto --rebalance`)"),
    # the same split as "auto"; only the emulation differs (see the hdp.md text)
    "auto_cpu": (["--speeds", "auto", "--emulate-clock", "cpu"],
                 "measured speeds, slowdown on the CPU clock (`--speeds auto --emulate-clock cpu`)"),
}
PAIR_EPOCHS = 5  # epochs of each 2-rank run: a re-split needs two agreeing re-fits
NODE_K = (1, 10, 50, 200)
NODE_STEPS = 200  # steps per epoch of the node experiment: a multiple of every K' above
NODE_LR = 0.005  # for its small global batches (lr 0.01-0.02 diverged, NaN, with node-local batches of 4-5)
LINKS = (None, "50,1", "10,10")


@dataclass
class Dataset:
    """One scene and the optimisation settings that suit it."""

    name: str
    label: str
    argv: list[str]
    lr: float  # for the global batch of 64
    num_train: int
    note: str = ""
    # The node experiment's own data: N training samples with N / batch = NODE_STEPS steps
    # per epoch, a multiple of every K' of NODE_K (see node()).
    node_argv: list = field(default_factory=list)
    node_batch: int = 0
    node_num_train: int = 0
    node_note: str = ""
    node_commands: list = field(default_factory=list)


@dataclass
class Plan:
    """How big each experiment is (full or --quick)."""

    hdp_epochs: int
    hdp_repeats: int
    pair_repeats: int  # runs of each 2-rank configuration
    homogeneous_starts: int  # starts of 4 identical ranks
    hdp_max_steps: int | None
    bal_epochs: int
    bal_seeds: tuple
    bal_skews: tuple
    node_epochs: int
    node_seeds: tuple
    node_links: tuple
    max_steps: int | None
    samson_sizes: tuple  # (train, test) of the Samson subset, None = whole split
    samson_hdp_repeats: int
    timeout: float
    extra: dict = field(default_factory=dict)


FULL = Plan(hdp_epochs=3, hdp_repeats=2, pair_repeats=3, homogeneous_starts=10, hdp_max_steps=None,
            bal_epochs=4, bal_seeds=(0, 1, 2), bal_skews=("1,1,2,4", "1,1,1,13"), node_epochs=4,
            node_seeds=(0, 1), node_links=LINKS, max_steps=None, samson_sizes=(320, 640),
            samson_hdp_repeats=1, timeout=1500)
QUICK = Plan(hdp_epochs=1, hdp_repeats=1, pair_repeats=1, homogeneous_starts=1, hdp_max_steps=3,
             bal_epochs=2, bal_seeds=(0, 1), bal_skews=("1,1,2,4",), node_epochs=1, node_seeds=(0,),
             node_links=(None,), max_steps=3, samson_sizes=(96, 96), samson_hdp_repeats=1, timeout=240)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps per run (CI); numbers mean nothing")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="where the tables and figures go")
    p.add_argument("--work", type=Path, default=None, help="raw metrics and logs (default: a temporary folder)")
    p.add_argument("--only", nargs="+", choices=EXPERIMENTS + EXTERNAL, default=None)
    p.add_argument("--skip", nargs="+", choices=EXPERIMENTS + EXTERNAL, default=[])
    p.add_argument("--samson-dir", type=Path, default=common.SAMSON_DIR)
    p.add_argument("--no-samson", action="store_true", help="synthetic scene only")
    p.add_argument("--slowdown-scale", type=float, default=3.0,
                   help="HDP: every emulated slowdown factor is multiplied by this, so that the "
                        "emulated (sleeping) time dominates the contended compute (see hdp.md)")
    p.add_argument("--mpich-defaults", action="store_true", help="do not set MPICH progress throttling")
    args = p.parse_args(argv)
    if args.slowdown_scale < 1:
        p.error("--slowdown-scale must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    selected = [e for e in (args.only or EXPERIMENTS + EXTERNAL) if e not in args.skip]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    started = time.perf_counter()
    me = "python benchmarks/experiments.py" + (" --quick" if args.quick else "")
    print(f"benchmarks: {', '.join(selected)} -> {out} (raw metrics in {work})", flush=True)

    datasets, data_notes, data_commands = build_datasets(args, plan, work)
    ctx = Context(args=args, plan=plan, out=out, work=work, info=info, me=me, datasets=datasets,
                  data_notes=data_notes, data_commands=data_commands)
    summary: dict = {"machine": info, "quick": args.quick, "sections": {}}
    for name in selected:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result = {"hdp": hdp, "balanced": balanced, "node": node, "comm": comm,
                      "scaling": scaling, "peers": peers, "overlap": overlap, "families": families}[name](ctx)
        except Exception as exc:  # one broken experiment must not hide the others' tables
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["wall_s"] = time.perf_counter() - t0
        result["machine"] = info  # when this section ran (a partial run merges into an older file)
        summary["sections"][name] = result
        print(f"   {name}: {result['wall_s']:.0f} s", flush=True)
    summary["wall_s"] = time.perf_counter() - started
    summary_path = out / ("experiments_quick.json" if args.quick else "experiments.json")
    written = summary
    if (args.only or args.skip) and summary_path.exists():
        # A partial run replaces its own sections and keeps the others' results.
        try:
            written = json.loads(summary_path.read_text())
            written.setdefault("sections", {}).update(summary["sections"])
        except (OSError, ValueError):
            written = summary
    summary_path.write_text(json.dumps(written, indent=1, default=str))
    if not args.quick and not args.only and not args.skip:  # the index describes a complete run
        write_index(ctx, summary)
    print(f"done in {summary['wall_s']:.0f} s: {out}", flush=True)
    failed = [k for k, v in summary["sections"].items() if "error" in v]
    return 1 if failed else 0


@dataclass
class Context:
    args: argparse.Namespace
    plan: Plan
    out: Path
    work: Path
    info: dict
    me: str
    datasets: list
    data_notes: list
    data_commands: list

    @property
    def env_note(self) -> str:
        return ("MPICH defaults (no progress throttling)." if self.args.mpich_defaults
                else common.THROTTLE_NOTE)

    def batch(self, tag, dataset, two_nodes=False, warmup_batch=64, argv=None):
        warm = (dataset.argv if argv is None else argv) + [
            "--epochs", "1", "--max-steps", "2", "--batch-size", str(warmup_batch), "--balance", "none"]
        return TrainBatch(self.work, tag, ranks=4, two_nodes=two_nodes,
                          throttle=not self.args.mpich_defaults, warmup=warm)

    def common_body(self) -> list[str]:
        return ["## Data", "", *[f"- {n}" for n in self.data_notes], "",
                "## Environment", "", f"- {self.env_note}",
                "- 4 MPI ranks on this machine's cores (oversubscribed when there are fewer than 4); "
                "each rank uses cores / ranks-per-node BLAS and Numba threads (at least 1).",
                "- Each row is a `python -m mpidl.train` run; the runs of one experiment and dataset "
                "run one after another inside one mpiexec (`benchmarks/train_batch.py`, the same "
                "`mpidl.train.main(argv)` code path), after an untimed warm-up run; configurations "
                "are interleaved across repeats.", ""]


def build_datasets(args, plan: Plan, work: Path):
    notes, commands = [], []
    from mpidl.data import synthetic_splits

    train, _, meta = synthetic_splits(seed=0)
    synthetic = Dataset("synthetic", "synthetic scene", [], lr=0.05, num_train=train.num_samples)
    datasets = [synthetic]
    notes.append(f"synthetic: the built-in scene (no `--data`): {meta['source']}; "
                 f"{meta['splits']['train']} train / {meta['splits']['test']} test patches of "
                 f"{tuple(meta['sample_shape'])}.")
    # The node experiment: the same scene written with 500 training samples per class (2000),
    # global batch 10 -> 200 steps per epoch.
    node_file = work / "node_data" / "synthetic_2000.h5"
    cmd = [PYTHON, "-m", "mpidl.data_tools", "synthetic", "--train-per-class", "500", "--out", str(node_file)]
    if not node_file.is_file():
        code, _ = common.run(cmd, work / "node_data" / "synthetic.log", 120)
        if code != 0:
            raise RuntimeError(f"writing the node experiment's scene failed: {common.tail(work / 'node_data' / 'synthetic.log', 3)}")
    synthetic.node_argv, synthetic.node_batch = ["--data", str(node_file)], 10
    synthetic.node_num_train = _train_size(node_file)
    synthetic.node_commands = [shown(cmd).replace(str(node_file), node_file.name)]
    synthetic.node_note = (f"synthetic: the same scene written to a file with 500 training samples per "
                           f"class (`{synthetic.node_commands[0]}`): {synthetic.node_num_train} train / "
                           f"{_test_size(node_file)} test patches; global batch 10 (3,3,2,2 per rank).")
    if args.no_samson:
        notes.append("Samson: skipped (--no-samson).")
        return datasets, notes, commands
    path, note, cmds = common.prepare_samson(work / "samson", *plan.samson_sizes, data_dir=args.samson_dir)
    notes.append(note)
    commands += cmds
    if path is not None:
        # lr 0.05 diverges on Samson's 156 bands (NaN at step 29 of a trial run); 0.01 does not.
        samson = Dataset("samson", "Samson", ["--data", str(path)], lr=0.01, num_train=_train_size(path))
        # The node experiment: 1600 training samples, global batch 8 -> 200 steps per epoch.
        node_path, _, node_cmds = common.prepare_samson(work / "samson", 1600, plan.samson_sizes[1],
                                                        data_dir=args.samson_dir)
        if node_path is not None:
            commands += node_cmds[1:]
            samson.node_argv, samson.node_batch = ["--data", str(node_path)], 8
            samson.node_num_train = _train_size(node_path)
            samson.node_commands = node_cmds
            samson.node_note = (f"Samson: a stratified random subset of the same conversion with "
                                f"{samson.node_num_train} train / {_test_size(node_path)} test samples "
                                f"(seed 0); global batch 8 (2 per rank).")
        datasets.append(samson)
    return datasets, notes, commands


def _train_size(path: Path) -> int:
    import h5py

    with h5py.File(path, "r") as f:
        return int(f["train/y"].shape[0])


def _test_size(path: Path) -> int:
    import h5py

    with h5py.File(path, "r") as f:
        return int(f["test/y"].shape[0])


# --------------------------------------------------------------------------------------------
# 1. HDP
# --------------------------------------------------------------------------------------------


def hdp(ctx: Context) -> dict:
    plan, k = ctx.plan, ctx.args.slowdown_scale
    results, body, rows_json = {}, [], []
    body += ["## What was run", "",
             f"Global batch 64, SGD (momentum 0.9, cosine schedule), {plan.hdp_epochs} epoch(s) per run"
             + (f", at most {plan.hdp_max_steps} steps" if plan.hdp_max_steps else "") + ". "
             "EMULATION: rank i sleeps (F_i - 1) x its measured compute time after every "
             "forward+backward (`--emulate-slowdown`), so its compute takes F_i times longer (the "
             "*CPU clock* rows: it sleeps F_i x the compute's CPU time - its wall time, when positive).",
             "",
             f"**Making the emulation meaningful on this machine.** 4 ranks share "
             f"{ctx.info['cores']} cores, so a rank's compute time depends on how many other ranks "
             f"compute at the same moment. The slowdowns of the experiment (relative speeds "
             f"1,1,1,2 and 1,1,2,4) are therefore applied multiplied by {k:g} "
             f"(`--emulate-slowdown {','.join(f'{k * float(f):g}' for f in SLOWDOWNS[1].split(','))}` "
             f"for 1,1,2,4): every rank then sleeps most of the time (sleep is not CPU). With a "
             f"balanced split rank i computes 1/(k f_i) of each step, so on average "
             f"sum_i 1/(k f_i) ranks compute at once: {sum(1 / float(f) for f in SLOWDOWNS[1].split(',')) / k:.2f} "
             f"for 1,1,2,4 and {sum(1 / float(f) for f in SLOWDOWNS[0].split(',')) / k:.2f} for 1,1,1,2 "
             f"(unscaled: 2.75 and 3.5, on {ctx.info['cores']} cores). The ratios between the ranks stay "
             f"those of the experiment. The rows marked *unscaled* use the factors as given (x1) and "
             f"show what contention does.",
             "",
             "**Ideal epoch time** = total work / sum of speeds = sum_i (comp_s_i / F_i) / sum_i (1 / F_i), "
             "with F_i the applied factors and comp_s_i rank i's compute seconds in the epoch (so "
             "comp_s_i / F_i is its work without the emulated sleep, the fixed per-step parts "
             "included); *c* is that total work per sample. It counts compute only: communication, "
             "waiting and the rounding of batch sizes to whole samples are what the ratio shows. "
             "Epoch time is the metrics' `time_s` (training steps + epoch-end collectives, "
             "evaluation excluded).",
             ""]
    for ds in ctx.datasets:
        batch = ctx.batch(f"hdp_{ds.name}", ds)
        repeats = plan.hdp_repeats if ds.name == "synthetic" else plan.samson_hdp_repeats
        names = {}
        slowdowns = SLOWDOWNS[1:] if ctx.args.quick else SLOWDOWNS
        variants = [(s, c, k) for s in slowdowns for c in HDP_CONFIGS]
        if ds.name == "synthetic" and k != 1 and not ctx.args.quick:
            variants += [(s, "auto", 1.0) for s in SLOWDOWNS]  # the unscaled, contended version
        for rep in range(repeats):
            for slow, cfg, scale in variants:
                if scale == 1.0 and k != 1 and rep > 0:
                    continue
                factors = [scale * float(f) for f in slow.split(",")]
                argv = ds.argv + ["--epochs", plan.hdp_epochs, "--batch-size", 64, "--lr", ds.lr,
                                  "--seed", 0, "--emulate-slowdown", ",".join(f"{f:g}" for f in factors),
                                  *HDP_CONFIGS[cfg][0]]
                if plan.hdp_max_steps:
                    argv += ["--max-steps", plan.hdp_max_steps]
                name = f"s{slow.replace(',', '')}_x{scale:g}_{cfg}_r{rep}"
                batch.add(name, argv)
                names.setdefault((slow, cfg, scale), []).append(name)
        runs = batch.launch(ctx.plan.timeout)
        rows = []
        for (slow, cfg, scale), keys in names.items():
            factors = [scale * float(f) for f in slow.split(",")]
            times, ideals, ratios, oas, sizes, costs, idles, comms, parts = [], [], [], [], [], [], [], [], []
            for key in keys:
                loaded = runs.get(key)
                if loaded is None:
                    continue
                start, epochs, end = loaded
                previous = {e["epoch"]: e["step"] for e in epochs}
                for e in timed_epochs(epochs):
                    prev = previous.get(e["epoch"] - 1, 0)
                    n_i = epoch_samples(e, prev, ds.num_train, 64)
                    c = unslowed_cost_per_sample(e, factors, n_i)
                    ideal = ideal_epoch_s(e, factors)
                    times.append(e["time_s"])
                    ideals.append(ideal)
                    ratios.append(e["time_s"] / ideal)
                    costs.append(c)
                    idles.append(statistics.mean(e["idle_s"]))
                    comms.append(statistics.mean(e["comm_s"]))
                    parts.append(ideal_ratio_factors(e, factors))
                oas.append(epochs[-1]["oa"])
                sizes.append(epochs[-1]["batch_sizes"])
            label = slow + ("" if scale == k else " *unscaled*")
            row = {"dataset": ds.name, "slowdown": slow, "scale": scale, "applied": factors, "config": cfg,
                   "epoch_s": times, "ideal_s": ideals, "ratio": ratios, "oa": oas,
                   "batch_sizes": sizes, "cost_per_sample_s": costs, "idle_s": idles, "comm_s": comms,
                   "split_variation_rest": parts, "runs": len(oas)}
            rows_json.append(row)
            split_factors = (" x ".join(f"{statistics.median(p[j] for p in parts):.3f}" for j in range(3))
                             if parts else "n/a")
            rows.append([label, ",".join(f"{f:g}" for f in factors), HDP_CONFIGS[cfg][1],
                         str(sizes[-1]) if sizes else "n/a", med_spread(times), med_spread(ideals),
                         med_spread(ratios), split_factors, med_spread(idles), med_spread(comms),
                         med_spread(costs, 1e3, 3), med_spread(oas, 100, 2),
                         f"{len(times)} / {len(oas)}"])
        body += [f"## {ds.label}", "", *failure_note(batch),
                 md_table(["slowdown (relative)", "applied factors (EMULATED)", "split", "batch sizes (last epoch)",
                           "epoch s", "ideal s", "epoch / ideal", "= split x variation x rest (medians)",
                           "idle s (rank mean)", "comm s (rank mean)",
                           "c (ms/sample)", "OA %",
                           "epochs / runs"], rows), ""]
        # How often --rebalance re-split: a dataset of few steps an epoch may see no re-fit at all.
        resplits = {}
        for (slow, cfg, scale), keys in names.items():
            if cfg == "rebalance":
                resplits[slow] = sum(rebalance_events(batch.work / batch.tag / f"{key}.jsonl") for key in keys
                                     if runs.get(key) is not None)
        steps_per_epoch = -(-ds.num_train // 64)
        steps_per_run = steps_per_epoch * plan.hdp_epochs
        if plan.hdp_max_steps:
            steps_per_run = min(steps_per_run, plan.hdp_max_steps)
        body += [f"`--rebalance` re-fits every {REBALANCE_EVERY} steps; this dataset has {steps_per_epoch} steps "
                 "an epoch. "
                 "Re-splits taken over all runs of a row: "
                 + ", ".join(f"{slow}: {n}" for slow, n in resplits.items())
                 + (" (fewer steps than one re-fit period per run: these rows differ from `--speeds auto` only by "
                    "the probe's outcome)." if steps_per_run < REBALANCE_EVERY else "."), ""]
        body += [f"Exact command of a row (here: 1,1,2,4, measured speeds): `{batch.train_command(names[(SLOWDOWNS[1], 'auto', k)][0])}`",
                 f"The batch of this dataset: `{shown(batch.command())}` ({batch.seconds:.0f} s, exit {batch.code}).", ""]
        results[ds.name] = {"batch_s": batch.seconds, "exit": batch.code}
        # One picture of what balancing does: the three splits of 1,1,2,4 side by side.
        for cfg in HDP_CONFIGS:
            key = names[(SLOWDOWNS[1], cfg, k)][0]
            if runs.get(key) is not None and not ctx.args.quick:
                try:
                    from mpidl.plot import load_run, plot_time_breakdown

                    png = ctx.out / f"hdp_breakdown_{ds.name}_{cfg}.png"
                    plot_time_breakdown(load_run(batch.work / batch.tag / f"{key}.jsonl",
                                                 label=f"{ds.label}, {cfg}"), png)
                    body.append(f"![{ds.label} {cfg}]({png.name})")
                except Exception as exc:  # matplotlib missing: the tables are what matters
                    body.append(f"(figure skipped: {exc})")
        if not ctx.args.quick:
            png = ctx.out / f"hdp_splits_{ds.name}.png"
            hdp_splits_figure([(HDP_CONFIGS[cfg][1].split(" (")[0], batch.work / batch.tag / f"{names[(SLOWDOWNS[1], cfg, k)][0]}.jsonl")
                               for cfg in ("none", "auto", "rebalance")], [k * float(f) for f in SLOWDOWNS[1].split(",")],
                              f"{ds.label}, EMULATED slowdowns {SLOWDOWNS[1]} (x{k:g})", png)
            if png.exists():
                body += ["", f"The three splits side by side (1,1,2,4, first repeat): ![{ds.label} splits]({png.name})"]
        body.append("")
    body += ["## Reading the table", "",
             "- *epoch s*: median over the timed epochs (all but the first) of all repeats, "
             "[min-max] across them. *ideal s* and *epoch / ideal*: the same epochs' own ideal.",
             "- With balanced weighting the global gradient does not depend on how the batch is "
             "split, so the three splits train the same model: OA differs only through the order of "
             "floating-point additions (and, for --speeds auto, the measured split).",
             "- *idle s*: the trainer's estimate sum_t (max_j c_jt - c_it), the time a rank waits "
             "each step for the slowest rank's compute. A split balanced on average still waits "
             "every step for that step's unluckiest rank: on a shared machine the per-step compute "
             "times jitter, and the emulation multiplies each rank's measured compute time, jitter "
             "included, by its factor F_i, so the slow ranks jitter F_i times more. Together with "
             "*comm s* this is the gap between *epoch s* and *ideal s*.",
             "- *= split x variation x rest*: epoch / ideal as the product of three factors, defined "
             "under the 2-rank table below. *variation* is the per-step waiting: with 4 ranks on "
             f"{ctx.info['cores']} cores a rank's measured compute includes waiting for a core another "
             "rank holds, different at every step, and the wall-clock emulation multiplies that waiting by "
             "F_i too. The *CPU clock* rows (`--emulate-clock cpu`) multiply each compute's CPU seconds "
             "instead (it lasts max(wall, F_i x CPU)), which is what a cluster with a processor per "
             "rank would show: the same balancer and probe, a different emulation, so compare their "
             "*variation* and *rest* with the measured-speeds rows, not their epoch seconds.",
             "- Goals: epoch / ideal <= 1.10 for the balanced splits of 4 ranks on this machine, <= 1.03 for "
             "2 ranks with one thread each; identical ranks keep the equal split.", ""]
    small, small_body = hdp_small_worlds(ctx)
    body += small_body
    results["small_worlds"] = small
    path = ctx.out / ("hdp_quick.md" if ctx.args.quick else "hdp.md")
    hdp_figure(ctx, rows_json)
    common.write_markdown(path, "Heterogeneous data parallelism (HDP): epoch time vs the ideal",
                          ctx.me, ctx.info, ctx.common_body() + body)
    results["rows"] = rows_json
    return results


def hdp_small_worlds(ctx: Context) -> tuple[dict, list[str]]:
    """Two more setups on the synthetic scene: 2 ranks with 1 thread each (not oversubscribed on
    2 cores) at EMULATED slowdowns 1,2; and 4 identical ranks started many times, where the
    split must stay equal (measurement noise must not unbalance a homogeneous job)."""
    ds = next(d for d in ctx.datasets if d.name == "synthetic")
    plan = ctx.plan
    one_thread = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                   "NUMBA_NUM_THREADS")}
    epochs = plan.hdp_epochs
    warm = ds.argv + ["--epochs", "1", "--max-steps", "2", "--batch-size", "64", "--balance", "none"]
    # ---- 2 ranks, 1 thread each, slowdowns 1,2: on the built-in scene and on the issue's
    # 156-band 9x9 scene (a 4x larger step, so the exchange is a smaller part of it)
    scenes = [("32x7x7 (built-in)", ds.argv)]
    wide = ctx.work / "pair_data" / "synthetic_156x9x9.h5"
    cmd = [PYTHON, "-m", "mpidl.data_tools", "synthetic", "--bands", "156", "--patch", "9", "--out", str(wide)]
    if not wide.is_file():
        code, _ = common.run(cmd, ctx.work / "pair_data" / "synthetic.log", 120)
        if code != 0:
            raise RuntimeError(f"writing the 156-band scene failed: {common.tail(ctx.work / 'pair_data' / 'synthetic.log', 3)}")
    scenes.append(("156x9x9", ["--data", str(wide)]))
    pair_epochs = epochs if ctx.args.quick else PAIR_EPOCHS
    pair = TrainBatch(ctx.work, "hdp_pair", ranks=2, throttle=not ctx.args.mpich_defaults, warmup=warm)
    pair.extra_env = one_thread
    names = {}
    for rep in range(plan.pair_repeats):
        for scene, scene_argv in scenes:
            for cfg in HDP_CONFIGS:
                name = f"pair_{scene.split()[0]}_{cfg}_r{rep}"
                argv = scene_argv + ["--epochs", pair_epochs, "--batch-size", 64, "--lr", ds.lr, "--seed", 0,
                                     "--emulate-slowdown", "1,2", *HDP_CONFIGS[cfg][0]]
                if plan.hdp_max_steps:
                    argv += ["--max-steps", plan.hdp_max_steps]
                pair.add(name, argv)
                names.setdefault((scene, cfg), []).append(name)
    runs = pair.launch(plan.timeout)
    rows, out = [], {"pair": {}, "homogeneous": {}}
    for (scene, cfg), keys in names.items():
        ratios, sizes, comms, idles, parts = [], [], [], [], []
        for key in keys:
            loaded = runs.get(key)
            if loaded is None:
                continue
            _, ep, _ = loaded
            for e in timed_epochs(ep):
                ratios.append(e["time_s"] / ideal_epoch_s(e, (1.0, 2.0)))
                comms.append(statistics.mean(e["comm_s"]) / e["time_s"])
                idles.append(statistics.mean(e["idle_s"]) / e["time_s"])
                parts.append(ideal_ratio_factors(e, (1.0, 2.0)))
            sizes.append(ep[-1]["batch_sizes"])
        out["pair"][f"{scene} {cfg}"] = {"ratio": ratios, "batch_sizes": sizes, "comm_share": comms,
                                         "idle_share": idles, "split_variation_rest": parts}
        factors = " x ".join(f"{statistics.median(p[j] for p in parts):.3f}" for j in range(3)) if parts else "n/a"
        rows.append([f"2 ranks x 1 thread, {scene}", "1,2", HDP_CONFIGS[cfg][1],
                     str(sizes[-1]) if sizes else "n/a", med_spread(ratios), factors, med_spread(comms, 100, 1),
                     med_spread(idles, 100, 1), f"{len(ratios)}"])
    # ---- 4 identical ranks, many starts
    homo = ctx.batch("hdp_homogeneous", ds)
    starts = plan.homogeneous_starts
    # Each start: --speeds auto, --balance none, and --balance none again (the control: two
    # runs of one configuration, whose ratio is this machine's own spread).
    for k in range(starts):
        for cfg, tag in (("auto", "auto"), ("none", "none"), ("none", "control")):
            argv = ds.argv + ["--epochs", 3 if not ctx.args.quick else 1, "--batch-size", 64, "--lr", ds.lr,
                              "--seed", 0, *HDP_CONFIGS[cfg][0]]
            if plan.hdp_max_steps:
                argv += ["--max-steps", plan.hdp_max_steps]
            homo.add(f"homo_{tag}_{k}", argv)
    runs = homo.launch(plan.timeout)
    equal, paired, control, splits = 0, [], [], []

    def epoch_median(run):
        return statistics.median(e["time_s"] for e in timed_epochs(run[1]))

    for k in range(starts):
        a, n, c = (runs.get(f"homo_{tag}_{k}") for tag in ("auto", "none", "control"))
        if a is None or n is None:
            continue
        split = a[1][-1]["batch_sizes"]
        splits.append(split)
        equal += max(split) - min(split) <= 1
        paired.append(epoch_median(a) / epoch_median(n))
        if c is not None:
            control.append(epoch_median(c) / epoch_median(n))
    out["homogeneous"] = {"starts": len(splits), "equal": equal, "splits": splits, "time_vs_none": paired,
                          "control_vs_none": control}
    body = ["## Two more setups (synthetic scene)", "",
            md_table(["setup", "slowdown (EMULATED)", "split", "batch sizes (last run)", "epoch / ideal",
                      "= split x variation x rest (medians)", "comm % of epoch", "idle % of epoch", "epochs"],
                     rows), "",
            f"The 156x9x9 scene: `{shown(cmd).replace(str(wide), wide.name)}`. {pair_epochs} epochs a run, "
            "all but the first timed. *comm* and *idle* (rank means, as in the tables above) are the "
            "exchange and the waiting for the other rank, as a share of the epoch. *epoch / ideal* is the "
            "product of three factors (`ideal_ratio_factors` in `benchmarks/common.py`; their medians are "
            "shown, so their product is near, not equal to, the median ratio): *split*, the slower rank's "
            "compute total over the ideal (the split's error: 1 when the ranks' totals are equal); "
            "*variation*, the sum over steps of each step's slowest compute over that total (every step "
            "waits for its own slowest rank; no fixed split removes it); *rest*, the epoch over that sum "
            "(exchange, optimizer, epoch-end collectives).", "",
            f"Exact command of a row: `{pair.train_command(names[(scenes[0][0], 'auto')][0])}` with "
            "`OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1` (one thread per rank, "
            f"2 ranks on {ctx.info['cores']} cores).", "",
            f"**4 identical ranks** (no emulation), {len(splits)} starts of `--speeds auto`, each next "
            "to a run with `--balance none`: the split stayed equal (within one sample) in "
            f"**{equal} of {len(splits)}** starts; epoch time with `--speeds auto` / with `--balance none`, "
            f"paired by start (median of each run's timed epochs): {med_spread(paired, 1, 3)} (max "
            f"{max(paired) if paired else float('nan'):.3f}); the control, a second `--balance none` run "
            f"of the same start against the first: {med_spread(control, 1, 3)} (max "
            f"{max(control) if control else float('nan'):.3f}), the spread this machine gives two runs of one "
            f"configuration. Splits: {', '.join(str(s) for s in splits)}.", "",
            f"Command: `{homo.train_command(f'homo_auto_0')}` (and the same with `--balance none`).", ""]
    return out, body


def rebalance_events(metrics: Path) -> int:
    """The re-splits a run's metrics logged (``{"event": "rebalance"}`` records)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    return sum(json.loads(line).get("event") == "rebalance" for line in lines if line.strip())


def hdp_splits_figure(runs: list, factors: list, title: str, png: Path) -> None:
    """Where each rank's epoch goes, for several splits of one emulated slowdown: per rank, the
    mean over the timed epochs of computation / communication / idle seconds (stacked), one
    group of bars per split, with the epoch time (dashed) and the ideal epoch time (black)."""
    fig = common.matplotlib_figure(9, 4.2)
    if fig is None:
        return
    from mpidl.plot import TIME_KINDS, load_run

    ax = fig.subplots()
    labels, drawn = [], 0
    for g, (label, path) in enumerate(runs):
        if not Path(path).is_file():
            continue
        epochs = timed_epochs(load_run(path).epochs)
        if not epochs:
            continue
        ranks = len(epochs[0]["comp_s"])
        bar = 0.8 / ranks
        bottom = [0.0] * ranks
        for key, name, color in TIME_KINDS:
            vals = [statistics.mean(e[key][r] for e in epochs) for r in range(ranks)]
            xs = [g + (r - (ranks - 1) / 2) * bar for r in range(ranks)]
            ax.bar(xs, vals, width=bar * 0.92, bottom=bottom, color=color, edgecolor="white", linewidth=0.3,
                   label=name if drawn == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
        epoch_s = median([e["time_s"] for e in epochs])
        ideal = median([ideal_epoch_s(e, factors) for e in epochs])
        ax.hlines(epoch_s, g - 0.45, g + 0.45, colors="#B22222", linestyles="--",
                  label="epoch time (median)" if drawn == 0 else None)
        ax.hlines(ideal, g - 0.45, g + 0.45, colors="black", linewidth=2,
                  label="ideal: work / sum of speeds" if drawn == 0 else None)
        ax.text(g, epoch_s, f" {epoch_s / ideal:.2f}x ideal", ha="center", va="bottom", fontsize=8)
        labels.append((g, f"{label}\n(bars: ranks 0-{ranks - 1}, factors {','.join(f'{f:g}' for f in factors)})"))
        drawn += 1
    if not drawn:
        return
    ax.set_xticks([g for g, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylabel("seconds per epoch (mean of the timed epochs)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def hdp_figure(ctx: Context, rows: list[dict]) -> None:
    fig = common.matplotlib_figure(9, 4)
    if fig is None or ctx.args.quick or not rows:
        return
    datasets = [d.name for d in ctx.datasets]
    axes = fig.subplots(1, len(datasets), squeeze=False)[0]
    for ax, ds in zip(axes, datasets):
        sel = [r for r in rows if r["dataset"] == ds and r["scale"] == ctx.args.slowdown_scale]
        labels = [f"{r['slowdown']}\n{r['config']}" for r in sel]
        xs = range(len(sel))
        ax.bar(xs, [median(r["epoch_s"]) for r in sel], color="#4C72B0", label="measured epoch")
        ax.scatter(xs, [median(r["ideal_s"]) for r in sel], color="black", marker="_", s=400,
                   label="ideal (work / sum of speeds)", zorder=3)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("seconds per epoch")
        ax.set_title(f"{ds} (EMULATED slowdowns x{ctx.args.slowdown_scale:g})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ctx.out / "hdp.png", dpi=110)


# --------------------------------------------------------------------------------------------
# 2. balanced gradient
# --------------------------------------------------------------------------------------------


def balanced(ctx: Context) -> dict:
    plan = ctx.plan
    results, body, rows_json = {}, [], []
    body += ["## What was run", "",
             f"Global batch 64 split by `--speeds` (given relative speeds: no slowdown is emulated, "
             f"timing plays no part here), {plan.bal_epochs} epochs"
             + (f" (at most {plan.max_steps} steps)" if plan.max_steps else "")
             + f", seeds {', '.join(map(str, plan.bal_seeds))} (model initialisation and data order). "
             "`uniform`: g = (1/P) sum_i g_i, the naive average; `balanced`: g = sum_i (b_i/B) g_i, "
             "the exact gradient of the global batch's mean loss. With equal batches (1,1,1,1) the "
             "two are the same computation.", ""]
    for ds in ctx.datasets:
        batch = ctx.batch(f"balanced_{ds.name}", ds)
        names = {}
        for seed in plan.bal_seeds:
            for skew in plan.bal_skews:
                for w in ("uniform", "balanced"):
                    argv = ds.argv + ["--epochs", plan.bal_epochs, "--batch-size", 64, "--lr", ds.lr,
                                      "--seed", seed, "--speeds", skew, "--weighting", w]
                    if plan.max_steps:
                        argv += ["--max-steps", plan.max_steps * plan.bal_epochs]
                    name = f"{skew.replace(',', '')}_{w}_seed{seed}"
                    batch.add(name, argv)
                    names.setdefault((skew, w), []).append(name)
        runs = batch.launch(plan.timeout)
        rows, per_epoch = [], []
        curves = {}
        for (skew, w), keys in names.items():
            finals = {"oa": [], "aa": [], "kappa": []}
            by_epoch: dict[int, list[float]] = {}
            sizes = None
            for key in keys:
                loaded = runs.get(key)
                if loaded is None:
                    continue
                _, epochs, _ = loaded
                sizes = epochs[-1]["batch_sizes"]
                for m in finals:
                    finals[m].append(epochs[-1][m])
                for e in epochs:
                    by_epoch.setdefault(e["epoch"], []).append(e["oa"])
            curves[(skew, w)] = by_epoch
            rows_json.append({"dataset": ds.name, "speeds": skew, "weighting": w, "batch_sizes": sizes,
                              "final": finals, "oa_by_epoch": by_epoch})
            rows.append([skew, str(sizes), w, mean_std(finals["oa"]), mean_std(finals["aa"]),
                         mean_std(finals["kappa"], 1, 4), len(finals["oa"])])
            per_epoch.append([skew, w] + [mean_std(by_epoch.get(e, [])) for e in sorted(by_epoch)])
        deltas = []
        for skew in plan.bal_skews:
            u = [r for r in rows_json if r["dataset"] == ds.name and r["speeds"] == skew and r["weighting"] == "uniform"]
            b = [r for r in rows_json if r["dataset"] == ds.name and r["speeds"] == skew and r["weighting"] == "balanced"]
            if u and b and u[0]["final"]["oa"] and b[0]["final"]["oa"]:
                pairs = list(zip(b[0]["final"]["oa"], u[0]["final"]["oa"]))
                deltas.append([skew, mean_std([x - y for x, y in pairs])])
        epochs_hdr = [f"OA % epoch {e}" for e in range(1, max((len(r) - 2 for r in per_epoch), default=0) + 1)]
        body += [f"## {ds.label}", "", *failure_note(batch),
                 md_table(["speeds", "batch sizes", "weighting", "OA %", "AA %", "kappa", "seeds"], rows), "",
                 "Balanced minus uniform, final OA (points, mean ± std over paired seeds):", "",
                 md_table(["speeds", "OA delta (points)"], deltas), "",
                 "Per epoch (OA %, mean ± std over seeds):", "",
                 md_table(["speeds", "weighting", *epochs_hdr], per_epoch), "",
                 f"Exact command of a row: `{batch.train_command(names[(plan.bal_skews[-1], 'balanced')][0])}`",
                 f"The batch: `{shown(batch.command())}` ({batch.seconds:.0f} s, exit {batch.code}).", ""]
        results[ds.name] = {"batch_s": batch.seconds, "exit": batch.code}
        balanced_figure(ctx, ds, curves)
        if not ctx.args.quick and (ctx.out / f"balanced_{ds.name}.png").exists():
            body += [f"![{ds.label}](balanced_{ds.name}.png)", ""]
    path = ctx.out / ("balanced_quick.md" if ctx.args.quick else "balanced.md")
    common.write_markdown(path, "Balanced gradient: uniform vs sample-weighted averaging with uneven batches",
                          ctx.me, ctx.info, ctx.common_body() + body)
    results["rows"] = rows_json
    return results


def balanced_figure(ctx: Context, ds: Dataset, curves: dict) -> None:
    fig = common.matplotlib_figure(7, 4)
    if fig is None or ctx.args.quick:
        return
    ax = fig.subplots()
    for (skew, w), by_epoch in curves.items():
        if not by_epoch:
            continue
        es = sorted(by_epoch)
        means = [100 * statistics.mean(by_epoch[e]) for e in es]
        stds = [100 * statistics.stdev(by_epoch[e]) if len(by_epoch[e]) > 1 else 0.0 for e in es]
        (line,) = ax.plot(es, means, marker="o", markersize=3,
                          linestyle="-" if w == "balanced" else "--", label=f"speeds {skew}, {w}")
        ax.fill_between(es, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)],
                        color=line.get_color(), alpha=0.15)
    ax.set(xlabel="epoch", ylabel="test OA (%), mean ± std over seeds",
           title=f"{ds.label}: uniform (dashed) vs balanced (solid) weighting")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ctx.out / f"balanced_{ds.name}.png", dpi=110)


# --------------------------------------------------------------------------------------------
# 3. node-based communication
# --------------------------------------------------------------------------------------------


def node_variants():
    yield "flat", ["--strategy", "flat"]
    yield "hierarchical", ["--strategy", "hierarchical"]
    for k in NODE_K:
        yield f"node K'={k}", ["--strategy", "node", "--sync-every", k]


def node(ctx: Context) -> dict:
    plan = ctx.plan
    results, body, rows_json = {}, [], []
    datasets = [ds for ds in ctx.datasets if ds.node_argv]
    body += ["## What was run", "",
             "2 nodes x 2 ranks, EMULATED on one machine with MPICH's launcher "
             "(`mpiexec -n 4 -ppn 2 -hosts localhost,127.0.0.1 -launcher fork`: each -hosts entry "
             "is a node, `MPI_COMM_TYPE_SHARED` really splits into 2 groups of 2, and the two "
             "groups talk through MPICH's network module, not shared memory). "
             f"Equal split (`--balance none`: deterministic, so a run's accuracy does not depend on "
             f"the link emulation), SGD lr {NODE_LR} (cosine), {plan.node_epochs} epochs"
             + (f" (at most {plan.max_steps} steps)" if plan.max_steps else "") + ". "
             "EMULATED links (`--emulate-link LATENCY_US,GBIT_S`): every inter-node collective "
             "additionally sleeps its alpha-beta time (ring allreduce over the L participants: "
             "2 (L-1) (alpha + n / (L beta))); for `flat` that is a ring over all 4 ranks every "
             "step, for `hierarchical` and `node` a ring over the 2 leaders.", "",
             f"**Data: S = {NODE_STEPS} steps per epoch, a multiple of every K' "
             f"({', '.join(map(str, NODE_K))}).** The node strategy averages the parameters between "
             "the nodes after steps K', 2K', ...; the trainer also averages them at every epoch end "
             "(so that the evaluated model is one model), except when the K' sync has just run at "
             "that step. A leader therefore makes ceil(S/K') inter-node calls per epoch, and with S "
             "a multiple of K' that is exactly S/K': the measured counters show the K' effect "
             "itself, not an epoch-end sync.", "",
             *[f"- {ds.node_note}" for ds in datasets], "",
             f"Learning rate: {NODE_LR} for both scenes (lr 0.01 and 0.02 gave NaN gradients with "
             "the node strategy, whose every-step reduction averages only one node's 4-5 samples, "
             "in trial runs; flat trained at both).", "",
             "**Inter-node bytes.** The exchange's channels count, per level, the bytes each rank hands to "
             "each collective (`comm` in the metrics of rank 0, a node leader). `hierarchical` and "
             "`node` have an inter-node level (the leaders' communicator): their inter-node calls "
             "and bytes are MEASURED. `flat` has no such level: it makes one MPI_Allreduce of the "
             "whole gradient buffer (b bytes) on the world communicator per step, and its "
             "inter-node share is hidden inside MPICH. Its inter-node column is therefore an "
             "ESTIMATE: S calls and S x b bytes per node and direction per epoch, b x S being flat's "
             "own measured world counter per rank. For 2 nodes that is the least any algorithm "
             "must move (each node needs the other's partial sum once per step, whatever MPICH "
             "does inside), and it equals what `hierarchical` measures on its leaders. Two ratios "
             "are given: *per node* (a leader's measured inter-node bytes / that estimate), and "
             "*the all-ranks count* (flat moves every rank's buffer across the node boundary every "
             "step: 4 ranks x S x b, the sum of flat's measured world counters; node moves one "
             "buffer per node every K' steps: 2 leaders x the measured inter-node bytes), for "
             "which the expected factor is K' x ranks per node = 2 K'.", ""]
    for ds in datasets:
        B = ds.node_batch
        batch = ctx.batch(f"node_{ds.name}", ds, two_nodes=True, warmup_batch=B, argv=ds.node_argv)
        names = {}
        for seed in plan.node_seeds:
            for link in plan.node_links:
                if link is not None and seed != plan.node_seeds[0]:
                    continue  # the links change time only; accuracy comes from the link-free runs
                for label, opts in node_variants():
                    argv = ds.node_argv + ["--epochs", plan.node_epochs, "--batch-size", B, "--lr", NODE_LR,
                                           "--seed", seed, "--balance", "none", *opts]
                    if link:
                        argv += ["--emulate-link", link]
                    if plan.max_steps:
                        argv += ["--max-steps", plan.max_steps * plan.node_epochs]
                    name = f"{label.replace(' ', '').replace(chr(39), '').replace('=', '')}_{link or 'nolink'}_seed{seed}".replace(",", "-")
                    batch.add(name, argv)
                    names[(label, link, seed)] = name
        runs = batch.launch(plan.timeout)
        seed0 = plan.node_seeds[0]
        table, time_rows, acc_rows = [], [], []
        ref = {}
        for label, _ in node_variants():
            loaded = runs.get(names[(label, None, seed0)])
            if loaded is None:
                continue
            _, epochs, _ = loaded
            n_ep = len(epochs)
            per_epoch = {lvl: [e["comm"][lvl] for e in epochs] for lvl in ("inter", "intra", "world")}
            ref[label] = {f"{lvl}_{what}": sum(c[what] for c in cs) / n_ep
                          for lvl, cs in per_epoch.items() for what in ("calls", "bytes")}
            ref[label]["steps_per_epoch"] = epochs[-1]["step"] / n_ep
            ref[label]["inter_calls_by_epoch"] = [c["calls"] for c in per_epoch["inter"]]
        flat = ref.get("flat", {})
        flat_world, flat_steps = flat.get("world_bytes", math.nan), flat.get("steps_per_epoch", math.nan)
        for label, _ in node_variants():
            r = ref.get(label)
            if r is None:
                table.append([label] + ["n/a"] * 9)
                continue
            measured = label != "flat"
            steps = r["steps_per_epoch"]
            if label.startswith("node"):
                k = int(label.split("=")[1])
                expected = math.ceil(steps / k)
            else:
                expected = steps
            calls = r["inter_calls"] if measured else flat_steps
            inter = r["inter_bytes"] if measured else flat_world
            per_node = inter / flat_world if flat_world else math.nan
            # flat against itself is 1 by definition (its 4 ranks' buffers each cross every step)
            design = (2 * inter) / (4 * flat_world) if measured and flat_world else (1.0 if not measured else math.nan)
            r.update(inter_calls_used=calls, inter_bytes_used=inter, expected_calls=expected,
                     per_node_ratio=per_node, design_ratio=design, estimated=not measured)
            table.append([label, f"{steps:.0f}", f"{calls:.1f}" + ("" if measured else " (est.)"),
                          f"{expected:.0f}", fmt_bytes(inter) + ("" if measured else " (est.)"),
                          fmt_bytes(r["world_bytes"]) if r["world_bytes"] else "-",
                          fmt_bytes(r["intra_bytes"]) if r["intra_bytes"] else "-",
                          _ratio(per_node), _ratio(design), f"{design:.4f}"])
        goal = ref.get("node K'=50", {}).get("design_ratio")
        verdict = ("n/a" if goal is None or not math.isfinite(goal) else
                   f"{_ratio(goal)} ({goal:.4f}): goal {'MET' if goal <= 0.01 * (1 + 1e-9) else 'MISSED'}")
        # accuracy over seeds (link-free runs), deltas vs flat paired by seed
        flat_oa = {s: runs[names[("flat", None, s)]][1][-1]["oa"] for s in plan.node_seeds
                   if runs.get(names[("flat", None, s)]) is not None}
        acc_json = {}
        for label, _ in node_variants():
            oas, aas, kappas, deltas, same = [], [], [], [], []
            for s in plan.node_seeds:
                loaded = runs.get(names[(label, None, s)])
                if loaded is None or not loaded[1]:
                    continue
                last = loaded[1][-1]
                oas.append(last["oa"]), aas.append(last["aa"]), kappas.append(last["kappa"])
                if s in flat_oa:
                    deltas.append(last["oa"] - flat_oa[s])
            for link in plan.node_links[1:]:  # determinism check: the link emulation only sleeps
                other = runs.get(names[(label, link, seed0)])
                base = runs.get(names[(label, None, seed0)])
                if other is not None and base is not None:
                    same.append(other[1][-1]["oa"] == base[1][-1]["oa"])
            r = ref.get(label, {})
            acc_json[label] = {"oa": oas, "aa": aas, "kappa": kappas, "delta_vs_flat": deltas,
                               "inter_ratio_per_node": r.get("per_node_ratio"),
                               "inter_ratio_design": r.get("design_ratio")}
            acc_rows.append([label, mean_std(oas), mean_std(aas), mean_std(kappas, 1, 4),
                             mean_std(deltas), _ratio(r.get("per_node_ratio", math.nan)),
                             _ratio(r.get("design_ratio", math.nan)),
                             ("yes" if all(same) else "NO") if same else "n/a"])
        for label, _ in node_variants():
            cells = [label]
            per_link = {}
            for link in plan.node_links:
                loaded = runs.get(names[(label, link, seed0)])
                times = [e["time_s"] for e in timed_epochs(loaded[1])] if loaded else []
                per_link[link or "none"] = times
                cells.append(med_spread(times))
            time_rows.append(cells)
            acc_json[label]["epoch_s"] = per_link
        example = names[("node K'=50", plan.node_links[1] if len(plan.node_links) > 1 else None, seed0)]
        link_hdr = ["no link emulation" if l is None else f"EMULATED link {l.split(',')[0]} us, {l.split(',')[1]} Gbit/s"
                    for l in plan.node_links]
        body += [f"## {ds.label}", "", *failure_note(batch),
                 f"{ds.node_num_train} training samples, global batch {B}. Traffic per epoch (mean over "
                 "the epochs of the seed-0, link-free run; counters of rank 0, a leader; one leader's "
                 "bytes = what crosses the node boundary in each direction):", "",
                 md_table(["strategy", "steps/epoch (S)", "inter-node calls/epoch",
                           "expected calls/epoch (S or ceil(S/K'))", "inter-node bytes/epoch (per leader)",
                           "world bytes/epoch (per rank)", "intra-node bytes/epoch (per rank)",
                           "inter-node vs flat (per node)", "vs flat (all-ranks count)",
                           "vs flat (all-ranks count, decimal)"], table), "",
                 f"Goal 'node K'=50 inter-node bytes <= 1/100 of flat (the all-ranks count)': {verdict}.", "",
                 f"Accuracy after {plan.node_epochs} epoch(s), mean ± std over seeds "
                 f"{', '.join(map(str, plan.node_seeds))}; delta vs flat paired by seed, in points; "
                 "each K''s accuracy cost next to its traffic saving:", "",
                 md_table(["strategy", "OA %", "AA %", "kappa", "OA - flat OA (points)",
                           "inter-node bytes vs flat (per node)", "vs flat (all-ranks count)",
                           "same OA under the link emulation"], acc_rows), "",
                 "Epoch time (s), median [min-max] over the timed epochs (all but the first) of the seed-0 run:", "",
                 md_table(["strategy", *link_hdr], time_rows), "",
                 f"Exact command of a row (node K'=50, EMULATED link 50 us / 1 Gbit/s): "
                 f"`{batch.train_command(example)}`",
                 f"The batch: `{shown(batch.command())}` ({batch.seconds:.0f} s, exit {batch.code}).", ""]
        results[ds.name] = {"batch_s": batch.seconds, "exit": batch.code, "traffic": ref, "accuracy": acc_json,
                            "k50_design_ratio": goal}
        rows_json.append({"dataset": ds.name, "traffic": ref, "accuracy": acc_json})
    body += ["## Reading the tables", "",
             f"- Steady state: a node-based leader makes one inter-node call every K' steps where "
             f"hierarchical makes one every step, so its inter-node bytes are 1/K' of flat's per "
             f"node, and 1/(2K') by the all-ranks count on 2 ranks per node. With S = {NODE_STEPS} "
             f"steps per epoch, a multiple of every K', the measured calls per epoch are exactly "
             f"S/K' (the epoch-end sync coincides with a K' sync and is skipped).",
             "- K'=1 syncs the parameters after every step: the same inter-node traffic as "
             "hierarchical (parameters instead of gradients), a different algorithm (parameter "
             "averaging after local updates).",
             "- Goals: node K'=50 inter-node bytes <= 1/100 of flat (by the all-ranks count) on 2x2; "
             "OA within 1 point of flat.", ""]
    path = ctx.out / ("node_quick.md" if ctx.args.quick else "node.md")
    node_figure(ctx, rows_json)
    if not ctx.args.quick and (ctx.out / "node.png").exists():
        body += ["![node](node.png)", ""]
    common.write_markdown(path, "Node-based communication: inter-node traffic, time and accuracy vs K'",
                          ctx.me, ctx.info, ctx.common_body() + body)
    results["rows"] = rows_json
    return results


def failure_note(batch) -> list[str]:
    """Lines for the report when a batch did not finish: its exit code and the end of its log."""
    if batch.code == 0:
        return []
    return [f"**This batch failed (exit code {batch.code}); rows without numbers did not run.** "
            "End of its log:", "", common.code_block(common.tail(batch.log, 12).splitlines()), ""]


def _ratio(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    if x == 0:
        return "0"
    if x >= 0.5:
        return f"{x:.2f}"
    v = 1 / x
    return f"1/{v:.0f}" if abs(v - round(v)) < 0.05 else f"1/{v:.1f}"


def node_figure(ctx: Context, rows: list[dict]) -> None:
    fig = common.matplotlib_figure(9, 3.8)
    if fig is None or ctx.args.quick or not rows:
        return
    ax_bytes, ax_oa = fig.subplots(1, 2)
    for r in rows:
        labels = [lab for lab, _ in node_variants()]
        traffic = r["traffic"]
        ys = [traffic[l].get("inter_bytes_used", math.nan) / 1e6 if l in traffic else math.nan for l in labels]
        ax_bytes.plot(range(len(labels)), ys, marker="o", label=r["dataset"])
        acc = r["accuracy"]
        ax_oa.errorbar(range(len(labels)),
                       [100 * statistics.mean(acc[l]["oa"]) if acc.get(l, {}).get("oa") else math.nan for l in labels],
                       yerr=[100 * statistics.stdev(acc[l]["oa"]) if len(acc.get(l, {}).get("oa", [])) > 1 else 0
                             for l in labels], marker="o", capsize=3, label=r["dataset"])
        ax_bytes.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
        ax_oa.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
    ax_bytes.set_yscale("log")
    ax_bytes.set(ylabel="inter-node MB / epoch (per leader)", title="inter-node traffic (flat: estimate)")
    ax_oa.set(ylabel="test OA % (mean ± std over seeds)", title="accuracy, 2 EMULATED nodes x 2 ranks")
    for ax in (ax_bytes, ax_oa):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ctx.out / "node.png", dpi=110)


# --------------------------------------------------------------------------------------------
# the other scripts
# --------------------------------------------------------------------------------------------


def _script(ctx: Context, cmd: list[str], log_name: str, timeout: float) -> dict:
    code, seconds = common.run(cmd, ctx.work / log_name, timeout,
                               common.bench_env(not ctx.args.mpich_defaults))
    if code != 0:
        print(common.tail(ctx.work / log_name), flush=True)
    return {"command": shown(cmd), "exit": code, "seconds": seconds, "log": str(ctx.work / log_name)}


def comm(ctx: Context) -> dict:
    quick = ["--quick"] if ctx.args.quick else []
    program = [PYTHON, str(common.BENCH_DIR / "comm.py"), "--out", str(ctx.out), *quick]
    one = _script(ctx, common.mpiexec(4, program), "comm_1node.log", 600)
    two = _script(ctx, common.mpiexec(4, program, two_nodes=True), "comm_2nodes.log", 600)
    result = {"one_node": one, "two_nodes": two}
    if one["exit"] or two["exit"]:
        result["error"] = "comm.py failed; see the logs"
    return result


def overlap(ctx: Context) -> dict:
    """``benchmarks/overlap.py`` (exposed communication of --overlap, resnet8, 2 EMULATED nodes
    x 2 ranks, 50 us / 10 Gbit/s) and ``benchmarks/comm.py --shm`` on 1 node x 2 and x 4."""
    quick = ["--quick"] if ctx.args.quick else []
    program = [PYTHON, str(common.BENCH_DIR / "overlap.py"), "--out", str(ctx.out), *quick]
    result = {"overlap": _script(ctx, common.mpiexec(4, program, two_nodes=True), "overlap.log", 1800)}
    shm = [PYTHON, str(common.BENCH_DIR / "comm.py"), "--shm", "--out", str(ctx.out), *quick]
    for ranks in (2, 4):
        result[f"shm_{ranks}"] = _script(ctx, common.mpiexec(ranks, shm), f"comm_shm_{ranks}.log", 1800)
    if any(r["exit"] for r in result.values()):
        result["error"] = "overlap.py or comm.py --shm failed; see the logs"
    return result


def scaling(ctx: Context) -> dict:
    quick = ["--quick"] if ctx.args.quick else []
    cmd = [PYTHON, str(common.BENCH_DIR / "scaling.py"), "--out", str(ctx.out), "--work", str(ctx.work / "scaling"), *quick]
    if ctx.args.mpich_defaults:
        cmd.append("--mpich-defaults")
    result = _script(ctx, cmd, "scaling.log", 900)
    if result["exit"]:
        result["error"] = "scaling.py failed; see the log"
    return result


def peers(ctx: Context) -> dict:
    quick = ["--quick"] if ctx.args.quick else []
    cmd = [PYTHON, str(common.BENCH_DIR / "peers_torch.py"), "--out", str(ctx.out), "--work", str(ctx.work / "peers"), *quick]
    for ds in ctx.datasets:
        if ds.name == "samson":
            cmd += ["--samson", ds.argv[1]]
    if ctx.args.mpich_defaults:
        cmd.append("--mpich-defaults")
    result = _script(ctx, cmd, "peers.log", 900)
    if result["exit"]:
        result["error"] = "peers_torch.py failed; see the log"
    return result


def families(ctx: Context) -> dict:
    quick = ["--quick"] if ctx.args.quick else []
    cmd = [PYTHON, str(common.BENCH_DIR / "families.py"), "--out", str(ctx.out), "--work", str(ctx.work / "families"), *quick]
    if ctx.args.mpich_defaults:
        cmd.append("--mpich-defaults")
    result = _script(ctx, cmd, "families.log", 3600)
    if result["exit"]:
        result["error"] = "families.py failed; see the log"
    return result


# --------------------------------------------------------------------------------------------
# the index
# --------------------------------------------------------------------------------------------


def write_index(ctx: Context, summary: dict) -> None:
    lines = ["# Benchmark results", "",
             "Regenerate everything (tables, figures, this page) with one command from the "
             "repository root:", "", "```", "python benchmarks/experiments.py", "```", "",
             f"This run took {summary['wall_s'] / 60:.1f} minutes.", "",
             common.machine_md(ctx.info), "",
             "| file | what |", "|---|---|",
             "| [hdp.md](hdp.md) | heterogeneous data parallelism: epoch time of equal / measured / re-balanced splits vs the ideal, EMULATED slowdowns |",
             "| [balanced.md](balanced.md) | balanced vs uniform gradient weighting with uneven batches: OA/AA/kappa over seeds |",
             "| [node.md](node.md) | node-based communication on 2 EMULATED nodes: inter-node traffic, epoch time under EMULATED links, accuracy per K' |",
             "| [comm.md](comm.md) | reduction strategies on flat buffers 4 KiB - 64 MiB, raw MPI_Allreduce, torch.distributed (gloo) |",
             "| [scaling.md](scaling.md) | samples/s with 1, 2, 4 ranks, hsicnn and resnet8 |",
             "| [peers.md](peers.md) | mpidl vs PyTorch DDP (gloo) on the same model and data |",
             "| [families.md](families.md) | model families (CNN, LSTM, ViT, GAN) and every optimizer on hsicnn: flat vs node K'=50 on 2 EMULATED nodes |",
             '| [families_lstm_vit.md](families_lstm_vit.md) | the LSTM and ViT rows of families.md alone: run on its own, `python benchmarks/families.py --only LSTM ViT` (not part of this command) |',
             '| [comm_shm.md](comm_shm.md) | node-shared buffers (`--intra shm`) vs MPI Allreduce + replicated update, 4 KiB - 64 MiB, time and memory per node: run on its own, `python benchmarks/comm.py --shm` (not part of this command) |',
             '| [overlap.md](overlap.md) | the gradient exchange overlapped with the backward pass (`--overlap`) under an EMULATED link: part of this command (section overlap) |',
             '| [twins.md](twins.md) | mlp, spectral_lstm and vit trained on Samson vs PyTorch twins from the same initial weights: run on its own, `python benchmarks/twins_torch.py --data samson.h5 --seeds 0,1,2` (not part of this command) |',
             '| [read.md](read.md) | read speed of the patch file vs the scene-backed file (Samson): run on its own, `python benchmarks/read.py --rounds 5 --samson-dir DIR` (not part of this command) |',
             "| [plan.md](plan.md) | the strategies' cost model (`mpidl.plan`): validation against emulated runs, and modelled efficiency at scale: run on its own, `python benchmarks/plan.py` (not part of this command) |",
             "| [node_variants.md](node_variants.md) | node K'=50 with the blocking sync vs `--sync-overlap 1` vs `--compress bf16`: OA over 3 seeds, synthetic and Samson: run on its own, `python benchmarks/node_variants.py` (not part of this command) |",
             "| [conv.txt](conv.txt) | convolution step and conv layers vs sgemm peak and PyTorch: run on its own, "
             "`python benchmarks/conv.py --repeats 5 > benchmarks/results/conv.txt` (not part of this command) |",
             "| [step.md](step.md), [step_threads1.md](step_threads1.md) | one training step of every model vs its PyTorch twin, fresh processes, nothing set (and one thread each): run on its own, `python benchmarks/step.py` (`--threads 1`) (not part of this command) |",
             "", "Sections and their wall time:", ""]
    for name, sec in summary["sections"].items():
        status = "FAILED: " + sec["error"] if "error" in sec else "ok"
        lines.append(f"- {name}: {sec['wall_s']:.0f} s, {status}")
    if ctx.data_commands:
        lines += ["", "Samson was converted with:", "", common.code_block(ctx.data_commands)]
    (ctx.out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
