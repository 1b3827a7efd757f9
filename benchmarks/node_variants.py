# python benchmarks/node_variants.py [--quick] [--out benchmarks/results] [--work DIR] [--samson-dir DIR]
"""The node strategy's way of hiding its sync, against the blocking one: accuracy.

``node`` K'=50 (every rank steps on its node's average; the nodes average their parameters
every 50 steps) two ways:

``blocking``      the parameter average waits for the inter-node exchange;
``sync-overlap``  ``--sync-overlap 1``: the average starts at step t and is applied at step
                  t + 1 as ``avg(theta_t) + (theta_now - theta_t)`` (one step of staleness).

(A third, ``--compress bf16`` on the node strategy's parameter sync, is gone: compression now
acts on the hierarchical strategy's gradient exchange only, ``mpidl/distributed/extras/compress.py``.)

2 EMULATED nodes x 2 ranks (MPICH ``-hosts``), every inter-node collective also sleeping its
alpha-beta time on an EMULATED 50 us / 1 Gbit/s link, ``hsicnn`` with SGD (momentum 0.9,
cosine schedule), global batch 32, 3 seeds, on the built-in synthetic scene (3 epochs, lr
0.02) and on the whole converted Samson scene (1805 train / 7220 test, 10 epochs, lr 0.01;
skipped when ``../shared/data/samson`` is absent). Rows: final test OA, mean ± std over the
seeds, and the variant's mean minus the blocking one's. All runs of a scene execute inside
one ``mpiexec`` (``benchmarks/train_batch.py``), seeds outermost. ``--quick`` (CI): 1 seed,
3 steps, the synthetic scene only; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import TrainBatch, md_table, mean_std  # noqa: E402

VARIANTS = {
    "blocking": [],
    "sync-overlap": ["--sync-overlap", "1"],
}
NODE = ["--strategy", "node", "--sync-every", "50"]
LINK = "50,1"
GOAL_POINTS = 0.5


def plan(quick: bool) -> dict:
    if quick:
        return {"seeds": (0,), "synthetic_epochs": 1, "samson_epochs": 1, "max_steps": 3, "samson": False,
                "timeout": 300}
    return {"seeds": (0, 1, 2), "synthetic_epochs": 3, "samson_epochs": 10, "max_steps": None, "samson": True,
            "timeout": 2400}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 3 steps, synthetic only (CI); numbers mean nothing")
    ap.add_argument("--out", type=Path, default=common.RESULTS, help="where node_variants.md goes")
    ap.add_argument("--work", type=Path, default=None, help="raw metrics and logs (default: a temporary folder)")
    ap.add_argument("--samson-dir", type=Path, default=common.SAMSON_DIR, help="folder of Samson.mat / _EndSamson.mat")
    args = ap.parse_args(argv)
    p = plan(args.quick)
    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-node-variants-"))
    info = common.machine_info()
    started = time.perf_counter()

    scenes = [("synthetic scene", [], p["synthetic_epochs"], 0.02)]
    notes = []
    if p["samson"]:
        path, note, _ = common.prepare_samson(work / "samson", None, None, data_dir=args.samson_dir)
        notes.append(note)
        if path is not None:
            scenes.append(("Samson", ["--data", str(path)], p["samson_epochs"], 0.01))

    rows, raw, commands, failed = [], {}, [], []
    for label, data_argv, epochs, lr in scenes:
        tag = "samson" if data_argv else "synthetic"
        warm = data_argv + ["--epochs", "1", "--max-steps", "2", "--batch-size", "32", "--balance", "none"]
        batch = TrainBatch(work, tag, ranks=4, two_nodes=True, warmup=warm)
        names: dict[str, list[str]] = {}
        for seed in p["seeds"]:
            for variant, options in VARIANTS.items():
                name = f"{tag}_{variant}_s{seed}"
                argv = data_argv + ["--model", "hsicnn", "--lr", lr, "--epochs", epochs, "--batch-size", 32,
                                    "--seed", seed, "--balance", "none", "--emulate-link", LINK, *NODE, *options]
                if p["max_steps"]:
                    argv += ["--max-steps", p["max_steps"]]
                batch.add(name, argv)
                names.setdefault(variant, []).append(name)
        results = batch.launch(p["timeout"])
        oa = {}
        for variant, keys in names.items():
            oa[variant] = []
            for key in keys:
                r = results.get(key)
                if r is None or r[2] is None:
                    failed.append(key)
                else:
                    oa[variant].append(r[2]["oa"])
        raw[tag] = {"names": names, "oa": oa}
        base = statistics.mean(oa["blocking"]) if oa["blocking"] else None
        for variant in VARIANTS:
            values = oa[variant]
            delta = (f"{100 * (statistics.mean(values) - base):+.2f}" if values and base is not None
                     and variant != "blocking" else "")
            rows.append([label, variant, " ".join(VARIANTS[variant]) or "(node K'=50)", mean_std(values),
                         ", ".join(f"{100 * v:.2f}" for v in values), delta])
        commands.append(batch.train_command(names["sync-overlap"][0]))

    deltas = [abs(float(r[5])) for r in rows if r[5]]
    verdict = ("met" if deltas and max(deltas) <= GOAL_POINTS else "missed") if not args.quick else "not judged (--quick)"
    seeds = len(p["seeds"])
    body = [
        "## Set-up", "",
        f"- 4 ranks on 2 EMULATED nodes x 2 ranks (MPICH `-hosts`); every inter-node collective also sleeps its "
        f"alpha-beta time on an EMULATED {LINK.split(',')[0]} us / {LINK.split(',')[1]} Gbit/s link "
        f"(`--emulate-link {LINK}`).",
        f"- `hsicnn`, SGD momentum 0.9, cosine schedule, global batch 32, `--strategy node --sync-every 50`; "
        f"synthetic scene {p['synthetic_epochs']} epoch(s) at lr 0.02"
        + (f", Samson {p['samson_epochs']} epochs at lr 0.01" if p["samson"] else "") + f"; {seeds} seed(s).",
        *[f"- {n}" for n in notes],
        "- Final test OA; mean ± std over the seeds; *variant - blocking* is the difference of the means in points.",
        "",
        "## OA", "",
        md_table(["scene", "variant", "options", "OA (%)", "per seed (%)", "variant - blocking (points)"], rows),
        "",
        f"Goal: every variant within {GOAL_POINTS} points of blocking: **{verdict}**.",
        "",
        "## Commands", "",
        "One row's run alone:", "",
        common.code_block(commands),
        "",
        f"Failed runs: {', '.join(failed) if failed else 'none'}. This invocation took "
        f"{(time.perf_counter() - started) / 60:.1f} minutes.",
    ]
    name = "node_variants_quick.md" if args.quick else "node_variants.md"
    me = "python benchmarks/node_variants.py" + (" --quick" if args.quick else "")
    path = common.write_markdown(args.out / name, "The node strategy's sync: blocking vs overlapped",
                                 me, info, body)
    (args.out / name.replace(".md", ".json")).write_text(json.dumps(raw, indent=1))
    print(path, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
