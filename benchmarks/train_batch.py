# mpiexec -n 4 python benchmarks/train_batch.py RUNS.json
"""Run several ``python -m mpidl.train`` command lines one after another in one ``mpiexec``.

``RUNS.json`` is a list of ``{"name": ..., "argv": [...]}`` (optionally ``"module":
"mpidl.gan"``, another command with a ``main(argv)``; default ``mpidl.train``); every rank
reads it and calls ``mpidl.train.main(argv)`` for each entry in order, exactly what ``mpiexec -n N python -m
mpidl.train ARGV`` runs, so a row of a benchmark table is reproduced by that command alone.
The only difference is what is shared between runs: the interpreter, imported modules and
Numba's compiled kernels (a benchmark therefore starts with an untimed warm-up run), which
saves a job start-up of several seconds per run on a small machine.

A run that ends with a set-up error (exit code 2, every rank alike) is recorded and the
batch goes on; an exception during training aborts the whole job (``mpidl.train`` calls
``MPI_Abort`` so that no rank waits forever). Rank 0 prints one line per run.
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        runs = json.load(f)
    import importlib

    from mpidl.train import main as train_main  # its main applies the thread policy, as the command does

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failed = 0
    for i, entry in enumerate(runs, start=1):
        world.Barrier()  # every run starts together, as a fresh job would
        start = time.perf_counter()
        module = entry.get("module", "mpidl.train")
        run = train_main if module == "mpidl.train" else importlib.import_module(module).main
        code = run(entry["argv"])
        seconds = time.perf_counter() - start
        failed += code != 0
        if world.Get_rank() == 0:
            print(f"[{i}/{len(runs)}] {entry['name']}: exit {code}, {seconds:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: mpiexec -n N python benchmarks/train_batch.py RUNS.json")
    sys.exit(main(sys.argv[1]))
