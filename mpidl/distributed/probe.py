"""The speed probe: how ``DataParallel(speeds="auto", probe=...)`` measures the ranks before
training, and the split it starts from.

``probe(n)`` is one forward + backward on ``n`` samples (the loop's own code). Every rank:

1. :func:`warm_up`: one untimed ``probe(2)``, the node's first rank before the others, so that
   one process compiles the JIT kernels into the shared cache and the rest load them;
2. times ``probe(b)`` at the batch sizes of :func:`probe_sizes` in :data:`PROBE_ROUNDS` rounds
   after one untimed round, every pass started by all ranks together (a sleeping barrier), so
   that each pass is measured under the contention of a real step (an EMULATED slowdown
   stretches it like a step);
3. fits ``t_i(b) = a_i + c_i b`` to its passes (:func:`~mpidl.distributed.balance.fit_cost`);
   the fits and each rank's timing noise are gathered on every rank, and the split is the
   cost model's optimum unless the equal split is within the margin
   (:func:`~mpidl.distributed.balance.choose_split`);
4. an uneven split is measured a second time before it is taken (:func:`measured_split`).

Every decision is computed from gathered numbers, so every rank takes the same branch. The
probe passes leave the model's buffers (batch-norm statistics) as they found them.
"""

from __future__ import annotations

import statistics
import time

from mpidl.distributed import balance

__all__ = ["PROBE_ROUNDS", "probe_sizes", "warm_up", "measure_costs", "measured_split"]

#: timed rounds of the speed probe (each times every probe batch size once)
PROBE_ROUNDS = 7


def probe_sizes(batch_size: int, ranks: int) -> list[int]:
    """The local batch sizes the speed probe times: half, one and two equal shares
    ``m = ceil(B / P)`` (at most ``B``), so the fitted line covers the splits it will choose."""
    share = -(-batch_size // ranks)
    return sorted({max(1, share // 2), share, min(batch_size, 2 * share)})


def sleeping_barrier(comm, poll_s: float) -> None:
    """A barrier over ``comm`` that sleeps ``poll_s`` between polls: a busy-waiting
    MPI_Barrier would take the cores from ranks still computing on an oversubscribed machine."""
    waiting = comm.Ibarrier()
    while not waiting.Test():
        time.sleep(poll_s)


def warm_up(dp, probe) -> None:
    """One untimed ``probe(2)`` per rank of ``dp``, the node's first rank first."""
    saved = dp.buffers_host()  # probe passes must not move batch-norm statistics
    node = dp.topology.node
    for first_turn in (True, False):
        if (node.Get_rank() == 0) == first_turn:
            probe(min(2, dp.batch_size))
        if first_turn:
            # Sleeping, not MPI_Barrier, whose busy-wait would take the cores from the
            # compiling rank.
            sleeping_barrier(node, 0.005)
    if saved:
        dp.model.load_buffers_host(saved)


def measure_costs(dp, probe) -> tuple[list[balance.RankCost], float]:
    """Every rank's ``t_i(b) = a_i + c_i b`` and the measurements' noise (collective; steps 2
    and 3 of the module docstring). The noise is the median over ranks of each rank's median
    over batch sizes of :func:`~mpidl.distributed.balance.timing_noise`."""
    saved = dp.buffers_host()
    sizes = probe_sizes(dp.batch_size, dp.size)
    measured_sizes, measured_times = [], []
    for round_ in range(PROBE_ROUNDS + 1):
        for b in sizes[round_ % len(sizes):] + sizes[:round_ % len(sizes)]:  # rotate the order
            sleeping_barrier(dp.topology.world, 0.0005)
            dp.clock.start()
            probe(b)
            seconds = dp.clock.stop()
            if round_ > 0:
                measured_sizes.append(b)
                measured_times.append(max(seconds, 1e-9))
    if saved:
        dp.model.load_buffers_host(saved)
    own = balance.fit_cost(measured_sizes, measured_times)
    spread = statistics.median(
        balance.timing_noise([t for b2, t in zip(measured_sizes, measured_times) if b2 == b])
        for b in sizes)
    gathered = dp.all_gather_object((own.a, own.c, spread))
    return ([balance.RankCost(a, c) for a, c, _ in gathered],
            statistics.median(s for _, _, s in gathered))


def measured_split(dp, probe) -> tuple[list[balance.RankCost], float, list[int], float]:
    """``(costs, noise, batch_sizes, predicted step seconds)`` measured for ``dp`` (collective).

    When the first measurement's split is not the equal one, the ranks are measured once
    more before the equal split is left. A rank descheduled by another process during its
    probe passes looks slow in all of them alike, so their spread (the noise margin) does not
    reveal it; a rank that is really slower is slower the second time too. The second
    measurement alone must also choose an uneven split; then the split follows the two fits
    averaged, ``a_i`` and ``c_i`` each the mean of its two values, with the larger of the two
    noise margins."""
    def split(costs, noise):
        return balance.choose_split(costs, dp.batch_size, dp.balance_threshold,
                                    minimum=dp.min_local_batch, noise=noise)

    costs, noise = measure_costs(dp, probe)
    batch_sizes, predicted = split(costs, noise)
    equal = balance.equal_split(dp.batch_size, dp.size)
    if batch_sizes == equal:
        return costs, noise, batch_sizes, predicted
    again, noise_again = measure_costs(dp, probe)
    if split(again, noise_again)[0] == equal:
        return again, noise_again, equal, balance.step_time(again, equal)
    costs = [balance.RankCost(0.5 * (x.a + y.a), 0.5 * (x.c + y.c)) for x, y in zip(costs, again)]
    noise = max(noise, noise_again)
    return (costs, noise, *split(costs, noise))
