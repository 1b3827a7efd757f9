# mpiexec -n 2 python benchmarks/overlap_hook_cpu.py MODEL [overlap|blocking] [STEPS]
#     (on jobs/cluster.sh hosts: see docs/results_cluster.md)
"""Where ``--overlap`` spends the backward's CPU: wall and THREAD CPU time of its hook and of
its parts, per step (diagnostic; prints one line per rank, writes nothing).

The thread's CPU time is split into user and system (``getrusage(RUSAGE_THREAD)``), and the
rank's core (its cpuset's first CPU) is read from ``/proc/stat`` around the compute phases:
``core user/system/softirq`` are the kernel's tick counts of that core (USER_HZ, 10 ms each),
whoever ran. A tick in a softirq (the network stack: TCP, veth, bridge, ``tbf``) is charged to
the task it interrupted as system time, so compute phases that grow in system time and in the
core's softirq ticks pay for packet work, not for Python or MPI calls. ``blocking`` runs the
same steps without overlap (the exchange after the backward), the baseline to compare with.

flat, ``overlap=True``, ``bucket_mb`` 1; random inputs 32 x 9 x 9, 128 samples per rank; 2
warm-up steps, then 20 steps. Thread CPU time (``time.thread_time``) is the figure that
survives a loaded machine: wall time there is mostly waiting for the core. Columns:
``comp`` (local_indices to the end of backward), ``step`` (``dp.step``: the rest of the
exchange), and per instrumented method (wall ms, CPU ms, calls) per step:
``_gradients_final`` (the hook: all of what overlap adds to the backward), ``_progress``
(starting and Testing, inside the hook and in ``reduce``), ``_start`` (scaling a bucket and
starting its collective), ``_wait_one`` (the final wait).
"""

import collections
import os
import resource
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidl.distributed import Topology, data_parallel  # noqa: E402
from mpidl.engine.models import build_model  # noqa: E402
from mpidl.engine.nn import SoftmaxCrossEntropy  # noqa: E402
from mpidl.engine.optim import SGD  # noqa: E402


def core_ticks(cpu: int) -> dict:
    """``/proc/stat`` ticks (user, system, softirq) of one CPU."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                v = [int(x) for x in line.split()[1:]]
                return {"user": v[0] + v[1], "system": v[2], "softirq": v[6]}
    return {"user": 0, "system": 0, "softirq": 0}


def thread_user_system() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime, usage.ru_stime


def main(name: str, steps: int = 20, local_batch: int = 128, overlap: bool = True) -> None:
    world = MPI.COMM_WORLD
    core = min(os.sched_getaffinity(0))
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    model = build_model(name, (32, 9, 9), 10, seed=0)
    opt = SGD(model.params, lr=1e-3, momentum=0.9)
    dp = data_parallel(model, opt, batch_size=local_batch * world.Get_size(), topology=Topology.from_comm(world),
                       strategy="flat", overlap=overlap, bucket_mb=1.0)
    rng = np.random.default_rng(world.Get_rank())
    x = rng.standard_normal((local_batch, 32, 9, 9)).astype(np.float32)
    y = rng.integers(0, 10, local_batch)
    loss = SoftmaxCrossEntropy()
    ex = dp.exchange
    wall, cpu, calls = collections.defaultdict(float), collections.defaultdict(float), collections.defaultdict(int)

    def instrument(method: str) -> None:
        inner = getattr(ex, method)

        def timed(*args):
            t, c = time.perf_counter(), time.thread_time()
            out = inner(*args)
            wall[method] += time.perf_counter() - t
            cpu[method] += time.thread_time() - c
            calls[method] += 1
            return out
        setattr(ex, method, timed)

    if overlap:
        model.net.unwatch_gradients()  # re-installed below with the instrumented hook
    for method in ("_start", "_progress", "_gradients_final", "_wait_one"):
        if hasattr(ex, method):  # the blocking exchange has none of them
            instrument(method)
    if overlap:
        model.net.watch_gradients(ex._gradients_final)
    total = collections.defaultdict(float)
    for step in range(steps + 2):
        if step == 2:
            for d in (wall, cpu, calls, total):
                d.clear()
        world.Barrier()
        t0, c0, (u0, s0), k0 = time.perf_counter(), time.thread_time(), thread_user_system(), core_ticks(core)
        dp.local_indices(np.arange(local_batch * dp.size))
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        t1, c1, (u1, s1), k1 = time.perf_counter(), time.thread_time(), thread_user_system(), core_ticks(core)
        dp.step(local_batch)
        t2, c2 = time.perf_counter(), time.thread_time()
        if step >= 2:
            total["comp wall"] += t1 - t0
            total["comp cpu"] += c1 - c0
            total["comp user"] += u1 - u0
            total["comp system"] += s1 - s0
            for k in k1:
                total[f"core {k}"] += (k1[k] - k0[k]) * tick
            total["step wall"] += t2 - t1
            total["step cpu"] += c2 - c1
    per = {k: round(1e3 * v / steps, 2) for k, v in total.items()}
    parts = {k: (round(1e3 * wall[k] / steps, 2), round(1e3 * cpu[k] / steps, 2), calls[k] / steps) for k in wall}
    mode = "overlap" if overlap else "blocking"
    print(f"rank {world.Get_rank()} {name} {mode} core {core} ms/step: {per}; (wall, cpu, calls) per step: {parts}",
          flush=True)
    dp.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vit", steps=int(sys.argv[3]) if len(sys.argv) > 3 else 20,
         overlap=not (len(sys.argv) > 2 and sys.argv[2] == "blocking"))
