# mpiexec -n 4 -ppn 2 -hosts localhost,127.0.0.1 -launcher fork python benchmarks/overlap.py [--quick]
"""Exposed communication of the blocking and the overlapped gradient exchange (``--overlap``).

resnet8 on random inputs, 2 nodes x 2 ranks (MPICH ``-hosts`` emulation) with an EMULATED
inter-node link (default 50 us, 10 Gbit/s), SGD + momentum. Contenders, built once each
with its own model and interleaved round by round (the order rotates):

* ``compute``: the same loop with a DataParallel on ``MPI.COMM_SELF`` on every rank at once
  (no exchange at all, the same contention for the cores): the compute time;
* ``flat`` / ``hierarchical``, blocking and ``overlap`` (``--bucket-mb``).

A round of a contender: barrier, ``--steps`` steps (local slice, forward, backward,
``dp.step``), time per step = the slowest rank's elapsed time / steps. Exposed communication
= step time - compute time of the same round; the goal compares ``exposed(overlap) /
exposed(blocking)``. Medians over the rounds with [min - max]. Rank 0 writes
``overlap.json`` and ``overlap.md`` into ``--out``.
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds of 2 steps (CI); numbers mean nothing")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--rounds", type=int, default=40, help="rounds per contender (default 40: the exposed time is a few ms against a compute jitter of the same size)")
    p.add_argument("--steps", type=int, default=10, help="steps per round and contender")
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--size", type=int, default=16, help="input height = width")
    p.add_argument("--bucket-mb", type=float, default=0.01)
    p.add_argument("--link", default="50,10", help="EMULATED link LATENCY_US,GBIT_S")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 2
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    import numpy as np
    from mpi4py import MPI

    import common
    from mpidl.distributed import DataParallel, Flat, Topology, data_parallel
    from mpidl.engine import threads
    from mpidl.engine.models import build_model
    from mpidl.engine.nn import SoftmaxCrossEntropy
    from mpidl.engine.optim import SGD

    threads.apply()  # as mpidl.train does first (the one-thread counts set above win)

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    topo = Topology.from_comm(world)
    info = common.machine_info() if rank == 0 else None
    shape, classes = (3, args.size, args.size), 10
    batch = args.local_batch * size
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.local_batch, *shape)).astype(np.float32)
    y = rng.integers(0, classes, args.local_batch)
    loss_fn = SoftmaxCrossEntropy()

    def make(strategy=None, overlap=False):
        model = build_model("resnet8", shape, classes, seed=0)
        opt = SGD(model.params, lr=1e-3, momentum=0.9)
        if strategy is None:
            return model, DataParallel(model, opt, batch_size=args.local_batch,
                                       exchange=Flat(Topology.from_comm(MPI.COMM_SELF)))
        return model, data_parallel(model, opt, batch_size=batch, topology=topo, strategy=strategy,
                                    emulate_link=args.link, overlap=overlap, bucket_mb=args.bucket_mb)

    contenders = {"compute": make()}
    for strategy in ("flat", "hierarchical"):
        contenders[f"{strategy} blocking"] = make(strategy)
        contenders[f"{strategy} overlap"] = make(strategy, overlap=True)
    names = list(contenders)
    local_all = np.arange(batch)

    def run_steps(model, dp, steps):
        for _ in range(steps):
            dp.local_indices(local_all if dp.size > 1 else np.arange(args.local_batch))
            loss_fn.forward(model.forward(x), y)
            model.backward(loss_fn.backward())
            dp.step()

    for name in names:  # warm-up (JIT, first allocations)
        run_steps(*contenders[name], 2)
    for _, dp in contenders.values():
        dp.reset_counters()
    times = {name: [] for name in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            model, dp = contenders[name]
            world.Barrier()
            t0 = time.perf_counter()
            run_steps(model, dp, args.steps)
            elapsed = (time.perf_counter() - t0) / args.steps
            times[name].append(world.allreduce(elapsed, op=MPI.MAX))
    buckets = len(contenders["flat overlap"][1].exchange.buckets)
    # EMULATED link seconds this rank slept per step (the modelled link time left exposed)
    slept = {name: world.allreduce(dp.exchange.traffic.emulated_seconds / (args.rounds * args.steps), op=MPI.MAX)
             for name, (_, dp) in contenders.items()}
    for model, dp in contenders.values():
        dp.close()
    if rank == 0:
        exposed = {n: [t - c for t, c in zip(times[n], times["compute"])] for n in names if n != "compute"}
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": info, "times": times,
                  "emulated_slept_s": slept,
                  "exposed": exposed, "buckets": buckets, "nodes": topo.num_nodes, "ranks": size,
                  "params": int(contenders["compute"][0].params.size),
                  "command": common.shown(common.mpiexec(size, [common.PYTHON, "benchmarks/overlap.py"]
                                                         + (["--quick"] if args.quick else []), two_nodes=True))}
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "_quick" if args.quick else ""
        (args.out / f"overlap{suffix}.json").write_text(json.dumps(record, indent=1))
        write_report(args.out / f"overlap{suffix}.md", record, args)
        print((args.out / f"overlap{suffix}.md").read_text())
    topo.free()
    return 0


def _ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.2f} [{min(values) * 1e3:.2f} - {max(values) * 1e3:.2f}]"


def write_report(path: Path, r: dict, args) -> None:
    import common
    from mpidl.distributed.emulation import parse_link

    link = parse_link(args.link)
    n = r["params"] * 4 + 12
    model_flat = link.allreduce_seconds(n, r["ranks"])
    model_hier = link.allreduce_seconds(n, r["nodes"])
    lines = ["# Overlapping the gradient exchange with the backward pass", "",
             f"Generated by `{r['command']}`. EMULATED: {r['nodes']} nodes x {r['ranks'] // r['nodes']} ranks "
             f"on one machine (MPICH -hosts), inter-node link {link.describe()}; the machine was "
             "shared with other jobs (see the load average).", "", common.machine_md(r["machine"]), "",
             f"resnet8 ({r['params']} parameters, {n / 2**10:.0f} KiB message), input "
             f"3x{args.size}x{args.size}, {args.local_batch} samples per rank, SGD + momentum; "
             f"overlap with `--bucket-mb {args.bucket_mb:g}` = {r['buckets']} buckets. {args.rounds} "
             f"rounds x {args.steps} steps per contender, interleaved; median [min - max] of the "
             "slowest rank's time per step.", "",
             "| contender | step (ms) | exposed = step - compute (ms) | exposed / blocking's | EMULATED link time slept per step (ms) |",
             "|---|---|---|---|---|",
             f"| compute (no exchange) | {_ms(r['times']['compute'])} | - | - | - |"]
    for strategy in ("flat", "hierarchical"):
        blocking = r["exposed"][f"{strategy} blocking"]
        for kind in ("blocking", "overlap"):
            name = f"{strategy} {kind}"
            ratios = [e / b if b > 0 else float("nan") for e, b in zip(r["exposed"][name], blocking)]
            ratio = "1" if kind == "blocking" else f"{statistics.median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]"
            lines.append(f"| {name} | {_ms(r['times'][name])} | {_ms(r['exposed'][name])} | {ratio} | "
                         f"{r['emulated_slept_s'][name] * 1e3:.3f} |")
    lines += ["", "The ratio is taken round by round (each round's overlap against the same round's "
              "blocking exchange). Modelled link time of one blocking exchange: flat "
              f"{model_flat * 1e3:.3f} ms (ring over {r['ranks']} ranks), hierarchical "
              f"{model_hier * 1e3:.3f} ms (ring over {r['nodes']} leaders). The last bucket (the "
              "first layers) can only start when backward ends, so its latency terms stay exposed: "
              f"at least 2 (L-1) alpha = {2 * (r['ranks'] - 1) * link.alpha * 1e3:.3f} ms (flat) / "
              f"{2 * (r['nodes'] - 1) * link.alpha * 1e3:.3f} ms (hierarchical) of modelled time, "
              "plus that bucket's real MPI time. The last column is the modelled link time each "
              "contender actually waited for (slowest rank): the blocking exchange sleeps all of it, "
              "the overlapped one only what its buckets' deadlines had not yet passed when "
              "`step` needed them; the rest of the exposed time is the real MPI exchange (TCP "
              "between the emulated nodes, shared memory inside), which needs the same CPU cores "
              "as the compute when the ranks outnumber the cores.", ""]
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
