"""Read speed of the two layout variants: the patch file and the scene-backed file.

    python benchmarks/read.py [--rounds 5] [--quick]   ->  benchmarks/results/read.md

The scene (Samson when ``../shared/data/samson`` has it, else the built-in synthetic scene) is
converted twice by the project's converter (``--storage patches`` and ``--storage scene``),
into ``/dev/shm`` when it has room. Each measurement is a FRESH process (no warm h5py or page
state inside Python; the OS page cache is warm for both, the files having just been
written) that opens the training split and reads what rank 0 of ``P`` ranks reads in two
epochs: its contiguous slice (``64 / P`` samples) of every global batch of 64 of a random
permutation, in order. The variants alternate round by round (patches, scene, patches, ...),
and each cell is the median [min - max] over the rounds of the time per sample read, for the
first epoch (the scene reader reads its rows from the file) and the second (its rows are in
its row cache; the patch reader reads its patches from the file again). Samples are normalized;
no augmentation (the same cost for both).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PYTHON, RESULTS, ROOT, SAMSON_DIR, bench_env, machine_info, md_table,  # noqa: E402
                    med_spread, write_markdown)


def worker(path: str, ranks: int, epochs: int, batch: int = 64) -> dict:
    import numpy as np  # noqa: PLC0415

    from mpidl.data import open_dataset  # noqa: PLC0415

    t0 = time.perf_counter()
    ds = open_dataset(path, "train")
    open_s = time.perf_counter() - t0
    local = batch // ranks
    out = {"open_s": open_s, "epochs": []}
    for epoch in range(epochs):
        perm = np.random.default_rng([0, epoch]).permutation(ds.num_samples)
        n = 0
        start = time.perf_counter()
        for lo in range(0, ds.num_samples, batch):
            idx = perm[lo:lo + batch][:local]
            ds.read(idx)
            n += idx.size
        out["epochs"].append({"s": time.perf_counter() - start, "samples": n})
    out["rows_read"] = int(getattr(ds, "rows_read", 0))
    out["kind"] = ds.meta.get("kind", "patches")
    return out


def convert(work: Path, quick: bool, samson_dir: Path = SAMSON_DIR) -> tuple[dict, str]:
    cube, ends = samson_dir / "Samson.mat", samson_dir / "_EndSamson.mat"
    files = {}
    if cube.is_file() and ends.is_file() and not quick:
        base = [PYTHON, "-m", "mpidl.data_tools", "hsi", "--cube", str(cube), "--abundances", str(ends),
                "--patch", "7", "--train-fraction", "0.2"]
        what = "Samson (95 x 95 px, 156 bands, patch 7, 20 % of each class for training: 1805 samples)"
    else:
        import numpy as np  # noqa: PLC0415

        from mpidl.data_tools.synthetic import make_scene  # noqa: PLC0415
        scene = make_scene(seed=0)
        np.save(work / "cube.npy", scene.cube)
        np.save(work / "gt.npy", scene.labels + 1)
        base = [PYTHON, "-m", "mpidl.data_tools", "hsi", "--cube", str(work / "cube.npy"), "--labels",
                str(work / "gt.npy"), "--patch", "7", "--train-fraction", "0.5"]
        what = "the built-in synthetic scene (64 x 64 px, 32 bands, patch 7, 50 % for training)"
    for storage in ("patches", "scene"):
        files[storage] = work / f"{storage}.h5"
        subprocess.run(base + ["--storage", storage, "--out", str(files[storage])], check=True,
                       capture_output=True, env=bench_env(), cwd=ROOT, timeout=600)
    return files, what


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="fresh processes per cell and variant (default 5)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts P whose rank-0 share is read (default 1,2,4)")
    p.add_argument("--quick", action="store_true", help="synthetic scene, 1 round: a smoke test")
    p.add_argument("--out", default=str(RESULTS / "read.md"), help="Markdown output (default benchmarks/results/read.md)")
    p.add_argument("--samson-dir", default=str(SAMSON_DIR),
                   help="folder with Samson.mat and _EndSamson.mat (default ../shared/data/samson); "
                        "without them the synthetic scene is used")
    p.add_argument("--worker", nargs=3, metavar=("FILE", "RANKS", "EPOCHS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))))
        return 0
    rounds = 1 if args.quick else args.rounds
    ranks = [int(r) for r in args.ranks.split(",")]
    info = machine_info()
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2**30 else None
    work = Path(tempfile.mkdtemp(prefix="mpidl-read-", dir=base))
    try:
        files, what = convert(work, args.quick, Path(args.samson_dir))
        sizes = {k: v.stat().st_size for k, v in files.items()}
        results = {(k, r): [] for k in files for r in ranks}
        for _ in range(rounds):
            for r in ranks:
                for kind in ("patches", "scene"):  # alternating, fresh processes
                    proc = subprocess.run([PYTHON, __file__, "--worker", str(files[kind]), str(r), "2"],
                                          capture_output=True, text=True, env=bench_env(), cwd=ROOT,
                                          timeout=600, check=True)
                    results[(kind, r)].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    ratios = []
    for r in ranks:
        cells = {}
        for kind in ("patches", "scene"):
            runs = results[(kind, r)]
            per = [[1e3 * e["s"] / e["samples"] for e in run["epochs"]] for run in runs]
            cells[kind] = per
            rows.append([kind, r, runs[0]["epochs"][0]["samples"], med_spread([q[0] for q in per], digits=3),
                         med_spread([q[1] for q in per], digits=3),
                         med_spread([1e3 * run["open_s"] for run in runs], digits=1),
                         runs[0]["rows_read"] if kind == "scene" else "-"])
        for e in (0, 1):
            import statistics  # noqa: PLC0415
            ratios.append((r, e, statistics.median(q[e] for q in cells["scene"])
                           / statistics.median(q[e] for q in cells["patches"])))
    body = [
        f"Data: {what}, converted by `python -m mpidl.data_tools hsi ... --storage patches|scene`.",
        "",
        md_table(["variant", "file size"], [[k, f"{v / 2**20:.1f} MiB"] for k, v in sizes.items()]),
        "",
        f"Rank 0's share of the training split read in shuffled batches ({rounds} fresh processes "
        "per cell, variants alternating; ms per sample, median [min - max]; the machine is shared "
        f"and loaded, load average {info['load_average']} at the start):",
        "",
        md_table(["variant", "ranks P", "samples / epoch", "epoch 1 ms/sample", "epoch 2 ms/sample",
                  "open ms", "padded rows read"], rows),
        "",
        "Scene / patches, ratio of the medians (below 1: the scene-backed file reads faster): "
        + "; ".join(f"P={r} epoch {e + 1}: {q:.2f}" for r, e, q in ratios) + ".",
        "",
        "The scene-backed reader reads whole row chunks the first time a sample needs them and "
        "keeps them (its row cache, 512 MiB by default): for Samson a rank ends up holding the "
        "6.1 MiB padded cube, against 54 MiB for a patch cache of the whole training split.",
    ]
    write_markdown(Path(args.out), "Read speed: patch file vs scene-backed file",
                   "python benchmarks/read.py" + (" --quick" if args.quick else f" --rounds {rounds}")
                   + ("" if Path(args.samson_dir) == SAMSON_DIR else " --samson-dir DIR"),
                   info, body)
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
