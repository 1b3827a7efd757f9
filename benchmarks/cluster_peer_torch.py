# mpiexec (across the hosts of jobs/cluster.sh) python benchmarks/cluster_peer_torch.py --peer ddp|postlocal
#     --master ADDR:PORT [--model M] [--data D] [--epochs E] [--batch-size B] [--lr LR] [--seed S]
#     [--sync-every K] [--node-sizes 1,1] [--metrics PATH]
"""PyTorch's answer to one mpidl run, trained as ``python -m mpidl.train`` trains (the peer of
``benchmarks/cluster_claims.py``'s table 2).

* ``--peer ddp``: ``DistributedDataParallel`` (gloo over TCP), gradients averaged 1/P every
  step: the peer of ``--strategy flat --balance none`` (equal local batches, so 1/P averaging
  is mpidl's balanced weighting).
* ``--peer postlocal``: DDP with ``post_localSGD_hook`` (``PostLocalSGDState`` with the host's
  ranks as the subgroup, local SGD from the first step) and
  ``PeriodicModelAverager(period=K')`` over all ranks, plus a world average at every epoch
  end: the peer of ``--strategy node --sync-every K' --balance none`` (mpidl's trainer also
  averages the nodes before every evaluation).

The same model (mpidl's ``build_model(M, shape, classes, seed=S)`` weights copied into the
twin of ``benchmarks/torch_twins.py``), the same samples in the same order (the trainer's
per-epoch permutation ``default_rng([S, epoch]).permutation(N)``; each global batch of B split
into contiguous per-rank slices by largest remainder), SGD with momentum 0.9 and weight decay
5e-4, the same cosine schedule set every step, one thread per rank. Test OA after every
epoch (each rank scores its shard; counts summed), evaluation time excluded from the epoch
time (rank 0's clock, after a barrier), as in mpidl's metrics.

Ranks come from MPICH's launcher (``PMI_RANK``, ``PMI_SIZE``); nothing here uses MPI, so the
only traffic between the hosts is gloo's (``GLOO_SOCKET_IFNAME=eth0``; the rendezvous at
``--master``, rank 0's host). The metrics file has mpidl's keys (``event``, ``epoch``,
``step``, ``loss``, ``oa``, ``time_s``) so the driver reads both alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", choices=("ddp", "postlocal", "allreduce"), required=True,
                   help="allreduce: time gloo's allreduce of --sizes MB alone (no training)")
    p.add_argument("--sizes", default="0.0625,0.5,2", help="--peer allreduce: message sizes in MB")
    p.add_argument("--master", required=True, help="ADDR:PORT of rank 0's rendezvous")
    p.add_argument("--model", default="hsicnn")
    p.add_argument("--data", default=None)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--node-sizes", default=None, help="ranks per host, consecutive (default: one per rank)")
    p.add_argument("--metrics", type=Path, default=None)
    return p.parse_args(argv)


def split_counts(total: int, sizes: list[int]) -> list[int]:
    """``total`` items in proportion to ``sizes``, largest remainder, ties to the lower index
    (mpidl's ``balance.split_counts``, which splits each global batch)."""
    ideal = [total * s / sum(sizes) for s in sizes]
    counts = [math.floor(x) for x in ideal]
    order = sorted(range(len(sizes)), key=lambda i: (-(ideal[i] - counts[i]), i))
    for k in range(total - sum(counts)):
        counts[order[k % len(order)]] += 1
    return counts


def main(argv=None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpidl import data as mdata
    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_schedule
    from torch_twins import twin_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    if args.peer == "allreduce":
        return time_allreduce(dist, torch, args.sizes, rank)
    if args.data:
        train_set, test_set, _ = mdata.load_splits(args.data)
    else:
        train_set, test_set, _ = mdata.synthetic_splits(seed=0)
    model = build_model(args.model, train_set.sample_shape, train_set.num_classes, seed=args.seed)
    torch.manual_seed(args.seed)
    net = twin_of(model)
    ddp = DDP(net)
    averager = None
    if args.peer == "postlocal":
        import warnings

        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                    post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        node_sizes = [int(s) for s in (args.node_sizes or ",".join(["1"] * size)).split(",")]
        starts = [sum(node_sizes[:i]) for i in range(len(node_sizes))]
        groups = [dist.new_group(ranks=list(range(s, s + n))) for s, n in zip(starts, node_sizes)]
        mine = next(g for g, s, n in zip(groups, starts, node_sizes) if s <= rank < s + n)
        ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=mine, start_localSGD_iter=0),
                               post_localSGD_hook)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            averager = PeriodicModelAverager(period=args.sync_every, warmup_steps=0)
        averager.step = 1  # average after optimizer steps K', 2K', ... (mpidl's node strategy)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    n, batch = train_set.num_samples, args.batch_size
    per_epoch = math.ceil(n / batch)
    schedule = make_schedule("cosine", args.lr, args.epochs * per_epoch)
    equal = [1] * size
    loss_fn = torch.nn.CrossEntropyLoss()
    out = open(args.metrics, "w", encoding="utf-8") if (args.metrics and rank == 0) else None
    step = 0
    for epoch in range(args.epochs):
        perm = np.random.default_rng([args.seed, epoch]).permutation(n)
        net.train()
        dist.barrier()
        start = time.perf_counter()
        loss_sum = 0.0
        for t in range(per_epoch):
            idx = perm[t * batch:(t + 1) * batch]
            counts = split_counts(len(idx), equal)
            lo = sum(counts[:rank])
            x, y = train_set.read(idx[lo:lo + counts[rank]])
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(ddp(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(ddp.parameters())
            loss_sum += float(loss.detach()) * len(y)
            step += 1
        if averager is not None:
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            average_parameters(iter(ddp.parameters()), dist.group.WORLD)
        seconds = time.perf_counter() - start
        net.eval()
        lo, hi = rank * test_set.num_samples // size, (rank + 1) * test_set.num_samples // size
        correct = 0
        with torch.no_grad():
            for s in range(lo, hi, 512):
                x, y = test_set.read(np.arange(s, min(s + 512, hi)))
                correct += int((net(torch.from_numpy(x)).argmax(1).numpy() == y).sum())
        totals = torch.tensor([float(correct), loss_sum], dtype=torch.float64)
        dist.all_reduce(totals)
        if out is not None:
            out.write(json.dumps({"event": "epoch", "epoch": epoch + 1, "step": step,
                                  "loss": float(totals[1]) / n, "oa": float(totals[0]) / test_set.num_samples,
                                  "time_s": seconds}) + "\n")
            out.flush()
    if out is not None:
        out.write(json.dumps({"event": "end", "oa": float(totals[0]) / test_set.num_samples}) + "\n")
        out.close()
    dist.destroy_process_group()
    return 0


def time_allreduce(dist, torch, sizes: str, rank: int, reps: int = 15) -> int:
    """Median seconds of gloo's blocking ``all_reduce`` of each size (rank 0 prints JSON)."""
    import statistics

    out = {}
    for mb in (float(s) for s in sizes.split(",")):
        t = torch.ones(int(mb * 1e6) // 4)
        dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        out[str(mb)] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
    if rank == 0:
        print("GLOO_ALLREDUCE " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
