# python benchmarks/winograd_pieces.py [--model resnet8] [--reps 30]
"""Each piece of every Winograd convolution of a model, timed alone, against the whole layer.

For every 3x3 stride-1 ``Conv2d`` that runs Winograd (``Conv2d.winograd_tile``), on the input
it receives in one forward pass of a batch of 64: the filter transform, the input transform
``V = B^T d B``, the batched GEMM ``M = U V``, the output transform ``y = A^T M A``, and in
backward the output adjoint, the two batched GEMMs ``dU``, ``dV``, the filter adjoint and
the input adjoint; then the layer's ``forward`` and ``forward + backward`` as a whole. Each
is repeated ``--reps`` times after one untimed call: wall ms per call and the cores it used
(CPU seconds of all threads / wall seconds).

What it tells: a piece timed alone runs with its operands warm in the caches. When the
pieces use both cores but the layer inside a training step (``benchmarks/profile_layers.py``
with ``--clock wall`` and ``--clock cpu``) is slower and uses fewer cores, the loss is
between the kernels (memory traffic of the transformed intermediates, Python), not in their
threading. One process, the thread policy as applied by mpidl (nothing set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# This checkout's mpidl, whatever an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, reps: int) -> tuple[float, float]:
    """(wall ms per call, cores used) of ``fn`` over ``reps`` calls after one untimed call."""
    fn()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return 1e3 * wall / reps, cpu / wall if wall > 0 else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    if args.reps < 1 or args.batch < 1:
        p.error("--reps and --batch must be >= 1")

    import numpy as np  # noqa: PLC0415

    from mpidl import kernels  # noqa: PLC0415
    from mpidl.blas import batched_matmul  # noqa: PLC0415
    from mpidl.models import MODELS, build_model  # noqa: PLC0415
    from mpidl.nn import Conv2d  # noqa: PLC0415
    from mpidl.nn import winograd  # noqa: PLC0415
    from mpidl.nn.module import workspace  # noqa: PLC0415

    if args.model not in MODELS:
        p.error(f"--model must be one of {', '.join(MODELS)}")
    shape = (3, 32, 32) if args.model.startswith("resnet") else (156, 9, 9)
    model = build_model(args.model, shape, 10, seed=0)
    x = np.random.default_rng(0).standard_normal((args.batch, *shape)).astype(np.float32)
    inputs = {}
    for module in model.net.modules():
        if isinstance(module, Conv2d):
            def keep(inp, forward=module.forward, module=module):
                inputs[id(module)] = inp
                return forward(inp)
            module.forward = keep
    model.forward(x)
    layers = [m for m in model.net.modules() if isinstance(m, Conv2d) and id(m) in inputs
              and m.winograd_tile(*m.output_shape(inputs[id(m)].shape)[2:]) is not None]
    if not layers:
        print(f"{args.model}: no convolution runs Winograd")
        return 0
    names = ("filter", "input", "gemm", "output", "out_adj", "gemm_dU", "filter_adj", "gemm_dV", "in_adj")
    totals = {name: [0.0, 0.0] for name in names}
    print(f"{args.model}, batch {args.batch}: wall ms per call (cores used)")
    for conv in layers:
        inp = inputs[id(conv)]
        n, f, oh, ow = conv.output_shape(inp.shape)
        m, k, p_, c = conv.winograd_tile(oh, ow), conv.kernel_size, conv.padding, conv.in_channels
        alpha = m + k - 1
        _, _, tiles_h, tiles_w = kernels.winograd_geometry(inp.shape, m, k, p_)
        columns = tiles_h * tiles_w * n
        ws = conv._workspaces
        u = winograd._filter_transform(conv, m, inp)
        v = workspace(ws, "V", (c, alpha, alpha, columns), inp)
        mt = workspace(ws, "M", (f, alpha, alpha, columns), inp)
        dy = np.ones((n, f, oh, ow), dtype=inp.dtype)
        dm = workspace(ws, "dM", (f, alpha, alpha, columns), dy)
        du = workspace(ws, "dU", (alpha * alpha, f, c), dy)
        dv = workspace(ws, "dV", (c, alpha, alpha, columns), dy)
        by_position = winograd._by_position
        pieces = {
            "filter": lambda: winograd._filter_transform(conv, m, inp),
            "input": lambda: kernels.winograd_input(inp, m, k, p_, out=v),
            "gemm": lambda: batched_matmul(u, by_position(v), by_position(mt)),
            "output": lambda: kernels.winograd_output(mt, (n, f, oh, ow), m, k, bias=None),
            "out_adj": lambda: kernels.winograd_output_adjoint(dy, m, k, out=dm),
            "gemm_dU": lambda: batched_matmul(by_position(dm), by_position(v).transpose(0, 2, 1), du),
            "filter_adj": lambda: winograd._filter_transform_adjoint(conv, du, m),
            "gemm_dV": lambda: batched_matmul(u.transpose(0, 2, 1), by_position(dm), by_position(dv)),
            "in_adj": lambda: kernels.winograd_input_adjoint(dv, inp.shape, m, k, p_),
        }
        cells = []
        for name, fn in pieces.items():
            ms, cores = timed(fn, args.reps)
            totals[name][0] += ms
            totals[name][1] += ms * cores
            cells.append(f"{name} {ms:.2f} ({cores:.2f})")
        forward_ms, forward_cores = timed(lambda: conv.forward(inp), args.reps)

        def forward_backward():
            conv.forward(inp)
            conv.backward(dy)

        both_ms, both_cores = timed(forward_backward, args.reps)
        print(f"C={c} F={f} {oh}x{ow} tile {m}: " + "  ".join(cells))
        print(f"    whole layer: forward {forward_ms:.2f} ({forward_cores:.2f}), "
              f"forward + backward {both_ms:.2f} ({both_cores:.2f})")
    print("all layers: " + "  ".join(f"{name} {ms:.2f} ({cpu / ms if ms else 0:.2f})"
                                     for name, (ms, cpu) in totals.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
