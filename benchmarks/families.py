# python benchmarks/families.py [--quick] [--only FAMILY ...] [--out benchmarks/results] [--work DIR]
"""The model families and the optimizer study under ``flat`` vs ``node`` K'=50 (TNNLS 2023).

2 emulated nodes x 2 ranks (MPICH ``-hosts``, so ``MPI_COMM_TYPE_SHARED`` really splits),
every inter-node collective also sleeping its alpha-beta time on an EMULATED 50 us / 1 Gbit/s
link (``--emulate-link 50,1``), the built-in synthetic scene, 3 seeds:

1. **Families**: each family's model (``FAMILIES``: CNN = ``hsicnn``, LSTM = ``spectral_lstm``,
   ViT = ``vit``, keyed by model name so that a model joins the table once it is in
   ``mpidl.engine.models.MODELS``; one that is not is listed as absent) trained by ``mpidl.train``,
   and the conditional GAN (``mpidl.gan``): epoch time and final quality (test OA; the GAN's
   ``gen_accuracy_mlp``, the share of generated spectra a classifier trained on real spectra
   assigns to their conditioning class, and the class-mean spectral angle).
2. **Optimizers**: every optimizer of ``mpidl.engine.optim.OPTIMIZERS`` on ``hsicnn``, each with its
   own learning rate (``OPTIMIZER_LR``).

Rows: mean ± std over the seeds; ``node - flat`` is the difference of the means. Epoch time is
the mean of each run's epochs but the first. All runs of a kind execute inside one
``mpiexec`` (``benchmarks/train_batch.py``), seeds outermost so that load from other processes
falls on every configuration alike. ``--quick`` (CI): 1 seed, a few steps, CNN + GAN + the
optimizers only; its numbers mean nothing. ``--only LSTM ViT`` runs those families' rows alone
(no optimizer table, no GAN) into ``families_lstm_vit.md``.
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
from common import TrainBatch, md_table, shown  # noqa: E402

#: family -> (model, optimizer, lr, epochs). Each family is trained to its plateau, since the
#: claim compared is the final quality: the LSTM (Adam 1e-2; at 1e-3 it is at 61 % flat after 3
#: epochs) gains 0.7 points from 3 to 6 epochs flat and stays near 85 % after.
FAMILIES = {
    "CNN": ("hsicnn", "sgd", 0.02, 3),
    "LSTM": ("spectral_lstm", "adam", 1e-2, 6),
    "ViT": ("vit", "adam", 1e-3, 3),
}
#: learning rate of each optimizer on hsicnn, global batch 32 (each rule's usual scale)
OPTIMIZER_LR = {"sgd": 0.02, "adam": 1e-3, "adamw": 1e-3, "rmsprop": 1e-3, "adagrad": 1e-2,
                "radam": 1e-3, "nadam": 2e-3, "adamax": 2e-3, "adadelta": 1.0, "lamb": 1e-2}
STRATEGIES = {"flat": ["--strategy", "flat"], "node K'=50": ["--strategy", "node", "--sync-every", "50"]}
LINK = "50,1"


def plan(quick: bool) -> dict:
    if quick:
        return {"seeds": (0,), "epochs": 1, "max_steps": 3, "gan_epochs": 1, "gan_batch": 512,
                "families": ("CNN",), "timeout": 300}
    # The GAN: after 20 epochs its generated spectra are still near chance (30 % seed 0, flat);
    # after 60-150 they are 75-90 %, oscillating as GANs do, so 100 epochs and the seed spread.
    return {"seeds": (0, 1, 2), "epochs": 3, "max_steps": None, "gan_epochs": 100, "gan_batch": 64,
            "families": tuple(FAMILIES), "timeout": 3000}


def mean_std(values, scale=1.0, digits=2) -> str:
    values = [v * scale for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def diff(a, b, scale=1.0, digits=2) -> str:
    a, b = [v for v in a if v is not None], [v for v in b if v is not None]
    if not a or not b:
        return "n/a"
    return f"{scale * (statistics.mean(b) - statistics.mean(a)):+.{digits}f}"


def epoch_time(result) -> float | None:
    if not result or not result[1]:
        return None
    epochs = common.timed_epochs(result[1])
    return statistics.mean(e["time_s"] for e in epochs)


def classifier_argv(model, optimizer, lr, seed, p, epochs=None) -> list:
    epochs = p["epochs"] if p["max_steps"] or epochs is None else epochs
    argv = ["--model", model, "--optimizer", optimizer, "--lr", lr, "--epochs", epochs,
            "--batch-size", 32, "--seed", seed, "--balance", "none", "--emulate-link", LINK]
    return argv + (["--max-steps", p["max_steps"]] if p["max_steps"] else [])


def reuse_finished(*batches) -> dict:
    """Drop from each batch the runs whose metrics file already holds a finished run of the
    same arguments (its ``start`` record's config); return their results."""
    reused = {}
    for batch in batches:
        keep = []
        for run in batch.runs:
            path = Path(run["argv"][run["argv"].index("--metrics") + 1])
            result = None
            if run["name"] != "warmup" and path.is_file():
                try:
                    result = common.load_metrics(path)
                except (OSError, ValueError):
                    result = None
            if result and result[0] and result[2] and _same_arguments(result[0]["config"], run["argv"]):
                reused[run["name"]] = result
            else:
                keep.append(run)
        batch.runs = keep
    return reused


def _same_arguments(config: dict, argv: list) -> bool:
    """Every ``--option value`` of ``argv`` equals the recorded config's value."""
    for i, word in enumerate(argv):
        if not word.startswith("--") or word in ("--metrics", "--quiet"):
            continue
        key = word[2:].replace("-", "_")
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
        recorded = config.get(key)
        if value is True:
            if recorded is not True:
                return False
        elif recorded is None or str(recorded) != str(value) and not _same_number(recorded, value):
            return False
    return True


def _same_number(a, b) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps per run (CI); numbers mean nothing")
    ap.add_argument("--out", type=Path, default=common.RESULTS, help="where families.md goes")
    ap.add_argument("--work", type=Path, default=None, help="raw metrics and logs (default: a temporary folder)")
    ap.add_argument("--mpich-defaults", action="store_true", help="do not set MPICH progress throttling")
    ap.add_argument("--reuse", action="store_true",
                    help="with --work: keep the finished runs of an earlier invocation whose arguments "
                         "are the same, run only the others (default off)")
    ap.add_argument("--only", nargs="+", choices=[f for f in FAMILIES if f != "CNN"], default=None,
                    help="run only these families' rows (no optimizer table, no GAN)")
    args = ap.parse_args(argv)
    p = plan(args.quick)
    if args.only:
        p["families"] = tuple(args.only)
    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-families-"))
    info = common.machine_info()
    started = time.perf_counter()
    from mpidl.engine.models import MODELS
    from mpidl.engine.optim import OPTIMIZERS

    throttle = not args.mpich_defaults
    warm = ["--epochs", "1", "--max-steps", "2", "--batch-size", "32", "--balance", "none"]
    cls = TrainBatch(work, "classifiers", ranks=4, two_nodes=True, throttle=throttle, warmup=warm)
    gan = TrainBatch(work, "gan", ranks=4, two_nodes=True, throttle=throttle)
    runs: dict = {}  # (kind, key, strategy) -> [run names]
    absent = []
    families = [f for f in p["families"] if FAMILIES[f][0] in MODELS]
    absent = [f"{f} (`{FAMILIES[f][0]}`)" for f in FAMILIES if FAMILIES[f][0] not in MODELS]
    for seed in p["seeds"]:
        for strategy, options in STRATEGIES.items():
            tag = "flat" if strategy == "flat" else "node"
            for family in families:
                model, optimizer, lr, epochs = FAMILIES[family]
                if model == "hsicnn" and optimizer in OPTIMIZERS and epochs == p["epochs"]:
                    continue  # the same runs as the optimizer table's row
                name = f"{model}_{optimizer}_{tag}_s{seed}"
                cls.add(name, classifier_argv(model, optimizer, lr, seed, p, epochs) + options)
                runs.setdefault(("family", family, strategy), []).append(name)
            for optimizer in OPTIMIZERS if not args.only else ():
                name = f"hsicnn_{optimizer}_{tag}_s{seed}"
                cls.add(name, classifier_argv("hsicnn", optimizer, OPTIMIZER_LR.get(optimizer, 1e-3), seed, p) + options)
                runs.setdefault(("optimizer", optimizer, strategy), []).append(name)
                if optimizer == FAMILIES["CNN"][1] and FAMILIES["CNN"][3] == p["epochs"]:
                    runs.setdefault(("family", "CNN", strategy), []).append(name)
            if args.only:
                continue
            name = f"gan_{tag}_s{seed}"
            gan.add(name, ["--epochs", p["gan_epochs"], "--batch-size", p["gan_batch"], "--seed", seed,
                           "--emulate-link", LINK] + options)
            gan.runs[-1]["module"] = "mpidl.gan"
            runs.setdefault(("family", "GAN", strategy), []).append(name)
    planned = (list(cls.runs), list(gan.runs))  # every row's command, reused or not
    reused = reuse_finished(cls, gan) if args.reuse else {}
    print(f"families: {len(cls.runs) - 1} classifier runs and {len(gan.runs)} GAN runs -> {work}"
          f" ({len(reused)} reused)", flush=True)
    results = dict(reused)
    if len(cls.runs) > 1:
        results.update(cls.launch(p["timeout"]))
    if gan.runs:
        results.update(gan.launch(p["timeout"]))
    results.pop("warmup", None)
    cls.runs, gan.runs = planned
    failed = [n for n, r in results.items() if r is None or r[2] is None]

    def column(kind, key, strategy, metric):
        out = []
        for name in runs.get((kind, key, strategy), []):
            r = results.get(name)
            if r is None or r[2] is None:
                out.append(None)
            elif metric == "time":
                out.append(epoch_time(r))
            else:
                out.append(r[2].get(metric))
        return out

    flat, node = STRATEGIES
    fam_rows = []
    for family in [f for f in p["families"] if f in families or f == "CNN"] + ([] if args.only else ["GAN"]):
        is_gan = family == "GAN"
        metric = "gen_accuracy_mlp" if is_gan else "oa"
        if ("family", family, flat) not in runs:
            continue
        t = {s: column("family", family, s, "time") for s in (flat, node)}
        q = {s: column("family", family, s, metric) for s in (flat, node)}
        row = [family, "cgan (`mpidl.gan`)" if is_gan else FAMILIES[family][0],
               "gen. accuracy (%)" if is_gan else "OA (%)",
               mean_std(t[flat]), mean_std(t[node]), mean_std(q[flat], 100), mean_std(q[node], 100),
               diff(q[flat], q[node], 100)]
        if is_gan:
            sam = {s: column("family", "GAN", s, "sam_deg") for s in (flat, node)}
            row.append(f"SAM {mean_std(sam[flat], digits=2)} / {mean_std(sam[node], digits=2)} deg")
        else:
            row.append("")
        fam_rows.append(row)
    opt_rows = []
    for optimizer in OPTIMIZERS if not args.only else ():
        t = {s: column("optimizer", optimizer, s, "time") for s in (flat, node)}
        q = {s: column("optimizer", optimizer, s, "oa") for s in (flat, node)}
        opt_rows.append([optimizer, f"{OPTIMIZER_LR.get(optimizer, 1e-3):g}", mean_std(t[flat]), mean_std(t[node]),
                         mean_std(q[flat], 100), mean_std(q[node], 100), diff(q[flat], q[node], 100)])

    example = next(r["name"] for r in cls.runs if r["name"] != "warmup" and "_node_" in r["name"])
    commands = [cls.train_command(example)]
    if gan.runs:
        gan_argv = list(gan.runs[-1]["argv"])
        gan_argv[gan_argv.index("--metrics") + 1] = "gan.jsonl"
        commands.append(shown(common.mpiexec(4, [common.PYTHON, "-m", "mpidl.gan", *gan_argv], True)))
    seeds = len(p["seeds"])
    longer = [f"{f} {FAMILIES[f][3]}" for f in families if FAMILIES[f][3] != p["epochs"] and not p["max_steps"]]
    longer = f" ({', '.join(longer)}: trained to its plateau)" if longer else ""
    body = [
        "## Set-up", "",
        f"- 4 ranks on 2 EMULATED nodes x 2 ranks (MPICH `-hosts localhost,127.0.0.1 -ppn 2`); every "
        f"inter-node collective also sleeps its alpha-beta time on an EMULATED {LINK.split(',')[0]} us / "
        f"{LINK.split(',')[1]} Gbit/s link (`--emulate-link {LINK}`).",
        "- The built-in synthetic scene (2048 train / 2048 test 7x7 patches of 32 bands, 4 classes); the GAN "
        "uses its centre-pixel spectra (patch 1).",
        f"- Classifiers: {p['epochs']} epoch(s){longer}, global batch 32 (64 steps per epoch, so node K'=50 "
        f"syncs about once per epoch), cosine schedule, weight decay 5e-4, `--balance none`; "
        f"GAN: {p['gan_epochs']} epoch(s), global batch {p['gan_batch']}, Adam lr 1e-3 betas (0.5, 0.999).",
        f"- {seeds} seed(s) (initial weights and batch order); mean ± std over the seeds; epoch time "
        "excludes each run's first epoch; `node - flat` is the difference of the mean qualities in points.",
        f"- {common.THROTTLE_NOTE if throttle else 'MPICH defaults (no progress throttling).'}",
        "- The machine was shared with other jobs while this ran: times are noisy, compare within a row.",
        "",
        "## Families", "",
        md_table(["family", "model", "quality", "epoch s (flat)", "epoch s (node K'=50)",
                  "quality flat", "quality node K'=50", "node - flat (points)", "also"], fam_rows),
        "",
        ("Not on this branch (no such model in `mpidl.engine.models.MODELS`; they join the table once merged): "
         + ", ".join(absent) + "." if absent else "")
        + (" `--quick` runs the CNN and the GAN only." if args.quick and not args.only else "")
        + (f"`--only {' '.join(args.only)}`: these rows alone; the CNN, GAN and optimizer rows are in "
           "families.md." if args.only else ""),
        "",
    ]
    if gan.runs:
        body += [
            "The GAN's quality is the share of generated spectra (256 per class) that a classifier trained on "
            "the real training spectra (Linear-ReLU-Linear) assigns to their conditioning class (chance 25 %); "
            "SAM is the spectral angle between generated and real class-mean spectra (real train vs test: "
            "about 0.3 deg).",
            "",
        ]
    if opt_rows:
        body += [
            "## Optimizers on hsicnn", "",
            md_table(["optimizer", "lr", "epoch s (flat)", "epoch s (node K'=50)", "OA flat (%)",
                      "OA node K'=50 (%)", "node - flat (points)"], opt_rows),
            "",
        ]
    body += [
        "## Commands", "",
        "One row's run alone" + (" (classifier, GAN)" if gan.runs else "") + ":", "",
        common.code_block(commands),
        "",
        (f"Reused from an earlier invocation with the same arguments (`--reuse`): {len(reused)} of "
         f"{len(results)} runs; the others ran in this one." if reused else ""),
        "",
        f"Failed runs: {', '.join(failed) if failed else 'none'}. This invocation took "
        f"{(time.perf_counter() - started) / 60:.1f} minutes.",
    ]
    name = ("families_quick.md" if args.quick else
            f"families_{'_'.join(f.lower() for f in args.only)}.md" if args.only else "families.md")
    me = ("python benchmarks/families.py" + (" --quick" if args.quick else "")
          + (f" --only {' '.join(args.only)}" if args.only else ""))
    path = common.write_markdown(args.out / name, "Model families and optimizers: flat vs node K'=50",
                                 me, info, body)
    (args.out / name.replace(".md", ".json")).write_text(json.dumps(
        {"runs": {"/".join(k): v for k, v in runs.items()},
         "results": {n: (r[2] if r else None) for n, r in results.items()}}, indent=1, default=str))
    print(path, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
