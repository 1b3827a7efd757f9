# python benchmarks/step.py [--rounds 3] [--steps 10] [--models hsicnn,resnet8] [--device cpu|gpu]
#     [--threads N] [--shape C,H,W --batch B --tag TAG]
"""One training step of every model, mpidl against its PyTorch twin, each in a fresh process.

For every model of ``mpidl.engine.models.MODELS`` (each has an entry in ``benchmarks/torch_twins.py``,
``TWINS``: sample shape, classes, the PyTorch twin), the time of one training step (forward,
loss, backward, optimizer: SGD lr 0.01, momentum 0.9; batch 64 of random samples) in three
kinds of fresh process, started with **no thread or wait-policy variable set** (the
benchmark removes ``OMP_*``, ``OPENBLAS_*``, ``MKL_*``, ``NUMBA_*_THREADS``, ``GOMP_*`` and
``KMP_*`` from the environment it passes on):

``api``    the one-process Python API (docs/tour.md): ``threads.apply()`` (the thread policy,
           the one call a training program makes first), ``build_model`` +
           ``SoftmaxCrossEntropy`` + ``SGD``, a plain loop (``import numpy`` first, as a user would);
``cli``    the path of ``python -m mpidl.train``: the thread policy applied first for the ranks
           the launcher put on this machine, the machine's ranks counted over MPI, and each step goes through
           ``DataParallel.step`` (the flat reducer's allreduce on one rank, then the optimizer),
           as the trainer does; the data reading of the trainer is not timed;
``torch``  the twin, with mpidl's initial parameters and buffers (``torch_twins.load_weights``,
           from a file an mpidl process wrote: this one never imports mpidl), same batch,
           ``torch.optim.SGD``, PyTorch's defaults (its own thread count).

Rounds alternate the three (the order rotates each round), so every kind sees the same load;
each process times ``--warmup`` steps untimed, then ``--steps`` steps, and reports the median.
Reported per model: the median over rounds of each kind's step time with its ``[min-max]``, the
median over rounds of the per-round ratio mpidl/torch (same round, similar load) with its
spread, the CPU time per step (``process_time``, all threads), and the peak resident memory (``ru_maxrss``) of each process, also as the growth
during the steps (peak minus the resident size before the first step). On ``--device gpu``
both frameworks run on the GPU (CuPy / CUDA), time with device synchronization, and report the
peak device memory their allocators held.

``--shape C,H,W`` and ``--batch B`` time another sample shape and batch than the twin's
(``--shape 32,9,9 --batch 32``: a rank's step in the cluster runs of ``synthetic_p9.h5``, batch
64 over 2 hosts); ``--tag`` keeps their result files apart.

``--threads N`` sets ``OMP_NUM_THREADS=N`` in every worker instead (mpidl's policy and PyTorch
both follow it): on a loaded machine, one thread each measures the arithmetic without the
thread pools' waiting.

Writes ``benchmarks/results/step.md`` (``step_gpu.md`` for the GPU) and a JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

KINDS = ("api", "cli", "torch")
BATCH = 64
LR, MOMENTUM = 0.01, 0.9
#: prefixes of the environment variables a worker must not inherit ("nothing set")
THREAD_VARIABLE_PREFIXES = ("OMP_", "OPENBLAS_", "MKL_", "GOMP_", "KMP_", "NUMBA_NUM_THREADS",
                            "NUMBA_THREADING_LAYER", "MPIDL_")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated model names (default: every model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per process (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per process (default 3)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="set OMP_NUM_THREADS=N in every worker (both frameworks read it); default: nothing set")
    p.add_argument("--shape", default=None,
                   help="C,H,W of one sample instead of the twin's (e.g. 32,9,9: the cluster runs' synthetic_p9)")
    p.add_argument("--batch", type=int, default=BATCH, help=f"samples per step (default {BATCH})")
    p.add_argument("--tag", default="", help="suffix of the result files (step_TAG.md)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"which of {','.join(KINDS)} (default all)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per worker process (default 600)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.batch < 1:
        p.error("--rounds, --steps and --batch must be >= 1, --warmup >= 0")
    return args


# --------------------------------------------------------------------------------------------
# workers (one fresh process each)
# --------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def input_shape(args, twin) -> tuple:
    """``--shape`` if given, else the twin's sample shape."""
    return tuple(int(v) for v in args.shape.split(",")) if args.shape else tuple(twin.input_shape)


def _batch(input_shape, num_classes, batch=BATCH, seed=0):
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
    y = rng.integers(0, num_classes, batch)
    return x, y


_CPU_TIMES: list = []  # CPU seconds (all threads of the process) of the timed steps


def _time_steps(step, warmup: int, steps: int, sync=lambda: None):
    for _ in range(warmup):
        step()
    sync()
    rss_before = _rss_bytes()
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        sync()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    _CPU_TIMES[:] = cpu_times
    return times, rss_before


def worker_mpidl(args) -> dict:
    import numpy as np  # noqa: PLC0415,F401 - a user imports NumPy first (OpenBLAS starts its pool)

    from torch_twins import TWINS  # noqa: PLC0415
    from mpidl.engine import threads  # noqa: PLC0415
    from mpidl.engine.backend import get_backend  # noqa: PLC0415
    from mpidl.engine.models import build_model  # noqa: PLC0415
    from mpidl.engine.nn import SoftmaxCrossEntropy  # noqa: PLC0415
    from mpidl.engine.optim import SGD  # noqa: PLC0415

    threads.apply()  # the first call of a training program (README, mpidl.train): the thread policy
    twin = TWINS[args.model]
    backend = get_backend(args.device, "float32")
    dp = None
    if args.worker == "cli":
        from mpidl.distributed.launch import machine_rank_and_size  # noqa: PLC0415
        from mpidl.engine import threads  # noqa: PLC0415

        threads.apply()  # as mpidl.train.main does: explicitly, before the first kernel
        local_rank, _ = machine_rank_and_size()
        backend.select_device(local_rank)
    model = build_model(args.model, input_shape(args, twin), twin.num_classes, backend=backend, seed=0, **twin.kwargs)
    opt = SGD(model.params, lr=LR, momentum=MOMENTUM)
    if args.worker == "cli":
        from mpidl.distributed import DataParallel  # noqa: PLC0415

        dp = DataParallel(model, opt, batch_size=args.batch)
    loss_fn = SoftmaxCrossEntropy()
    x, y = _batch(input_shape(args, twin), twin.num_classes, args.batch)
    x, y = backend.asarray(x), backend.xp.asarray(y)

    def step():
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        if dp is not None:
            dp.step(args.batch)
        else:
            opt.step()

    sync = lambda: None  # noqa: E731
    if args.device == "gpu":
        import cupy  # noqa: PLC0415

        sync = cupy.cuda.Device().synchronize
    times, rss_before = _time_steps(step, args.warmup, args.steps, sync)
    result = {"times": times, "cpu_times": list(_CPU_TIMES), "rss_before": rss_before, "peak_rss": _peak_rss_bytes()}
    if args.device == "gpu":
        import cupy  # noqa: PLC0415

        result["device_bytes"] = int(cupy.get_default_memory_pool().total_bytes())
    result["threads"] = threads.describe()
    return result


def worker_torch(args) -> dict:
    import torch  # noqa: PLC0415 - first, with PyTorch's defaults

    import numpy as np  # noqa: PLC0415
    from torch_twins import TWINS, load_weights  # noqa: PLC0415

    twin = TWINS[args.model]
    saved = np.load(args.weights, allow_pickle=False)
    layout = json.loads(str(saved["__layout__"]))
    net = load_weights(twin.build(layout["build_args"]), [(name, saved[name]) for name in layout["parameters"]],
                       [(name, saved[name]) for name in layout["buffers"]])
    device = "cuda" if args.device == "gpu" else "cpu"
    net = net.to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    x_np, y_np = _batch(input_shape(args, twin), twin.num_classes, args.batch)
    x, y = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, rss_before = _time_steps(step, args.warmup, args.steps, sync)
    result = {"times": times, "cpu_times": list(_CPU_TIMES), "rss_before": rss_before, "peak_rss": _peak_rss_bytes(),
              "threads": {"torch": torch.get_num_threads()}, "version": torch.__version__}
    if device == "cuda":
        result["device_bytes"] = int(torch.cuda.max_memory_reserved())
    return result


def worker_export(args) -> dict:
    """mpidl's initial parameters and buffers of ``args.model``, for the twin: the arrays by
    name, and ``__layout__`` (JSON: the build arguments, the parameter and buffer names in
    registration order, the order ``load_weights`` pairs them in)."""
    import numpy as np  # noqa: PLC0415

    from torch_twins import TWINS  # noqa: PLC0415
    from mpidl.engine.models import build_model  # noqa: PLC0415

    twin = TWINS[args.model]
    model = build_model(args.model, input_shape(args, twin), twin.num_classes, seed=0, **twin.kwargs)
    parameters = {name: np.asarray(p.data) for name, p in model.net.named_parameters()}
    buffers = {name: np.asarray(b) for name, b in model.net.named_buffers()}
    layout = {"build_args": model.build_args, "parameters": list(parameters), "buffers": list(buffers)}
    np.savez(args.weights, **parameters, **buffers, __layout__=np.array(json.dumps(layout)))
    return {"parameters": int(model.params.size)}


def worker(args) -> int:
    functions = {"api": worker_mpidl, "cli": worker_mpidl, "torch": worker_torch, "export": worker_export}
    result = functions[args.worker](args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# the driver (imports neither mpidl nor torch)
# --------------------------------------------------------------------------------------------


def clean_env(threads: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(THREAD_VARIABLE_PREFIXES)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def run_worker(kind: str, model: str, args, weights: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--model", model,
           "--weights", str(weights), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device, "--batch", str(args.batch)] + (["--shape", args.shape] if args.shape else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(args.threads), capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{kind} worker for {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _ms(values) -> str:
    import common  # noqa: PLC0415

    return common.med_spread(values, scale=1e3, digits=1)


def _mb(values) -> str:
    return f"{statistics.median(values) / 1e6:.0f}"


def report(results: dict, args, info: dict, command: str) -> list[str]:
    import common  # noqa: PLC0415

    kinds = [k for k in KINDS if k in args.kind_list]
    headers = ["model", "input"] + [f"{k} step ms" for k in kinds]
    mpidl_kinds = [k for k in kinds if k != "torch"]
    if "torch" in kinds:
        headers += [f"{k}/torch" for k in mpidl_kinds]
    headers += [f"{k} CPU ms" for k in kinds]
    if "torch" in kinds:
        headers += [f"{k}/torch CPU" for k in mpidl_kinds]
    headers += [f"{k} peak RSS MB (step growth)" for k in kinds]
    if "torch" in kinds:
        headers += [f"{k}/torch peak RSS" for k in mpidl_kinds]
    if args.device == "gpu":
        headers += [f"{k} device MB" for k in kinds]
    rows = []
    for model, by_kind in results.items():
        row = [f"`{model}`", "x".join(map(str, by_kind["input_shape"]))]
        medians = {k: [statistics.median(r["times"]) for r in by_kind[k]] for k in kinds}
        row += [_ms(medians[k]) for k in kinds]
        if "torch" in kinds:
            for k in mpidl_kinds:
                ratios = [a / t for a, t in zip(medians[k], medians["torch"])]
                row.append(f"**{common.med_spread(ratios)}**")
        cpu = {k: [statistics.median(r.get("cpu_times") or [float("nan")]) for r in by_kind[k]] for k in kinds}
        row += [_ms(cpu[k]) for k in kinds]
        if "torch" in kinds:
            for k in mpidl_kinds:
                row.append(common.med_spread([a / t for a, t in zip(cpu[k], cpu["torch"])]))
        for k in kinds:
            peaks = [r["peak_rss"] for r in by_kind[k]]
            growth = [r["peak_rss"] - r["rss_before"] for r in by_kind[k]]
            row.append(f"{_mb(peaks)} ({_mb(growth)})")
        if "torch" in kinds:
            for k in mpidl_kinds:
                ratios = [a["peak_rss"] / t["peak_rss"] for a, t in zip(by_kind[k], by_kind["torch"])]
                row.append(common.med_spread(ratios))
        if args.device == "gpu":
            row += [_mb([r.get("device_bytes", 0) for r in by_kind[k]]) for k in kinds]
        rows.append(row)
    threads = {k: next(iter(results.values()))[k][0].get("threads") for k in kinds} if results else {}
    body = [
        f"`{command}`: {args.rounds} rounds, each a fresh process per model and kind, the order "
        f"rotating; {args.warmup} untimed + {args.steps} timed steps per process, batch {args.batch}, "
        f"SGD lr {LR} momentum {MOMENTUM}, float32, device {args.device}. "
        + ("No thread or wait-policy variable set in any worker. " if args.threads is None else
           f"Every worker runs with `OMP_NUM_THREADS={args.threads}` and nothing else set. ")
        + "Step ms: median over rounds of each process's median step "
        "[min-max over rounds]. Ratios: median over rounds of the same round's mpidl/torch "
        "[min-max]; below 1 mpidl is faster / smaller. CPU ms: the same for the process's CPU "
        "time per step (all its threads: work plus any spinning; with one thread it does not "
        "count the time the process waited for a core, so it is the load-independent measure). "
        "Peak RSS: `ru_maxrss` of the whole process "
        "(interpreter, libraries, JIT caches included); in parentheses its growth during the timed "
        "steps over the resident size before them.",
        "",
        common.md_table(headers, rows),
        "",
        "Threads in force (first round): " + "; ".join(f"{k}: `{json.dumps(v)}`" for k, v in threads.items()),
    ]
    return body


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    import common  # noqa: PLC0415
    from torch_twins import TWINS  # noqa: PLC0415

    # The model registry, read in a child: the driver imports neither mpidl nor torch.
    registry = subprocess.run([sys.executable, "-c", "from mpidl.engine.models import MODELS; print(','.join(MODELS))"],
                              cwd=ROOT, env=clean_env(), capture_output=True, text=True, check=True).stdout.strip()
    all_models = registry.split(",")
    args.model_list = args.models.split(",") if args.models else all_models
    args.kind_list = args.kinds.split(",")
    unknown = [m for m in args.model_list if m not in all_models]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; MODELS has {all_models}")
    untwinned = [m for m in args.model_list if m not in TWINS]
    if untwinned:  # the twin entry gives the benchmark's sample shape too
        raise SystemExit(f"no entry in benchmarks/torch_twins.py for {untwinned}: add its twin there")
    info = common.machine_info()
    work = Path(tempfile.mkdtemp(prefix="mpidl-step-"))
    results: dict = {}
    for model in args.model_list:
        weights = work / f"{model}.npz"
        run_worker("export", model, args, weights)
        shape = [int(v) for v in args.shape.split(",")] if args.shape else list(TWINS[model].input_shape)
        results[model] = {"input_shape": shape, **{k: [] for k in args.kind_list}}
    for round_index in range(args.rounds):
        for model in args.model_list:
            order = args.kind_list[round_index % len(args.kind_list):] + args.kind_list[:round_index % len(args.kind_list)]
            for kind in order:
                result = run_worker(kind, model, args, work / f"{model}.npz")
                results[model][kind].append(result)
                print(f"round {round_index + 1} {model:13s} {kind:5s} {1e3 * statistics.median(result['times']):8.1f} ms "
                      f"peak RSS {result['peak_rss'] / 1e6:6.0f} MB", flush=True)
    command = "python benchmarks/step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    suffix = (("" if args.device == "cpu" else "_gpu") + ("" if args.threads is None else f"_threads{args.threads}")
              + (f"_{args.tag}" if args.tag else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"step{suffix}.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    body = report(results, args, info, command.strip())
    path = common.write_markdown(args.out / f"step{suffix}.md", "One training step: mpidl vs PyTorch",
                                 command.strip(), info, body)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
