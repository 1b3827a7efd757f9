# python benchmarks/profile_layers.py [--model resnet8] [--steps 10]
"""Where a training step goes: forward and backward time per layer of a model, summed by kind.

Every leaf layer's ``forward`` and ``backward`` is wrapped with a timer (``--clock``;
the kernels are synchronous on the CPU), the loss and the optimizer step are timed as their own
rows; after ``--warmup`` steps the median over ``--steps`` steps of each layer's time is taken,
and the table lists the per-kind sums (Conv2d 3x3, Conv2d 1x1, BatchNorm2d, ReLU, Residual's
add, pooling, Linear, ...) with their share of the step, then the ten costliest single layers.
The Residual row is the add of the two branches (forward) and of the two gradients (backward),
its branches excluded. One process, the thread policy applied first (``threads.apply()``, as a
training program does; nothing set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's mpidl, not whichever one an editable install points at (the script's folder,
# not the working directory, heads sys.path): step.py's workers get the same via PYTHONPATH.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet8")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter; cpu: process_time, CPU seconds of all threads (immune to "
                        "other processes' load; with OMP_NUM_THREADS=1 the same as wall on an idle machine)")
    args = p.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    import numpy as np  # noqa: PLC0415

    from torch_twins import TWINS  # noqa: PLC0415
    from mpidl.engine import threads  # noqa: PLC0415
    from mpidl.engine.models import build_model  # noqa: PLC0415
    from mpidl.engine.nn import Conv2d, Residual, SoftmaxCrossEntropy  # noqa: PLC0415
    from mpidl.engine.optim import SGD  # noqa: PLC0415

    threads.apply()
    twin = TWINS[args.model]
    model = build_model(args.model, twin.input_shape, twin.num_classes, seed=0)
    opt = SGD(model.params, lr=0.01, momentum=0.9)
    loss_fn = SoftmaxCrossEntropy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, *twin.input_shape)).astype(np.float32)
    y = rng.integers(0, twin.num_classes, 64)

    times: dict = defaultdict(list)  # (layer name, kind, pass) -> seconds per step

    def kind_of(module) -> str:
        name = type(module).__name__
        if isinstance(module, Conv2d):
            name += f" {module.kernel_size}x{module.kernel_size}"
        return name

    def wrap(name, module):
        kind = kind_of(module)
        forward, backward = module.forward, module.backward

        def timed(function, direction):
            def run(value):
                start = clock()
                out = function(value)
                elapsed = clock() - start
                times[(name, kind, direction)].append(elapsed)
                return out
            return run

        module.forward, module.backward = timed(forward, "forward"), timed(backward, "backward")

    def leaves(module, prefix=""):
        children = list(module.children())
        if isinstance(module, Residual) or not children:
            yield prefix, module
        if isinstance(module, Residual) or children:
            for child_name, child in children:
                yield from leaves(child, f"{prefix}.{child_name}" if prefix else child_name)

    residuals = []
    for name, module in leaves(model.net):
        wrap(name, module)
        if isinstance(module, Residual):
            residuals.append(name)

    def step():
        start = clock()
        logits = model.forward(x)
        loss_fn.forward(logits, y)
        dlogits = loss_fn.backward()
        model.backward(dlogits)
        t_opt = clock()
        opt.step()
        end = clock()
        times[("optimizer", "SGD step", "update")].append(end - t_opt)
        times[("step", "step", "total")].append(end - start)

    for _ in range(args.warmup):
        step()
    times.clear()
    for _ in range(args.steps):
        step()

    median = {key: statistics.median(values) for key, values in times.items()}
    # A Residual's time includes its branches: keep only its own add.
    for name in residuals:
        for direction in ("forward", "backward"):
            inner = sum(v for (n, _, d), v in median.items() if d == direction and n.startswith(name + "."))
            key = next(k for k in median if k[0] == name and k[2] == direction)
            median[key] = max(0.0, median[key] - inner)
    total = median.pop(("step", "step", "total"))
    by_kind: dict = defaultdict(lambda: [0.0, 0.0])
    for (name, kind, direction), value in median.items():
        by_kind[kind][0 if direction != "backward" else 1] += value
    print(f"{args.model}: step {1e3 * total:.1f} ms (median of {args.steps}); "
          f"layers + optimizer sum to {1e3 * sum(median.values()):.1f} ms (the rest: loss, Python)")
    print(f"{'kind':24s} {'forward ms':>10s} {'backward ms':>11s} {'share':>6s}")
    for kind, (fwd, bwd) in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        print(f"{kind:24s} {1e3 * fwd:10.2f} {1e3 * bwd:11.2f} {100 * (fwd + bwd) / total:5.1f}%")
    print("\ncostliest layers:")
    for (name, kind, direction), value in sorted(median.items(), key=lambda item: -item[1])[:10]:
        print(f"  {name:24s} {kind:16s} {direction:8s} {1e3 * value:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
