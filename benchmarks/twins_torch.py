# python benchmarks/twins_torch.py [--data samson.h5] [--models mlp,spectral_lstm,vit] [--epochs 15] [--seeds 0] [--quick]
"""mpidl's mlp, spectral_lstm and vit against PyTorch twins of the same networks.

For every model and seed, two runs on the same data and split:

* mpidl: ``mpiexec -n 4 -launcher fork python -m mpidl.train --data D --model M --epochs E
  --seed S`` (default options: SGD, momentum 0.9, weight decay 5e-4, lr 0.02 with a cosine
  schedule over all steps, global batch 64, balanced weighting), its test OA read from the
  metrics file;
* its PyTorch twin, one process: the same architecture built from ``torch.nn`` modules
  (``nn.LSTM``, ``nn.MultiheadAttention``, ``nn.LayerNorm``, ``nn.GELU``, ...), starting from
  mpidl's initial parameters (``build_model(M, ..., seed=S)``, copied in), trained on the same
  normalized samples (read through mpidl's dataset) in the same order (the trainer's
  per-epoch permutation, the whole global batch of 64 at once: what the 4 ranks' balanced
  reduction computes), with ``torch.optim.SGD`` (the same momentum and weight decay) and the
  same schedule set every step; test OA with ``torch.argmax`` in evaluation mode.

Without --data the Samson scene is converted first with the README's command
(``python -m mpidl.data_tools hsi ... --patch 7 --train-fraction 0.2``). ``--quick`` runs one
epoch on the built-in synthetic scene (a smoke test; its numbers mean nothing).

The twins are those of ``benchmarks/torch_twins.py`` (``twin_of``: mpidl's weights paired in
registration order), which ``benchmarks/step.py`` times too. PyTorch is needed by this script
only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_twins import twin_of  # noqa: E402 - imports neither torch nor mpidl

SAMSON = Path("/work/shared/data/samson")
#: the models this comparison trains (its report's text is written for them); step.py times
#: one step of every model against its twin
TRAINED = ("mlp", "spectral_lstm", "vit")


# --------------------------------------------------------------------------------------------
# training the twin (one process, the whole global batch)
# --------------------------------------------------------------------------------------------


def train_twin(name, train_set, test_set, *, epochs, seed, lr=0.02, batch=64, momentum=0.9, weight_decay=5e-4):
    """Train the twin of ``name`` as mpidl's trainer does (defaults of ``mpidl.train``);
    returns (test OA, seconds)."""
    import numpy as np
    import torch

    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_schedule
    from mpidl.app.trainer import epoch_permutation, steps_per_epoch

    torch.manual_seed(seed)
    model = build_model(name, train_set.sample_shape, train_set.num_classes, seed=seed)
    net = twin_of(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    n = train_set.num_samples
    per_epoch = steps_per_epoch(n, batch, False)
    schedule = make_schedule("cosine", lr, epochs * per_epoch)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    step = 0
    net.train()
    for epoch in range(epochs):
        perm = epoch_permutation(seed, epoch, n)
        for t in range(per_epoch):
            x, y = train_set.read(perm[t * batch:(t + 1) * batch])
            for g in opt.param_groups:
                g["lr"] = schedule(step)
            opt.zero_grad(set_to_none=False)
            loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            opt.step()
            step += 1
    net.eval()
    correct = 0
    with torch.no_grad():
        for lo in range(0, test_set.num_samples, 256):
            x, y = test_set.read(np.arange(lo, min(lo + 256, test_set.num_samples)))
            correct += int((net(torch.from_numpy(x)).argmax(1).numpy() == y).sum())
    return correct / test_set.num_samples, time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help="a layout file (default: Samson, converted here)")
    p.add_argument("--models", default=",".join(TRAINED), help=f"comma-separated, of {','.join(TRAINED)} (default all)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--ranks", type=int, default=4, help="mpidl's ranks (default 4)")
    p.add_argument("--quick", action="store_true", help="1 epoch on the synthetic scene (smoke test)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--from-json", type=Path, default=None,
                   help="rewrite the report from a twins.json of an earlier run (no training)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in TRAINED]
    if unknown:
        p.error(f"--models: {unknown} not among {', '.join(TRAINED)}")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        args.epochs = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import common

    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
        args.models = list(dict.fromkeys(r["model"] for r in results))
        args.seeds = sorted({r["seed"] for r in results})
        info = common.machine_info()  # the run's own facts, from twins_machine.json, override these
        info.update(json.loads((args.from_json.parent / "twins_machine.json").read_text())
                    if (args.from_json.parent / "twins_machine.json").is_file() else {})
        write_report(args, info, args.data, results)
        return 0
    try:
        import torch
    except ImportError:
        print("twins_torch.py needs PyTorch (pip install torch); nothing measured", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    from mpidl import data as mdata

    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-twins-"))
    work.mkdir(parents=True, exist_ok=True)
    data = args.data
    if data is None and not args.quick:
        data = work / "samson.h5"
        convert = [common.PYTHON, "-m", "mpidl.data_tools", "hsi", "--cube", str(SAMSON / "Samson.mat"),
                   "--abundances", str(SAMSON / "_EndSamson.mat"), "--patch", "7", "--train-fraction", "0.2",
                   "--out", str(data)]
        code, _ = common.run(convert, work / "convert.log", 600)
        if code:
            print(common.tail(work / "convert.log"), file=sys.stderr)
            return 1
    if data is None:
        train_set, test_set, _ = mdata.synthetic_splits(seed=0)
    else:
        train_set, test_set, _ = mdata.load_splits(str(data))

    info = common.machine_info()
    info["argv"] = "python benchmarks/twins_torch.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = []
    for name in args.models:
        for seed in args.seeds:
            metrics = work / f"{name}_{seed}.jsonl"
            metrics.unlink(missing_ok=True)
            train_argv = ["-m", "mpidl.train", "--model", name, "--epochs", str(args.epochs), "--seed", str(seed),
                          "--metrics", str(metrics), "--quiet"] + (["--data", str(data)] if data else [])
            cmd = common.mpiexec(args.ranks, [common.PYTHON, *train_argv])
            code, seconds = common.run(cmd, work / f"{name}_{seed}.log", 3600)
            end = common.load_metrics(metrics)[2] if metrics.is_file() else None
            if code or not end:
                print(common.tail(work / f"{name}_{seed}.log", 30), file=sys.stderr)
                return 1
            oa_mpidl = float(end["oa"])
            oa_torch, torch_s = train_twin(name, train_set, test_set, epochs=args.epochs, seed=seed)
            results.append({"model": name, "seed": seed, "oa_mpidl": oa_mpidl, "oa_torch": oa_torch,
                            "mpidl_s": seconds, "torch_s": torch_s, "command": common.shown(cmd)})
            print(f"{name} seed {seed}: mpidl OA {100 * oa_mpidl:.2f}% ({seconds:.0f} s), "
                  f"torch twin {100 * oa_torch:.2f}% ({torch_s:.0f} s)", flush=True)
    write_report(args, info, data, results)
    return 0


def _template(command: str) -> str:
    """A run's command with its model, seed and metrics path replaced by placeholders."""
    words = command.split()
    for flag, value in (("--model", "M"), ("--seed", "S"), ("--metrics", "M_S.jsonl"), ("--data", None)):
        if flag in words:
            value = value or Path(words[words.index(flag) + 1]).name
            words[words.index(flag) + 1] = value
    return " ".join(words)


def write_report(args, info, data, results) -> None:
    import common

    from mpidl import data as mdata
    from mpidl.engine.models import build_model

    try:
        train_set = mdata.load_splits(str(data))[0] if data else mdata.synthetic_splits(seed=0)[0]
    except (OSError, ValueError):
        train_set = None

    rows = []
    for name in args.models:
        mine = [r for r in results if r["model"] == name]
        a = [r["oa_mpidl"] for r in mine]
        b = [r["oa_torch"] for r in mine]
        diffs = [100 * (x - y) for x, y in zip(a, b)]
        size = "?" if train_set is None else (
            f"{build_model(name, train_set.sample_shape, train_set.num_classes).params.size:,}")
        rows.append([f"`{name}`", size, common.mean_std(a), common.mean_std(b),
                     " / ".join(f"{d:+.2f}" for d in diffs),
                     "yes" if all(abs(d) <= 1.0 for d in diffs) else "**no**",
                     common.med_spread([r["mpidl_s"] for r in mine], digits=0),
                     common.med_spread([r["torch_s"] for r in mine], digits=0)])
    intro = __doc__.split("\n\n", 1)[1].split("The twins are those")[0].strip()
    body = [intro.replace("``", "`"), "",
            f"{args.epochs} epochs, seeds {', '.join(map(str, args.seeds))}, data `{Path(data).name if data else 'synthetic'}` "
            f"({'the built-in synthetic scene, a smoke test' if not data else 'Samson through the README converter command'}). OA in %, "
            f"mean ± std over the seeds; the difference is mpidl − twin per seed, in points; times are "
            f"whole runs (mpidl: the `mpiexec` job with start-up and per-epoch evaluation; twin: "
            f"training and one evaluation, 1 thread) on a loaded machine.", "",
            common.md_table(["model", "parameters", f"mpidl OA ({args.ranks} ranks)", "PyTorch twin OA",
                             "mpidl − twin", "within 1 point", "mpidl s", "twin s"], rows), "",
            "mpidl's command, per model M and seed S: `" + _template(results[0]["command"]) + "`.", "",
            "The two columns agree to the test sample because the runs follow the same trajectory "
            "(same initial values, samples, order and schedule; float32 on both sides); a different "
            "sample order alone moves OA by tenths of a point.", ""]
    generated_by = info.pop("argv", None) or "python benchmarks/twins_torch.py " + " ".join(sys.argv[1:])
    stem = "twins_quick" if args.quick else "twins"
    out = common.write_markdown(args.out / f"{stem}.md", "PyTorch twins of mlp, spectral_lstm and vit",
                                generated_by, info, body)
    if args.quick:
        print(f"wrote {out}")
        return
    (args.out / "twins.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (args.out / "twins_machine.json").write_text(json.dumps({**info, "argv": generated_by}, indent=1) + "\n",
                                                 encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
