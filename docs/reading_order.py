"""The reading-order tables: the files one training step passes through, in the order a reader
meets them, with their line counts. README.md has the step of ``python -m mpidl.train``;
docs/tour.md also has the custom loop's ``dp.step`` under the node strategy.

    python docs/reading_order.py            # print the tables (Markdown)
    python docs/reading_order.py --write    # replace the tables between their markers
    python docs/reading_order.py --check    # exit 1 if a table's counts are off by more than 10 %

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
#: no emulation, on_failure='restart'): first the set-up that composes the DataParallel, then
#: the step itself. Small files the step passes through are named in the row of the one that
#: calls them (``topology.py``, built by train.py; the split, ``split/``; the clock,
#: ``clock.py``; the message, ``message.py``; the channel, ``channel.py``).
#: ``elastic/loop.py`` (an epoch as one stretch) only runs the loop.
STEP = [
    ("mpidl/train.py", "set-up: the command line: options in, `Trainer` built, `run()`"),
    ("mpidl/app/config.py", "set-up: every option validated once, before any MPI call"),
    ("mpidl/distributed/build.py", "set-up: `data_parallel(...)`: options to the composed `DataParallel` (exchange, split, clock), and the rules between them"),
    ("mpidl/app/trainer.py", "the loop: epoch order, one step, evaluation, checkpoints"),
    ("mpidl/data/__init__.py", "this rank's slice of the global batch, read from HDF5 or memory"),
    ("mpidl/engine/models.py", "`hsicnn`: the layers of the default model"),
    ("mpidl/engine/params.py", "one flat parameter buffer and one flat gradient buffer"),
    ("mpidl/engine/nn/module.py", "`Sequential`: forward in order, backward in reverse"),
    ("mpidl/engine/nn/conv.py", "`Conv2d`: im2col + one GEMM, or Winograd"),
    ("mpidl/engine/nn/winograd.py", "Winograd's filter transform; the rest is one kernel call"),
    ("kernels/__init__.py", "the kernels' one dispatch and argument checks"),
    ("kernels/winograd_reference.py", "the Winograd convolution in NumPy: the definition"),
    ("mpidl/engine/nn/loss.py", "softmax cross-entropy, fused"),
    ("mpidl/distributed/data_parallel.py", "`DataParallel.local_indices` (the split's slice) and `step`: the compute clock, the weight, the exchange's reduce, the update, `after_step`"),
    ("mpidl/distributed/exchange.py", "the exchange interface: `reduce` = the stages on the message (gradient, count, stop and non-finite slots), then `reduced()`: the division, the finiteness check"),
    ("mpidl/distributed/flat.py", "the flat strategy: one stage, a world `Allreduce` (through a counted channel, `channel.py`)"),
    ("mpidl/engine/optim.py", "SGD (and the other rules) on the flat buffers"),
]

#: the custom loop's ``dp.step`` (README) with ``exchange=Node(topology, sync_every=10)``,
#: SGD: from the call to the update and the K' parameter sync.
NODE_STEP = [
    ("mpidl/distributed/data_parallel.py", "`DataParallel.step`: the clock, the weight, the exchange's calls, the agreed flags"),
    ("mpidl/distributed/clock.py", "the compute clock `step` stops"),
    ("mpidl/distributed/split/base.py", "`FixedSplit`: the equal split of `local_indices`; `observe` and `after_step` do nothing"),
    ("mpidl/distributed/exchange.py", "`reduce`: the weight, the stages, `reduced()`: the division, the finiteness check"),
    ("mpidl/distributed/message.py", "the message's slots"),
    ("mpidl/distributed/node.py", "the node strategy: one stage, the node-local `Allreduce`; `reduced` counts the node's weight; every K' steps `after_step` averages the parameters between nodes"),
    ("mpidl/distributed/channel.py", "the counted collectives of the stage and the sync"),
    ("mpidl/engine/optim.py", "SGD on the flat buffers"),
]

#: page, its markers, its table, the prefix of its links (relative to the page)
TABLES = [(README, START, END, STEP, ""), (TOUR, NODE_START, NODE_END, NODE_STEP, "../")]


def line_count(path: str) -> int:
    with open(ROOT / path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def table(step=None, prefix: str = "") -> str:
    step = STEP if step is None else step
    missing = [path for path, _ in step if not (ROOT / path).is_file()]
    if missing:
        raise SystemExit(f"reading_order: no such file(s): {', '.join(missing)}; edit STEP in {__file__}")
    rows = ["| # | file | lines | what |", "| --- | --- | ---: | --- |"]
    total = 0
    for i, (path, what) in enumerate(step, 1):
        n = line_count(path)
        total += n
        rows.append(f"| {i} | [`{path}`]({prefix}{path}) | {n} | {what} |")
    rows.append(f"| | **total** | **{total}** | |")
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
    for page, start, end, step, prefix in TABLES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT)
        if args.check:
            problems += [f"{name}: {p}" for p in check(text, step, start, end)]
        elif args.write:
            head, rest = text.split(start, 1)
            tail = rest.split(end, 1)[1]
            page.write_text(f"{head}{start}\n{table(step, prefix)}\n{end}{tail}", encoding="utf-8")
        else:
            print(f"{name}:\n{table(step, prefix)}\n")
    for p in problems:
        print(f"reading_order: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
