# mpiexec --with-ft ulfm --host A:2,B:2,C:2 -n 6 python tests/shrink_node_worker.py OUT_DIR --kill 4,5 --at 9
"""``data_parallel(strategy='node', on_failure='shrink')`` (an ElasticDataParallel) losing a
whole host, for the tests.

A linear least-squares fit in float64 (the data of tests/recovery_worker.py) trained with
``data_parallel(params, SGD(momentum), strategy='node', sync_every=K, on_failure='shrink')`` on
real hosts (one node per host). The ranks ``--kill`` SIGKILL themselves at the start of step ``--at``; the
nodes left notice it at their next parameter sync, go back to the state right before it and
sync again over the remaining nodes, then go on with the batch re-split over the survivors.

:func:`reference` replays the node scheme in one process: every node its own replica and
SGD state, its gradient the mean over its ranks' slices; every ``K`` steps (and at the end)
``theta = sum_n S_n theta_n / sum_n S_n`` over the nodes alive, ``S_n`` the samples node ``n``
took since the last sync. Every survivor writes ``OUT/w_ID.npy`` and ``OUT/rank_ID.json``
(its failure records); where the MPI cannot recover, rank 0 writes ``OUT/skip.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from recovery_worker import D, LR, MOMENTUM, data, global_batch

BATCH, K = 24, 4


def slices(split: list[int]) -> list[tuple[int, int]]:
    bounds = np.concatenate([[0], np.cumsum(split)])
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(split))]


def reference(steps: int, nodes: list[list[int]], split: list[int], lost: set[int], at: int,
              new_split: list[int]) -> np.ndarray:
    """The node scheme in one process (see the module docstring). ``nodes``: start-up ranks of
    every node; ``split``: batch sizes by start-up rank before the loss; ``new_split`` after
    the first sync that follows it (by survivor, in start-up order)."""
    from mpidl.engine.backend import get_backend
    from mpidl.engine.optim import SGD
    from mpidl.engine.params import FlatParameters, Parameter, zeros

    x, y = data()
    replicas = []
    for _ in nodes:
        params = FlatParameters([("w", Parameter((D,), zeros()))], get_backend("cpu", "float64"))
        replicas.append((params, SGD(params, lr=LR, momentum=MOMENTUM)))
    alive = list(range(len(nodes)))
    ranks = [r for node in nodes for r in node]
    samples = [0] * len(nodes)
    current = dict(zip(ranks, slices(split)))
    resplit_pending = False
    for t in range(steps):
        if t == at:
            alive = [n for n in alive if not set(nodes[n]) <= lost]
            resplit_pending = True
        batch = global_batch(t, BATCH)
        for n in alive:
            params, opt = replicas[n]
            idx = np.concatenate([batch[current[r][0]:current[r][1]] for r in nodes[n] if r in current])
            xs = x[idx]
            params.grad[...] = xs.T @ (xs @ params.data - y[idx]) / len(idx)
            opt.step()
            samples[n] += len(idx)
        if (t + 1) % K == 0 or t + 1 == steps:
            total = sum(samples[n] for n in alive)
            theta = sum(samples[n] * replicas[n][0].data for n in alive) / total
            for n in alive:
                replicas[n][0].data[...] = theta
                samples[n] = 0
            if resplit_pending:
                survivors = [r for r in ranks if r not in lost]
                current = dict(zip(survivors, slices(new_split)))
                resplit_pending = False
    return replicas[alive[0]][0].data.copy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill", default="", help="start-up ranks that die, e.g. 4,5")
    parser.add_argument("--at", type=int, default=9, help="the step they die in")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    from mpidl.distributed import data_parallel
    from mpidl.distributed.elastic import RanksLost
    from mpidl.engine.backend import get_backend
    from mpidl.engine.optim import SGD
    from mpidl.engine.params import FlatParameters, Parameter, zeros

    me = MPI.COMM_WORLD.Get_rank()
    victims = {int(r) for r in args.kill.split(",") if r}
    params = FlatParameters([("w", Parameter((D,), zeros()))], get_backend("cpu", "float64"))
    dp = data_parallel(params, SGD(params, lr=LR, momentum=MOMENTUM), batch_size=BATCH,
                       strategy="node", sync_every=K, on_failure="shrink")
    if dp.on_failure != "shrink":
        if me == 0:
            (args.out / "skip.json").write_text(json.dumps({"reason": dp.failure_note}))
        return 0
    start = {"nodes": [dp.topology.ranks_of_node(n) for n in range(dp.topology.num_nodes)],
             "split": list(dp.batch_sizes)}
    x, y = data()
    while dp.steps < args.steps:
        try:
            if dp.steps == args.at and me in victims:
                os.kill(os.getpid(), 9)
            local = dp.local_indices(global_batch(dp.steps, BATCH))
            xs = x[local]
            params.grad[...] = xs.T @ (xs @ params.data - y[local]) / len(local)
            dp.step()
        except RanksLost:
            pass  # the state is back before dp.steps: run that global batch again
    dp.sync()
    np.save(args.out / f"w_{me}.npy", params.data)
    (args.out / f"rank_{me}.json").write_text(json.dumps(
        {"id": me, "start": start, "failures": dp.failures, "split": list(dp.batch_sizes)}))
    if dp.shrunk:
        dp.leave(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
