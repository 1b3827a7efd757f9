"""A cost model of every strategy at scale: ``python -m mpidl.plan``.

    python -m mpidl.plan --model hsicnn --input-shape 156,7,7 --classes 3 --measure \\
        --ranks-per-node 4 --nodes 1,8,128,1024 --inter 10,25 --sync-every 10,50,200

predicts, for ``N`` nodes of ``R`` ranks (``P = N R``), the time of one training step, of
one epoch and the parallel efficiency of ``flat``, ``hierarchical`` and ``node`` K', and
recommends a strategy and K'.

The model (alpha-beta, no overlap)
----------------------------------
A message of ``n`` bytes over a link of latency ``alpha`` (s) and bandwidth ``beta``
(bytes/s) takes ``alpha + n / beta``. Among ``L`` participants:

* ring allreduce (reduce-scatter + allgather): ``T_ring(n, L) = 2 (L - 1) (alpha + n / (L beta))``
* tree allreduce (binomial reduce + broadcast): ``T_tree(n, L) = 2 ceil(log2 L) (alpha + n / beta)``
* ``--algorithm best`` (default) takes the smaller of the two, as MPI libraries switch
  algorithm by message size and count; broadcast and reduce are binomial trees,
  ``ceil(log2 L) (alpha + n / beta)``.

With ``t_c`` the compute time of one step on one rank (forward + backward of its local batch
``b``), ``g = 4 * params`` bytes (float32 gradient), ``intra`` the link between ranks of a node
and ``inter`` the link between nodes, one step costs:

* ``flat``: ``t_c + T(g, P)`` over ``inter`` when ``N > 1`` (a ring that spans nodes runs
  at the speed of its slowest link in each of its ``2 (P - 1)`` steps), over ``intra`` when
  ``N = 1``;
* ``hierarchical``: ``t_c + reduce_intra(g, R) + T_inter(g, N) + bcast_intra(g, R)``;
* ``node`` K': ``t_c + T_intra(g, R) + [T_inter(g, N) + bcast_intra(g, R)] * syncs / S``,
  where ``S`` is the steps per epoch and ``syncs`` the parameter syncs per epoch (every
  ``K'`` global steps and at every epoch end that did not just sync), as the trainer does.

An epoch is ``S = ceil(D / (b P))`` steps (``D`` samples; weak scaling: the local batch
``b`` is fixed, the global batch grows with ``P``). The efficiency is ``t_c / step``: the
fraction of the ideal ``P``-fold throughput of one rank that computes without
communicating. Assumptions: every rank computes at the same speed (no stragglers); no
overlap of communication with compute (mpidl reduces after the backward pass); the links
are uncontended (one leader per node talks across the network; in ``flat`` every rank's
ring step crosses the slowest link); the non-exact ``node`` scheme's extra epochs to reach
the same accuracy are not modelled (benchmarks/results/node.md measures them).

``--measure`` times the step in rounds (:func:`measure_rounds`) and prints their median and
range; when the machine looks loaded (the rounds differ by more than ``WIDE_SPREAD`` of their
median, or the process had the CPU less than ``BUSY_CPU_SHARE`` of the time) it warns, and
says whether the recommendation holds at both ends of the measured range.

``--emulated`` predicts what the EMULATION on one machine does instead (``mpidl.train
--emulate-link`` with ``MPIDL_RANKS_PER_NODE``): every level's real collective runs over the
shared-memory ``intra`` link, and the modelled inter-node time (always the ring formula,
``mpidl.distributed.emulation.LinkModel``) is slept on top of it: ``flat`` sleeps
``T_ring(g, P)``, ``hierarchical`` and ``node`` sleep ``T_ring(g, N)`` on the leaders.
``benchmarks/plan.py`` compares these predictions with measured emulated epochs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

from mpidl.distributed.links import LinkModel
from mpidl.distributed.links import parse_link as parse_link_model

STRATEGY_NAMES = ("flat", "hierarchical", "node")
ALGORITHMS = ("best", "ring", "tree")
DEFAULT_SYNC_EVERY = (1, 2, 5, 10, 20, 50, 100, 200)


#: the planner's links are the emulation's (one alpha-beta model)
Link = LinkModel


def parse_link(text: str, option: str) -> Link:
    """``LATENCY_US,GBIT_S`` for ``option``; ValueError naming it."""
    try:
        return parse_link_model(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def ring_allreduce(n: float, L: int, link: Link) -> float:
    """``2 (L - 1) (alpha + n / (L beta))``; 0 for ``L <= 1``."""
    return link.allreduce_seconds(n, L)


def tree_allreduce(n: float, L: int, link: Link) -> float:
    """``2 ceil(log2 L) (alpha + n / beta)``; 0 for ``L <= 1``."""
    return link.tree_allreduce_seconds(n, L)


def tree_bcast(n: float, L: int, link: Link) -> float:
    """Binomial broadcast (or reduce): ``ceil(log2 L) (alpha + n / beta)``; 0 for ``L <= 1``."""
    return link.tree_bcast_seconds(n, L)


def allreduce(n: float, L: int, link: Link, algorithm: str = "best") -> float:
    if algorithm == "ring":
        return ring_allreduce(n, L, link)
    if algorithm == "tree":
        return tree_allreduce(n, L, link)
    return min(ring_allreduce(n, L, link), tree_allreduce(n, L, link))


def syncs_per_epoch(steps: int, sync_every: int, epoch: int = 1) -> int:
    """Parameter syncs of the ``node`` strategy in epoch ``epoch`` (0-based) of ``steps``
    steps: one at every global step that is a multiple of K', plus one at the epoch end
    unless its last step just synced (the trainer's rule)."""
    lo, hi = epoch * steps, (epoch + 1) * steps
    on_k = hi // sync_every - lo // sync_every
    return on_k + (0 if hi % sync_every == 0 else 1)


@dataclass
class Scenario:
    """Everything a prediction needs.

    step_compute_s : ``t_c``, one step's forward + backward on one rank
    params : number of float32 parameters (the gradient message is ``4 params`` bytes)
    ranks_per_node, nodes : ``R`` and ``N``
    intra, inter : the links inside a node and between nodes
    samples : ``D``, training samples per epoch; local_batch : ``b`` per rank
    steps : steps per epoch (default ``ceil(D / (b P))``)
    """

    step_compute_s: float
    params: int
    ranks_per_node: int
    nodes: int
    intra: Link
    inter: Link
    samples: int = 1_000_000
    local_batch: int = 16
    steps: int | None = None
    algorithm: str = "best"
    emulated: bool = False
    epoch: int = 1

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def message_bytes(self) -> float:
        return 4.0 * self.params

    @property
    def steps_per_epoch(self) -> int:
        if self.steps is not None:
            return int(self.steps)
        return max(1, math.ceil(self.samples / (self.local_batch * self.ranks)))


@dataclass
class Prediction:
    strategy: str
    sync_every: int | None
    step_s: float
    comm_step_s: float
    epoch_s: float
    efficiency: float
    parts: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.strategy if self.sync_every is None else f"node K'={self.sync_every}"


def predict(sc: Scenario, strategy: str, sync_every: int | None = None) -> Prediction:
    """Step time, epoch time and efficiency of one strategy (see the module docstring)."""
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {STRATEGY_NAMES}")
    g, R, N, P, alg = sc.message_bytes, sc.ranks_per_node, sc.nodes, sc.ranks, sc.algorithm
    S = sc.steps_per_epoch
    if sc.emulated:
        inter = lambda n, L: ring_allreduce(n, L, sc.inter) + allreduce(n, L, sc.intra, alg)  # noqa: E731
    else:
        inter = lambda n, L: allreduce(n, L, sc.inter, alg)  # noqa: E731
    parts = {}
    if strategy == "flat":
        if N == 1:
            parts["world allreduce"] = allreduce(g, P, sc.intra, alg)
        elif sc.emulated:
            parts["world allreduce"] = allreduce(g, P, sc.intra, alg) + ring_allreduce(g, P, sc.inter)
        else:
            parts["world allreduce"] = allreduce(g, P, sc.inter, alg)
        per_step = parts["world allreduce"]
    elif strategy == "hierarchical":
        parts["node reduce"] = tree_bcast(g, R, sc.intra)
        parts["leaders allreduce"] = inter(g, N) if N > 1 else 0.0
        parts["node bcast"] = tree_bcast(g, R, sc.intra)
        per_step = sum(parts.values())
    else:
        k = int(sync_every or 50)
        if k < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        parts["node allreduce"] = allreduce(g, R, sc.intra, alg)
        if N > 1:
            syncs = syncs_per_epoch(S, k, sc.epoch)
            sync = inter(g, N) + tree_bcast(g, R, sc.intra)
            parts["parameter sync (per step)"] = sync * syncs / S
            parts["syncs per epoch"] = syncs
        per_step = parts["node allreduce"] + parts.get("parameter sync (per step)", 0.0)
    step = sc.step_compute_s + per_step
    return Prediction(strategy, int(sync_every or 50) if strategy == "node" else None, step, per_step,
                      step * S, sc.step_compute_s / step if step > 0 else 1.0, parts)


def predict_all(sc: Scenario, sync_every=DEFAULT_SYNC_EVERY) -> list[Prediction]:
    out = [predict(sc, "flat"), predict(sc, "hierarchical")]
    out += [predict(sc, "node", k) for k in sync_every]
    return out


def recommend(sc: Scenario, sync_every=DEFAULT_SYNC_EVERY, gain: float = 0.05) -> tuple[Prediction, str]:
    """The exact strategy (flat or hierarchical) with the shorter step, unless ``node`` K'
    is faster by more than ``gain`` (default 5 %); then the SMALLEST such K' whose step is
    within 5 % of the largest K' tried (a larger K' saves little more time and drifts the
    nodes' models further apart). Returns the choice and a one-line reason."""
    flat, hier = predict(sc, "flat"), predict(sc, "hierarchical")
    exact = flat if flat.step_s <= hier.step_s else hier
    if sc.nodes == 1:
        return exact, "one node: no inter-node traffic, use the exact strategy"
    nodes = [predict(sc, "node", k) for k in sorted(sync_every)]
    floor = nodes[-1].step_s
    for p in nodes:
        if p.step_s <= exact.step_s * (1 - gain) and p.step_s <= floor * 1.05:
            return p, (f"{p.label} is {exact.step_s / p.step_s:.2f}x faster per step than {exact.label} "
                       f"(efficiency {100 * p.efficiency:.1f} % vs {100 * exact.efficiency:.1f} %) and "
                       f"within 5 % of K'={nodes[-1].sync_every}")
    return exact, (f"{exact.label}: efficiency {100 * exact.efficiency:.1f} %; node K' would save "
                   f"less than {100 * gain:.0f} % of the step")


#: a measurement whose rounds differ by more than this fraction of their median is noisy
WIDE_SPREAD = 0.25
#: a process that got less than this share of a CPU while it measured was waiting for one
BUSY_CPU_SHARE = 0.8


@dataclass(frozen=True)
class StepMeasurement:
    """One step's compute time measured ``len(rounds_s)`` times: each round is the median of a
    few steps, so one stray slow step does not move it, while a machine that is loaded for a
    while moves whole rounds. ``cpu_share`` is this process's CPU seconds over the wall
    seconds of all rounds (about 1 on an idle machine with one thread per process, less when
    other processes took the CPU).

    The step time used is the median of the rounds; the spread is ``(max - min) / median``."""

    rounds_s: tuple
    cpu_share: float
    params: int

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.rounds_s))

    @property
    def low_s(self) -> float:
        return float(min(self.rounds_s))

    @property
    def high_s(self) -> float:
        return float(max(self.rounds_s))

    @property
    def spread(self) -> float:
        return (self.high_s - self.low_s) / self.median_s if self.median_s > 0 else 0.0

    def describe(self) -> str:
        return (f"median of {len(self.rounds_s)} rounds {1e3 * self.median_s:.2f} ms, range "
                f"{1e3 * self.low_s:.2f}-{1e3 * self.high_s:.2f} ms (spread {100 * self.spread:.0f} %)")

    def warning(self) -> str | None:
        """Why the number is not to be trusted (the machine is loaded), or None."""
        reasons = []
        if self.spread > WIDE_SPREAD:
            reasons.append(f"the rounds differ by {100 * self.spread:.0f} % of their median "
                           f"(more than {100 * WIDE_SPREAD:.0f} %)")
        if self.cpu_share < BUSY_CPU_SHARE:
            reasons.append(f"this process had the CPU {100 * self.cpu_share:.0f} % of the time it measured")
        if not reasons:
            return None
        return ("the machine looks loaded: " + " and ".join(reasons) + "; the step time (and the "
                "recommendation) may be far from an idle machine's: measure again on an idle machine, "
                "or give --step-time")


def measure_rounds(model: str, input_shape, classes: int, local_batch: int, rounds: int = 5,
                   repeats: int = 3) -> StepMeasurement:
    """Time ``rounds`` rounds of ``repeats`` forward + backward steps of ``model`` on
    ``local_batch`` random samples on this process (after 2 warm-up steps)."""
    m, step = _timed_step(model, input_shape, classes, local_batch)
    medians = []
    wall = cpu = 0.0
    for _ in range(rounds):
        times = []
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t)
            cpu += time.process_time() - c
        wall += sum(times)
        medians.append(float(statistics.median(times)))
    return StepMeasurement(tuple(medians), cpu / wall if wall > 0 else 1.0, int(m.params.size))


def measure_step(model: str, input_shape, classes: int, local_batch: int, repeats: int = 7) -> tuple[float, int]:
    """Median seconds of one forward + backward of ``model`` on ``local_batch`` random samples
    on this process (after 2 warm-up steps), and the model's parameter count."""
    m, step = _timed_step(model, input_shape, classes, local_batch)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return float(statistics.median(times)), int(m.params.size)


def _timed_step(model: str, input_shape, classes: int, local_batch: int):
    """The model and a function that runs one step of it, after 2 warm-up steps."""
    import numpy as np  # noqa: PLC0415

    from mpidl.engine.models import build_model  # noqa: PLC0415
    from mpidl.engine.nn import SoftmaxCrossEntropy  # noqa: PLC0415

    m = build_model(model, input_shape, classes, seed=0)
    loss = SoftmaxCrossEntropy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((local_batch, *input_shape)).astype(np.float32)
    y = rng.integers(0, classes, local_batch)

    def step():
        loss.forward(m.forward(x), y)
        m.backward(loss.backward())

    for _ in range(2):
        step()
    return m, step


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option}: expected integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpidl.plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hsicnn", help="model to measure or count (default hsicnn)")
    p.add_argument("--input-shape", default="156,7,7", help="C,H,W of one sample (default 156,7,7: Samson)")
    p.add_argument("--classes", type=int, default=3, help="number of classes (default 3)")
    p.add_argument("--params", type=int, default=None,
                   help="parameter count (default: counted from --model and --input-shape)")
    p.add_argument("--step-time", type=float, default=None,
                   help="per-step compute time on one rank, seconds (default: --measure)")
    p.add_argument("--measure", action="store_true",
                   help="measure the step on this machine (forward + backward, default when no --step-time): "
                        "5 rounds of 3 steps, the median of the rounds and their range; a warning when the "
                        "machine looks loaded (the rounds spread widely, or the process waited for the CPU)")
    p.add_argument("--local-batch", type=int, default=16, help="samples per rank per step (default 16)")
    p.add_argument("--samples", type=int, default=1_000_000,
                   help="training samples per epoch (default 1000000)")
    p.add_argument("--steps", type=int, default=None, help="steps per epoch (default ceil(samples / (local batch x ranks)))")
    p.add_argument("--ranks-per-node", type=int, default=4, help="ranks per node R (default 4)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256,512,1024",
                   help="node counts N, comma-separated (default 1,2,4,...,1024)")
    p.add_argument("--intra", default="1,100", help="intra-node link LATENCY_US,GBIT_S (default 1,100: shared memory)")
    p.add_argument("--inter", default="10,25", help="inter-node link LATENCY_US,GBIT_S (default 10,25)")
    p.add_argument("--sync-every", default=",".join(map(str, DEFAULT_SYNC_EVERY)),
                   help="K' values of the node strategy (default 1,2,5,10,20,50,100,200)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="best",
                   help="allreduce model: ring, tree, or the faster of the two (default best)")
    p.add_argument("--emulated", action="store_true",
                   help="predict the one-machine EMULATION (mpidl.train --emulate-link) instead of a cluster (default off)")
    return p


def table(sc: Scenario, nodes: list[int], ks: list[int]) -> str:
    lines = []
    head = f"{'nodes':>6} {'ranks':>6} {'steps':>6}  " + "  ".join(
        f"{lab:>16}" for lab in ["flat", "hierarchical", *[f"node K'={k}" for k in ks]]) + "  recommended"
    lines.append("step ms / efficiency %; epoch = steps x step")
    lines.append(head)
    for n in nodes:
        s = replace(sc, nodes=n)
        preds = predict_all(s, ks)
        best, _ = recommend(s, ks)
        cells = "  ".join(f"{1e3 * p.step_s:9.2f} /{100 * p.efficiency:5.1f}" for p in preds)
        lines.append(f"{n:>6} {s.ranks:>6} {s.steps_per_epoch:>6}  {cells}  {best.label}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        shape = tuple(_ints(args.input_shape, "--input-shape"))
        if len(shape) != 3:
            raise ValueError(f"--input-shape must be C,H,W, got {args.input_shape!r}")
        nodes = _ints(args.nodes, "--nodes")
        ks = _ints(args.sync_every, "--sync-every")
        intra, inter = parse_link(args.intra, "--intra"), parse_link(args.inter, "--inter")
        for name in ("local_batch", "samples", "ranks_per_node", "classes"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if args.step_time is not None and not args.step_time > 0:
            raise ValueError(f"--step-time must be > 0 seconds, got {args.step_time}")
        measured = None
        if args.step_time is None or args.params is None:
            if args.step_time is None:
                measured = measure_rounds(args.model, shape, args.classes, args.local_batch)
                t_c, counted = measured.median_s, measured.params
                how = (f"measured here: {args.model} {shape}, local batch {args.local_batch}; "
                       f"{measured.describe()}")
            else:
                from mpidl.engine.models import build_model  # noqa: PLC0415
                t_c, counted = args.step_time, build_model(args.model, shape, args.classes).params.size
                how = "given"
        else:
            t_c, counted, how = args.step_time, args.params, "given"
        params = args.params or counted
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sc = Scenario(t_c, params, args.ranks_per_node, nodes[0], intra, inter, samples=args.samples,
                  local_batch=args.local_batch, steps=args.steps, algorithm=args.algorithm,
                  emulated=args.emulated)
    print(f"step compute {1e3 * t_c:.2f} ms ({how}); {params} parameters = {4 * params / 2**20:.2f} MiB "
          f"per gradient; {args.ranks_per_node} ranks per node; intra {intra}; inter {inter}; "
          f"allreduce {args.algorithm}; {args.samples} samples per epoch"
          + ("; EMULATED (one machine)" if args.emulated else ""))
    warning = measured.warning() if measured is not None else None
    if warning:
        print(f"warning: {warning}")
    print(table(sc, nodes, ks))
    last = replace(sc, nodes=nodes[-1])
    best, why = recommend(last, ks)
    print(f"at {nodes[-1]} nodes: use {best.label} ({why}); epoch {best.epoch_s:.3g} s")
    if warning:
        # one noisy number is not a recommendation: say what the ends of the range give
        ends = {f"{1e3 * t:.2f} ms": recommend(replace(last, step_compute_s=t), ks)[0].label
                for t in (measured.low_s, measured.high_s)}
        if len(set(ends.values())) > 1:
            print("warning: the recommendation depends on the measured step: "
                  + ", ".join(f"{label} at {t}" for t, label in ends.items()))
        else:
            print(f"the same recommendation holds across the measured range ({', '.join(ends)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
