"""The reading-order tables: the files one training step passes through, in the order a reader
meets them, with their line counts. README.md has the step of ``python -m mpidl.train``;
docs/tour.md also has the custom loop's ``dp.step`` under the node strategy.

    python docs/reading_order.py            # print the tables (Markdown)
    python docs/reading_order.py --write    # replace the tables between their markers
    python docs/reading_order.py --check    # exit 1 if a table's counts are off by more than 10 %
    mpiexec -n 2 python docs/reading_order.py --write   # measured with 2 ranks (rank 0 writes)

The column "run" is measured, not estimated: the distinct lines of each file that execute
during one steady-state step of the job (``sys.settrace`` from ``dp.local_indices`` to the
end of ``Trainer.train_step`` of step 3, on one process, the default job), so a reader knows
which part of a file is the step and which is set-up, options and error paths.

Edit ``STEP`` / ``NODE_STEP`` when the code moves; the counts come from the files themselves.
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOUR = ROOT / "docs" / "tour.md"
START, END = "<!-- reading-order:start -->", "<!-- reading-order:end -->"
NODE_START, NODE_END = "<!-- reading-order-node:start -->", "<!-- reading-order-node:end -->"
TOLERANCE = 0.10

#: (file, what a reader finds there), in the order one CLI step of the default job reaches
#: them (hsicnn on the built-in scene, strategy flat, balanced weighting, SGD with momentum,
#: speeds auto, no emulation, on_failure='restart'): first the set-up that composes the
#: DataParallel, then the step itself (the files whose lines run in one step).
STEP = [
    ("mpidl/train.py", "set-up: the command line: options in, the thread policy, `Trainer` built, `run()`"),
    ("mpidl/app/config.py", "set-up: every option validated once, before any MPI call"),
    ("mpidl/distributed/build.py", "set-up: `check_options` (what works with what) and `data_parallel`: the parts composed"),
    ("mpidl/distributed/split/measured.py", "set-up: the measured split: probe, fit `a_i + c_i b`, choose"),
    ("mpidl/distributed/split/balance.py", "the HDP math: cost fit, min-max split (water-filling + repair)"),
    ("mpidl/app/trainer.py", "the loop: epoch order, one step, evaluation, checkpoints"),
    ("mpidl/data/__init__.py", "this rank's slice of the global batch, read from HDF5 or memory"),
    ("mpidl/engine/models.py", "`hsicnn`: the layers of the default model"),
    ("mpidl/engine/params.py", "one flat parameter buffer and one flat gradient buffer"),
    ("mpidl/engine/nn/module.py", "`Sequential`: forward in order, backward in reverse"),
    ("mpidl/engine/nn/conv.py", "`Conv2d`: im2col + one GEMM, or Winograd"),
    ("mpidl/engine/nn/winograd.py", "Winograd's filter transform; the rest is one kernel call"),
    ("kernels/__init__.py", "the kernels' one dispatch and argument checks"),
    ("kernels/winograd_cpu.py", "the Winograd convolution's Numba kernels (what runs; its NumPy definition is winograd_reference.py)"),
    ("mpidl/engine/blas.py", "the GEMM calls of the layers"),
    ("mpidl/engine/nn/loss.py", "softmax cross-entropy, fused"),
    ("mpidl/distributed/data_parallel.py", "`DataParallel.local_indices` and `step`: weight, reduce, update, after_step"),
    ("mpidl/distributed/split/base.py", "the split `local_indices` takes its slice from"),
    ("mpidl/distributed/exchange.py", "the exchange interface: the weighted SUM by stages, the division, the finiteness"),
    ("mpidl/distributed/message.py", "the message: the gradient, its weight, the stop and non-finite slots"),
    ("mpidl/distributed/flat.py", "the flat strategy: one `Allreduce` stage"),
    ("mpidl/distributed/channel.py", "the counted collective the stage runs"),
    ("mpidl/engine/optim/core.py", "SGD on the flat buffers"),
]

#: the custom loop's ``dp.step`` (README) under the node strategy, SGD: from the call to the
#: update and the K' parameter sync.
NODE_STEP = [
    ("mpidl/distributed/data_parallel.py", "`DataParallel.step`: the weight, `reduce`, the update, `after_step`, the agreed flags"),
    ("mpidl/distributed/exchange.py", "`reduce`: the weighted SUM by stages, `reduced`: the division and the finiteness"),
    ("mpidl/distributed/message.py", "the message's slots"),
    ("mpidl/distributed/node.py", "the node strategy: the node-local `Allreduce` stage; every K' steps `after_step` averages the parameters between nodes"),
    ("mpidl/distributed/channel.py", "the counted collectives"),
    ("mpidl/engine/optim/core.py", "SGD on the flat buffers"),
]

#: page, its markers, its table, the prefix of its links (relative to the page), whether its
#: "run" column is measured (the default job's step; the node table is read, not measured)
TABLES = [(README, START, END, STEP, "", True), (TOUR, NODE_START, NODE_END, NODE_STEP, "../", False)]


def line_count(path: str) -> int:
    with open(ROOT / path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def lines_run_in_one_step(argv=("--epochs", "1", "--max-steps", "3", "--quiet"), step: int = 2) -> dict[str, int]:
    """``{repository path: distinct lines executed}`` during global step ``step`` of
    ``python -m mpidl.train ARGV`` run in this process (see the module docstring)."""
    import os  # noqa: PLC0415

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mpidl import train  # noqa: PLC0415
    from mpidl.app.trainer import Trainer  # noqa: PLC0415
    from mpidl.distributed.data_parallel import DataParallel  # noqa: PLC0415

    seen: set = set()
    tracing = [False]

    def tracer(frame, event, arg):
        if tracing[0] and event == "line":
            seen.add((frame.f_code.co_filename, frame.f_lineno))
        return tracer

    local_indices, train_step = DataParallel.local_indices, Trainer.train_step

    def traced_indices(self, batch):
        if self.steps == step:
            tracing[0] = True
            sys.settrace(tracer)
        return local_indices(self, batch)

    def traced_step(self, local):
        try:
            return train_step(self, local)
        finally:
            if tracing[0]:
                sys.settrace(None)
                tracing[0] = False

    DataParallel.local_indices, Trainer.train_step = traced_indices, traced_step
    try:
        train.main(list(argv))
    finally:
        DataParallel.local_indices, Trainer.train_step = local_indices, train_step
    counts: dict[str, int] = {}
    for filename, _ in seen:
        path = Path(filename).resolve()
        if ROOT in path.parents:
            key = str(path.relative_to(ROOT))
            counts[key] = counts.get(key, 0) + 1
    return counts


def table(step=None, prefix: str = "", run: dict | None = None) -> str:
    step = STEP if step is None else step
    missing = [path for path, _ in step if not (ROOT / path).is_file()]
    if missing:
        raise SystemExit(f"reading_order: no such file(s): {', '.join(missing)}; edit STEP in {__file__}")
    rows = ["| # | file | lines | run | what |", "| --- | --- | ---: | ---: | --- |"]
    total = total_run = 0
    for i, (path, what) in enumerate(step, 1):
        n = line_count(path)
        r = (run or {}).get(path, 0)
        total, total_run = total + n, total_run + r
        rows.append(f"| {i} | [`{path}`]({prefix}{path}) | {n} | {r if run is not None else ''} | {what} |")
    rows.append(f"| | **total** | **{total}** | {f'**{total_run}**' if run is not None else ''} | |")
    return "\n".join(rows)


def readme_counts(text: str, start: str = START, end: str = END) -> dict[str, int]:
    """``{file: lines}`` as a page's table (between ``start`` and ``end``) states them."""
    block = text.split(start, 1)[1].split(end, 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| \d+ \| \[`([^`]+)`\]\([^)]*\) \| (\d+) \|", block, re.M)}


def check(text: str, step=None, start: str = START, end: str = END) -> list[str]:
    """What is wrong with a page's table: files it lacks or has too many, counts off by
    more than ``TOLERANCE``."""
    step = STEP if step is None else step
    if start not in text or end not in text:
        return [f"no table between {start} and {end}"]
    stated = readme_counts(text, start, end)
    problems = [f"{path}: listed in the script but not in the table" for path, _ in step if path not in stated]
    problems += [f"{path}: in the table but not in the script" for path in stated if path not in dict(step)]
    for path, n in stated.items():
        if (ROOT / path).is_file():
            real = line_count(path)
            if abs(real - n) > TOLERANCE * real:
                problems.append(f"{path}: the table says {n} lines, the file has {real}")
        else:
            problems.append(f"{path}: no such file")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the tables in their pages")
    mode.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    args = parser.parse_args(argv)
    problems = []
    run = None if args.check else lines_run_in_one_step()
    if not args.check:
        from mpi4py import MPI  # noqa: PLC0415 - measured under mpiexec: rank 0 writes

        if MPI.COMM_WORLD.Get_rank() != 0:
            return 0
    for page, start, end, step, prefix, measured in TABLES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT)
        if args.check:
            problems += [f"{name}: {p}" for p in check(text, step, start, end)]
        elif args.write:
            head, rest = text.split(start, 1)
            tail = rest.split(end, 1)[1]
            page.write_text(f"{head}{start}\n{table(step, prefix, run if measured else None)}\n{end}{tail}", encoding="utf-8")
        else:
            print(f"{name}:\n{table(step, prefix, run if measured else None)}\n")
    for p in problems:
        print(f"reading_order: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
