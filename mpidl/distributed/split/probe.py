"""The speed probe: how :class:`~.measured.MeasuredSplit` measures the ranks before training.

``probe(n)`` is one forward + backward on ``n`` samples (the loop's own code, no
communication, leaving the model's buffers as it found them). Every rank:

1. :func:`warm_up`: one untimed ``probe(2)``, the node's first rank before the others, so that
   one process compiles the JIT kernels into the shared cache and the rest load them;
2. times ``probe(b)`` at the batch sizes of :func:`probe_sizes` in :data:`PROBE_ROUNDS` rounds
   after one untimed round, every pass started by all ranks together (a sleeping barrier), so
   that each pass is measured under the contention of a real step;
3. fits ``t_i(b) = a_i + c_i b`` to its passes (:func:`~.balance.fit_cost`); the fits and
   each rank's timing noise are gathered on every rank.

Every decision is computed from gathered numbers, so every rank takes the same branch.
"""

from __future__ import annotations

import statistics
import time

from mpidl.distributed.split import balance

__all__ = ["PROBE_ROUNDS", "probe_sizes", "sleeping_barrier", "warm_up", "measure_costs"]

#: timed rounds of the speed probe (each times every probe batch size once)
PROBE_ROUNDS = 7


def probe_sizes(batch_size: int, ranks: int) -> list[int]:
    """The local batch sizes the probe times: half, one and two equal shares
    ``m = ceil(B / P)`` (at most ``B``), so the fitted line covers the splits it will choose."""
    share = -(-batch_size // ranks)
    return sorted({max(1, share // 2), share, min(batch_size, 2 * share)})


def sleeping_barrier(comm, poll_s: float) -> None:
    """A barrier over ``comm`` that sleeps ``poll_s`` between polls: a busy-waiting
    MPI_Barrier would take the cores from ranks still computing on an oversubscribed machine."""
    waiting = comm.Ibarrier()
    while not waiting.Test():
        time.sleep(poll_s)


def warm_up(topology, probe, batch_size: int) -> None:
    """One untimed ``probe(2)`` per rank, the node's first rank first (collective)."""
    for first_turn in (True, False):
        if topology.is_leader == first_turn:
            probe(min(2, batch_size))
        if first_turn:
            sleeping_barrier(topology.node, 0.005)


def measure_costs(topology, probe, clock, batch_size: int) -> tuple[list[balance.RankCost], float]:
    """Every rank's ``t_i(b) = a_i + c_i b`` and the measurements' noise (collective): the
    median over ranks of each rank's median over batch sizes of :func:`~.balance.timing_noise`."""
    sizes = probe_sizes(batch_size, topology.size)
    measured_sizes, measured_times = [], []
    for round_ in range(PROBE_ROUNDS + 1):
        for b in sizes[round_ % len(sizes):] + sizes[:round_ % len(sizes)]:  # rotate the order
            sleeping_barrier(topology.world, 0.0005)
            clock.start()
            probe(b)
            seconds = clock.stop()
            if round_ > 0:
                measured_sizes.append(b)
                measured_times.append(max(seconds, 1e-9))
    own = balance.fit_cost(measured_sizes, measured_times)
    spread = statistics.median(
        balance.timing_noise([t for b2, t in zip(measured_sizes, measured_times) if b2 == b])
        for b in sizes)
    gathered = topology.world.allgather((own.a, own.c, spread))
    return ([balance.RankCost(a, c) for a, c, _ in gathered],
            statistics.median(s for _, _, s in gathered))
