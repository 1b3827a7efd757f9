# mpiexec --with-ft ulfm -n 3 python tests/recovery_worker.py OUT_DIR --victims 0:4 --steps 12
"""A data-parallel loop that loses ranks and goes on (mpidl.distributed.elastic.recovery), for the tests.

The model is a linear least-squares fit in float64 with SGD + momentum, so that its exact
result is known from one process (:func:`reference`). Step ``t`` uses the global batch
``perm_e[j*B:(j+1)*B]`` (``e = t // steps_per_epoch``, ``j = t % steps_per_epoch``, ``perm_e``
a permutation of the data per epoch), split over the ranks in contiguous slices of ``b_i``
samples; the gradient ``g = sum_i (1/B) sum_{n in slice i} (x_n.w - y_n) x_n`` is reduced
hierarchically (node allreduce, leaders allreduce, node broadcast) over the topology, so a
rebuilt topology is exercised too.

A victim (``--victims ID:STEP,...``, ``ID`` its start-up rank) writes the time to
``OUT/killed_ID.txt`` and SIGKILLs itself after computing its part of step ``STEP``, just
before the exchange (with ``--die-after-leaders``, a node leader dies after the leaders'
allreduce instead: the other nodes complete the step and fail in the next one, its own node
fails in this one, so the survivors' step counts differ by one). The survivors detect it in that exchange, shrink, restore the state
before the agreed step, rebuild the topology, re-split the global batch over themselves and
go on to ``--steps``. Every survivor writes ``OUT/w_ID.npy`` (the final parameters) and
``OUT/rank_ID.json`` (its recoveries, with times). Where the MPI cannot recover, rank 0 writes
``OUT/skip.json`` with the reason, and nobody dies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SEED, N, D, LR, MOMENTUM = 7, 60, 5, 0.05, 0.9


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((N, D))
    y = x @ rng.standard_normal(D) + 0.1 * rng.standard_normal(N)
    return x, y


def global_batch(step: int, batch: int) -> np.ndarray:
    """Sample indices of global step ``step`` (the same on every rank, whatever the split)."""
    per_epoch = N // batch
    epoch, j = divmod(step, per_epoch)
    perm = np.random.default_rng([SEED, epoch]).permutation(N)
    return perm[j * batch:(j + 1) * batch]


def partial_gradient(x, y, w, indices, batch: int) -> np.ndarray:
    """``(1/B) sum_{n in indices} (x_n.w - y_n) x_n``: this rank's balanced share of the mean
    gradient of the global batch (``B = batch``)."""
    xs = x[indices]
    return xs.T @ (xs @ w - y[indices]) / batch


def update(w, v, g) -> None:
    v *= MOMENTUM
    v += g
    w -= LR * v


def reference(steps: int, batch: int) -> np.ndarray:
    """The parameters after ``steps`` steps, computed by one process on whole global batches."""
    x, y = data()
    w, v = np.zeros(D), np.zeros(D)
    for t in range(steps):
        update(w, v, partial_gradient(x, y, w, global_batch(t, batch), batch))
    return w


class NodesByStartupRank:
    """Emulated nodes of ``k`` consecutive START-UP ranks (``node = id // k``), so that a rank
    keeps its node after a shrink; the attributes the loop uses, as on a Topology.

    (:func:`~mpidl.distributed.elastic.recovery.rebuild_topology` refuses emulated nodes: Topology
    groups by the current rank. This stands in for it on one machine, where Open MPI has no
    other way to make nodes.)
    """

    def __init__(self, comm, ids, k: int):
        from mpi4py import MPI

        self.rank = comm.Get_rank()
        node_of = [i // k for i in comm.allgather(ids[self.rank])]
        self.node = comm.Split(color=node_of[self.rank], key=self.rank)
        self.is_leader = self.node.Get_rank() == 0
        self.leaders = comm.Split(color=0 if self.is_leader else MPI.UNDEFINED, key=self.rank)
        self.node_sizes = [node_of.count(n) for n in sorted(set(node_of))]


def die(stamp: Path) -> None:
    """Write the time to ``stamp``, then SIGKILL this process."""
    stamp.write_text(repr(time.time()))
    os.kill(os.getpid(), 9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--victims", default="", help="ID:STEP,... (start-up rank, step it dies in)")
    parser.add_argument("--speeds", default="", help="relative speeds, one per rank (default equal)")
    parser.add_argument("--emulate-nodes", type=int, default=0,
                        help="K: nodes of K consecutive start-up ranks instead of the shared-memory split")
    parser.add_argument("--die-after-leaders", action="store_true",
                        help="a victim that leads its node dies after the leaders' allreduce, before "
                             "its node's broadcast: the other nodes complete the step, its node does not")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    from mpidl.distributed.split.balance import equal_split, split_counts
    from mpidl.distributed.elastic.recovery import (Members, RecoveryError, StepSnapshots, agreed_step,
                                                    is_process_failure, leave, rebuild_topology, resplit,
                                                    shrink, ulfm_available)
    from mpidl.distributed.topology import Topology

    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)  # before any split: the node and leader comms inherit it
    ok, reason = ulfm_available(comm)
    if not ok:
        if comm.Get_rank() == 0:
            (args.out / "skip.json").write_text(json.dumps({"reason": reason}))
        return 0
    victims = {}
    for item in filter(None, args.victims.split(",")):
        who, step = item.split(":")
        victims[int(who)] = int(step)
    members = Members.gather(comm)
    me = comm.Get_rank()
    topo = (NodesByStartupRank(comm, members.ids, args.emulate_nodes) if args.emulate_nodes
            else Topology.from_comm(comm))
    size = comm.Get_size()
    split = (split_counts(args.batch, [float(s) for s in args.speeds.split(",")]) if args.speeds
             else equal_split(args.batch, size))
    x, y = data()
    w, v = np.zeros(D), np.zeros(D)
    snapshots = StepSnapshots()
    recoveries, failed_at = [], None
    step = 0  # steps completed
    while step < args.steps:
        snapshots.save(step, {"w": w, "v": v})
        try:
            lo = sum(split[:topo.rank])
            mine = global_batch(step, args.batch)[lo:lo + split[topo.rank]]
            g = partial_gradient(x, y, w, mine, args.batch)
            dies = victims.get(me) == step
            if dies and not args.die_after_leaders:
                die(args.out / f"killed_{me}.txt")
            topo.node.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            if topo.is_leader:
                topo.leaders.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            if dies:
                die(args.out / f"killed_{me}.txt")
            topo.node.Bcast(g, root=0)
            update(w, v, g)
            step += 1
            if failed_at is not None:  # the first step completed after a recovery
                recoveries[-1]["next_step_done_at"] = time.time()
                failed_at = None
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            failed_at = time.time()
            error = exc.Get_error_string()
            shrunk = shrink(comm, members, also_revoke=[topo.node, topo.leaders])
            if not shrunk.quorum:
                raise RecoveryError(shrunk.describe()) from exc
            completed = step
            step = agreed_step(shrunk.comm, step)
            snapshots.restore(step, {"w": w, "v": v})
            topo = (NodesByStartupRank(shrunk.comm, shrunk.members.ids, args.emulate_nodes)
                    if args.emulate_nodes else rebuild_topology(shrunk.comm, topo))
            split = resplit(args.batch, split, shrunk.old_ranks)
            comm, members = shrunk.comm, shrunk.members
            recoveries.append({
                "error": error, "detected_at": failed_at, "completed_before": completed,
                "resumed_from_step": step, "lost_ids": list(shrunk.lost_ids),
                "lost_hosts": list(shrunk.lost_hosts), "emptied_hosts": list(shrunk.emptied_hosts),
                "shrink_s": shrunk.seconds, "recovered_at": time.time(), "size": comm.Get_size(),
                "split": split, "members": list(members.ids), "nodes": topo.node_sizes,
                "describe": shrunk.describe(),
            })
    np.save(args.out / f"w_{me}.npy", w)
    (args.out / f"rank_{me}.json").write_text(json.dumps(
        {"id": me, "rank": comm.Get_rank(), "size": comm.Get_size(), "split": split,
         "recoveries": recoveries}))
    if recoveries:
        leave(comm)  # MPI_Finalize may wait for the dead ranks
    return 0


if __name__ == "__main__":
    sys.exit(main())
