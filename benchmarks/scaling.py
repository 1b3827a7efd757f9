# python benchmarks/scaling.py [--quick] [--out benchmarks/results] [--ranks 1 2 4]
"""Training throughput (samples/s) with 1, 2 and 4 ranks, for hsicnn and resnet8.

* ``hsicnn`` on the built-in synthetic hyperspectral scene (the default data);
* ``resnet8`` on a synthetic image set of 3x32x32 images (10 classes: a coloured blob whose
  colour and position depend on the class, plus noise), written once into the mpidl HDF5
  layout with :func:`mpidl.data.layout.write_layout`.

For each rank count, one ``mpiexec -n P`` runs the rows of both models one after another
(``benchmarks/train_batch.py``: ``python -m mpidl.train`` runs in one job, after untimed
warm-up runs), global batch 64 split equally (``--balance none``, so no speed probe), flat
strategy. samples/s is the metrics' ``samples_per_s`` (training samples of the epoch / epoch
time, evaluation excluded), median over the timed epochs (all but the first) with [min-max].
Each rank uses cores / ranks BLAS and Numba threads (at least one), as ``mpidl.train`` sets.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

IMAGE_CLASSES = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps per row (CI); numbers mean nothing")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--work", type=Path, default=None, help="raw metrics and logs (default: temporary)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--images", type=int, default=384, help="resnet8 training images")
    p.add_argument("--mpich-defaults", action="store_true", help="do not set MPICH progress throttling")
    args = p.parse_args(argv)
    if min(args.ranks) < 1 or args.epochs < 1 or args.images < 64:
        p.error("--ranks and --epochs must be >= 1, --images >= 64")
    return args


def write_images(path: Path, train: int, test: int, seed: int = 0) -> Path:
    """A small learnable image set in the mpidl layout: class k is a blob of colour k at a
    position that depends on k, on a noisy background."""
    import numpy as np

    from mpidl.data.layout import write_layout

    if path.is_file():
        return path
    rng = np.random.default_rng(seed)
    colours = rng.uniform(0.2, 1.0, size=(IMAGE_CLASSES, 3))
    centres = rng.uniform(8, 24, size=(IMAGE_CLASSES, 2))
    yy, xx = np.mgrid[0:32, 0:32]

    def make(n):
        y = rng.integers(0, IMAGE_CLASSES, size=n)
        x = rng.normal(0.0, 0.3, size=(n, 3, 32, 32)).astype(np.float32)
        for i, k in enumerate(y):
            cy, cx = centres[k] + rng.normal(0, 2, size=2)
            blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * 4.0 ** 2))
            x[i] += colours[k][:, None, None] * blob
        return x, y

    path.parent.mkdir(parents=True, exist_ok=True)
    write_layout(path, {"train": make(train), "test": make(test)}, [f"class{k}" for k in range(IMAGE_CLASSES)],
                 source=f"benchmarks/scaling.py synthetic images (seed {seed})", split_seed=seed)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    quick = args.quick
    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-scaling-"))
    images = write_images(work / "images.h5", 128 if quick else args.images, 64 if quick else 128)
    info = common.machine_info()
    epochs = 1 if quick else args.epochs
    limit = ["--max-steps", "2"] if quick else []
    models = {
        "hsicnn": ([], "the built-in synthetic scene (32x7x7 patches)", 0.05),
        "resnet8": (["--data", str(images)], f"synthetic images 3x32x32, {128 if quick else args.images} train samples", 0.05),
    }
    rows, table, commands = {}, [], []
    # mpidl.train gives each rank cores // ranks-per-node threads; with 1 rank that is all the
    # cores, so the 1-rank case is also measured with 1 thread (the threads setting it would
    # get among several ranks): on small kernels more threads can be slower, not faster.
    variants = [(r, None) for r in args.ranks]
    if 1 in args.ranks:
        variants.insert(args.ranks.index(1) + 1, (1, 1))
    for ranks, threads in variants:
        tag = f"scaling_{ranks}" + (f"_{threads}thread" if threads else "")
        batch = common.TrainBatch(work, tag, ranks=ranks, throttle=not args.mpich_defaults)
        if threads:
            batch.extra_env = {v: str(threads) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                          "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}
        for model, (data, _, lr) in models.items():
            # untimed first: JIT compilation of this model's kernels, caches
            batch.add(f"warmup_{model}", data + ["--model", model, "--epochs", "1", "--max-steps", "2",
                                                 "--balance", "none"])
            batch.add(model, data + ["--model", model, "--epochs", epochs, "--batch-size", 64, "--lr", lr,
                                     "--balance", "none", *limit])
        print(f"scaling: {ranks} rank(s)" + (f", {threads} thread(s)" if threads else ""), flush=True)
        runs = batch.launch(600)
        env_txt = " ".join(f"{k}={v}" for k, v in getattr(batch, "extra_env", {}).items())
        commands.append(f"`{env_txt + ' ' if env_txt else ''}{common.shown(batch.command())}` "
                        f"({batch.seconds:.0f} s, exit {batch.code})")
        for model in models:
            loaded = runs.get(model)
            if loaded is None:
                rows[(model, ranks, threads)] = None
                continue
            epochs_ = common.timed_epochs(loaded[1])
            comp = [max(e["comp_s"]) / e["time_s"] for e in epochs_]
            rows[(model, ranks, threads)] = {"sps": [e["samples_per_s"] for e in epochs_], "comp_share": comp,
                                             "command": batch.train_command(model), "oa": loaded[1][-1]["oa"]}
    for model, (_, desc, _) in models.items():
        ones = [rows[k] for k in rows if k[0] == model and k[1] == min(args.ranks) and rows[k]]
        base_sps = max((common.median(r["sps"]) for r in ones), default=float("nan"))  # the faster 1-rank row
        for ranks, threads in variants:
            r = rows.get((model, ranks, threads))
            label = f"{ranks}" + (f" ({threads} thread)" if threads else
                                   f" ({max(1, info['cores'] // ranks)} thread{'s' if info['cores'] // ranks > 1 else ''} each)")
            if r is None:
                table.append([model, label, "failed", "", "", "", ""])
                continue
            sps = common.median(r["sps"])
            speedup = sps / base_sps
            table.append([model, label, common.med_spread(r["sps"], 1, 0), f"{speedup:.2f}",
                          f"{speedup / (ranks / min(args.ranks)):.2f}", f"{100 * common.median(r['comp_share']):.0f}%",
                          f"{100 * r['oa']:.1f}"])
    body = ["Global batch 64 split equally, flat strategy, SGD; samples/s = training samples of an "
            "epoch / its time (evaluation excluded), median [min-max] over the timed epochs "
            "(all but the first). Speed-up and efficiency against the faster of the two 1-rank rows. "
            f"This machine has {info['cores']} cores: 1 rank runs with {info['cores']} BLAS/Numba "
            "threads, more ranks share the cores (1 thread each), and 4 ranks oversubscribe them, "
            "so the 4-rank row measures overhead, not parallel speed-up. The extra 1-rank row runs "
            "with 1 thread (OMP/OpenBLAS/MKL/Numba_NUM_THREADS=1).", "",
            "- hsicnn: " + models["hsicnn"][1],
            "- resnet8: " + models["resnet8"][1] + " (written with `mpidl.data.layout.write_layout`)", "",
            common.md_table(["model", "ranks", "samples/s", "speed-up", "efficiency",
                             "compute share of epoch (slowest rank)", f"OA % after {epochs} epoch(s)"], table), "",
            "Exact command of a row (resnet8, largest rank count): "
            f"`{rows[('resnet8', max(args.ranks), None)]['command'] if rows.get(('resnet8', max(args.ranks), None)) else 'n/a'}`", "",
            "Batches:", "", *[f"- {c}" for c in commands], "",
            f"Environment: {common.THROTTLE_NOTE if not args.mpich_defaults else 'MPICH defaults.'}"]
    suffix = "_quick" if quick else ""
    common.write_markdown(args.out / f"scaling{suffix}.md", "Scaling: samples/s with 1, 2 and 4 ranks",
                          "python benchmarks/scaling.py" + (" --quick" if quick else ""), info, body)
    figure(args, rows, models, suffix)
    return 1 if any(v is None for v in rows.values()) else 0


def figure(args, rows, models, suffix) -> None:
    fig = common.matplotlib_figure(6, 3.8)
    if fig is None or suffix:
        return
    ax = fig.subplots()
    for model in models:
        ys = [common.median(rows[(model, r, None)]["sps"]) if rows.get((model, r, None)) else float("nan")
              for r in args.ranks]
        ax.plot(args.ranks, ys, marker="o", label=f"{model} (cores // ranks threads)")
        one = rows.get((model, 1, 1))
        if one:
            ax.scatter([1], [common.median(one["sps"])], marker="x", label=f"{model}, 1 rank, 1 thread")
    ax.set(xlabel="ranks", ylabel="training samples/s (median)", title="throughput vs ranks (2-core machine)")
    ax.set_xticks(args.ranks)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "scaling.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
