# python benchmarks/cluster_overlap_steps.py [--name ovl] [--rate 100mbit] [--rounds 30] [--quick]
"""Exposed communication of ``--overlap`` on a REAL link, step by step, contenders interleaved.

The epoch-level table (``cluster_claims.py overlap``) compares separate jobs minutes apart;
on a shared machine the load drifts between them by more than the effect. Here ONE job on
2 hosts of ``jobs/cluster.sh`` (1 rank each, a core each, the link shaped by ``tc tbf``,
MPICH over UCX/TCP: nothing emulated) holds, per model, three contenders built once each:

* ``compute``: the same loop with a DataParallel on ``MPI.COMM_SELF`` (no exchange);
* ``blocking``: flat, one Allreduce after the backward;
* ``overlap``: flat, ``overlap=True`` (buckets cut by parameter, started from the backward).

A round runs ``--steps`` steps of each contender, in an order that rotates round by round;
per contender and round: the slowest rank's mean step time and mean compute time (from
``local_indices`` to ``dp.step``: the forward, the backward and, for ``overlap``, the hooks'
MPI calls). Exposed = step - the SAME round's ``compute`` step; the ratio overlap / blocking
is taken round by round; overlapped compute / compute likewise. Random inputs of the shape of
``synthetic_p9.h5`` (32 x 9 x 9), 128 samples per rank (global batch 256, as the epoch
table). Writes ``cluster_overlap_steps[_TAG].{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

THREADS = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="ovs", help="the cluster's name (jobs/cluster.sh --name)")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--models", default="resnet8,vit")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--local-batch", type=int, default=128)
    p.add_argument("--env", default="", help="the job's environment, K=V,K=V (e.g. MPICH's Iallreduce algorithm)")
    p.add_argument("--tag", default="")
    p.add_argument("--quick", action="store_true", help="2 rounds of 1 step (numbers mean nothing)")
    p.add_argument("--keep-cluster", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # inside the job: the JSON to write
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 1
    return args


# ------------------------------------------------------------------ inside the job
def worker(args) -> int:
    for key, value in THREADS.items():
        os.environ.setdefault(key, value)
    import numpy as np
    from mpi4py import MPI

    from mpidl.distributed import Topology, data_parallel
    from mpidl.engine import threads
    from mpidl.engine.models import build_model
    from mpidl.engine.nn import SoftmaxCrossEntropy
    from mpidl.engine.optim import SGD

    threads.apply()
    world = MPI.COMM_WORLD
    size = world.Get_size()
    shape, classes = (32, 9, 9), 10
    rng = np.random.default_rng(world.Get_rank())
    x = rng.standard_normal((args.local_batch, *shape)).astype(np.float32)
    y = rng.integers(0, classes, args.local_batch)
    loss_fn = SoftmaxCrossEntropy()
    result = {"ranks": size, "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        def make(comm, **options):
            model = build_model(name, shape, classes, seed=0)
            opt = SGD(model.params, lr=1e-3, momentum=0.9)
            batch = args.local_batch * comm.Get_size()
            return model, data_parallel(model, opt, batch_size=batch, topology=Topology.from_comm(comm),
                                        strategy="flat", **options)

        contenders = {"compute": make(MPI.COMM_SELF), "blocking": make(world),
                      "overlap": make(world, overlap=True)}
        names = list(contenders)

        def run(model, dp, steps):
            """(mean step s, mean compute s) of this rank over ``steps`` steps."""
            comp = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                t0 = time.perf_counter()
                dp.local_indices(np.arange(args.local_batch * dp.size))
                loss_fn.forward(model.forward(x), y)
                model.backward(loss_fn.backward())
                comp += time.perf_counter() - t0
                dp.step(args.local_batch)
            return (time.perf_counter() - start) / steps, comp / steps

        for contender in names:  # warm-up: JIT, first allocations
            run(*contenders[contender], 2)
        rounds = {n: {"step_s": [], "comp_s": []} for n in names}
        for rnd in range(args.rounds):
            for contender in names[rnd % 3:] + names[:rnd % 3]:
                model, dp = contenders[contender]
                world.Barrier()
                step_s, comp_s = run(model, dp, args.steps)
                rounds[contender]["step_s"].append(world.allreduce(step_s, op=MPI.MAX))
                rounds[contender]["comp_s"].append(world.allreduce(comp_s, op=MPI.MAX))
        result["models"][name] = {"rounds": rounds, "buckets": len(contenders["overlap"][1].exchange.buckets),
                                  "message_bytes": int(contenders["blocking"][0].params.message.nbytes)}
        for _, dp in contenders.values():
            dp.close()
    if world.Get_rank() == 0:
        tmp = Path(str(args.worker) + ".part")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, args.worker)
    return 0


# ------------------------------------------------------------------ the driver
def med(values) -> str:
    if not values:
        return "n/a (blocking exposed nothing)"
    return f"{statistics.median(values):.3g} [{min(values):.3g} - {max(values):.3g}]"


def report(record: dict) -> str:
    lines = ["# `--overlap` on a real link, contenders interleaved step by step", "",
             f"Generated by `{record['command']}` ({record['date']}). One job, 2 hosts x 1 rank of "
             f"`jobs/cluster.sh` (a core each, link `tc tbf` {record['rate']}, MPICH over UCX/TCP; nothing "
             "emulated); the job's environment: " + (record["env_shown"] or "MPICH's defaults") + ".", "",
             f"Load average of the 2-core machine {record['load_before']} before, {record['load_after']} "
             "after (1/5/15 min; the job's own 2 ranks count about 2). Interleaving the contenders "
             "round by round keeps any drift of the machine's other work out of the ratios as far as "
             "it goes.", "",
             f"{record['rounds']} rounds x {record['steps']} steps per contender; per round the slowest "
             "rank's mean; median [min - max] over the rounds. exposed = step - the same round's "
             "`compute` step; ratios round by round.", "",
             "| model | buckets | message KB | compute step ms | blocking: exposed ms | overlap: exposed ms "
             "| exposed overlap / blocking (per round) | the same, medians' ratio | overlap's compute / compute |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in record["models"].items():
        r = m["rounds"]
        compute = r["compute"]["step_s"]
        exposed = {c: [s - c0 for s, c0 in zip(r[c]["step_s"], compute)] for c in ("blocking", "overlap")}
        ratio = [o / b for o, b in zip(exposed["overlap"], exposed["blocking"]) if b > 0]
        comp_ratio = [o / c for o, c in zip(r["overlap"]["comp_s"], r["compute"]["comp_s"])]
        of_medians = statistics.median(exposed["overlap"]) / statistics.median(exposed["blocking"])
        ms = lambda v: med([1e3 * t for t in v])  # noqa: E731
        lines.append(f"| {name} | {m['buckets']} | {m['message_bytes'] / 1e3:.0f} | {ms(compute)} | "
                     f"{ms(exposed['blocking'])} | {ms(exposed['overlap'])} | **{med(ratio)}** | "
                     f"{of_medians:.3g} | {med(comp_ratio)} |")
        m["summary"] = {"exposed_ratio_median": statistics.median(ratio) if ratio else None,
                        "exposed_ratio_of_medians": of_medians,
                        "overlap_compute_ratio_median": statistics.median(comp_ratio)}
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    import common
    from cluster_run import Cluster

    env = dict(kv.split("=", 1) for kv in args.env.split(",") if kv)
    cluster = Cluster(args.name)
    suffix = ("_" + args.tag if args.tag else "") + ("_quick" if args.quick else "")
    out_json = args.out / f"cluster_overlap_steps{suffix}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"cluster_overlap_steps{suffix}.raw.tmp"  # on the hosts' shared file system
    program = [common.PYTHON, str(Path(__file__).resolve()), "--worker", str(raw), "--models", args.models,
               "--rounds", str(args.rounds), "--steps", str(args.steps), "--local-batch", str(args.local_batch)]
    shown = "python benchmarks/cluster_overlap_steps.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load_before = "%.1f %.1f %.1f" % os.getloadavg()
    try:
        cluster.start(rate=args.rate, cpus="none")
        cmd = cluster.mpiexec([1, 1], program, env={**THREADS, **env})
        log = Path(f"/tmp/cluster_overlap_steps{suffix}.log")
        code, seconds = common.run(cmd, log, 3600)
    finally:
        if not args.keep_cluster:
            cluster.stop()
    if code != 0 or not raw.is_file():
        print(f"the job failed (exit {code}); see {log}", file=sys.stderr)
        return 1
    record = {"command": shown, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rate": args.rate,
              "env": env, "env_shown": " ".join(f"`{k}={v}`" for k, v in env.items()),
              "rounds": args.rounds, "steps": args.steps, "load_before": load_before,
              "load_after": "%.1f %.1f %.1f" % os.getloadavg(), "job_s": seconds,
              "machine": common.machine_info(), **json.loads(raw.read_text())}
    raw.unlink()
    text = report(record)
    out_json.write_text(json.dumps(record, indent=1))
    (args.out / f"cluster_overlap_steps{suffix}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
