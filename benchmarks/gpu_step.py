# python benchmarks/gpu_step.py [--repeats 20] [--warmup 3] [--dtype float32] [--budget-s 60] [--device cpu]
"""One training step on the GPU: its time and samples/s for hsicnn and resnet8.

Cases: ``hsicnn`` on 156-band 9x9 patches at batch 64 and 512, ``resnet8`` on 3x32x32 images at
batch 64 and 256, each with the stride-1 3x3 convolutions done by im2col and by Winograd. A step is what :meth:`mpidl.app.trainer.Trainer.compute` and the optimizer do
with one local batch: copy the host batch to the GPU, forward, softmax cross-entropy (whose
``float`` loss waits for the GPU), backward into the flat gradient buffer, SGD with momentum
on the flat buffers. No MPI: this is one rank's compute.

GPU work is asynchronous, so every timed step is bracketed by a device synchronization (the
clock would otherwise stop while kernels are still queued). Each case runs ``--warmup``
untimed steps first (Numba compiles its CUDA kernels and CuPy its element-wise kernels at
first use; workspaces and the memory pool fill up), then ``--repeats`` timed steps: the table
shows the median, the spread (min-max) and samples/s = batch / median. ``copy`` is the median
time of the host-to-device copy of the batch alone (pageable memory), part of the step.

Without CuPy or a CUDA device it prints ``gpu_step: skipped: <reason>`` and exits 0. It
exits 1 if any case fails. ``--device cpu`` times the same steps on the CPU (NumPy + Numba),
for comparison, and to try this script on a machine without a GPU. ``--budget-s`` caps the timed part (each case stops repeating once
its share is spent, after at least 3 steps), so a pathologically slow step still ends in time;
on an H200 the whole run takes well under a minute, most of it kernel compilation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import numpy as np

#: (model, input_shape (C, H, W), batch, classes)
CASES = (
    ("hsicnn", (156, 9, 9), 64, 16),
    ("hsicnn", (156, 9, 9), 512, 16),
    ("resnet8", (3, 32, 32), 64, 10),
    ("resnet8", (3, 32, 32), 256, 10),
)
MIN_REPEATS = 3
CONV_ALGORITHMS = ("im2col", "winograd")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per case (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, workspaces)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--budget-s", type=float, default=60.0, help="seconds for all timed steps together")
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"], help="cpu: the same steps on the CPU")
    args = parser.parse_args(argv)
    if args.repeats < MIN_REPEATS or args.warmup < 1 or args.budget_s <= 0:
        parser.error(f"--repeats must be >= {MIN_REPEATS}, --warmup >= 1, --budget-s > 0")
    return args


def describe_gpu(cupy, ordinal: int) -> str:
    props = cupy.cuda.runtime.getDeviceProperties(ordinal)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    runtime, driver = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    import numba  # noqa: PLC0415

    return (
        f"GPU {ordinal}: {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB, compute capability "
        f"{props['major']}.{props['minor']}; CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}, "
        f"driver {driver // 1000}.{driver % 1000 // 10}; CuPy {cupy.__version__}, Numba {numba.__version__}; "
        f"CUPY_TF32={os.environ.get('CUPY_TF32', 'unset')}"
    )


def time_case(backend, model_name, input_shape, batch, num_classes, algorithm, args, budget_s):
    """Time one case; returns a dict of the table's numbers. ``algorithm``: every convolution's
    (the model's layers are all ``"auto"``; set explicitly, as ``MPIDL_CONV_ALGORITHM`` would
    for a run: a layer Winograd cannot do, stride 2, stays im2col)."""
    from mpidl import kernels  # noqa: PLC0415
    from mpidl.engine.models import build_model  # noqa: PLC0415
    from mpidl.engine.nn import Conv2d, SoftmaxCrossEntropy  # noqa: PLC0415
    from mpidl.engine.optim import build_optimizer  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((batch, *input_shape)).astype(backend.dtype)
    y_host = rng.integers(0, num_classes, size=batch)
    model = build_model(model_name, input_shape, num_classes, backend=backend, seed=0)
    for layer in model.net.modules():
        if isinstance(layer, Conv2d):
            layer.algorithm = algorithm
    optimizer = build_optimizer("sgd", model.params, lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = SoftmaxCrossEntropy()

    def step() -> float:
        logits = model.forward(backend.asarray(x_host))
        loss = loss_fn.forward(logits, y_host)  # a Python float: waits for the forward pass
        model.backward(loss_fn.backward())
        optimizer.step()
        return loss

    def timed(fn) -> float:
        backend.synchronize()
        start = time.perf_counter()
        fn()
        backend.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        loss = step()
    if not np.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss} during warm-up")
    implementation = kernels.implementation_for(backend.asarray(x_host[:1])).__name__

    step_seconds, copy_seconds = [], []
    started = time.perf_counter()
    while len(step_seconds) < args.repeats:
        step_seconds.append(timed(step))
        copy_seconds.append(timed(lambda: backend.asarray(x_host)))
        if len(step_seconds) >= MIN_REPEATS and time.perf_counter() - started > budget_s:
            break
    median = statistics.median(step_seconds)
    return {
        "median_ms": median * 1e3,
        "min_ms": min(step_seconds) * 1e3,
        "max_ms": max(step_seconds) * 1e3,
        "samples_per_s": batch / median,
        "copy_ms": statistics.median(copy_seconds) * 1e3,
        "repeats": len(step_seconds),
        "pool_mib": _pool_bytes(backend) / 2**20,
        "kernels": implementation,
    }


def _pool_bytes(backend) -> float:
    """Bytes held by CuPy's memory pool (what the case allocated on the GPU); NaN on the CPU."""
    if backend.device != "gpu":
        return float("nan")
    import cupy  # noqa: PLC0415

    return float(cupy.get_default_memory_pool().total_bytes())


def _free_pool(backend) -> None:
    """Hand the pool's free blocks back, so that one case's arrays do not count in the next."""
    if backend.device == "gpu":
        import cupy  # noqa: PLC0415

        cupy.get_default_memory_pool().free_all_blocks()


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpidl.engine import threads  # noqa: PLC0415
    from mpidl.engine.backend import get_backend, gpu_unavailable_reason  # noqa: PLC0415

    threads.apply()  # as a training program does first (the CPU's thread policy)

    if args.device == "gpu":
        reason = gpu_unavailable_reason()
        if reason is not None:
            print(f"gpu_step: skipped: {reason}")
            return 0
    backend = get_backend(args.device, args.dtype)
    if args.device == "gpu":
        import cupy  # noqa: PLC0415

        ordinal = backend.select_device(0)  # CUDA_VISIBLE_DEVICES picks which GPU this is
        print(f"gpu_step: {describe_gpu(cupy, ordinal)}")
    else:
        print(f"gpu_step: --device cpu: the CPU, {os.cpu_count()} cores (for comparison; no GPU involved)")
    print(f"gpu_step: {args.dtype}, {args.warmup} warm-up + up to {args.repeats} timed steps per case; "
          f"step = host batch -> device, forward, loss, backward, SGD (momentum 0.9)\n")

    header = (f"{'model':<8} {'input':<10} {'batch':>5} {'conv':<8} {'step ms':>9} {'min-max ms':>15} {'spread':>7} "
              f"{'samples/s':>10} {'copy ms':>8} {'pool MiB':>9} {'n':>3}  kernels")
    print(header)
    print("-" * len(header))
    failures = 0
    wall = time.perf_counter()
    runs = [(case, algorithm) for case in CASES for algorithm in CONV_ALGORITHMS]
    for (model_name, input_shape, batch, num_classes), algorithm in runs:
        shape = "x".join(map(str, input_shape))
        try:
            r = time_case(backend, model_name, input_shape, batch, num_classes, algorithm, args,
                          args.budget_s / len(runs))
        except Exception as exc:  # noqa: BLE001 - report the case, go on with the others
            failures += 1
            print(f"{model_name:<8} {shape:<10} {batch:>5} {algorithm:<8}  FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
            continue
        spread = (r["max_ms"] - r["min_ms"]) / r["median_ms"] * 100
        print(f"{model_name:<8} {shape:<10} {batch:>5} {algorithm:<8} {r['median_ms']:>9.2f} "
              f"{r['min_ms']:>7.2f}-{r['max_ms']:<7.2f} {spread:>6.0f}% {r['samples_per_s']:>10.0f} "
              f"{r['copy_ms']:>8.2f} {r['pool_mib']:>9.0f} {r['repeats']:>3}  {r['kernels']}", flush=True)
        _free_pool(backend)
    print(f"\ngpu_step: {len(runs) - failures}/{len(runs)} cases in {time.perf_counter() - wall:.1f} s "
          f"(spread = (max - min) / median; conv: the stride-1 3x3 layers' algorithm (Conv2d.algorithm); "
          f"Conv2d's 'auto' uses im2col on the GPU until these numbers say otherwise)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
