# python benchmarks/cluster_step.py [--rounds 5] [--model resnet8] [--shape 32,9,9] [--batch 32]
#     [--configs head,head-env,host,host-env,mpi] [--cpu 1] [--name cstep]
"""Is mpidl's step on a cluster host the same as its own single-process step?

One worker (``--worker``) times a training step of one model the way ``python -m mpidl.train``
runs it: ``app.cli.start_process()`` first (the thread policy), the model, SGD with momentum,
and, under ``mpiexec``, ``DataParallel.step`` after backward. It reports the first step's time
(Numba's compilation lands there), the median of the timed steps split into compute
(forward, loss, backward) and the rest (the optimizer, and the allreduce under MPI), the
CPU time per step, and what the process ran with: the thread policy's counts
(``threads.describe()``), Numba's threading layer, each convolution's algorithm, the
thread variables of its environment, its CPU affinity and its cgroup's CPU quota.

The driver runs the worker in each configuration, alternating within every round (the
order rotates), on one cluster of ``jobs/cluster.sh`` kept up for all rounds:

``head``      this machine's own namespace, one process, no thread variable set
              (``benchmarks/step.py``'s environment; the policy decides);
``head-1``    the same with ``OMP_NUM_THREADS=1`` only (``benchmarks/step.py --threads 1``);
``head-pin``  ``head-env`` pinned to core 0 (``taskset -c 0``): a host's cpuset without its cgroup;
``head-env``  the same with the variables the cluster benchmarks set
              (``OMP/OPENBLAS/MKL/NUMBA_NUM_THREADS=1``, ``cluster_claims.THREADS_ENV``);
``host``      one process inside host 1 (``jobs/cluster.sh run 1 --``: its cgroups, its
              CPU quota and cpuset), no thread variable set;
``host-env``  the same with ``THREADS_ENV``;
``host-2``    the same with ``OMP_NUM_THREADS=2``: what the policy chose before it read the
              cgroup's quota on a host whose cpuset holds both cores (``--own-core no``);
``mpi``       2 hosts x 1 rank under ``mpiexec`` with ``THREADS_ENV``, as ``cluster_claims.py``
              starts a training run (rank 0's compute part is the figure to compare);
              ``mpi-RATE`` (e.g. ``mpi-100mbit``, ``mpi-none``) with both links set to RATE first;
              ``mpi-oneweight`` with the cluster's cgroup at ``cpu.shares`` 1024 (the whole
              cluster weighs as one ordinary process: the old ``jobs/cluster.sh``).

Writes ``benchmarks/results/cluster_step.md`` and a JSON beside it (``--tag`` suffixes both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

THREADS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
#: variables a worker must not inherit when a configuration says "nothing set"
THREAD_VARIABLE_PREFIXES = ("OMP_", "OPENBLAS_", "MKL_", "GOMP_", "KMP_", "NUMBA_NUM_THREADS",
                            "NUMBA_THREADING_LAYER", "MPIDL_")
CONFIGS = ("head", "head-1", "head-env", "head-pin", "host", "host-env", "host-2", "mpi")
LR, MOMENTUM = 0.01, 0.9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet8")
    p.add_argument("--shape", default="32,9,9", help="C,H,W of one sample (default 32,9,9: synthetic_p9)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32: 64 over 2 hosts)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (default 3)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--cpu", default="1", help="each host's CPU share (jobs/cluster.sh --cpu; default 1)")
    p.add_argument("--rate", default="1gbit", help="each host's link (jobs/cluster.sh --rate; default 1gbit)")
    p.add_argument("--own-core", default="auto", help="jobs/cluster.sh --own-core (default auto)")
    p.add_argument("--name", default="cstep", help="the cluster's name (default cstep)")
    p.add_argument("--tag", default="")
    p.add_argument("--baseline", default="head-1", help="the configuration the ratios divide by (default head-1)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dp", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------------


def cgroup_cpu_quota() -> dict:
    """This process's cgroup v1 ``cpu`` controller: its path and quota/period (or the v2
    ``cpu.max``); what a one-core host's limit looks like from inside."""
    info: dict = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(",") or controllers == "":
                info["path" if controllers else "path_v2"] = path
    except OSError:
        return info
    base = Path("/sys/fs/cgroup/cpu") / info.get("path", "/").lstrip("/")
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"):
        try:
            info[name] = int((base / name).read_text())
        except (OSError, ValueError):
            pass
    return info


def cgroup_throttled() -> tuple[int, float]:
    """(periods throttled, seconds throttled) of this process's cgroup so far (cgroup v1
    ``cpu.stat``), (0, 0.0) where there is none."""
    path = cgroup_cpu_quota().get("path", "/")
    try:
        stat = dict(line.split() for line in (Path("/sys/fs/cgroup/cpu") / path.lstrip("/") / "cpu.stat")
                    .read_text().splitlines())
        return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9
    except (OSError, KeyError, ValueError):
        return 0, 0.0


def worker(args) -> dict:
    import numpy as np  # noqa: F401 - a user imports NumPy first

    start_import = time.perf_counter()
    from mpidl.app.cli import start_process

    start_process()  # what mpidl.train does first: the thread policy
    import numba

    from mpidl.engine import threads
    from mpidl.engine.backend import get_backend
    from mpidl.engine.models import build_model
    from mpidl.engine.nn import Conv2d, SoftmaxCrossEntropy
    from mpidl.engine.optim import SGD

    shape = tuple(int(v) for v in args.shape.split(","))
    backend = get_backend("cpu", "float32")
    model = build_model(args.model, shape, args.classes, backend=backend, seed=0)
    opt = SGD(model.params, lr=LR, momentum=MOMENTUM)
    dp, rank = None, 0
    if args.dp:
        from mpi4py import MPI

        from mpidl.distributed import DataParallel

        rank = MPI.COMM_WORLD.Get_rank()
        dp = DataParallel(model, opt, batch_size=args.batch * MPI.COMM_WORLD.Get_size())
    loss_fn = SoftmaxCrossEntropy()
    rng = np.random.default_rng(rank)
    x = backend.asarray(rng.standard_normal((args.batch, *shape)).astype(np.float32))
    y = rng.integers(0, args.classes, args.batch)
    setup_s = time.perf_counter() - start_import

    def compute():
        loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())

    def update():
        if dp is not None:
            dp.step(args.batch)
        else:
            opt.step()

    first = time.perf_counter()
    compute()
    update()
    first_s = time.perf_counter() - first
    for _ in range(args.warmup):
        compute()
        update()
    import resource

    compute_s, update_s, cpu_s, compute_cpu_s = [], [], [], []
    usage = resource.getrusage(resource.RUSAGE_SELF)
    throttled_before = cgroup_throttled()
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        compute()
        t1 = time.perf_counter()
        compute_cpu_s.append(time.process_time() - c0)
        update()
        t2 = time.perf_counter()
        compute_s.append(t1 - t0)
        update_s.append(t2 - t1)
        cpu_s.append(time.process_time() - c0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    switches = {"voluntary_per_step": (after.ru_nvcsw - usage.ru_nvcsw) / args.steps,
                "involuntary_per_step": (after.ru_nivcsw - usage.ru_nivcsw) / args.steps,
                "os_threads": len(os.listdir("/proc/self/task"))}
    throttled_after = cgroup_throttled()
    switches["throttled_periods_per_step"] = (throttled_after[0] - throttled_before[0]) / args.steps
    switches["throttled_ms_per_step"] = 1e3 * (throttled_after[1] - throttled_before[1]) / args.steps
    ticks = os.sysconf("SC_CLK_TCK")
    thread_cpu = {}
    for task in os.listdir("/proc/self/task"):  # CPU seconds of each OS thread over the whole process
        try:
            fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
            thread_cpu[f"{task}:{name}"] = (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            pass
    switches["thread_cpu_s"] = thread_cpu
    convs = ["winograd" if m._winograd is not None else "im2col" for m in model.net.modules() if isinstance(m, Conv2d)]
    try:
        layer = numba.threading_layer()
    except ValueError:
        layer = None
    return {"rank": rank, "host": os.uname().nodename, "setup_s": setup_s, "first_step_s": first_s,
            "compute_ms": 1e3 * statistics.median(compute_s), "update_ms": 1e3 * statistics.median(update_s),
            "step_ms": 1e3 * statistics.median(c + u for c, u in zip(compute_s, update_s)),
            "cpu_ms": 1e3 * statistics.median(cpu_s),
            "compute_cpu_ms": 1e3 * statistics.median(compute_cpu_s), "switches": switches, "threads": threads.describe(), "numba_layer": layer,
            "numba_config_threads": numba.config.NUMBA_NUM_THREADS, "convs": convs,
            "env": {k: v for k, v in os.environ.items() if k.startswith(THREAD_VARIABLE_PREFIXES)},
            "affinity": sorted(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "cgroup": cgroup_cpu_quota(), "dtype": str(x.dtype)}


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(THREAD_VARIABLE_PREFIXES)}
    env.update(extra or {})
    return env


def run_config(config: str, args, cluster) -> dict:
    worker_argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
                   "--shape", args.shape, "--classes", str(args.classes), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if cluster is not None:  # jobs/cluster.sh's weight (1024 per rank: 2 hosts x 1) unless mpi-oneweight
        Path(f"/sys/fs/cgroup/cpu/mpidl-cluster-{args.name}/cpu.shares").write_text(
            f"{1024 if config == 'mpi-oneweight' else 2048}\n")
    with_env = config.endswith("-env") or config.startswith("mpi") or config == "head-pin"
    env = clean_env(THREADS_ENV if with_env else {"OMP_NUM_THREADS": "1"} if config == "head-1" else None)
    if config == "head-pin":
        cmd = ["taskset", "-c", "0", *worker_argv]
    elif config.startswith("head"):
        cmd = worker_argv
    elif config.startswith("host"):
        host_env = THREADS_ENV if with_env else {"OMP_NUM_THREADS": "2"} if config == "host-2" else {}
        cmd = ["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", args.name, "run", "1", "--",
               "env", *[f"{k}={v}" for k, v in host_env.items()], *worker_argv]
        env = clean_env()
    else:  # mpi, or mpi-RATE: both hosts' links set to RATE first (jobs/cluster.sh link)
        rate = config.partition("-")[2] or args.rate
        # mpi-oneweight (cpu.shares written above): the whole cluster weighs as one ordinary process
        rate = args.rate if rate == "oneweight" else rate
        for host in ("1", "2"):
            subprocess.run(["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", args.name, "link", host, rate],
                           check=True, capture_output=True, text=True)
        cmd = cluster.mpiexec([1, 1], worker_argv + ["--dp"], THREADS_ENV)
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    results = [r for line in proc.stdout.splitlines() if line.startswith("[{") for r in json.loads(line)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{config}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    result = min(results, key=lambda r: r["rank"])
    result["others"] = [r for r in results if r is not result]
    result["load"] = load
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        result = worker(args)
        if args.dp:  # one line from rank 0 with every rank's result (ranks' lines would interleave)
            from mpi4py import MPI

            results = MPI.COMM_WORLD.gather(result)
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(json.dumps(results), flush=True)
        else:
            print(json.dumps([result]), flush=True)
        return 0
    import common
    from cluster_run import Cluster

    configs = [c for c in args.configs.split(",") if c]
    unknown = {c for c in configs if c.partition("-")[0] != "mpi"} - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    cluster = None
    if any(c.startswith("host") or c == "mpi" for c in configs):
        cluster = Cluster(args.name, hosts=2)
        subprocess.run(["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", args.name, "start", "--hosts", "2",
                        "--ranks", "1", "--cpu", args.cpu, "--own-core", args.own_core, "--rate", args.rate],
                       check=True, capture_output=True, text=True)
    runs: dict = {c: [] for c in configs}
    try:
        for round_index in range(args.rounds):
            order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
            for config in order:
                result = run_config(config, args, cluster)
                result["round"] = round_index
                runs[config].append(result)
                print(f"round {round_index + 1} {config:9s} compute {result['compute_ms']:7.1f} ms  "
                      f"step {result['step_ms']:7.1f} ms  cpu {result['cpu_ms']:7.1f} ms  compute cpu {result['compute_cpu_ms']:7.1f} ms  first {result['first_step_s']:.2f} s  "
                      f"load {result['load']:.1f}  threads {result['threads']['threads']} numba {result['threads']['numba']} "
                      f"blas {list(result['threads']['blas'].values())} primed {bool(result['threads']['openblas_primed'])} "
                      f"affinity {result['affinity']} quota {result['cgroup'].get('cpu.cfs_quota_us')} "
                      f"switches {result['switches']}", flush=True)
    finally:
        if cluster is not None:
            subprocess.run(["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", args.name, "stop"],
                           capture_output=True, text=True)
    write_report(args, runs, common)
    return 0


def write_report(args, runs: dict, common) -> None:
    suffix = f"_{args.tag}" if args.tag else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"cluster_step{suffix}.json").write_text(json.dumps(runs, indent=1) + "\n")
    base = runs.get(args.baseline) or next(iter(runs.values()))
    base_by_round = {r["round"]: r["compute_ms"] for r in base}
    base_cpu = {r["round"]: r["compute_cpu_ms"] for r in base}
    lines = [f"# mpidl's step: single process vs cluster host ({args.model} {args.shape}, batch {args.batch})", "",
             f"Generated by `python benchmarks/cluster_step.py {' '.join(sys.argv[1:])}`.", "",
             common.machine_md(common.machine_info()), "",
             "Per configuration: medians over rounds of each process's median over its timed steps "
             f"[min-max over rounds]; `vs head`: median of the same round's compute (CPU) time / `{args.baseline}`'s. "
             "CPU ms: the process's CPU time per step (all threads), the measure the machine's other load "
             "changes least; throttled: the CFS quota's stops of the process's cgroup during the timed steps.", "",
             "| config | compute ms | step ms | compute CPU ms | step CPU ms | first step s | vs head (compute) | vs head (CPU) | throttled ms/step | voluntary switches/step | threads / numba / blas | primed | convs | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def spread(values, fmt="{:.1f}"):
        return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"

    for config, rs in runs.items():
        if not rs:
            continue
        ratios = [r["compute_ms"] / base_by_round[r["round"]] for r in rs if r["round"] in base_by_round]
        cpu_ratios = [r["compute_cpu_ms"] / base_cpu[r["round"]] for r in rs if r["round"] in base_cpu]
        t = rs[0]["threads"]
        lines.append(f"| {config} | {spread([r['compute_ms'] for r in rs])} | {spread([r['step_ms'] for r in rs])} | "
                     f"{spread([r['compute_cpu_ms'] for r in rs])} | {spread([r['cpu_ms'] for r in rs])} | {spread([r['first_step_s'] for r in rs], '{:.2f}')} | "
                     f"{spread(ratios, '{:.2f}') if ratios else '-'} | {spread(cpu_ratios, '{:.2f}') if cpu_ratios else '-'} | "
                     f"{spread([r['switches']['throttled_ms_per_step'] for r in rs])} | "
                     f"{spread([r['switches']['voluntary_per_step'] for r in rs])} | {t['threads']} / {t['numba']} / "
                     f"{list(t['blas'].values())} | {bool(t['openblas_primed'])} | {'/'.join(rs[0]['convs'])} | "
                     f"{spread([r['load'] for r in rs])} |")
    lines += ["", "Environment and limits each process saw (round 1):", ""]
    for config, rs in runs.items():
        if rs:
            r = rs[0]
            lines.append(f"- {config}: env `{json.dumps(r['env'])}`, affinity {r['affinity']}, cgroup "
                         f"`{json.dumps(r['cgroup'])}`, numba layer {r['numba_layer']}, dtype {r['dtype']}")
    (args.out / f"cluster_step{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
