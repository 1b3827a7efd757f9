# python benchmarks/peers_torch.py [--quick] [--out benchmarks/results] [--samson FILE.h5]
#   (launches: mpiexec -n 4 -ppn 2 -hosts localhost,127.0.0.1 -launcher fork python benchmarks/peers_torch.py --worker ...)
"""mpidl against its PyTorch peers, on the same hsicnn model, data and split, in the same job.

============  ======================================  ===========================================
mpidl         ``python -m mpidl.train`` options        PyTorch peer (DDP, gloo backend)
============  ======================================  ===========================================
flat          ``--strategy flat --balance none``       DDP, default gradient averaging (1/P)
balanced      ``--strategy flat --speeds 1,1,2,4``     DDP + a communication hook that scales the
              (balanced weighting, uneven batches)     bucket by b_i / B before a SUM allreduce
node K'       ``--strategy node --sync-every K'``      DDP + ``post_localSGD_hook`` (gradients
              (``--balance none``)                     averaged in a subgroup per node) +
                                                       ``PeriodicModelAverager(period=K')``
============  ======================================  ===========================================

The job runs on 2 EMULATED nodes x 2 ranks (MPICH ``-hosts``), so the node strategy and its
peer's per-node subgroups are real groups. In the same processes, for every configuration,
the mpidl run (``mpidl.train.main(argv)``, exactly the command line) and the PyTorch run
alternate, so both see the same load. Both start from the same initial weights (mpidl's,
copied into the torch modules), see the same samples in the same order (the trainer's
per-epoch permutation and per-rank slices), read them through the same dataset object,
use SGD (momentum 0.9, weight decay 5e-4) with the same cosine schedule, and run the same
threads per rank. Epoch time is training only (evaluation excluded) on rank 0, the median
over the timed epochs (all but the first); per step = epoch time / steps.

PyTorch is optional: without it (or when ``torch.distributed`` cannot initialise) the torch
columns say why and only mpidl is measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("flat", "balanced", "node")
BALANCED_SPEEDS = "1,1,2,4"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps (CI); numbers mean nothing")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--samson", type=Path, default=None, help="a Samson layout file (also run on it)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sync-every", type=int, default=50, help="K' of the node strategy and of the averager")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--mpich-defaults", action="store_true", help="do not set MPICH progress throttling")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 1 or args.repeats < 1 or args.sync_every < 1:
        p.error("--epochs, --repeats and --sync-every must be >= 1")
    return args


# --------------------------------------------------------------------------------------------
# the launcher (no MPI): start the worker job, then write the report
# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    import common

    work = args.work or Path(tempfile.mkdtemp(prefix="mpidl-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    result = work / "peers.json"
    result.unlink(missing_ok=True)
    forwarded = ["--epochs", str(args.epochs), "--repeats", str(args.repeats), "--sync-every", str(args.sync_every)]
    forwarded += ["--quick"] * args.quick + ["--no-torch"] * args.no_torch
    if args.samson:
        forwarded += ["--samson", str(args.samson)]
    cmd = common.mpiexec(4, [common.PYTHON, str(Path(__file__).resolve()), *forwarded, "--worker", str(result)],
                         two_nodes=True)
    info = common.machine_info()
    code, seconds = common.run(cmd, work / "peers.log", 1200, common.bench_env(not args.mpich_defaults))
    print(common.tail(work / "peers.log", 30 if code else 8), flush=True)
    data = json.loads(result.read_text()) if result.is_file() else None
    write_report(args, info, data, cmd, code, seconds, work / "peers.log")
    return 0 if code == 0 and data is not None else 1


def write_report(args, info, data, cmd, code, seconds, log) -> None:
    import common

    intro = __doc__.split("\n\n", 1)[1].split("PyTorch is optional")[0].strip()
    table, prose = intro.split("\n\n", 1)  # the docstring's table, then its explanation
    body = [common.code_block(table.replace("``", "").splitlines()), "", prose.replace("``", "`"), "",
            f"Job: `{common.shown(cmd)}` ({seconds:.0f} s, exit {code}).", ""]
    if code != 0:
        body += ["**The job did not finish (the datasets below are those measured before it "
                 "stopped).** End of its log:", "", common.code_block(common.tail(log, 12).splitlines()), ""]
    if data is None:
        body += ["**No results**: the job failed; see its log."]
    else:
        torch_note = data["torch"]
        body += [f"PyTorch: {torch_note}.", ""]
        for ds, modes in data["datasets"].items():
            rows, acc = [], []
            for mode, rec in modes.items():
                m_ep, t_ep = rec["mpidl"]["epoch_s"], rec.get("torch", {}).get("epoch_s", [])
                m_step, t_step = rec["mpidl"]["step_s"], rec.get("torch", {}).get("step_s", [])
                ratio_ep = common.median(m_ep) / common.median(t_ep) if t_ep else math.nan
                ratio_step = common.median(m_step) / common.median(t_step) if t_step else math.nan
                rows.append([rec["label"], common.med_spread(m_step, 1e3, 1),
                             common.med_spread(t_step, 1e3, 1) if t_step else "skipped",
                             f"{ratio_step:.2f}" if t_step else "-",
                             common.med_spread(m_ep, 1, 2), common.med_spread(t_ep, 1, 2) if t_ep else "skipped",
                             f"{ratio_ep:.2f}" if t_ep else "-"])
                t_oa = rec.get("torch", {}).get("oa")
                acc.append([rec["label"], common.mean_std(rec["mpidl"]["oa"]),
                            common.mean_std(t_oa) if t_oa else "skipped",
                            rec["mpidl"]["inter_bytes"], rec.get("torch", {}).get("peer", "-")])
            body += [f"## {ds}", "", f"Batch sizes: {data['batch_sizes'][ds]}; {data['epochs']} epoch(s), "
                     f"{data['steps_per_epoch'][ds]} steps per epoch; K' = {data['sync_every']}.", "",
                     common.md_table(["configuration", "mpidl ms/step", "torch ms/step", "mpidl/torch (step)",
                                      "mpidl s/epoch", "torch s/epoch", "mpidl/torch (epoch)"], rows), "",
                     f"Accuracy after {data['epochs']} epoch(s) (OA %):", "",
                     common.md_table(["configuration", "mpidl OA %", "torch OA %", "mpidl inter-node bytes/epoch (rank 0)",
                                      "torch peer"], acc), "",
                     "Exact mpidl commands (one per configuration, each run in the job above):", "",
                     common.code_block([rec["mpidl"]["command"] for rec in modes.values()]), ""]
        body += ["Notes:", "",
                 "- ms/step and s/epoch: median [min-max] over the timed epochs of all repeats; "
                 "ratios of the medians (below 1: mpidl is faster).",
                 "- The flat peer averages 1/P (DDP's default). In the last, smaller global batch of an "
                 "epoch some ranks may have no sample (they run a zero-weight pass so that DDP's "
                 "collectives match); DDP then divides by P where mpidl's balanced weighting divides by "
                 "the samples: one step per epoch differs.",
                 "- `PeriodicModelAverager` is started at step 1 so that it averages after optimizer "
                 "steps K', 2K', ... as mpidl does; both also average at every epoch end (mpidl's "
                 "trainer does so before evaluating), the peer through `average_parameters` on the "
                 "world group.",
                 f"- Environment: {common.THROTTLE_NOTE if not args.mpich_defaults else 'MPICH defaults.'}"]
    suffix = "_quick" if args.quick else ""
    common.write_markdown(args.out / f"peers{suffix}.md", "Peers: mpidl vs PyTorch DDP (gloo)",
                          "python benchmarks/peers_torch.py" + (" --quick" if args.quick else ""), info, body)


# --------------------------------------------------------------------------------------------
# the worker (under mpiexec)
# --------------------------------------------------------------------------------------------


def worker(args) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_size = node.Get_size()
    node.Free()
    threads = max(1, len(os.sched_getaffinity(0)) // local_size)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))  # before NumPy loads, as mpidl.train does
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as mpidl.train does (before OpenMP loads)

    import common

    from mpidl import data as mdata

    rank = world.Get_rank()
    dist, torch_reason = common.init_torch_gloo(world, args.no_torch)
    if dist is not None:
        import torch

        torch.set_num_threads(threads)
    epochs = 1 if args.quick else args.epochs
    max_steps = 3 if args.quick else None
    datasets = {"synthetic": ([], 0.05)}
    if args.samson:
        datasets["Samson"] = (["--data", str(args.samson)], 0.01)
    work = args.worker.parent
    out = {"torch": torch_reason or f"{__import__('torch').__version__}, gloo, {threads} thread(s) per rank",
           "epochs": epochs, "sync_every": args.sync_every, "datasets": {}, "batch_sizes": {},
           "steps_per_epoch": {}}
    if dist is not None:
        # one subgroup per node, for the post-local SGD hook (nodes = consecutive ranks, as -ppn 2 places them)
        from mpidl.distributed.topology import Topology

        topo = Topology.from_comm(world)
        groups = [topo.ranks_of_node(n) for n in range(topo.num_nodes)]
        subgroups = [dist.new_group(ranks=g) for g in groups]  # every rank creates every group
        my_subgroup = subgroups[topo.node_id]
    for ds, (data_argv, lr) in datasets.items():
        if data_argv:
            train_set, test_set, _ = mdata.load_splits(data_argv[1])
        else:
            train_set, test_set, _ = mdata.synthetic_splits(seed=0)
        records = {}
        for rep in range(args.repeats):
            for mode in MODES:
                opts = {"flat": ["--strategy", "flat", "--balance", "none"],
                        "balanced": ["--strategy", "flat", "--speeds", BALANCED_SPEEDS],
                        "node": ["--strategy", "node", "--sync-every", str(args.sync_every), "--balance", "none"]}[mode]
                argv = data_argv + ["--epochs", str(epochs), "--batch-size", "64", "--lr", str(lr), "--seed", "0", *opts]
                if max_steps:
                    argv += ["--max-steps", str(max_steps)]
                label = {"flat": "flat", "balanced": f"balanced (speeds {BALANCED_SPEEDS})",
                         "node": f"node K'={args.sync_every}"}[mode]
                rec = records.setdefault(mode, {"label": label, "mpidl": {"epoch_s": [], "step_s": [], "oa": []}})
                metrics = work / f"{ds}_{mode}_{rep}.jsonl"
                m = run_mpidl(world, argv + ["--quiet", "--metrics", str(metrics)], metrics)
                rec["mpidl"]["command"] = common.shown(common.mpiexec(4, [common.PYTHON, "-m", "mpidl.train", *argv],
                                                                      two_nodes=True))
                if m is not None:
                    for e in common.timed_epochs(m["epochs"]):
                        rec["mpidl"]["epoch_s"].append(e["time_s"])
                        rec["mpidl"]["step_s"].append(e["time_s"] / e["steps"])
                    rec["mpidl"]["oa"].append(m["epochs"][-1]["oa"])
                    rec["mpidl"]["inter_bytes"] = common.fmt_bytes(
                        sum(e["comm"]["inter"]["bytes"] for e in m["epochs"]) / len(m["epochs"]))
                    out["batch_sizes"][ds] = out["batch_sizes"].get(ds, {})
                    out["batch_sizes"][ds][mode] = m["epochs"][-1]["batch_sizes"]
                    out["steps_per_epoch"][ds] = m["steps_per_epoch"]
                if dist is not None:
                    t = run_torch(dist, world, mode, train_set, test_set, lr, epochs, max_steps,
                                  args.sync_every, my_subgroup, m)
                    tr = rec.setdefault("torch", {"epoch_s": [], "step_s": [], "oa": [], "peer": t["peer"]})
                    tr["epoch_s"] += t["epoch_s"]
                    tr["step_s"] += t["step_s"]
                    tr["oa"].append(t["oa"])
                if rank == 0:
                    print(f"{ds} {mode} rep {rep}: mpidl {rec['mpidl']['epoch_s'][-1:]} s/epoch, torch "
                          f"{rec.get('torch', {}).get('epoch_s', ['-'])[-1:]}", flush=True)
        out["datasets"][ds] = records
        if rank == 0:  # after every dataset: a later failure (MPI_Abort) keeps what was measured
            args.worker.write_text(json.dumps(out, indent=1))
    if dist is not None:
        dist.destroy_process_group()
    return 0


def run_mpidl(world, argv, metrics: Path):
    """One ``python -m mpidl.train`` run in this job; its epochs (rank 0 reads the metrics and
    shares them), with each epoch's step count."""
    from mpidl.train import main as train_main

    import common

    world.Barrier()
    code = train_main(argv)
    result = None
    if world.Get_rank() == 0 and code == 0:
        start, epochs, end = common.load_metrics(metrics)
        previous = 0
        for e in epochs:
            e["steps"] = e["step"] - previous
            previous = e["step"]
        result = {"epochs": epochs, "steps_per_epoch": epochs[0]["steps"], "start": start}
    return world.bcast(result, root=0)


class _Weight:
    """The current step's weight b_i / B of this rank, read by the communication hook."""

    value = 1.0


def _weighted_sum_hook(state, bucket):
    """DDP communication hook of the balanced peer: g = sum_i (b_i / B) g_i."""
    import torch.distributed as dist

    buf = bucket.buffer()
    buf.mul_(state.value)
    fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def torch_hsicnn(model_mpidl):
    """The hsicnn network in PyTorch, with mpidl's initial parameters copied in."""
    import numpy as np
    import torch

    c, h, w = model_mpidl.input_shape
    hidden = model_mpidl.build_args.get("hidden", 128)
    ch = model_mpidl.build_args.get("channels", [64, 64])
    net = torch.nn.Sequential(
        torch.nn.Conv2d(c, ch[0], 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(ch[0], ch[1], 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(ch[1] * (h // 2) * (w // 2), hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, model_mpidl.num_classes),
    )
    ours = [(p.name, p.data) for p in model_mpidl.params]
    theirs = list(net.parameters())
    if len(ours) != len(theirs) or any(tuple(a.shape) != tuple(b.shape) for (_, a), b in zip(ours, theirs)):
        raise RuntimeError(f"hsicnn layouts differ: mpidl {[(n, a.shape) for n, a in ours]}, "
                           f"torch {[tuple(b.shape) for b in theirs]}")
    with torch.no_grad():
        for (_, a), b in zip(ours, theirs):
            b.copy_(torch.from_numpy(np.asarray(a)))
    return net


def run_torch(dist, world, mode, train_set, test_set, lr, epochs, max_steps, sync_every, subgroup, mpidl_run):
    """The PyTorch peer of ``mode``: per-epoch seconds (rank 0's), per-step seconds, final OA."""
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpidl.app.config import MIN_LOCAL_BATCH
    from mpidl.app.metrics import classification_report, confusion_matrix
    from mpidl.engine.models import build_model
    from mpidl.engine.optim import make_schedule
    from mpidl.app.trainer import epoch_permutation
    from mpidl.distributed.split import FixedSplit

    rank, size = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    model = build_model("hsicnn", train_set.sample_shape, train_set.num_classes, seed=0)
    net = torch_hsicnn(model)
    ddp = DDP(net)
    weight = _Weight()
    peer = "DDP (gloo), default averaging"
    averager = None
    if mode == "balanced":
        ddp.register_comm_hook(weight, _weighted_sum_hook)
        peer = "DDP (gloo) + b_i/B-weighted SUM allreduce hook"
    elif mode == "node":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                    post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=0)
        ddp.register_comm_hook(state, post_localSGD_hook)
        import warnings

        with warnings.catch_warnings():  # period 1 warns that plain DDP would do; K' here is larger
            warnings.simplefilter("ignore")
            averager = PeriodicModelAverager(period=sync_every, warmup_steps=0)
        averager.step = 1  # average after optimizer steps K', 2K', ... as mpidl does
        peer = f"DDP (gloo) + post_localSGD_hook (node subgroups) + PeriodicModelAverager(period={sync_every})"
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    n, B = train_set.num_samples, 64
    steps_per_epoch = math.ceil(n / B)
    total = epochs * steps_per_epoch if max_steps is None else min(max_steps, epochs * steps_per_epoch)
    schedule = make_schedule("cosine", lr, total)
    speeds = [float(s) for s in BALANCED_SPEEDS.split(",")] if mode == "balanced" else [1.0] * size
    # The split mpidl's trainer takes for given speeds (its minimum per rank).
    split = FixedSplit(B, size, speeds, MIN_LOCAL_BATCH)
    loss_fn = torch.nn.CrossEntropyLoss()
    step, epoch_s, step_s = 0, [], []
    dummy_x, _ = train_set.read(np.arange(1))
    for epoch in range(epochs):
        perm = epoch_permutation(0, epoch, n)
        dist.barrier()
        t0 = time.perf_counter()
        steps_done = 0
        for t in range(steps_per_epoch):
            if step >= total:
                break
            batch = perm[t * B:(t + 1) * B]
            counts = split.counts(len(batch))
            lo = sum(counts[:rank])  # this rank's contiguous slice, as DataParallel.local_indices
            hi = lo + counts[rank]
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            weight.value = counts[rank] / sum(counts)
            opt.zero_grad(set_to_none=False)
            if hi > lo:
                x, y = train_set.read(batch[lo:hi])
                loss = loss_fn(ddp(torch.from_numpy(x)), torch.from_numpy(y))
            else:  # no sample this step: a zero-weight pass, so the collectives still match
                loss = ddp(torch.from_numpy(dummy_x)).sum() * 0.0
            loss.backward()
            opt.step()
            if averager is not None:
                averager.average_parameters(ddp.parameters())
            step += 1
            steps_done += 1
        if averager is not None:  # epoch-end average, as mpidl's trainer does
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            average_parameters(iter(ddp.parameters()), dist.group.WORLD)
        seconds = time.perf_counter() - t0
        if steps_done:
            epoch_s.append(seconds)
            step_s.append(seconds / steps_done)
    # evaluation: every rank scores a contiguous shard; confusion matrices summed over MPI
    k = train_set.num_classes
    cm = np.zeros((k, k), dtype=np.int64)
    lo, hi = rank * test_set.num_samples // size, (rank + 1) * test_set.num_samples // size
    net.eval()
    with torch.no_grad():
        for s in range(lo, hi, 512):
            x, y = test_set.read(np.arange(s, min(s + 512, hi)))
            cm += confusion_matrix(y, net(torch.from_numpy(x)).argmax(1).numpy(), k)
    from mpi4py import MPI

    world.Allreduce(MPI.IN_PLACE, cm, op=MPI.SUM)
    oa = classification_report(cm)["oa"]
    epoch_s = world.bcast(epoch_s, root=0)  # rank 0's clock, as mpidl's metrics
    step_s = world.bcast(step_s, root=0)
    timed = slice(1, None) if len(epoch_s) > 1 else slice(None)
    return {"epoch_s": epoch_s[timed], "step_s": step_s[timed], "oa": oa, "peer": peer}


if __name__ == "__main__":
    sys.exit(main())
