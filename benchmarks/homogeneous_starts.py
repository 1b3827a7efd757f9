"""Identical ranks must keep the equal split: fresh starts of ``--speeds auto`` next to
``--balance none``.

    python benchmarks/homogeneous_starts.py [--starts 10] [--ranks 4] [--epochs 3] [--json FILE]

Each start is three fresh ``mpiexec`` jobs of ``python -m mpidl.train`` on the built-in scene,
one after another: ``--speeds auto`` (the default), ``--balance none``, and ``--balance none``
again (the control: two runs of one configuration, whose ratio is the machine's own spread).
Printed per start: the split ``--speeds auto`` chose (its last epoch's batch sizes) and the
epoch-time ratios auto / none and control / none (each run's median over its epochs but the
first). At the end: in how many starts the split was equal within one sample, and the
ratios' median [min-max].

The launcher is the one beside this Python (MPICH or Open MPI, with the flags of
``tests/launcher.py``), with nothing else set (no MPICH throttling: a new user's job), so
``~/venv-openmpi/bin/python benchmarks/homogeneous_starts.py`` runs the same check under Open
MPI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIGS = (("auto", ["--speeds", "auto"]), ("none", ["--balance", "none"]),
           ("control", ["--balance", "none"]))


def run_once(ranks: int, epochs: int, extra: list[str], metrics: Path, timeout: float) -> tuple[list[int], float]:
    """One fresh job; returns (last epoch's batch sizes, median epoch time but the first)."""
    cmd = common.launcher.mpiexec(ranks, [common.PYTHON, "-m", "mpidl.train", "--epochs", str(epochs),
                                          "--quiet", "--metrics", str(metrics), *extra])
    code, _ = common.run(cmd, metrics.with_suffix(".log"), timeout, env=common.bench_env(throttle=False))
    if code != 0:
        raise SystemExit(f"{common.shown(cmd)} failed (exit {code}):\n{common.tail(metrics.with_suffix('.log'))}")
    _, epochs_done, _ = common.load_metrics(metrics)
    timed = common.timed_epochs(epochs_done)
    return epochs_done[-1]["batch_sizes"], statistics.median(r["time_s"] for r in timed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=10)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.starts < 1 or args.ranks < 2 or args.epochs < 2:
        p.error("--starts >= 1, --ranks >= 2 and --epochs >= 2 (the first epoch is not timed)")
    flavor = common.launcher.flavor(common.MPIEXEC)
    print(f"{args.starts} starts of {args.ranks} identical ranks under {flavor} ({common.MPIEXEC})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpidl-homogeneous-") as work:
        for k in range(args.starts):
            result = {tag: run_once(args.ranks, args.epochs, extra, Path(work) / f"{tag}_{k}.jsonl", args.timeout)
                      for tag, extra in CONFIGS}
            split = result["auto"][0]
            row = {"split": split, "auto_vs_none": result["auto"][1] / result["none"][1],
                   "control_vs_none": result["control"][1] / result["none"][1]}
            rows.append(row)
            print(f"start {k}: split {split}, auto / none {row['auto_vs_none']:.3f}, "
                  f"control / none {row['control_vs_none']:.3f}", flush=True)
    equal = sum(max(r["split"]) - min(r["split"]) <= 1 for r in rows)
    summary = {"mpi": flavor, "starts": len(rows), "equal": equal, "rows": rows}
    print(f"equal split (within one sample) in {equal} of {len(rows)} starts; auto / none "
          f"{common.med_spread([r['auto_vs_none'] for r in rows], 1, 3)}; control / none "
          f"{common.med_spread([r['control_vs_none'] for r in rows], 1, 3)}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
