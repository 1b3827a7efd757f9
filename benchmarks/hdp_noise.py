"""How precisely an HDP table of ``cluster_claims.py hdp`` can tell 1.03x from 1.00x.

    python benchmarks/hdp_noise.py benchmarks/results/cluster_hdp_s4_05.json [...]

For every row of each table, its per-round ratio ``r_k = epoch_row,k / epoch_best,k`` to the
best fixed split (the fixed row with the smallest median epoch) in round ``k``, then:

- the median of the ``r_k`` with a 95 % bootstrap interval (10,000 resamples of the rounds,
  seeded, percentile interval);
- ``sigma``: the robust spread of ``log r_k`` (1.4826 x its median absolute deviation);
- the rounds a 95 % interval of +-3 % around the median would need: the median of ``n``
  normal values has a standard error of ``1.2533 sigma / sqrt(n)``, so
  ``n = (1.96 * 1.2533 * sigma / log 1.03)^2``.

For ``--speeds auto --rebalance`` also its ratio to the fixed row nearest the split it ended
with, in the same round: how much of its gap is the split it chose and how much the rest.
The fixed rows are the control: the same noise applies to them, and one of them is the best
by construction.

Last, per split (the fixed rows, and the auto row's epochs by the split they ran), the median
per step of each rank's compute, idle wait and exchange (the metrics' ``comp_s``, ``idle_s``,
``comm_s`` over the epoch's steps) and of the whole step: where the step's time goes as the
split moves.
"""
from __future__ import annotations

import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_claims import epoch_s  # noqa: E402

RESAMPLES = 10_000
GOAL = 1.03


def bootstrap_median(values: list[float], seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(RESAMPLES))
    return meds[int(0.025 * RESAMPLES)], meds[int(0.975 * RESAMPLES) - 1]


def robust_sigma(values: list[float]) -> float:
    logs = [math.log(v) for v in values]
    mid = statistics.median(logs)
    return 1.4826 * statistics.median(abs(x - mid) for x in logs)


def rounds_needed(sigma: float, half_width: float = GOAL) -> int:
    return math.ceil((1.96 * 1.2533 * sigma / math.log(half_width)) ** 2)


def split_of(label: str) -> tuple[int, int] | None:
    if not label.startswith("fixed "):
        return None
    a, b = label.split()[1].split(":")
    return int(a), int(b)


def table_lines(table: dict) -> list[str]:
    runs = [r for r in table["runs"] if r.get("epochs")]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    per_round = {lab: {r["round"]: epoch_s(r) for r in runs if r["label"] == lab} for lab in labels}
    fixed = {lab: statistics.median(per_round[lab].values()) for lab in labels if split_of(lab)}
    if not fixed:
        return []
    best = min(fixed, key=fixed.get)
    out = [f"shares {table.get('cpu')}, best fixed split by the medians: {best}",
           "| row | same-round ratio to the best: median [95 % bootstrap] | sigma of log ratio | rounds for +-3 % | rounds |",
           "|---|---|---|---|---|"]
    for lab in labels:
        ratios = [t / per_round[best][k] for k, t in per_round[lab].items() if k in per_round[best]]
        if len(ratios) < 2:
            continue
        lo, hi = bootstrap_median(ratios)
        sigma = robust_sigma(ratios)
        out.append(f"| {lab} | {statistics.median(ratios):.3f} [{lo:.3f}-{hi:.3f}] | {sigma:.3f} | "
                   f"{rounds_needed(sigma) if lab != best else 'n/a'} | {len(ratios)} |")
    for r in (r for r in runs if "--rebalance" in r["label"]):
        end = tuple(r["epochs"][-1].get("batch_sizes", []))
        nearest = min(fixed, key=lambda lab: abs(split_of(lab)[0] - end[0])) if len(end) == 2 else None
        if nearest and r["round"] in per_round[nearest]:
            out.append(f"round {r['round']}: auto ended at {end[0]}:{end[1]}, / {nearest} in its round: "
                       f"{epoch_s(r) / per_round[nearest][r['round']]:.3f}")
    return out


def split_lines(table: dict, min_epochs: int = 4) -> list[str]:
    per_split: dict[str, list[list[float]]] = {}
    ranks = 0
    for r in (r for r in table["runs"] if r.get("epochs")):
        ranks = len(r["epochs"][0]["comp_s"])
        for before, e in zip(r["epochs"], r["epochs"][1:]):
            n = max(e["step"] - before["step"], 1)  # the epoch's steps
            label = ("fixed " if split_of(r["label"]) else "auto ") + ":".join(map(str, e["batch_sizes"]))
            per_split.setdefault(label, []).append(
                [1e3 * x / n for x in (*e["comp_s"], *e["idle_s"], *e["comm_s"], e["time_s"])])
    heads = [f"{q} {i + 1}" for q in ("compute", "idle", "exchange") for i in range(ranks)]
    out = ["", "ms per step (median over epochs 2..E of each epoch's mean):",
           "| split | epochs | " + " | ".join(heads) + " | step |", "|---" * (len(heads) + 3) + "|"]
    for label, rows in sorted(per_split.items(), key=lambda kv: (int(kv[0].split()[1].split(":")[0]), kv[0])):
        if len(rows) >= min_epochs:
            cells = [f"{statistics.median(row[k] for row in rows):.1f}" for k in range(len(rows[0]))]
            out.append(f"| {label} | {len(rows)} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for path in argv:
        print(f"## {path}")
        for table in json.loads(Path(path).read_text())["tables"]:
            if "runs" in table:
                print("\n".join(table_lines(table) + split_lines(table)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
