# python benchmarks/conv.py [--repeats 5] [--threads 1 --clock cpu] [--openblas-coretype auto]
"""Convolution speed on the CPU: im2col and Winograd, NumPy reference kernels and Numba kernels.

For each model (``hsicnn``: 156-band 9x9 patches; ``resnet8``: 3x32x32 images; batch 64) it
measures

* one training step: forward, softmax cross-entropy, backward, and the SGD update on the
  flat buffers (``params.data -= lr * params.grad``);
* the convolution layers alone (every Conv2d of the model: forward + backward on inputs of
  the shapes they see in the model);

for each convolution algorithm (every layer's ``Conv2d.algorithm`` set to ``im2col``, or to
``winograd``, which Conv2d's default ``"auto"`` picks for the stride-1 3x3 layers; the others
stay im2col) and each kernel set (``kernels.use("reference")`` and the Numba CPU kernels).
The runs are
interleaved (every contender once per round, in turn) so that load from other processes falls
on all of them alike; each time is the median of ``--repeats`` rounds, with the min and max
shown as the spread.

Convolution FLOPs are those of a direct convolution (= the im2col GEMMs):
``2*F*C*kh*kw*OH*OW*N`` forward, the same again for the weight gradient, and once more for the
input gradient where it is computed (the first layer skips it: nobody needs the gradient of
the data). ``conv GFLOP/s`` divides those by the time, so for Winograd, which does fewer
multiplications, it is an *effective* rate (the rate a direct convolution would need to be as
fast); ``real GFLOP/s`` divides the FLOPs the algorithm's GEMMs really do (the header gives
both counts) by the same time. The rates are set against
the machine's sgemm rate measured in the same run with NumPy float32 matmuls (a large square
product: the peak), and ``GEMMs alone`` is the time of the very matrix products the layers do
(same shapes, same memory order) without the kernels around them.

OpenBLAS picks its GEMM kernels for the CPU it detects, unless ``OPENBLAS_CORETYPE`` forces a
set (e.g. ``Haswell``, the AVX2 kernels, on an AVX-512 CPU; on this machine's AMD Zen 4, which
runs AVX-512 on 256-bit units, the two gave 181 and 189 GFLOP/s for a 2048^2 sgemm).
``--openblas-coretype NAME`` sets it before NumPy loads (``--openblas-coretype auto`` removes
it, so OpenBLAS detects the CPU); the kernel set in use is printed either way.

When PyTorch is importable (it is not a dependency of mpidl), the same hsicnn network is
timed in PyTorch on the CPU with the same threads and batch, and the table shows the ratio
mpidl / torch per step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per measurement (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per round (the round's time is divided by it)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (JIT compilation, workspaces)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["hsicnn", "resnet8"], choices=["hsicnn", "resnet8"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS, Numba and torch threads")
    parser.add_argument(
        "--openblas-coretype", default=None, help="set OPENBLAS_CORETYPE before NumPy loads (e.g. SkylakeX; 'auto' unsets it: OpenBLAS detects the CPU)"
    )
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (with --threads 1 it is immune to other "
        "processes sharing the cores, which a loaded machine needs)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch column even if torch imports")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (CPU time of several threads adds up, spin-waits included)")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.threads < 1:
        parser.error("--repeats, --steps, --batch and --threads must be >= 1, --warmup >= 0")
    return args


ARGS = parse_args()
# Thread counts must be fixed before NumPy (OpenBLAS) and Numba start their thread pools.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
# As mpidl.train does: Numba's OpenMP workers otherwise busy-wait after each parallel region
# and starve OpenBLAS's threads on the same cores (it applies to torch's OpenMP pool too).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Also as mpidl.train does: OpenBLAS's workers spin ~0.1 s after each GEMM. Without this they
# slow mpidl's non-GEMM kernels AND the torch step timed later in this same process (by up
# to half of torch's hsicnn step: benchmarks/results/notebook.md).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
if ARGS.openblas_coretype == "auto":
    os.environ.pop("OPENBLAS_CORETYPE", None)
elif ARGS.openblas_coretype:
    os.environ["OPENBLAS_CORETYPE"] = ARGS.openblas_coretype

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from mpidl import kernels  # noqa: E402
from mpidl.engine import threads  # noqa: E402
from mpidl.engine.blas import batched_matmul  # noqa: E402
from mpidl.engine.models import build_model  # noqa: E402
from mpidl.engine.nn import Conv2d, SoftmaxCrossEntropy  # noqa: E402

threads.apply()  # as a training program does first: the thread policy (the counts set above win)

MODEL_INPUTS = {"hsicnn": ((156, 9, 9), 16), "resnet8": ((3, 32, 32), 10)}
LEARNING_RATE = 0.01
IMPLEMENTATIONS = ("reference", "cpu")
ALGORITHMS = ("im2col", "winograd")


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


class Timings:
    """Seconds per step of each labelled contender, collected round by round."""

    def __init__(self):
        self.samples: dict[str, list[float]] = {}

    def add(self, label: str, seconds: float) -> None:
        self.samples.setdefault(label, []).append(seconds)

    def median(self, label: str) -> float:
        return statistics.median(self.samples[label])

    def spread(self, label: str) -> str:
        values = self.samples[label]
        return f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"


def clock():
    """The timer chosen with --clock."""
    return time.process_time() if ARGS.clock == "cpu" else time.perf_counter()


def run_interleaved(contenders: dict, steps: int, repeats: int, warmup: int) -> Timings:
    """``contenders``: label -> (setting, step). ``setting()`` is the context in which that
    contender runs (e.g. a kernel family, :func:`using`), ``step()`` runs one unit of work.
    Every contender is warmed up, then timed once per round, in turn."""
    timings = Timings()
    for setting, step in contenders.values():
        with setting():
            for _ in range(warmup):
                step()
    for _ in range(repeats):
        for label, (setting, step) in contenders.items():
            with setting():
                start = clock()
                for _ in range(steps):
                    step()
                timings.add(label, (clock() - start) / steps)
    return timings


def using(convs, family: str, algorithm: str = "im2col"):
    """A contender's setting: the kernel family ``family`` (:func:`mpidl.kernels.use`) and
    ``algorithm`` on every layer of ``convs`` (``Conv2d.algorithm``; the layers are the model's,
    all ``"auto"``, restored after; a layer Winograd cannot do stays im2col)."""

    @contextlib.contextmanager
    def setting():
        before = [conv.algorithm for conv in convs]
        for conv in convs:
            conv.algorithm = algorithm
        try:
            with kernels.use(family):
                yield
        finally:
            for conv, kept in zip(convs, before):
                conv.algorithm = kept

    return setting


# --------------------------------------------------------------------------------------------
# mpidl: a training step and the convolution layers alone
# --------------------------------------------------------------------------------------------


def make_batch(input_shape, num_classes, batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *input_shape)).astype(np.float32)
    y = rng.integers(0, num_classes, size=batch)
    return x, y


def training_step(model, x, y):
    loss = SoftmaxCrossEntropy()

    def step():
        loss.forward(model.forward(x), y)
        model.backward(loss.backward())
        model.params.data -= LEARNING_RATE * model.params.grad

    return step


def conv_layers_and_inputs(model, x):
    """Every Conv2d of ``model`` with the input shape it sees, found by one forward pass in
    which each conv's ``forward`` is wrapped (on the instance, removed again afterwards)."""
    convs = [m for m in model.net.modules() if isinstance(m, Conv2d)]
    shapes = {}
    for conv in convs:
        def recording_forward(inp, conv=conv):
            shapes[id(conv)] = tuple(inp.shape)
            return type(conv).forward(conv, inp)

        conv.forward = recording_forward
    try:
        model.forward(x)
    finally:
        for conv in convs:
            del conv.forward
    return [(conv, shapes[id(conv)]) for conv in convs]


def conv_only_step(layers, seed=1):
    """Forward + backward of every conv layer on random inputs / output gradients."""
    rng = np.random.default_rng(seed)
    work = []
    for conv, x_shape in layers:
        x = rng.standard_normal(x_shape).astype(np.float32)
        dy = rng.standard_normal(conv.output_shape(x_shape)).astype(np.float32)
        work.append((conv, x, dy))

    def step():
        for conv, x, dy in work:
            conv.forward(x)
            conv.backward(dy)

    return step


def gemm_shapes(layers, algorithm: str):
    """The GEMMs of one forward + backward of the conv layers: (kind, batch, M, K, N) each, as
    Conv2d does them. im2col: Y = W2 @ cols; dW2 = dY @ cols.T; dcols = W2.T @ dY (batch 1).
    Winograd (layers it applies to): alpha^2 products each, M = U @ V; dU = dM @ V.T;
    dV = U.T @ dM with P = tiles*N columns."""
    gemms = []
    for conv, (n, c, h, w) in layers:
        _, f, oh, ow = conv.output_shape((n, c, h, w))
        tile = conv.winograd_tile(oh, ow) if algorithm == "winograd" else None
        if tile is None:
            ckk, pixels = c * conv.kernel_size**2, n * oh * ow
            gemms.append(("W@cols", 1, f, ckk, pixels))
            gemms.append(("dY@cols.T", 1, f, pixels, ckk))
            if conv.compute_input_grad:
                gemms.append(("W.T@dY", 1, ckk, f, pixels))
            continue
        alpha = tile + conv.kernel_size - 1
        _, _, tiles_h, tiles_w = kernels.winograd_geometry((n, c, h, w), tile, conv.kernel_size, conv.padding)
        columns = tiles_h * tiles_w * n
        gemms.append(("W@cols", alpha**2, f, c, columns))
        gemms.append(("dY@cols.T", alpha**2, f, columns, c))
        if conv.compute_input_grad:
            gemms.append(("W.T@dY", alpha**2, c, f, columns))
    return gemms


def gemm_flops(gemms) -> float:
    return float(sum(2 * batch * m * k * n for _, batch, m, k, n in gemms))


def sgemm_step(gemms, seed=2):
    """The conv GEMMs alone, NumPy float32, with the operands' memory order Conv2d uses."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    work = []
    for kind, batch, m, k, n in gemms:
        if kind == "dY@cols.T":  # right operand is a transposed (C-contiguous) cols / V
            a, b = normal(batch, m, k), normal(batch, n, k).transpose(0, 2, 1)
        elif kind == "W.T@dY":  # left operand is a transposed weight / U
            a, b = normal(batch, k, m).transpose(0, 2, 1), normal(batch, k, n)
        else:
            a, b = normal(batch, m, k), normal(batch, k, n)
        if batch == 1:
            a, b = a[0], b[0]
        work.append((a, b, np.empty((m, n) if batch == 1 else (batch, m, n), np.float32)))

    def step():
        for a, b, out in work:
            if out.ndim == 3:
                batched_matmul(a, b, out)  # the stack of alpha^2 products, split between threads
            else:
                np.matmul(a, b, out=out)

    return step


def sgemm_peak(size=2048, repeats=5) -> float:
    """GFLOP/s of one large square float32 matmul (best of ``repeats``)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((size, size)).astype(np.float32)
    b = rng.standard_normal((size, size)).astype(np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)
    best = min(_timed(lambda: np.matmul(a, b, out=out)) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def openblas_core() -> str:
    """The kernel set OpenBLAS chose at load time (e.g. 'Haswell', 'SkylakeX'), or '?'."""
    import ctypes  # noqa: PLC0415

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and line.split()[-1].startswith("/")}
    except OSError:
        return "?"
    for path in paths:
        library = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                       "openblas_get_corename"):
            function = getattr(library, symbol, None)
            if function is not None:
                function.restype = ctypes.c_char_p
                return function().decode()
    return "?"


def _timed(fn) -> float:
    start = clock()
    fn()
    return clock() - start


# --------------------------------------------------------------------------------------------
# PyTorch (optional): the same hsicnn
# --------------------------------------------------------------------------------------------


def torch_hsicnn_step(input_shape, num_classes, batch, threads):
    """A training step of hsicnn in PyTorch (CPU), or None when torch does not import."""
    try:
        import torch  # noqa: PLC0415 - optional, for comparison only
    except ImportError:
        return None, None
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    bands, height, width = input_shape
    # mpidl's hsicnn: conv3x3(64)+ReLU, conv3x3(64)+ReLU, maxpool 2, linear(128)+ReLU, linear.
    net = torch.nn.Sequential(
        torch.nn.Conv2d(bands, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * (height // 2) * (width // 2), 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, num_classes),
    )
    x_np, y_np = make_batch(input_shape, num_classes, batch)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    params = list(net.parameters())

    def step():
        for p in params:
            p.grad = None
        torch.nn.functional.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p in params:
                p.sub_(LEARNING_RATE * p.grad)

    return step, torch.__version__


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def main():
    args = ARGS
    import numba  # noqa: PLC0415

    print(f"# benchmarks/conv.py: batch {args.batch}, {args.threads} thread(s), {args.repeats} rounds x "
          f"{args.steps} step(s), {args.clock} clock, numpy {np.__version__}, numba {numba.__version__}, "
          f"load average before {os.getloadavg()[0]:.2f}")
    peak = sgemm_peak()
    print(f"sgemm peak (NumPy float32 2048x2048 @ 2048x2048, best of 5): {peak:.0f} GFLOP/s; OpenBLAS kernels: "
          f"{openblas_core()} (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset: detected')}); "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print()

    rows = []
    for name in args.models:
        input_shape, num_classes = MODEL_INPUTS[name]
        model = build_model(name, input_shape, num_classes, seed=0)
        x, y = make_batch(input_shape, num_classes, args.batch)
        with kernels.use("reference"):
            layers = conv_layers_and_inputs(model, x)
        convs = [conv for conv, _ in layers]
        flops = gemm_flops(gemm_shapes(layers, "im2col"))  # = a direct convolution's
        winograd_flops = gemm_flops(gemm_shapes(layers, "winograd"))

        step_fn = training_step(model, x, y)
        conv_fn = conv_only_step(layers)
        contenders = {}
        for algorithm in ALGORITHMS:
            for impl in IMPLEMENTATIONS:
                contenders[f"step/{algorithm}/{impl}"] = (using(convs, impl, algorithm), step_fn)
                contenders[f"conv/{algorithm}/{impl}"] = (using(convs, impl, algorithm), conv_fn)
            contenders[f"sgemm/{algorithm}"] = (contextlib.nullcontext, sgemm_step(gemm_shapes(layers, algorithm)))
        torch_version = None
        if name == "hsicnn" and not args.no_torch:
            torch_step, torch_version = torch_hsicnn_step(input_shape, num_classes, args.batch, args.threads)
            if torch_step is not None:
                contenders["step/torch"] = (contextlib.nullcontext, torch_step)
        timings = run_interleaved(contenders, args.steps, args.repeats, args.warmup)

        print(f"## {name}: input {input_shape}, {len(layers)} conv layers, {flops / 1e9:.2f} GFLOP per step as a direct "
              f"convolution (im2col GEMMs); Winograd's GEMMs do {winograd_flops / 1e9:.2f} GFLOP "
              f"({100 * winograd_flops / flops:.0f} %); GEMMs alone in NumPy: im2col "
              f"{timings.median('sgemm/im2col') * 1e3:.1f} ms ({flops / timings.median('sgemm/im2col') / 1e9:.0f} GFLOP/s), "
              f"winograd {timings.median('sgemm/winograd') * 1e3:.1f} ms "
              f"({winograd_flops / timings.median('sgemm/winograd') / 1e9:.0f} GFLOP/s)")
        for algorithm in ALGORITHMS:
            for impl in IMPLEMENTATIONS:
                step, conv = timings.median(f"step/{algorithm}/{impl}"), timings.median(f"conv/{algorithm}/{impl}")
                conv_rate = flops / conv / 1e9
                real_flops = winograd_flops if algorithm == "winograd" else flops
                row = {
                    "model": name,
                    "algorithm": algorithm,
                    "kernels": impl,
                    "step ms": f"{step * 1e3:.1f}",
                    "spread": timings.spread(f"step/{algorithm}/{impl}"),
                    "samples/s": f"{args.batch / step:.0f}",
                    "conv ms": f"{conv * 1e3:.1f}",
                    "conv GFLOP/s": f"{conv_rate:.0f}",
                    "% sgemm peak": f"{100 * conv_rate / peak:.0f}",
                    "real GFLOP/s": f"{real_flops / conv / 1e9:.0f}",
                    "GEMMs alone ms": f"{timings.median(f'sgemm/{algorithm}') * 1e3:.1f}",
                    "torch ms": "",
                    "mpidl/torch": "",
                }
                if "step/torch" in timings.samples:
                    torch_step_s = timings.median("step/torch")
                    row["torch ms"] = f"{torch_step_s * 1e3:.1f} ({timings.spread('step/torch')})"
                    row["mpidl/torch"] = f"{step / torch_step_s:.2f}"
                rows.append(row)
        if torch_version:
            print(f"   torch {torch_version}, {args.threads} thread(s)")
        print()

    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for row in rows:
        print(" | ".join(row[c].ljust(widths[c]) for c in columns))
    print(f"\n(times are medians of {args.repeats} rounds; spread = min-max ms; conv GFLOP/s = direct-convolution "
          f"FLOPs / conv time, an effective rate for winograd; load average after {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
