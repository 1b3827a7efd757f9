"""The README's reading-order table: the files one training step of ``python -m mpidl.train``
passes through, in the order a reader meets them, with their line counts.

    python docs/reading_order.py            # print the table (Markdown)
    python docs/reading_order.py --write    # replace the table in README.md between its markers
    python docs/reading_order.py --check    # exit 1 if README.md's counts are off by more than 10 %

Edit ``STEP`` when the code moves; the counts come from the files themselves.
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- reading-order:start -->", "<!-- reading-order:end -->"
TOLERANCE = 0.10

#: (file, what a reader finds there), in the order one step of the default job reaches them:
#: hsicnn on the built-in scene, strategy flat, balanced weighting, SGD with momentum.
STEP = [
    ("mpidl/train.py", "the command line: options in, `Trainer` built, `run()`"),
    ("mpidl/config.py", "every option validated once, before any MPI call"),
    ("mpidl/trainer.py", "the loop: epoch order, one step, evaluation, checkpoints"),
    ("mpidl/data.py", "this rank's slice of the global batch, read from HDF5 or memory"),
    ("mpidl/models.py", "`hsicnn`: the layers of the default model"),
    ("mpidl/params.py", "one flat parameter buffer and one flat gradient buffer"),
    ("mpidl/nn/module.py", "`Sequential`: forward in order, backward in reverse"),
    ("mpidl/nn/conv.py", "`Conv2d`: im2col + one GEMM, or Winograd"),
    ("mpidl/nn/winograd.py", "Winograd's filter transform; the rest is one kernel call"),
    ("kernels/__init__.py", "the kernels' one dispatch and argument checks"),
    ("kernels/winograd_reference.py", "the Winograd convolution in NumPy: the definition"),
    ("mpidl/nn/loss.py", "softmax cross-entropy, fused"),
    ("mpidl/distributed/data_parallel.py", "`DataParallel.step`: weighted reduce, update, agree"),
    ("mpidl/distributed/reducer_base.py", "one message: the weighted gradient, its count, the stop and NaN flags"),
    ("mpidl/distributed/flat.py", "the flat strategy: one `Allreduce`"),
    ("mpidl/optim.py", "SGD (and the other rules) on the flat buffers"),
]


def line_count(path: str) -> int:
    with open(ROOT / path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def table() -> str:
    missing = [path for path, _ in STEP if not (ROOT / path).is_file()]
    if missing:
        raise SystemExit(f"reading_order: no such file(s): {', '.join(missing)}; edit STEP in {__file__}")
    rows = ["| # | file | lines | what |", "| --- | --- | ---: | --- |"]
    total = 0
    for i, (path, what) in enumerate(STEP, 1):
        n = line_count(path)
        total += n
        rows.append(f"| {i} | [`{path}`]({path}) | {n} | {what} |")
    rows.append(f"| | **total** | **{total}** | |")
    return "\n".join(rows)


def readme_counts(text: str) -> dict[str, int]:
    """``{file: lines}`` as the README's table states them."""
    block = text.split(START, 1)[1].split(END, 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| \d+ \| \[`([^`]+)`\]\([^)]*\) \| (\d+) \|", block, re.M)}


def check(text: str) -> list[str]:
    """What is wrong with the README's table: files it lacks or has too many, counts off by
    more than ``TOLERANCE``."""
    stated = readme_counts(text)
    problems = [f"{path}: listed in STEP but not in the README" for path, _ in STEP if path not in stated]
    problems += [f"{path}: in the README but not in STEP" for path in stated if path not in dict(STEP)]
    for path, n in stated.items():
        if (ROOT / path).is_file():
            real = line_count(path)
            if abs(real - n) > TOLERANCE * real:
                problems.append(f"{path}: README says {n} lines, the file has {real}")
        else:
            problems.append(f"{path}: no such file")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    if args.check:
        problems = check(text)
        for p in problems:
            print(f"reading_order: {p}", file=sys.stderr)
        return 1 if problems else 0
    if args.write:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1]
        README.write_text(f"{head}{START}\n{table()}\n{END}{tail}", encoding="utf-8")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
