# mpiexec -n 4 -launcher fork python benchmarks/comm.py [--quick] [--out benchmarks/results]
# mpiexec -n 4 -ppn 2 -hosts localhost,127.0.0.1 -launcher fork python benchmarks/comm.py   (2 EMULATED nodes)
# mpiexec -n R -launcher fork python benchmarks/comm.py --shm   (R = 2, 4: node-shared buffers)
"""Reduction strategies on one flat float32 buffer of 4 KiB ... 64 MiB.

For every buffer size, on the topology the launch gives (1 node, or 2 nodes emulated with
MPICH's ``-hosts`` launch), it times

* raw ``MPI_Allreduce(SUM)`` on the world communicator: the floor;
* each strategy of the distributed core (:class:`~mpidl.distributed.Flat`,
  :class:`~mpidl.distributed.Hierarchical`, :class:`~mpidl.distributed.Node`) on a real
  :class:`~mpidl.distributed.topology.Topology`: ``flat`` and ``hierarchical``
  (``Exchange.reduce`` of the buffer as the message ``[gradient | count | stop | nonfinite]``,
  balanced weighting: the scaling, the collectives, the division and the finiteness check
  every step runs), and ``node`` split into its two parts, the per-step node-local reduction
  (``reduce``) and the parameter sync between nodes (``synchronize``), plus their cost per
  step amortised over K' steps, ``step + sync / K'``;
* ``torch.distributed.all_reduce`` (gloo backend, on a tensor sharing the NumPy buffer) when
  PyTorch is installed; the column is skipped, with the reason, otherwise.

Every measurement starts after a barrier; its time is the slowest rank's. Contenders are
interleaved round by round, the buffer is refilled before each call (outside the clock; the
weighting would otherwise shrink it into denormals), and each cell is the median over the
rounds with its [min - max]. Algorithm bandwidth = buffer bytes / median time.

Rank 0 writes ``comm_<nodes>x<ranks per node>.json`` into ``--out`` and rebuilds ``comm.md``
(and ``comm.png``) from every such file there, so the 1-node and the 2-node launch end up
side by side.

``--shm`` (one node, R ranks) times instead the whole distributed step after backward on a
4, 16 and 64 MiB float32 model with SGD + momentum: ``mpi`` = ``Flat`` (MPI
``Allreduce`` of the message, weighting, division, the gradient's finiteness check) and the
replicated optimizer step on every rank (what ``DataParallel.step`` does), against ``shm`` =
:class:`mpidl.distributed.extras.shm.SharedWindow` around the flat exchange (each rank
sums its 1/R slice of the gradient slots in the node's window and updates that slice of the
one shared copy of parameters and momentum, its own finiteness check, two barriers). Rounds alternate the two;
each cell is the median over the rounds of the slowest rank's time, [min - max]. It also
measures the node's resident memory for each (the sum over the node's ranks of the
proportional set size, ``Pss`` in ``/proc/self/smaps_rollup``, after allocation and one
step, minus before), one at a time. Rank 0 writes ``comm_shm_1x<R>.json`` and rebuilds
``comm_shm.md``.
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

FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 256 << 10]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 sizes up to 256 KiB, 3 rounds (CI)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--sync-every", type=int, default=50, help="K' for the node strategy's amortised cost")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed column")
    p.add_argument("--rounds", type=int, default=None, help="rounds per size (default: by size)")
    p.add_argument("--shm", action="store_true",
                   help="node-shared buffers vs Allreduce + replicated update (4-64 MiB, one node)")
    args = p.parse_args(argv)
    if args.sync_every < 1 or (args.rounds is not None and args.rounds < 1):
        p.error("--sync-every and --rounds must be >= 1")
    return args


def _threads_per_rank() -> None:
    """One BLAS thread per rank's share of the cores, before NumPy loads (as mpidl.train does)."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    threads = str(max(1, len(os.sched_getaffinity(0)) // node.Get_size()))
    node.Free()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, threads)


def rounds_for(size: int, quick: bool, forced: int | None) -> int:
    if forced:
        return forced
    if quick:
        return 3
    return 20 if size <= 1 << 20 else 10 if size <= 16 << 20 else 5


def main(argv=None) -> int:
    args = parse_args(argv)
    _threads_per_rank()
    if args.shm:
        return main_shm(args)
    import numpy as np
    from mpi4py import MPI

    import common
    from mpidl.distributed import Flat, Hierarchical, Node
    from mpidl.distributed.message import COUNT
    from mpidl.distributed.topology import Topology

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    topo = Topology.from_comm(world)
    info = common.machine_info() if rank == 0 else None
    dist, torch_reason = common.init_torch_gloo(world, args.no_torch)
    k = args.sync_every
    exchanges = {"flat": Flat(topo), "hierarchical": Hierarchical(topo), "node": Node(topo, sync_every=k)}
    count = 16  # this rank's samples; the message carries it (balanced weighting: c_i = b_i)
    node = exchanges["node"]

    def reduce(name, message):
        message[COUNT] = count  # what DataParallel writes before the exchange's reduce
        exchanges[name].reduce(message)

    def node_sync(params):
        node.steps_since_sync, node.weight_since_sync = 1, count  # as after a step: the sync averages
        node.synchronize(params, [], (0.0, 0.0))
    sizes = QUICK_SIZES if args.quick else FULL_SIZES

    def contenders(buf):
        out = {"MPI_Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)}
        out["flat"] = lambda: reduce("flat", buf)
        out["hierarchical"] = lambda: reduce("hierarchical", buf)
        out["node step"] = lambda: reduce("node", buf)
        out["node sync"] = lambda: node_sync(buf[:-3])
        if dist is not None:
            import torch

            tensor = torch.from_numpy(buf)  # shares memory: the same buffer, no copy
            out["torch gloo"] = lambda: dist.all_reduce(tensor)
        return out

    results = {}
    for nbytes in sizes:
        template = np.ones(nbytes // 4, dtype=np.float32)
        buf = template.copy()
        calls = contenders(buf)
        times = {name: [] for name in calls}
        for rnd in range(rounds_for(nbytes, args.quick, args.rounds) + 1):  # round 0: warm-up
            for name, call in calls.items():
                np.copyto(buf, template)
                world.Barrier()
                t0 = time.perf_counter()
                call()
                elapsed = time.perf_counter() - t0
                slowest = world.allreduce(elapsed, op=MPI.MAX)
                if rnd > 0:
                    times[name].append(slowest)
        results[nbytes] = times
        if rank == 0:
            print(f"{common.fmt_size(nbytes):>8}: " + "  ".join(
                f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items()), flush=True)
        del buf, template, calls

    if rank == 0:
        label = f"{topo.num_nodes}x{'+'.join(str(s) for s in topo.node_sizes) if len(set(topo.node_sizes)) > 1 else topo.node_sizes[0]}"
        two = topo.num_nodes > 1
        record = {
            "label": label, "num_nodes": topo.num_nodes, "node_sizes": topo.node_sizes, "ranks": size,
            "sync_every": k, "quick": args.quick, "machine": info, "torch": torch_reason or "gloo",
            "command": common.shown(common.mpiexec(size, [common.PYTHON, "benchmarks/comm.py"]
                                                   + (["--quick"] if args.quick else []), two_nodes=two)),
            "env": {v: os.environ[v] for v in common.THROTTLE_ENV if v in os.environ},
            "times": {str(n): t for n, t in results.items()},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "_quick" if args.quick else ""
        (args.out / f"comm{suffix}_{label}.json").write_text(json.dumps(record, indent=1))
        write_report(args.out, suffix)
    if dist is not None:
        dist.destroy_process_group()
    topo.free()
    return 0


SHM_SIZES = [4 << 20, 16 << 20, 64 << 20]


def _pss_bytes() -> int:
    """This process's proportional set size (shared pages divided among their users)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def main_shm(args) -> int:
    import gc

    import numpy as np
    from mpi4py import MPI

    import common
    from mpidl import kernels
    from mpidl.distributed import Flat
    from mpidl.distributed.extras.shm import SharedWindow
    from mpidl.distributed.message import COUNT
    from mpidl.distributed.topology import Topology
    from mpidl.engine.optim import SGD
    from mpidl.engine.params import FlatParameters, Parameter, zeros

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    topo = Topology.from_comm(world)
    if topo.num_nodes != 1:
        raise SystemExit("--shm measures one node: launch without -hosts")
    info = common.machine_info() if rank == 0 else None
    sizes = QUICK_SIZES if args.quick else SHM_SIZES
    count = 16
    flat = Flat(topo)

    def reduce(message, exchange=flat):
        message[COUNT] = count  # this rank's weight, as DataParallel writes it
        return exchange.reduce(message)  # the weighted SUM, the division and the finiteness check

    def shared_step(shared, params):
        """The shared window's step as DataParallel runs it: reduce, the slice update, after_step
        (the barrier after which every rank may read the new parameters)."""
        reduce(params.message, shared)
        shared.optimizer.step()
        shared.after_step(1, params.data, shared.optimizer.state_buffers(), (0.0, 0.0))
    # Load the shm path's Numba kernel (its finiteness check) before any memory is measured:
    # the JIT runtime is a one-off cost of the process, not node memory held per model.
    kernels.all_finite(np.zeros(8, np.float32))

    def build(n):
        params = FlatParameters([("w", Parameter((n,), zeros()))])
        params.data[...] = 1.0
        return params, SGD(params, lr=1e-3, momentum=0.9)

    def node_pss(make):
        gc.collect()
        world.Barrier()
        before = _pss_bytes()
        held = make()
        world.Barrier()
        grown = world.allreduce(_pss_bytes() - before, op=MPI.SUM)
        return held, grown

    results, memory = {}, {}
    for nbytes in sizes:
        n = nbytes // 4

        def make_mpi():
            params, opt = build(n)
            params.grad[...] = 1.0
            reduce(params.message)
            opt.step()
            return params, opt

        def make_shm():
            params, opt = build(n)
            shared = SharedWindow(Flat(topo), params, opt)
            params.grad[...] = 1.0
            shared_step(shared, params)
            return params, opt, shared

        held, mpi_bytes = node_pss(make_mpi)
        del held
        held, shm_bytes = node_pss(make_shm)
        held[2].close()
        del held
        gc.collect()
        memory[nbytes] = {"mpi": mpi_bytes, "shm": shm_bytes}

        p_mpi, o_mpi = build(n)
        p_shm, o_shm = build(n)
        shared = SharedWindow(Flat(topo), p_shm, o_shm)
        calls = {
            # Both contenders check the gradient's finiteness, as DataParallel's step does
            # (the exchange's reduce does it).
            "mpi": (lambda: p_mpi.grad.fill(1.0), lambda: (reduce(p_mpi.message), o_mpi.step())),
            "shm": (lambda: p_shm.grad.fill(1.0), lambda: shared_step(shared, p_shm)),
        }
        times = {name: [] for name in calls}
        for rnd in range(rounds_for(nbytes, args.quick, args.rounds) + 1):  # round 0: warm-up
            for name in (("mpi", "shm") if rnd % 2 == 0 else ("shm", "mpi")):
                refill, call = calls[name]
                refill()
                world.Barrier()
                t0 = time.perf_counter()
                call()
                slowest = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if rnd > 0:
                    times[name].append(slowest)
        shared.close()
        del p_mpi, o_mpi, p_shm, o_shm, shared, calls
        gc.collect()
        results[nbytes] = times
        if rank == 0:
            print(f"{common.fmt_size(nbytes):>8}: mpi {statistics.median(times['mpi']) * 1e3:.2f} ms, "
                  f"shm {statistics.median(times['shm']) * 1e3:.2f} ms, memory mpi "
                  f"{memory[nbytes]['mpi'] / 2**20:.0f} MiB shm {memory[nbytes]['shm'] / 2**20:.0f} MiB", flush=True)
    if rank == 0:
        record = {"label": f"1x{size}", "ranks": size, "quick": args.quick, "machine": info,
                  "command": common.shown(common.mpiexec(size, [common.PYTHON, "benchmarks/comm.py", "--shm"]
                                                         + (["--quick"] if args.quick else []))),
                  "env": {v: os.environ[v] for v in (*common.THROTTLE_ENV, "MALLOC_MMAP_THRESHOLD_")
                          if v in os.environ},
                  "times": {str(n): t for n, t in results.items()},
                  "memory": {str(n): m for n, m in memory.items()}}
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "_quick" if args.quick else ""
        (args.out / f"comm_shm{suffix}_1x{size}.json").write_text(json.dumps(record, indent=1))
        write_shm_report(args.out, suffix)
    topo.free()
    return 0


def write_shm_report(out: Path, suffix: str) -> None:
    import common

    records = sorted((json.loads(p.read_text()) for p in out.glob(f"comm_shm{suffix}_1x*.json")),
                     key=lambda r: r["ranks"])
    lines = ["# Node-shared buffers: reduction + SGD-momentum update, one node", "",
             "Generated by `benchmarks/comm.py --shm` (one launch per rank count, fresh processes; "
             "rounds alternate the two contenders). `mpi`: MPI `Allreduce` of the message "
             "(`Flat`: weighting, division, the finiteness check of the gradient), then the replicated optimizer step on every rank. "
             "`shm`: the node's MPI-3 shared window, each rank reducing and updating its 1/R "
             "slice (`--intra shm`). Median of the slowest rank over the rounds, [min - max]. "
             "Memory: growth of the node's summed proportional set size (Pss) for one model "
             "with its gradients, momentum and scratch, measured one contender at a time "
             "(below glibc's dynamic mmap threshold, up to 32 MiB, freed blocks stay in the heap "
             "and blur the 4 and 16 MiB rows; `MALLOC_MMAP_THRESHOLD_=1048576` makes them exact).", ""]
    for r in records:
        env = " ".join(f"{k}={v}" for k, v in r.get("env", {}).items())
        lines += [f"## 1 node x {r['ranks']} ranks", "", f"`{env + ' ' if env else ''}{r['command']}`", ""]
        if r.get("machine"):
            lines += [common.machine_md(r["machine"]), ""]
        lines += ["| model | mpi (ms) | shm (ms) | speed-up | node memory mpi | node memory shm |",
                  "|---|---|---|---|---|---|"]
        for n, t in r["times"].items():
            a, b = statistics.median(t["mpi"]), statistics.median(t["shm"])
            m = r["memory"][n]
            lines.append(f"| {common.fmt_size(int(n))} | {a * 1e3:.2f} [{min(t['mpi']) * 1e3:.2f} - "
                         f"{max(t['mpi']) * 1e3:.2f}] | {b * 1e3:.2f} [{min(t['shm']) * 1e3:.2f} - "
                         f"{max(t['shm']) * 1e3:.2f}] | {a / b:.2f}x | {m['mpi'] / 2**20:.0f} MiB | "
                         f"{m['shm'] / 2**20:.0f} MiB |")
        lines.append("")
    path = out / f"comm_shm{suffix}.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)


def write_report(out: Path, suffix: str) -> None:
    import common

    records = [json.loads(p.read_text()) for p in sorted(out.glob(f"comm{suffix}_*x*.json"))]
    records.sort(key=lambda r: r["num_nodes"])
    body = ["Every cell: median [min-max] over the rounds, in milliseconds, of the slowest rank "
            "after a barrier; float32 buffers; balanced weighting (equal counts). `node step` is "
            "the node strategy's every-step, node-local reduction, `node sync` its parameter "
            "average between nodes (once every K' steps), `node / step` = step + sync / K'. "
            "MPI_Allreduce on the world communicator is the floor that `flat` wraps (flat adds one "
            "scaling pass over the buffer). Nodes are EMULATED on one machine (MPICH `-hosts`): "
            "the 'network' between them is the loopback interface through MPICH's network module. "
            "On one node `hierarchical` is a node Reduce + Bcast (two collectives where flat has "
            "one) and the node strategy never syncs: those columns matter on 2 nodes.",
            ""]
    for rec in records:
        names = list(next(iter(rec["times"].values())).keys())
        k = rec["sync_every"]
        rows, bw_rows = [], []
        for nbytes, times in rec["times"].items():
            n = int(nbytes)
            row, bw = [common.fmt_size(n)], [common.fmt_size(n)]
            for name in names:
                if name == "node sync" and rec["num_nodes"] == 1:  # one node: nothing to average
                    row.append("no-op (1 node)")
                    bw.append("-")
                    continue
                row.append(common.med_spread(times[name], 1e3, 3))
                bw.append(f"{n / statistics.median(times[name]) / 1e9:.3f}")
            amort = statistics.median(times["node step"]) + statistics.median(times["node sync"]) / k
            row.append(f"{amort * 1e3:.3f}")
            bw.append(f"{n / amort / 1e9:.3f}")
            rows.append(row)
            bw_rows.append(bw)
        headers = ["buffer", *names, f"node / step (K'={k})"]
        machine = rec["machine"]
        body += [f"## {rec['num_nodes']} node(s), {rec['ranks']} ranks ({rec['label']})"
                 + (" — EMULATED nodes" if rec["num_nodes"] > 1 else ""), "",
                 f"`{rec['command']}` — {machine['date']}, load average {machine['load_average']}; "
                 f"torch column: {rec['torch']}; MPICH environment: "
                 f"{' '.join(f'{a}={b}' for a, b in rec['env'].items()) or 'defaults'}.", "",
                 "Time (ms):", "", common.md_table(headers, rows), "",
                 "Algorithm bandwidth (GB/s = buffer bytes / median time):", "",
                 common.md_table(headers, bw_rows), ""]
    info = records[-1]["machine"] if records else common.machine_info()
    common.write_markdown(out / f"comm{suffix}.md", "Gradient reduction on flat buffers: strategies vs MPI vs gloo",
                          "mpiexec ... python benchmarks/comm.py (one launch per topology, below)", info, body)
    figure(out, records, suffix)


def figure(out: Path, records: list[dict], suffix: str) -> None:
    import common

    fig = common.matplotlib_figure(5 * max(1, len(records)), 4)
    if fig is None or suffix or not records:
        return
    axes = fig.subplots(1, len(records), squeeze=False)[0]
    for ax, rec in zip(axes, records):
        sizes = [int(n) for n in rec["times"]]
        for name in next(iter(rec["times"].values())):
            ax.plot(sizes, [statistics.median(t[name]) * 1e3 for t in rec["times"].values()],
                    marker="o", markersize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="buffer bytes", ylabel="ms (median, slowest rank)",
               title=f"{rec['num_nodes']} node(s) x {rec['node_sizes']}" + (" EMULATED" if rec["num_nodes"] > 1 else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "comm.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
