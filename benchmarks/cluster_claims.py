# python benchmarks/cluster_claims.py TABLE [--models hsicnn] [--rates 100mbit,1gbit] [--rounds 3] [--epochs 5]
#                                          [--name claims] [--quick] [--keep-cluster]
#   TABLE: node (1: node-based communication), peers (2: mpidl vs PyTorch DDP / post-local SGD),
#          overlap (3: --overlap vs blocking), hdp (4: real CPU shares), plan (5: the cost model
#          against table 1's measured epochs), or rows (any rows given by --row LABEL=ARGV)
"""The papers' claims measured on a real cluster of namespace hosts (``jobs/cluster.sh``).

Every run is a fresh ``mpiexec`` across 2 hosts of this machine, each a network namespace with
its own ``eth0`` (shaped by ``tc tbf`` to the table's rate), its own host name and its own
core (cpuset), its CPU share set by a cgroup; 1 rank per host unless a row says ``2x2``. The
inter-host traffic is TCP (``UCX_TLS=tcp,self``) through the shaped link; the bytes are the
kernel's counters of each host's ``eth0`` around the run (``/sys/class/net/eth0/statistics``),
beside mpidl's own per-level counters from its metrics file. Rows alternate within each round,
each round starting one row later (round 1: A B C, round 2: B C A, ...); every figure is the
median over the rounds with ``[min-max]``; the load average before each run is kept in the
JSON.

Nothing in these tables is emulated: no ``--emulate-link``, no ``--emulate-slowdown``, no fake
hosts, no ``MPIDL_RANKS_PER_NODE``. The machine's 2 cores are shared with other work, so the
timings carry its noise; the load averages say how much.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from cluster_run import Cluster, ClusterError, run_measured  # noqa: E402

THREADS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
#: per-model recipe of tables 1-3 (the CLI's defaults but for the lr of resnet8 / vit)
MODEL_ARGV = {"hsicnn": [], "resnet8": [], "vit": []}
TABLES = ("node", "peers", "overlap", "hdp", "plan", "rows")


@dataclass
class Row:
    """One configuration: ``kind`` mpidl (``python -m mpidl.train ARGV``) or a torch peer
    (``benchmarks/cluster_peer_torch.py ARGV``); ``sizes`` ranks per host."""

    label: str
    argv: list
    kind: str = "mpidl"
    sizes: list = field(default_factory=lambda: [1, 1])
    group: str = ""
    env: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# running one row
# --------------------------------------------------------------------------------------------


def read_records(path: Path) -> dict[str, list[dict]]:
    """The records of a metrics file (mpidl's or the peer's), by their ``event``, in one pass."""
    out: dict[str, list[dict]] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.setdefault(rec.get("event"), []).append(rec)
    return out


def read_epochs(path: Path) -> tuple[list[dict], dict | None]:
    """The epoch records and the (last) start record of a metrics file."""
    records = read_records(path)
    return records.get("epoch", []), (records.get("start") or [None])[-1]


def command(cluster: Cluster, row: Row, metrics: Path, extra: list | None = None) -> list:
    if row.kind == "mpidl":
        program = [common.PYTHON, "-m", "mpidl.train", *row.argv, "--quiet", "--metrics", str(metrics)]
    else:
        port = random.randint(20000, 40000)
        program = [common.PYTHON, str(common.BENCH_DIR / "cluster_peer_torch.py"), *row.argv,
                   "--master", f"{cluster.address(1)}:{port}", "--node-sizes", ",".join(map(str, row.sizes)),
                   "--metrics", str(metrics)]
    return cluster.mpiexec(row.sizes, program + list(extra or []), {**THREADS_ENV, **row.env})


def run_row(cluster: Cluster, row: Row, work: Path, tag: str, timeout: float, during=None) -> dict:
    """One fresh job of ``row``: its metrics, the kernel's bytes, the command."""
    metrics = work / f"{tag}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = command(cluster, row, metrics)
    if during is None:
        rec = run_measured(cluster, cmd, work / f"{tag}.log", timeout)
    else:
        rec = during(cmd, metrics, work / f"{tag}.log")
    records = read_records(metrics)
    epochs, start = records.get("epoch", []), (records.get("start") or [None])[-1]
    # the moves of a re-balanced split: the step, the new batch sizes, the gain and margin
    rec["rebalances"] = [{k: r.get(k) for k in ("step", "old", "new", "gain", "margin")}
                         for r in records.get("rebalance", [])]
    rec.update({"label": row.label, "kind": row.kind, "sizes": row.sizes, "epochs": epochs,
                "model_bytes": (start or {}).get("num_params", 0) * 4,
                "command": common.shown(cmd).replace(str(work) + "/", "")})
    if rec["code"] != 0 or not epochs:
        print(f"  {row.label}: exit {rec['code']}, see {work / (tag + '.log')}\n{common.tail(work / (tag + '.log'), 8)}",
              flush=True)
    return rec


def run_rounds(cluster: Cluster, rows: list[Row], rounds: int, work: Path, tag: str, timeout: float,
               only: list | None = None) -> list[dict]:
    """``rounds`` alternating rounds of ``rows``, each round starting one row later (A B C,
    B C A, C A B, ...) so that no row always runs first after a pause or right after the same
    neighbour: every run's record; ``only``: the labels to run (all when empty)."""
    rows = [r for r in rows if not only or r.label in only]
    out = []
    for r in range(rounds):
        start = r % len(rows) if rows else 0
        for i, row in [(i, rows[i]) for i in range(start, len(rows))] + [(i, rows[i]) for i in range(start)]:
            rec = run_row(cluster, row, work, f"{tag}_r{r}_{i}", timeout)
            rec["round"] = r
            out.append(rec)
            ep = rec["epochs"]
            print(f"  [{rec['time']}] {tag} round {r + 1} {row.label}: "
                  f"{'epoch ' + format(epoch_s(rec), '.2f') + ' s' if ep else 'FAILED'}, "
                  f"OA {100 * ep[-1]['oa']:.2f}%" if ep else "", f"host1 tx {rec['kernel'][0]['tx'] / 1e6:.2f} MB, "
                  f"load {rec['load']}", flush=True)
    return out


# --------------------------------------------------------------------------------------------
# per-run quantities
# --------------------------------------------------------------------------------------------


def epoch_s(rec: dict) -> float:
    """Median training time of the run's epochs, the first (speed probe, caches) left out."""
    eps = rec["epochs"][1:] if len(rec["epochs"]) > 1 else rec["epochs"]
    return statistics.median(e["time_s"] for e in eps) if eps else math.nan


def fastest_epoch_s(recs: list[dict]) -> float:
    """The shortest timed epoch (2..E) of any of the runs: the least disturbed by the machine's
    other work (its interference only adds time), beside the median."""
    times = [e["time_s"] for r in recs for e in (r["epochs"][1:] if len(r["epochs"]) > 1 else r["epochs"])]
    return min(times) if times else math.nan


def counted_bytes(rec: dict) -> float:
    """mpidl's own bytes over the run at the levels that may cross hosts (rank 0's counters):
    ``inter`` (leaders) plus ``world`` (flat's collectives over all ranks; with 2 ranks per
    host MPICH's allreduce crosses the link once per host pair); NaN for a peer."""
    return _counted(rec, "bytes")


def counted_calls(rec: dict) -> float:
    return _counted(rec, "calls")


def _counted(rec: dict, key: str) -> float:
    if rec["kind"] != "mpidl" or not rec["epochs"]:
        return math.nan
    return float(sum(e.get("comm", {}).get(level, {}).get(key, 0) for e in rec["epochs"] for level in ("inter", "world")))


def kernel_tx(rec: dict, host: int = 0) -> float:
    return float(rec["kernel"][host]["tx"])


def time_to(rec: dict, target: float) -> float:
    """Training seconds (sum of epoch times) until the test OA first reaches ``target``; NaN
    when it never does."""
    t = 0.0
    for e in rec["epochs"]:
        t += e["time_s"]
        if e["oa"] >= target - 1e-12:
            return t
    return math.nan


def final_oa(rec: dict) -> float:
    return rec["epochs"][-1]["oa"] if rec["epochs"] else math.nan


def ms(values, scale=1.0, digits=2):
    return common.med_spread(values, scale, digits)


def ratio_str(a, b, digits=2):
    return f"{a / b:.{digits}f}" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


# --------------------------------------------------------------------------------------------
# table 1: node-based communication
# --------------------------------------------------------------------------------------------


def node_rows(model: str, epochs: int, per_epoch: int, quick: bool, extra: list) -> list[Row]:
    base = ["--model", model, "--epochs", str(epochs), "--balance", "none", *MODEL_ARGV.get(model, []), *extra]
    if quick:
        return [Row("flat", base + ["--strategy", "flat"]),
                Row("node K'=10", base + ["--strategy", "node", "--sync-every", "10"])]
    return [
        Row("flat", base + ["--strategy", "flat"]),
        Row("node K'=10", base + ["--strategy", "node", "--sync-every", "10"]),
        Row("node K'=50", base + ["--strategy", "node", "--sync-every", "50"]),
        Row(f"node K'=epoch ({per_epoch})", base + ["--strategy", "node", "--sync-every", str(per_epoch)]),
        Row("flat 2x2", base + ["--strategy", "flat"], sizes=[2, 2]),
        Row("hierarchical 2x2", base + ["--strategy", "hierarchical"], sizes=[2, 2]),
    ]


def fixed_traffic(cluster: Cluster, model: str, work: Path, tag: str, extra: list, timeout: float) -> dict:
    """The bytes a run puts on host 1's link besides its strategy's exchanges: a flat run of
    ONE step (start-up, the launcher's control traffic, the speed agreement, one evaluation)
    minus that step's counted bytes."""
    row = Row("fixed", ["--model", model, "--balance", "none", *MODEL_ARGV.get(model, []), *extra,
                        "--epochs", "1", "--max-steps", "1"])
    rec = run_row(cluster, row, work, tag, timeout)
    fixed = kernel_tx(rec) - counted_bytes(rec) if rec["epochs"] else math.nan
    return {"fixed_tx": fixed, "record": rec}


def summarize_node(runs: list[dict], fixed: float, steps: int) -> tuple[list, dict]:
    labels = list(dict.fromkeys(r["label"] for r in runs))
    by = {lab: [r for r in runs if r["label"] == lab and r["epochs"]] for lab in labels}
    flat = by.get("flat", [])
    flat_oa = common.median([final_oa(r) for r in flat]) if flat else math.nan
    target = flat_oa - 0.005
    flat_bytes = common.median([kernel_tx(r) / len(r["epochs"]) for r in flat]) if flat else math.nan
    flat_tta = common.median([time_to(r, target) for r in flat]) if flat else math.nan
    rows, summary = [], {"flat_final_oa": flat_oa, "target_oa": target, "fixed_tx": fixed}
    for lab in labels:
        rs = by[lab]
        if not rs:
            rows.append([lab] + ["failed"] * 10)
            continue
        n_ep = len(rs[0]["epochs"])
        k_ep = [kernel_tx(r) / n_ep for r in rs]
        c_ep = [counted_bytes(r) / n_ep for r in rs]
        calls = [counted_calls(r) / n_ep for r in rs]
        k_vs_c = [kernel_tx(r) / counted_bytes(r) if counted_bytes(r) else math.nan for r in rs]
        k_vs_pred = [kernel_tx(r) / (counted_bytes(r) + fixed) if math.isfinite(fixed) else math.nan for r in rs]
        tta = [time_to(r, target) for r in rs]
        reached = sum(math.isfinite(t) for t in tta)
        summary[lab] = {"kernel_tx_per_epoch": common.median(k_ep), "counted_per_epoch": common.median(c_ep),
                        "epoch_s": common.median([epoch_s(r) for r in rs]),
                        "final_oa": common.median([final_oa(r) for r in rs]),
                        "tta_s": common.median(tta), "reached": reached, "runs": len(rs)}
        rows.append([lab, "x".join(map(str, rs[0]["sizes"])),
                     ms(k_ep, 1e-6, 2), ms(c_ep, 1e-6, 2), ms(calls, 1, 1), ms(k_vs_c, 1, 3), ms(k_vs_pred, 1, 3),
                     ratio_str(flat_bytes, common.median(k_ep), 1) if lab != "flat" else "1",
                     ms([epoch_s(r) for r in rs], 1, 2), f"{fastest_epoch_s(rs):.2f}", ms([final_oa(r) for r in rs], 100, 2),
                     (ms(tta, 1, 1) + (f" ({reached}/{len(rs)} reached)" if reached < len(rs) else ""))
                     if reached else f"not reached (0/{len(rs)})",
                     ratio_str(common.median(tta), flat_tta) if lab != "flat" else "1"])
    return rows, summary


NODE_HEADERS = ["row", "hosts x ranks", "kernel: host 1 tx MB/epoch", "mpidl counted MB/epoch (rank 0, inter + world)",
                "inter-host calls/epoch", "kernel / counted", "kernel / (counted + fixed)", "flat bytes / row bytes",
                "epoch s (median of epochs 2..E)", "fastest epoch s", "final test OA %",
                "time to flat OA - 0.5 (s, training)", "TTA / flat TTA"]


# --------------------------------------------------------------------------------------------
# table 2: peers
# --------------------------------------------------------------------------------------------


def peer_rows(model: str, epochs: int, sync: list[int], extra: list) -> list[Row]:
    base = ["--model", model, "--epochs", str(epochs), *extra]
    rows = [Row("mpidl flat", base + ["--balance", "none", "--strategy", "flat", *MODEL_ARGV.get(model, [])],
                group="flat"),
            Row("PyTorch DDP", base + ["--peer", "ddp"], kind="torch", group="flat")]
    for k in sync:
        rows += [Row(f"mpidl node K'={k}", base + ["--balance", "none", "--strategy", "node", "--sync-every", str(k),
                                                    *MODEL_ARGV.get(model, [])], group=f"K'={k}"),
                 Row(f"PyTorch post-local SGD K'={k}", base + ["--peer", "postlocal", "--sync-every", str(k)],
                     kind="torch", group=f"K'={k}")]
    return rows


def summarize_peers(runs: list[dict], samples: int) -> tuple[list, dict]:
    labels = list(dict.fromkeys(r["label"] for r in runs))
    by = {lab: [r for r in runs if r["label"] == lab and r["epochs"]] for lab in labels}
    flat = by.get("mpidl flat", [])
    target = common.median([final_oa(r) for r in flat]) - 0.005 if flat else math.nan
    rows, summary = [], {"target_oa": target}
    groups = list(dict.fromkeys(lab.split("K'=")[-1] if "K'=" in lab else "flat" for lab in labels))
    for lab in labels:
        rs = by[lab]
        if not rs:
            rows.append([lab] + ["failed"] * 8)
            continue
        n_ep = len(rs[0]["epochs"])
        thr = [samples / epoch_s(r) for r in rs]
        tta = [time_to(r, target) for r in rs]
        reached = sum(math.isfinite(t) for t in tta)
        summary[lab] = {"throughput": common.median(thr), "epoch_s": common.median([epoch_s(r) for r in rs]),
                        "final_oa": common.median([final_oa(r) for r in rs]), "tta_s": common.median(tta),
                        "kernel_tx_per_epoch": common.median([kernel_tx(r) / n_ep for r in rs]),
                        "loss_epoch1": rs[0]["epochs"][0]["loss"]}
        summary[lab]["fastest_epoch_s"] = fastest_epoch_s(rs)
        rows.append([lab, ms([epoch_s(r) for r in rs], 1, 2), f"{fastest_epoch_s(rs):.2f}", ms(thr, 1, 0),
                     ms([kernel_tx(r) / n_ep for r in rs], 1e-6, 2), ms([final_oa(r) for r in rs], 100, 2),
                     f"{rs[0]['epochs'][0]['loss']:.6f}",
                     (ms(tta, 1, 1) + (f" ({reached}/{len(rs)})" if reached < len(rs) else "")) if reached
                     else f"not reached (0/{len(rs)})"])
    pairs = []
    for lab in labels:
        if lab.startswith("mpidl") and lab in summary:
            peer = "PyTorch DDP" if lab == "mpidl flat" else "PyTorch post-local SGD " + lab.split(" ")[-1]
            if peer in summary:
                a, b = summary[lab], summary[peer]
                # per-round ratios: the two runs of one round ran side by side
                ratios = []
                for r in range(max(x["round"] for x in runs) + 1):
                    ma = [x for x in by[lab] if x["round"] == r]
                    pa = [x for x in by[peer] if x["round"] == r]
                    if ma and pa:
                        ratios.append(epoch_s(pa[0]) / epoch_s(ma[0]))
                pairs.append([f"{lab} / {peer}", ms(ratios, 1, 2),
                              ratio_str(b["fastest_epoch_s"], a["fastest_epoch_s"]), ratio_str(b["tta_s"], a["tta_s"]),
                              ratio_str(a["kernel_tx_per_epoch"], b["kernel_tx_per_epoch"], 3)])
                summary[f"{lab} vs {peer}"] = {"throughput_ratio_per_round": ratios}
    del groups
    return rows, {"pairs": pairs, **summary}


PEER_HEADERS = ["row", "epoch s (median of epochs 2..E)", "fastest epoch s", "samples/s (median)", "kernel: host 1 tx MB/epoch",
                "final test OA %", "epoch-1 training loss (round 1)", "time to mpidl flat OA - 0.5 (s, training)"]
PAIR_HEADERS = ["mpidl / peer", "throughput mpidl/peer (per round, median [min-max])",
                "throughput mpidl/peer (fastest epochs)", "TTA peer/mpidl",
                "bytes mpidl/peer"]


# --------------------------------------------------------------------------------------------
# table 3: overlap
# --------------------------------------------------------------------------------------------


def overlap_rows(model: str, epochs: int, extra: list, env: dict) -> list[Row]:
    base = ["--model", model, "--epochs", str(epochs), "--balance", "none", "--strategy", "flat",
            *MODEL_ARGV.get(model, []), *extra]
    rows = [Row("blocking", base), Row("--overlap", base + ["--overlap"])]
    if env:
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        rows += [Row(f"blocking, {shown}", base, env=env), Row(f"--overlap, {shown}", base + ["--overlap"], env=env)]
    return rows


def summarize_overlap(runs: list[dict]) -> tuple[list, dict]:
    """Exposed communication per epoch, two ways: epoch time - the run's own compute time
    (rank's ``comp_s``, slowest rank), and epoch time - the BLOCKING row's compute time (the
    compute with nothing to overlap; an overlapped backward may itself take longer, and that
    is exposed cost too). Each row is compared with the blocking row of its environment."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    by = {lab: [r for r in runs if r["label"] == lab and r["epochs"]] for lab in labels}

    def timed(r):
        return r["epochs"][1:] if len(r["epochs"]) > 1 else r["epochs"]

    def comp(r):
        return statistics.median(max(e.get("comp_s", [0])) for e in timed(r))

    rows, summary = [], {}
    for lab in labels:
        rs = by[lab]
        if not rs:
            rows.append([lab] + ["failed"] * 6)
            continue
        blocking = by.get(lab.replace("--overlap", "blocking"), [])
        base_comp = common.median([comp(r) for r in blocking])
        base_exposed = common.median([epoch_s(r) - comp(r) for r in blocking])
        own = [epoch_s(r) - comp(r) for r in rs]
        vs_base = [epoch_s(r) - base_comp for r in rs]
        summary[lab] = {"epoch_s": common.median([epoch_s(r) for r in rs]), "exposed_own_s": common.median(own),
                        "exposed_vs_blocking_compute_s": common.median(vs_base),
                        "fraction": common.median(vs_base) / base_exposed if base_exposed else math.nan}
        rows.append([lab, ms([epoch_s(r) for r in rs], 1, 3), ms([comp(r) for r in rs], 1, 3), ms(own, 1, 3),
                     ms(vs_base, 1, 3), ratio_str(common.median(vs_base), base_exposed)])
    return rows, summary


OVERLAP_HEADERS = ["row", "epoch s", "compute s/epoch (slowest rank)", "epoch - own compute (s)",
                   "exposed = epoch - blocking's compute (s)", "exposed / blocking's exposed"]


# --------------------------------------------------------------------------------------------
# table 4: HDP on real CPU shares
# --------------------------------------------------------------------------------------------


def hdp_rows(epochs: int, sweep: list[str], extra: list) -> list[Row]:
    base = ["--model", "hsicnn", "--epochs", str(epochs), "--strategy", "flat", *extra]
    rows = [Row("equal split", base + ["--balance", "none"]),
            Row("--speeds auto", base + ["--speeds", "auto"]),
            Row("--speeds auto --rebalance", base + ["--speeds", "auto", "--rebalance"]),
            Row("--speeds auto, uniform weighting", base + ["--speeds", "auto", "--weighting", "uniform"])]
    rows += [Row(f"fixed {s.replace(',', ':')}", base + ["--speeds", s], group="sweep") for s in sweep]
    return rows


def summarize_hdp(runs: list[dict]) -> tuple[list, dict]:
    labels = list(dict.fromkeys(r["label"] for r in runs))
    by = {lab: [r for r in runs if r["label"] == lab and r["epochs"]] for lab in labels}
    fixed = {lab: common.median([epoch_s(r) for r in by[lab]]) for lab in labels if lab.startswith("fixed") and by[lab]}
    best_lab = min(fixed, key=fixed.get) if fixed else None
    best = fixed.get(best_lab, math.nan) if best_lab else math.nan
    rows, summary = [], {"best_fixed": best_lab, "best_fixed_epoch_s": best}
    for lab in labels:
        rs = by[lab]
        if not rs:
            rows.append([lab] + ["failed"] * 7)
            continue
        splits = sorted({":".join(map(str, r["epochs"][-1].get("batch_sizes", []))) for r in rs})
        moves = ", ".join(str(len(r["rebalances"])) if "rebalances" in r else "?" for r in rs)
        e = [epoch_s(r) for r in rs]
        # The machine's speed drifts between rounds; within one round the row and the best
        # split ran minutes apart, so their ratio there is the steadier figure.
        best_in = {r["round"]: epoch_s(r) for r in by.get(best_lab, [])}
        same_round = [epoch_s(r) / best_in[r["round"]] for r in rs if r["round"] in best_in]
        summary[lab] = {"epoch_s": common.median(e), "final_oa": common.median([final_oa(r) for r in rs]),
                        "splits": splits, "per_round_ratio": same_round}
        rows.append([lab, ", ".join(splits), moves, ms(e, 1, 2), ratio_str(common.median(e), best),
                     ms(same_round, 1, 2) if same_round else "n/a",
                     ms([final_oa(r) for r in rs], 100, 2), str(len(rs))])
    return rows, summary


def run_with_share_change(cluster: Cluster, row: Row, work: Path, tag: str, timeout: float, after_epoch: int,
                          share: str) -> dict:
    """``row`` with host 2's CPU share set to ``share`` as soon as epoch ``after_epoch`` is in
    the metrics file (so from the start of the next epoch); the wall time of the change is kept."""
    import subprocess

    def during(cmd, metrics, log):
        load = "%.1f %.1f %.1f" % os.getloadavg()
        before = cluster.counters()
        start = time.perf_counter()
        changed = None
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env=common.bench_env(), start_new_session=True)
            while proc.poll() is None and time.perf_counter() - start < timeout:
                if changed is None and len(read_epochs(metrics)[0]) >= after_epoch:
                    cluster.set_cpu(2, share)
                    changed = time.time()
                time.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            code = proc.wait()
        return {"code": code, "wall_s": time.perf_counter() - start, "load": load, "changed_at": changed,
                "kernel": Cluster.delta(before, cluster.counters()), "time": time.strftime("%H:%M:%S", time.gmtime())}

    return run_row(cluster, row, work, tag, timeout, during)


def critical_steps(timing_dir: Path, ranks: int = 2) -> list[list[float]]:
    """Per epoch, the per-step compute of the slowest rank: ``max_i step_comp_s[i][t]``."""
    per_rank = []
    for r in range(ranks):
        recs = [json.loads(line) for line in (timing_dir / f"rank{r}.jsonl").read_text().splitlines() if line.strip()]
        per_rank.append([rec["step_comp_s"] for rec in recs if rec.get("event") == "epoch"])
    return [[max(vals) for vals in zip(*steps)] for steps in zip(*per_rank)]


def share_change(cluster: Cluster, args, work: Path) -> tuple[list[str], dict]:
    """Host 2's share 1.0 -> ``args.change`` after epoch 2 of a ``--speeds auto --rebalance``
    run; the best fixed split at the new shares by a sweep; steps until the rebalanced run's
    slowest-rank compute per step (median of 10) is within 5 % of the best split's."""
    rate = args.rates[-1]
    epochs = max(args.epochs, 5)
    base = ["--model", "hsicnn", "--strategy", "flat", *args.extra]
    sweep = [f"fixed {s.replace(',', ':')}" for s in args.change_sweep]
    cluster.start(rate=rate, cpus=f"1.0,{args.change}")
    sweep_runs = []
    for r in range(args.rounds):
        for s in args.change_sweep:
            tdir = work / f"change_sweep_{s.replace(',', '_')}_r{r}"
            row = Row(f"fixed {s.replace(',', ':')}", base + ["--epochs", "3", "--speeds", s, "--timing-dir", str(tdir)])
            rec = run_row(cluster, row, work, f"change_sweep_{s.replace(',', '_')}_r{r}", args.timeout)
            rec["round"], rec["critical"] = r, critical_steps(tdir) if rec["epochs"] else []
            sweep_runs.append(rec)
            print(f"  [{rec['time']}] 1.0/{args.change} {row.label}: epoch {epoch_s(rec):.2f} s", flush=True)
    fixed = {lab: common.median([epoch_s(x) for x in sweep_runs if x["label"] == lab and x["epochs"]]) for lab in sweep}
    best = min(fixed, key=fixed.get)
    best_step = common.median([c for x in sweep_runs if x["label"] == best for ep in x["critical"][1:] for c in ep])
    cluster.stop()
    cluster.start(rate=rate, cpus="1.0,1.0")
    change_runs = []
    for r in range(args.rounds):
        tdir = work / f"change_rebalance_r{r}"
        row = Row("--speeds auto --rebalance, share change", base + ["--epochs", str(epochs), "--speeds", "auto",
                                                                     "--rebalance", "--timing-dir", str(tdir)])
        rec = run_with_share_change(cluster, row, work, f"change_rebalance_r{r}", args.timeout, 2, args.change)
        cluster.set_cpu(2, "1.0")
        rec["round"], rec["critical"] = r, critical_steps(tdir) if rec["epochs"] else []
        after = [c for ep in rec["critical"][2:] for c in ep]
        back = None
        for t in range(len(after) - 9):
            if statistics.median(after[t:t + 10]) <= 1.05 * best_step:
                back = t
                break
        rec["steps_back"] = back
        change_runs.append(rec)
        print(f"  [{rec['time']}] share change round {r + 1}: splits "
              f"{[e.get('batch_sizes') for e in rec['epochs']]}, back within 5 % after {back} steps", flush=True)
    change = {"sweep_runs": sweep_runs, "change_runs": change_runs, "best": best, "best_epoch_s": fixed[best],
              "best_step_s": best_step, "sweep": sweep}
    return change_section(rate, args.change, change), change


def change_section(rate: str, share: str, change: dict) -> list[str]:
    """The Markdown of the share-change experiment (a live run's or its JSON's)."""
    sweep_runs, change_runs, best = change["sweep_runs"], change["change_runs"], change["best"]
    sweep = change.get("sweep") or list(dict.fromkeys(x["label"] for x in sweep_runs))
    best_epoch, best_step = change["best_epoch_s"], change["best_step_s"]
    steps_per = change_runs[0]["epochs"][0]["step"] if change_runs and change_runs[0]["epochs"] else 0
    rows = [[lab, ms([epoch_s(x) for x in sweep_runs if x["label"] == lab and x["epochs"]], 1, 2),
             ms([1e3 * common.median([c for ep in x["critical"][1:] for c in ep]) for x in sweep_runs
                 if x["label"] == lab and x["critical"]], 1, 1)] for lab in sweep]
    change_rows = []
    for rec in change_runs:
        change_rows.append([rec["round"] + 1, " -> ".join(":".join(map(str, e.get("batch_sizes", []))) for e in rec["epochs"]),
                            " / ".join(f"{e['time_s']:.2f}" for e in rec["epochs"]),
                            ", ".join(f"{e['time_s'] / best_epoch:.2f}" for e in rec["epochs"][2:]),
                            "not within 5 %" if rec["steps_back"] is None else str(rec["steps_back"]),
                            ", ".join(f"{m['step']}: {':'.join(map(str, m['new']))} (gain {100 * m['gain']:.0f} %, "
                                      f"margin {100 * m['margin']:.0f} %)" for m in rec.get("rebalances", []))
                            if "rebalances" in rec else "not recorded"])
    return [f"## A share lowered mid-run: host 2 1.0 -> {share} after epoch 2 (link {rate})", "",
            load_line(sweep_runs + change_runs) + ".", "",
            f"Best fixed split at 1.0 / {share} (sweep, 3 epochs each, median of epochs 2-3):", "",
            common.md_table(["split", "epoch s", "slowest rank's compute ms/step (median)"], rows), "",
            f"Best: {best} ({best_epoch:.2f} s per epoch, {1e3 * best_step:.1f} ms slowest-rank compute per step). "
            f"`--speeds auto --rebalance` runs ({steps_per} steps per epoch; re-fit every 20 steps; "
            f"the change lands at the start of epoch 3, step {2 * steps_per + 1}):", "",
            common.md_table(["round", "split per epoch", "epoch s per epoch", "epochs 3.. / best fixed epoch",
                             "steps after the change until the slowest-rank compute (median of 10) <= 1.05 x best's",
                             "moves of the split (step: new split)"],
                            change_rows), "", "Commands:", "", *commands_block(sweep_runs + change_runs)]


HDP_HEADERS = ["row", "split chosen (last epoch, per run)", "moves of the split (per run; ? not recorded)",
               "epoch s (median of epochs 2..E)", "/ best fixed split",
               "/ best fixed split in the same round", "final test OA %", "runs"]


# --------------------------------------------------------------------------------------------
# table 5: the cost model against table 1
# --------------------------------------------------------------------------------------------


def calibrate_link(cluster: Cluster, rate: str, work: Path, timeout: float) -> dict:
    """alpha and beta of the cluster's link at ``rate``: blocking 2-rank Allreduces of 64 KB ..
    4 MB (``benchmarks/cluster_progress.py``'s worker, MPICH defaults), fitted by least squares
    to ``t(n) = 2 alpha + n / beta`` (the cost model's ring formula for 2 nodes)."""
    cluster.start(rate=rate, cpus="none")
    out = work / f"calibrate_{rate}.json"
    out.unlink(missing_ok=True)
    sizes = "0.0625,0.25,1,2,4"
    cmd = cluster.mpiexec([1, 1], [common.PYTHON, str(common.BENCH_DIR / "cluster_progress.py"), "--sizes", sizes,
                                   "--reps", "6", "--worker", str(out)], THREADS_ENV)
    rec = run_measured(cluster, cmd, work / f"calibrate_{rate}.log", timeout)
    data = json.loads(out.read_text())
    points = [(float(mb) * 1e6, statistics.median(r["block_s"] for r in per_rank))
              for mb, per_rank in data["sizes"].items()]
    n = [p[0] for p in points]
    t = [p[1] for p in points]
    mean_n, mean_t = statistics.fmean(n), statistics.fmean(t)
    slope = sum((a - mean_n) * (b - mean_t) for a, b in zip(n, t)) / sum((a - mean_n) ** 2 for a in n)
    intercept = mean_t - slope * mean_n
    return {"rate": rate, "points": points, "alpha_s": max(intercept / 2, 1e-6), "beta_Bps": 1 / slope,
            "command": common.shown(cmd).replace(str(work) + "/", ""), "load": rec["load"]}


def plan_predict(model: str, sizes: list, step_s: float, link: dict, sync: list[int], steps: int,
                 samples: int, shape: str, classes: int) -> dict:
    """Step seconds per strategy from ``python -m mpidl.plan`` (ring allreduce) with the
    measured per-step compute ``step_s`` and link."""
    import subprocess

    ranks = sizes[0]
    cmd = [common.PYTHON, "-m", "mpidl.plan", "--model", model, "--input-shape", shape, "--classes", str(classes),
           "--step-time", f"{step_s:.6f}", "--local-batch", str(64 // sum(sizes)), "--samples", str(samples),
           "--steps", str(steps), "--nodes", "2", "--ranks-per-node", str(ranks), "--algorithm", "ring",
           "--inter", f"{link['alpha_s'] * 1e6:.1f},{link['beta_Bps'] * 8 / 1e9:.4f}",
           "--sync-every", ",".join(map(str, sync))]
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT, env=common.bench_env(),
                          timeout=120).stdout
    line = next(ln for ln in text.splitlines() if ln.split()[:3] == ["2", str(2 * ranks), str(steps)])
    # "nodes ranks steps  step / eff  step / eff ..."; the step ms is the last number before each "/"
    values = [float(piece.split()[-1]) for piece in line.split("/")[:-1]]
    names = ["flat", "hierarchical"] + [f"node K'={k}" for k in sync]
    return {"step_ms": dict(zip(names, values)), "command": common.shown(cmd)}


def plan_table(args, work: Path, cluster: Cluster) -> tuple[list, dict]:
    """Every row of ``cluster_node.json`` (table 1): its measured median epoch against the cost
    model's, the model given the row's own measured compute per step and the link's measured
    alpha and beta."""
    node = json.loads((args.out / "cluster_node.json").read_text())
    links = {}
    rows, out = [], {"links": links, "rows": []}
    for entry in node["tables"]:
        rate = entry["rate"]
        if rate not in links:
            links[rate] = calibrate_link(cluster, rate, work, args.timeout)
            print(f"link {rate}: alpha {links[rate]['alpha_s'] * 1e6:.0f} us, "
                  f"beta {links[rate]['beta_Bps'] * 8 / 1e6:.1f} Mbit/s", flush=True)
        runs = [r for r in entry["runs"] if r["epochs"] and r["kind"] == "mpidl"]
        for label in dict.fromkeys(r["label"] for r in runs):
            rs = [r for r in runs if r["label"] == label]
            steps = rs[0]["epochs"][0]["step"]
            comp = [statistics.median(max(e["comp_s"]) / steps for e in r["epochs"][1:] or r["epochs"]) for r in rs]
            sync = 10 if "K'=10" in label else 50 if "K'=50" in label else steps
            pred = plan_predict(entry["model"], rs[0]["sizes"], statistics.median(comp), links[rate], [sync], steps,
                                steps * 64, "32,7,7", 4)
            key = "flat" if label.startswith("flat") else "hierarchical" if label.startswith("hier") else f"node K'={sync}"
            predicted = pred["step_ms"][key] * steps / 1e3
            measured = common.median([epoch_s(r) for r in rs])
            out["rows"].append({"model": entry["model"], "rate": rate, "row": label, "predicted_epoch_s": predicted,
                                "measured_epoch_s": measured, "compute_step_s": statistics.median(comp),
                                "plan_command": pred["command"]})
            rows.append([entry["model"], rate, label, f"{1e3 * statistics.median(comp):.1f}", f"{predicted:.2f}",
                         ms([epoch_s(r) for r in rs], 1, 2), ratio_str(predicted, measured),
                         "yes" if abs(predicted / measured - 1) <= 0.15 else "**no**"])
    return rows, out


PLAN_HEADERS = ["model", "link", "row", "measured compute ms/step (slowest rank)", "predicted epoch s",
                "measured epoch s", "predicted / measured", "within 15 %"]


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=TABLES)
    p.add_argument("--models", default="hsicnn")
    p.add_argument("--rates", default="100mbit,1gbit", help="link rates, comma-separated (none: unshaped)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--sync-every", default="10,50", help="K' values of the peers table")
    p.add_argument("--shares", default="0.5", help="host 2's CPU share(s) of the hdp table (host 1: 1.0)")
    p.add_argument("--sweep", default="32,32,36,28,40,24,43,21,46,18,48,16",
                   help="fixed splits of the hdp table, pairs b1,b2 (flattened)")
    p.add_argument("--change", default="", help="hdp: host 2's share after epoch 2 of a rebalanced run (e.g. 0.33)")
    p.add_argument("--change-sweep", default="40,24,44,20,48,16,52,12,56,8",
                   help="hdp --change: fixed splits at the new shares, pairs b1,b2 (flattened)")
    p.add_argument("--skip-shares", action="store_true", help="hdp: only the --change experiment")
    p.add_argument("--env", default="", help="overlap: also both rows with this environment (K=V,K=V)")
    p.add_argument("--extra", default="", help="more mpidl.train options for every row (e.g. '--data X')")
    p.add_argument("--tag", default="", help="a suffix of the result files (cluster_TABLE_TAG.md/.json)")
    p.add_argument("--only", default="", help="run only the rows whose labels are listed (comma-separated)")
    p.add_argument("--name", default="claims", help="the cluster's name (jobs/cluster.sh --name)")
    p.add_argument("--quick", action="store_true", help="seconds: 1 rate, 1 round, 2 epochs of 4 steps")
    p.add_argument("--keep-cluster", action="store_true", help="leave the cluster up at the end")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--from-json", type=Path, default=None,
                   help="rewrite the Markdown from an earlier run's JSON (no cluster, no runs)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.rates = [r for r in args.rates.split(",") if r]
    args.sync = [int(k) for k in args.sync_every.split(",") if k]
    args.extra = args.extra.split()
    args.env = dict(kv.split("=", 1) for kv in args.env.split(",") if kv)
    flat = [s for s in args.sweep.split(",") if s]
    args.sweep = [f"{flat[i]},{flat[i + 1]}" for i in range(0, len(flat) - 1, 2)]
    args.shares = [s for s in args.shares.split(",") if s]
    flat_change = [s for s in args.change_sweep.split(",") if s]
    args.change_sweep = [f"{flat_change[i]},{flat_change[i + 1]}" for i in range(0, len(flat_change) - 1, 2)]
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.quick:
        args.rates, args.rounds, args.epochs = args.rates[:1], 1, 2
        args.extra += ["--max-steps", "8"]
        args.sync, args.sweep = args.sync[:1], args.sweep[:1]
    return args


def steps_per_epoch(extra: list, batch: int = 64) -> int:
    from mpidl import data as mdata

    if "--data" in extra:
        n = mdata.load_splits(extra[extra.index("--data") + 1])[0].num_samples
    else:
        n = mdata.synthetic_splits(seed=0)[0].num_samples
    if "--batch-size" in extra:
        batch = int(extra[extra.index("--batch-size") + 1])
    return math.ceil(n / batch)


def main(argv=None) -> int:
    args = parse_args(argv)
    cluster = Cluster(args.name)
    suffix = "_quick" if args.quick else ""
    per_epoch = steps_per_epoch(args.extra)
    n_train = per_epoch * 64  # exact for the default data (2048 = 32 x 64)
    if args.from_json is not None:
        return rewrite(args, json.loads(args.from_json.read_text()), n_train, per_epoch, suffix)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"mpidl-cluster-{args.table}-"))
    work.mkdir(parents=True, exist_ok=True)
    info = common.machine_info()
    argv_shown = "python benchmarks/cluster_claims.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"argv": argv_shown, "machine": info, "tables": []}
    body = []
    try:
        if args.table in ("node", "peers", "overlap"):
            for model in args.models:
                for rate in args.rates:
                    cluster.start(rate=rate, cpus="none")
                    print(f"{args.table} {model} @ {rate}: cluster {args.name} up", flush=True)
                    tag = f"{args.table}_{model}_{rate}"
                    entry = {"table": args.table, "model": model, "rate": rate, "cpu": "1.0/1.0 (own cores)",
                             "status": cluster.status()}
                    if args.table == "node":
                        fx = fixed_traffic(cluster, model, work, f"{tag}_fixed", args.extra, args.timeout)
                        runs = run_rounds(cluster, node_rows(model, args.epochs, per_epoch, args.quick, args.extra),
                                          args.rounds, work, tag, args.timeout, args.only)
                        table, summary = summarize_node(runs, fx["fixed_tx"], per_epoch)
                        entry.update(runs=runs, fixed=fx, summary=summary)
                        body += node_section(model, rate, table, summary, fx, runs, per_epoch)
                    elif args.table == "peers":
                        runs = run_rounds(cluster, peer_rows(model, args.epochs, args.sync, args.extra),
                                          args.rounds, work, tag, args.timeout, args.only)
                        table, summary = summarize_peers(runs, n_train)
                        entry.update(runs=runs, summary=summary)
                        body += peers_section(model, rate, table, summary, runs)
                    else:
                        runs = run_rounds(cluster, overlap_rows(model, args.epochs, args.extra, args.env), args.rounds, work,
                                          tag, args.timeout, args.only)
                        table, summary = summarize_overlap(runs)
                        entry.update(runs=runs, summary=summary)
                        body += generic_section(f"{model}, {rate}", OVERLAP_HEADERS, table, runs)
                    results["tables"].append(entry)
                    save(args, results, body, suffix, info, argv_shown)
        elif args.table == "hdp":
            rate = args.rates[-1]
            for share in ([] if args.skip_shares else args.shares):
                cluster.start(rate=rate, cpus=f"1.0,{share}")
                tag = f"hdp_{share}"
                runs = run_rounds(cluster, hdp_rows(args.epochs, args.sweep, args.extra), args.rounds, work, tag,
                                  args.timeout, args.only)
                table, summary = summarize_hdp(runs)
                results["tables"].append({"table": "hdp", "rate": rate, "cpu": f"1.0/{share}", "runs": runs,
                                          "summary": summary, "status": cluster.status()})
                body += generic_section(f"host CPU shares 1.0 / {share}, link {rate}", HDP_HEADERS, table, runs)
                save(args, results, body, suffix, info, argv_shown)
            if args.change:
                change_body, change = share_change(cluster, args, work)
                results["tables"].append({"table": "hdp_change", "rate": rate, "cpu": f"1.0 -> {args.change}", **change})
                body += change_body
        elif args.table == "plan":
            table, summary = plan_table(args, work, cluster)
            results["tables"].append({"table": "plan", **summary})
            link_rows = [[r, f"{1e6 * v['alpha_s']:.0f}", f"{v['beta_Bps'] * 8 / 1e6:.1f}",
                          ", ".join(f"{p[0] / 1e6:g} MB: {1e3 * p[1]:.1f} ms" for p in v["points"])]
                         for r, v in summary["links"].items()]
            body += ["## The links, measured", "", common.md_table(["link", "alpha us", "beta Mbit/s",
                                                                    "blocking 2-rank Allreduce (median)"], link_rows),
                     "", "## Predicted vs measured epoch (table 1's runs)", "", common.md_table(PLAN_HEADERS, table),
                     "", "Commands:", "", common.code_block(
                         [v["command"] for v in summary["links"].values()]
                         + [summary["rows"][0]["plan_command"] + "   # (one per row; its --step-time, --inter, "
                            "--sync-every, --ranks-per-node from the row)"] if summary["rows"] else []), ""]
    except ClusterError as exc:
        print(f"cluster_claims.py: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep_cluster:
            cluster.stop()
    save(args, results, body, suffix, info, argv_shown)
    return 0 if all(r["code"] == 0 for t in results["tables"] for r in t.get("runs", [])) else 1


def rewrite(args, results, n_train, per_epoch, suffix) -> int:
    """The Markdown of an earlier run's JSON, summarised again (same tables as a live run)."""
    body = []
    for entry in results["tables"]:
        runs = entry.get("runs", [])
        if entry["table"] == "node":
            table, summary = summarize_node(runs, entry["fixed"]["fixed_tx"], per_epoch)
            entry["summary"] = summary
            body += node_section(entry["model"], entry["rate"], table, summary, entry["fixed"], runs, per_epoch)
        elif entry["table"] == "peers":
            table, summary = summarize_peers(runs, n_train)
            entry["summary"] = summary
            body += peers_section(entry["model"], entry["rate"], table, summary, runs)
        elif entry["table"] == "overlap":
            table, summary = summarize_overlap(runs)
            body += generic_section(f"{entry['model']}, {entry['rate']}", OVERLAP_HEADERS, table, runs)
        elif entry["table"] == "hdp":
            table, summary = summarize_hdp(runs)
            body += generic_section(f"host CPU shares {entry['cpu']}, link {entry['rate']}", HDP_HEADERS, table, runs)
        elif entry["table"] == "hdp_change":
            body += change_section(entry["rate"], entry["cpu"].split("->")[-1].strip(), entry)
    args.argv_shown = results["argv"]
    save(args, results, body, suffix, results["machine"], results["argv"])
    return 0


def load_line(runs: list[dict]) -> str:
    loads = [float(r["load"].split()[0]) for r in runs]
    return f"load average (1 min) before the runs: median {statistics.median(loads):.1f} [{min(loads):.1f}-{max(loads):.1f}]"


def commands_block(runs: list[dict]) -> list[str]:
    seen = {}
    for r in runs:
        seen.setdefault(r["label"], r["command"])
    return [common.code_block([f"# {lab}\n{cmd}" for lab, cmd in seen.items()]), ""]


def generic_section(title: str, headers: list, table: list, runs: list) -> list[str]:
    return [f"## {title}", "", load_line(runs) + f"; {max(r['round'] for r in runs) + 1} round(s).", "",
            common.md_table(headers, table), "", "Commands (one fresh job per run; METRICS is the run's file):", "",
            *commands_block(runs)]


def node_section(model, rate, table, summary, fx, runs, per_epoch) -> list[str]:
    fixed = fx["fixed_tx"]
    return [f"## {model}, link {rate}", "",
            f"{per_epoch} steps per epoch; host CPU shares 1.0 / 1.0 (a core each); "
            + load_line(runs) + f"; {max(r['round'] for r in runs) + 1} round(s).", "",
            f"Fixed traffic (host 1's tx of a ONE-step run minus its counted bytes: start-up, launcher, "
            f"evaluation): {fixed / 1e6:.3f} MB per run. Flat's final OA {100 * summary['flat_final_oa']:.2f} %, "
            f"so the time-to-accuracy target is {100 * summary['target_oa']:.2f} %.", "",
            common.md_table(NODE_HEADERS, table), "", "Commands (one fresh job per run; METRICS is the run's file):",
            "", *commands_block(runs + [{**fx["record"], "label": "fixed traffic (one step)"}])]


def peers_section(model, rate, table, summary, runs) -> list[str]:
    return [f"## {model}, link {rate}", "", "Host CPU shares 1.0 / 1.0 (a core each); " + load_line(runs)
            + f"; {max(r['round'] for r in runs) + 1} round(s).", "", common.md_table(PEER_HEADERS, table), "",
            common.md_table(PAIR_HEADERS, summary["pairs"]), "",
            "Commands (one fresh job per run):", "", *commands_block(runs)]


def save(args, results, body, suffix, info, argv_shown) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"cluster_{args.table}{'_' + args.tag if args.tag else ''}{suffix}"
    tmp = args.out / f"{stem}.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, args.out / f"{stem}.json")
    intro = __doc__.split("\n\n", 1)[1].strip().replace("``", "`")
    common.write_markdown(args.out / f"{stem}.md", f"Cluster claims: table {args.table}", argv_shown, info,
                          [intro, "", *body])


if __name__ == "__main__":
    sys.exit(main())
