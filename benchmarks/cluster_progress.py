# python benchmarks/cluster_progress.py [--rate 100mbit] [--sizes 0.5,1,4] [--reps 8] [--name claims] [--quick]
#   (launches, per variant: mpiexec (2 hosts of jobs/cluster.sh) python benchmarks/cluster_progress.py --worker ...)
"""What moves a non-blocking allreduce across a real TCP link while the rank computes?

Two hosts of ``jobs/cluster.sh`` (a core each, the link shaped by ``tc tbf``), one rank each,
MPICH over UCX's TCP transport. Per message size ``n``, each rank measures (medians of
``--reps``, after a warm-up):

* ``block``: a blocking ``Allreduce`` of ``n`` bytes (the wire time plus MPI's own);
* ``compute``: a fixed amount of CPU work (float64 matrix products, no MPI call inside),
  sized to about 1.5 x ``block``: a backward pass long enough to hide the whole exchange;
* ``overlap``: ``Iallreduce`` started, the same CPU work with ``Request.Test`` between its
  chunks (as mpidl's backward hooks poll between layers), then ``Wait``;
  ``exposed = overlap - compute``, reported as a fraction of ``block``.

The variants change only the environment of the job: which allreduce algorithm MPICH's
non-blocking schedule uses, whether UCX sends the whole message eagerly (so that it lands in
the kernel's socket buffer at once, and the kernel, not the process, carries it over the
wire), and MPICH's asynchronous progress thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {
    "defaults": {},
    "recursive doubling (one exchange)": {"MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_recursive_doubling"},
    "eager (UCX_RNDV_THRESH=inf)": {"UCX_RNDV_THRESH": "inf"},
    "recursive doubling + eager": {"MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_recursive_doubling",
                                   "UCX_RNDV_THRESH": "inf"},
    "recursive doubling + eager + 8 MB socket buffers": {
        "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_recursive_doubling", "UCX_RNDV_THRESH": "inf",
        "UCX_TCP_SNDBUF": "8m", "UCX_TCP_RCVBUF": "8m"},
    "async progress thread (MPIR_CVAR_ASYNC_PROGRESS=1)": {"MPIR_CVAR_ASYNC_PROGRESS": "1"},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--sizes", default="0.5,1,4", help="message sizes in MB (10^6 bytes)")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--variants", default="", help="variant names to run, separated by ';' (default all)")
    p.add_argument("--name", default="claims")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--keep-cluster", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> int:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    a = np.random.default_rng(comm.rank).standard_normal((96, 96))

    def work(chunks: int, request=None) -> None:
        for _ in range(chunks):
            b = a
            for _ in range(8):
                b = a @ b
                b *= 0.01
            if request is not None:
                request.Test()

    def timed(fn) -> float:
        comm.Barrier()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    work(20)
    chunk_s = statistics.median(timed(lambda: work(20)) for _ in range(5)) / 20
    out = {"chunk_ms": chunk_s * 1e3, "sizes": {}}
    for mb in (float(s) for s in args.sizes.split(",")):
        buf = np.ones(int(mb * 1e6) // 4, dtype=np.float32)
        comm.Allreduce(MPI.IN_PLACE, buf)
        block = statistics.median(timed(lambda: comm.Allreduce(MPI.IN_PLACE, buf)) for _ in range(args.reps))
        chunks = max(1, int(round(1.5 * block / chunk_s)))
        chunks = comm.allreduce(chunks, op=MPI.MAX)
        compute = statistics.median(timed(lambda: work(chunks)) for _ in range(args.reps))

        def overlapped():
            req = comm.Iallreduce(MPI.IN_PLACE, buf)
            work(chunks, req)
            req.Wait()

        overlap = statistics.median(timed(overlapped) for _ in range(args.reps))
        res = {"block_s": block, "compute_s": compute, "overlap_s": overlap, "chunks": chunks}
        res = comm.gather(res, root=0)
        if comm.rank == 0:
            out["sizes"][str(mb)] = res
    if comm.rank == 0:
        args.worker.write_text(json.dumps(out))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    import common
    from cluster_run import Cluster, run_measured

    if args.quick:
        args.sizes, args.reps = "0.5", 3
    names = [v for v in args.variants.split(";") if v] or list(VARIANTS)
    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-progress-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args.name)
    info = common.machine_info()
    results = []
    try:
        cluster.start(rate=args.rate, cpus="none")
        for i, name in enumerate(names):
            result = work / f"v{i}.json"
            result.unlink(missing_ok=True)
            env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **VARIANTS[name]}
            cmd = cluster.mpiexec([1, 1], [common.PYTHON, str(Path(__file__).resolve()), "--sizes", args.sizes,
                                           "--reps", str(args.reps), "--worker", str(result)], env)
            rec = run_measured(cluster, cmd, work / f"v{i}.log", 900)
            rec.update(variant=name, env=VARIANTS[name], command=common.shown(cmd).replace(str(work) + "/", ""),
                       data=json.loads(result.read_text()) if result.is_file() else None)
            results.append(rec)
            print(f"[{rec['time']}] {name}: exit {rec['code']}, load {rec['load']}", flush=True)
            if rec["data"]:
                for mb, per_rank in rec["data"]["sizes"].items():
                    r0 = per_rank[0]
                    print(f"   {mb} MB: block {1e3 * r0['block_s']:.1f} ms, compute {1e3 * r0['compute_s']:.1f} ms, "
                          f"overlap {1e3 * r0['overlap_s']:.1f} ms, exposed/block "
                          f"{(r0['overlap_s'] - r0['compute_s']) / r0['block_s']:.2f}", flush=True)
            else:
                print(common.tail(work / f"v{i}.log", 10), flush=True)
    finally:
        if not args.keep_cluster:
            cluster.stop()
    rows = []
    for rec in results:
        for mb, per_rank in (rec["data"] or {}).get("sizes", {}).items():
            def col(key):
                return " / ".join(f"{1e3 * r[key]:.1f}" for r in per_rank)
            exposed = [(r["overlap_s"] - r["compute_s"]) / r["block_s"] for r in per_rank]
            rows.append([rec["variant"], mb, col("block_s"), col("compute_s"), col("overlap_s"),
                         " / ".join(f"{e:.2f}" for e in exposed)])
    body = [__doc__.split("\n\n", 1)[1].strip().replace("``", "`"), "",
            f"Link {args.rate} (tbf), 2 hosts x 1 rank, a core each; load average before each variant: "
            + ", ".join(r["load"].split()[0] for r in results) + ".", "",
            common.md_table(["variant", "MB", "block ms (rank 0 / 1)", "compute ms", "overlap ms",
                             "exposed / block"], rows), "", "Commands:", "",
            common.code_block([f"# {r['variant']}\n{r['command']}" for r in results]), ""]
    suffix = "_quick" if args.quick else ""
    common.write_markdown(args.out / f"cluster_progress{suffix}.md", "Progress of a non-blocking allreduce over TCP",
                          "python benchmarks/cluster_progress.py " + " ".join(sys.argv[1:] if argv is None else argv),
                          info, body)
    (args.out / f"cluster_progress{suffix}.json").write_text(json.dumps({"machine": info, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
