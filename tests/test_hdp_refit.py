"""HDP, the measured split on a throttled host, deterministically: recorded timings fed to the
split (its ``observe``, the probe's clock), a simulated machine, no timing asserts.

The machine: rank ``i`` computes ``b`` samples in ``(a_i + c_i b) / share_i`` seconds and spends
``u_i / share_i`` on its per-step work outside the compute (the optimizer update, the loop).
The best split is :func:`balance.solve_split` of the true step costs; the measured split must
reach it from the probe's estimate (the compute alone, which misses ``u_i``) within two
re-fits, keep the equal split on identical ranks whatever the noise, and follow a share
lowered mid-run within two re-fits.
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from mpidl.distributed.split import MeasuredSplit, balance, probe as speed_probe
from mpidl.distributed.split.measured import settle_every

B = 64
EVERY = 20                      # --rebalance-every
COMPUTE = balance.RankCost(0.004, 0.0006)   # a full core: 4 ms + 0.6 ms per sample
OUTSIDE = 0.006                 # the update and the loop: 6 ms per step on a full core


class LockstepWorld:
    """``allgather`` for ranks simulated by threads of one process (one call per rank)."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def comm(self, rank: int):
        def allgather(value):
            self.slots[rank] = value
            self.barrier.wait()
            gathered = list(self.slots)
            self.barrier.wait()
            return gathered
        return SimpleNamespace(allgather=allgather)


def make_splits(start_costs, batch_sizes, threshold=0.05):
    """One MeasuredSplit per simulated rank, started from ``start_costs`` (from_costs: the
    probe's estimate), re-fitted every ``EVERY`` steps."""
    world = LockstepWorld(len(start_costs))
    return [MeasuredSplit.from_costs(SimpleNamespace(rank=r, size=len(start_costs), world=world.comm(r)),
                                     B, start_costs, batch_sizes, threshold=threshold, rebalance_every=EVERY)
            for r in range(len(start_costs))]


def true_costs(shares):
    """The step costs the split should balance: compute plus outside work, at each share."""
    return [balance.RankCost((COMPUTE.a + OUTSIDE) / s, COMPUTE.c / s) for s in shares]


def run_steps(splits, steps, shares_at, rng, noise=0.05, first=1):
    """Steps ``first .. first + steps - 1``: every rank observes its recorded step (times with
    multiplicative noise ``exp(N(0, noise))``), then every rank's ``after_step`` runs (in
    threads: a re-fit gathers). Returns the steps at which the split moved and the splits."""
    moves = []
    for step in range(first, first + steps):
        shares = shares_at(step)
        for r, split in enumerate(splits):
            b = split.batch_sizes[r]
            jitter = lambda: rng.lognormvariate(0.0, noise)  # noqa: E731
            split.observe(b, COMPUTE.time(b) / shares[r] * jitter(), OUTSIDE / shares[r] * jitter())
        results = [None] * len(splits)

        def after(r):
            results[r] = splits[r].after_step(step)
        threads = [threading.Thread(target=after, args=(r,)) for r in range(len(splits))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s.batch_sizes == splits[0].batch_sizes for s in splits), "ranks disagree"
        if results[0] is not None:
            moves.append((step, list(results[0]["new"])))
    return moves


def refit_steps(splits, first, last):
    """The steps in ``first .. last`` at which a re-fit ran (every rank alike)."""
    return [s for s in range(first, last + 1) if s in splits[0]._refits]


def quality(split_sizes, shares):
    """The split's true step time over the best split's."""
    costs = true_costs(shares)
    return balance.step_time(costs, split_sizes) / balance.step_time(costs, balance.solve_split(costs, B, 1))


@pytest.fixture(autouse=True)
def record_refits(monkeypatch):
    """Record at which steps each split re-fits (to count re-fits, not to change them)."""
    original = MeasuredSplit.rebalance

    def rebalance(self, steps=0):
        self.__dict__.setdefault("_refits", []).append(steps)
        return original(self, steps)
    monkeypatch.setattr(MeasuredSplit, "rebalance", rebalance)


@pytest.mark.parametrize("share", [0.5, 0.25])
@pytest.mark.parametrize("seed", range(3))
def test_a_throttled_host_gets_the_best_split_within_two_refits(share, seed):
    """The probe's estimate is the compute alone (exact, even): it misses the per-step work
    outside the compute, which the capped host also pays at its share. Two re-fits later the
    split is the best one of the true step costs (within 3 % of its step time)."""
    rng = random.Random(seed)
    shares = [1.0, share]
    probe_costs = [balance.RankCost(COMPUTE.a / s, COMPUTE.c / s) for s in shares]
    start = balance.solve_split(probe_costs, B, 1)
    assert quality(start, shares) > 1.03  # the starting estimate is measurably off
    splits = make_splits(probe_costs, start)
    run_steps(splits, 100, lambda step: shares, rng)
    second_refit = splits[0]._refits[1]
    assert second_refit <= 2 * settle_every(EVERY)
    # replay to the second re-fit: the split then must be (close to) the best
    rng = random.Random(seed)
    splits = make_splits(probe_costs, start)
    run_steps(splits, second_refit, lambda step: shares, rng)
    assert quality(splits[0].batch_sizes, shares) <= 1.03, (splits[0].batch_sizes, splits[0].costs)
    # and it stays there (no drift) for the rest of the run
    moves_after = run_steps(splits, 200, lambda step: shares, rng, first=second_refit + 1)
    assert quality(splits[0].batch_sizes, shares) <= 1.03, moves_after


@pytest.mark.parametrize("seed", range(5))
def test_identical_hosts_keep_the_equal_split_under_rebalance(seed):
    """Two identical ranks, step times with 10 % noise (each step), 400 steps of re-fits
    every 20 (settling every 10 first): the equal split never moves, in 5 of 5 seeds."""
    rng = random.Random(100 + seed)
    start = [balance.RankCost(COMPUTE.a * rng.uniform(0.9, 1.1), COMPUTE.c * rng.uniform(0.9, 1.1))
             for _ in range(2)]
    splits = make_splits(start, [32, 32])
    moves = run_steps(splits, 400, lambda step: [1.0, 1.0], rng, noise=0.10)
    assert moves == [] and splits[0].batch_sizes == [32, 32], moves


def run_wandering_steps(splits, steps, rng, wander=0.10, every=16, noise=0.05):
    """Like :func:`run_steps` on identical full cores whose speed wanders: every ``every``
    steps each rank's speed is a new factor ``exp(N(0, wander))``, independently (another
    process taking turns on a core, a hypervisor's neighbour), with per-step noise on top."""
    factors = [1.0] * len(splits)

    def shares_at(step):
        if step % every == 1:
            factors[:] = [rng.lognormvariate(0.0, wander) for _ in splits]
        return list(factors)
    return run_steps(splits, steps, shares_at, rng, noise=noise)


def test_identical_hosts_whose_speed_wanders_mostly_keep_the_equal_split():
    """Two identical ranks whose speeds wander by 10 % from one stretch of 16 steps to the
    next, independently (the steps of one re-fit period agree with each other, the periods
    do not: a margin from the spread within a period misses it), 400 steps, 20 runs. Once
    the ranks have measured how much their periods differ (after step 100), the margin
    includes it: the split does not move again in at least 15 of the 20 runs (19 here; with
    the spread within a period alone as the margin, 0), and it ends within 5 samples of
    32:32 in every run."""
    still_after_drift_known, ends = 0, []
    for seed in range(20):
        rng = random.Random(500 + seed)
        splits = make_splits([COMPUTE, COMPUTE], [32, 32])
        moves = run_wandering_steps(splits, 400, rng)
        still_after_drift_known += not [step for step, _ in moves if step > 100]
        ends.append(splits[0].batch_sizes)
    assert still_after_drift_known >= 15, still_after_drift_known
    assert all(abs(b0 - 32) <= 5 for b0, _ in ends), ends


@pytest.mark.parametrize("seed", range(5))
def test_identical_hosts_start_with_the_equal_split(seed):
    """The start's decision from noisy probe passes (7 rounds at the probe's three sizes, 10 %
    noise per pass): fitted models differ, but the equal split is kept (5 of 5 seeds)."""
    rng = random.Random(200 + seed)
    sizes = speed_probe.probe_sizes(B, 2)
    fits, spreads = [], []
    for _ in range(2):
        passes = [(b, COMPUTE.time(b) * rng.lognormvariate(0.0, 0.10)) for _ in range(speed_probe.PROBE_ROUNDS)
                  for b in sizes]
        fits.append(balance.fit_cost([b for b, _ in passes], [t for _, t in passes]))
        spreads.append(sorted(balance.timing_noise([t for b2, t in passes if b2 == b]) for b in sizes)[1])
    chosen, _ = balance.choose_split(fits, B, 0.05, minimum=1, noise=sorted(spreads)[len(spreads) // 2])
    assert chosen == [32, 32], fits


@pytest.mark.parametrize("seed", range(3))
def test_a_share_lowered_mid_run_is_followed_within_two_refits(seed):
    """Host 2 at share 1.0 until step 64, then 0.33 (as `jobs/cluster.sh cpu 2 0.33`): by the
    second re-fit after the change the split is within 3 % of the best one at 1.0 / 0.33, in 3
    of 3 runs."""
    change_at = 64
    shares_at = lambda step: [1.0, 1.0] if step <= change_at else [1.0, 0.33]  # noqa: E731
    rng = random.Random(300 + seed)
    splits = make_splits([COMPUTE, COMPUTE], [32, 32])
    run_steps(splits, 200, shares_at, rng)
    refits_after = [s for s in splits[0]._refits if s > change_at]
    second = refits_after[1]
    rng = random.Random(300 + seed)
    splits = make_splits([COMPUTE, COMPUTE], [32, 32])
    run_steps(splits, second, shares_at, rng)
    assert quality(splits[0].batch_sizes, [1.0, 0.33]) <= 1.03, (second, splits[0].batch_sizes)


def test_refit_drops_the_period_before_a_speed_change():
    """The previous period at the old speed, the current one 3x slower: the re-fit follows the
    current period alone (the window's median would still be the old speed)."""
    model = balance.RankCost(0.004, 0.001)
    old = [(32, model.time(32))] * 20
    new = [(32, 3 * model.time(32))] * 8
    sizes, seconds = [b for b, _ in old + new], [t for _, t in old + new]
    refit = balance.refit_cost(model, sizes, seconds, recent=len(new))
    assert refit.time(32) == pytest.approx(3 * model.time(32))
    assert balance.refit_cost(model, sizes, seconds).time(32) == pytest.approx(model.time(32))  # no period known
    assert balance.speed_changed(model, old, new) and not balance.speed_changed(model, old, old)


class QuotaClock:
    """A recorded clock of a process under a CFS quota: ``work(s)`` of CPU time runs at full
    speed until the period's quota is spent, then waits for the next period."""

    def __init__(self, cores: float, period_s: float):
        self.quota, self.period, self.t, self.used = cores * period_s, period_s, 0.0, 0.0
        self.cpu = 0.0

    def cpu_now(self) -> float:
        return self.cpu

    def _period(self) -> int:
        return int(self.t / self.period + 1e-9)

    def _advance(self, seconds: float) -> None:
        """Time passes: a new period brings a fresh quota."""
        before = self._period()
        self.t += seconds
        if self._period() != before:
            self.used = 0.0

    def work(self, seconds: float) -> None:
        self.cpu += seconds
        while seconds > 1e-15:
            period_end = (self._period() + 1) * self.period
            run = min(seconds, self.quota - self.used, period_end - self.t)
            if run <= 1e-15:  # the quota is spent: wait for the next period
                self._advance(period_end - self.t)
                continue
            self.used += run
            seconds -= run
            self._advance(run)

    def idle(self, seconds: float) -> None:  # a barrier's wait
        self._advance(seconds)

    def now(self) -> float:
        return self.t

    def start(self) -> None:
        self._mark = self.t

    def stop(self) -> float:
        return self.t - self._mark


def test_the_probe_sees_the_quota_over_several_periods():
    """A 3 ms pass at half a core, 10 ms period, started after a wait: alone it runs
    unthrottled (3 ms, the full core's speed); over QUOTA_PERIODS periods the time per pass
    is the share's, 6 ms."""
    clock = QuotaClock(0.5, 0.010)
    probe = lambda n: clock.work(0.001 * n)  # noqa: E731
    clock.idle(0.05)
    assert speed_probe.timed_pass(probe, clock, 3, 0.0) == pytest.approx(0.003)
    clock.idle(0.05)
    per_pass = speed_probe.timed_pass(probe, clock, 3, speed_probe.QUOTA_PERIODS * 0.010)
    assert per_pass == pytest.approx(0.006, rel=0.15)
    clock.idle(0.05)  # with the quota's cores known: the CPU seconds over them, exactly
    assert speed_probe.timed_pass(probe, clock, 3, speed_probe.QUOTA_PERIODS * 0.010, 0.5) == pytest.approx(0.006)


def test_cpu_quota_and_throttling_are_read_from_the_cgroup(tmp_path):
    """cgroup v1 (cpu.cfs_quota_us / cpu.cfs_period_us, cpu.stat throttled_time in ns) and v2
    (cpu.max, throttled_usec); no quota (-1, 'max') and unreadable files give None."""
    v1 = tmp_path / "v1"
    node = v1 / "cpu" / "mpidl" / "node2"
    node.mkdir(parents=True)
    (node / "cpu.cfs_quota_us").write_text("5000\n")
    (node / "cpu.cfs_period_us").write_text("10000\n")
    (node / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 2500000000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup_v1"
    proc.write_text("2:cpuacct:/\n1:cpu:/mpidl/node2\n0::/\n")
    assert speed_probe.cpu_quota(str(v1), str(proc)) == pytest.approx((0.5, 0.010))
    assert speed_probe.throttled_s(str(v1), str(proc)) == pytest.approx(2.5)
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cpu.max").write_text("25000 100000\n")
    (v2 / "job" / "cpu.stat").write_text("usage_usec 1\nthrottled_usec 1500000\n")
    (v2 / "cpu.max").write_text("max 100000\n")
    proc2 = tmp_path / "cgroup_v2"
    proc2.write_text("0::/job\n")
    assert speed_probe.cpu_quota(str(v2), str(proc2)) == pytest.approx((0.25, 0.1))
    assert speed_probe.throttled_s(str(v2), str(proc2)) == pytest.approx(1.5)
    (v2 / "job" / "cpu.max").write_text("max 100000\n")
    assert speed_probe.cpu_quota(str(v2), str(proc2)) is None
    assert speed_probe.cpu_quota(str(v2), str(tmp_path / "missing")) is None


def test_proposals_pulling_opposite_ways_confirm_nothing():
    """A re-fit proposing to move a sample one way, the next the other way (each gain above
    the margin but below twice it): noise, the split stays; two the same way: it moves."""
    def drive(first_slower, second_slower):
        splits = make_splits([COMPUTE, COMPUTE], [32, 32], threshold=0.02)
        moves = []
        for step, slower in ((settle_every(EVERY), first_slower), (2 * settle_every(EVERY), second_slower)):
            for r, split in enumerate(splits):  # 10 steps since the last re-fit, rank `slower` 6 % slower
                for _ in range(settle_every(EVERY)):
                    split.observe(32, COMPUTE.time(32) * (1.06 if r == slower else 1.0), 0.0)
                split._previous_period = []  # each re-fit sees its own period only
            results = [None, None]
            threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, splits[r].rebalance(step)))
                       for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            moves.append(results[0])
        return moves, splits[0].batch_sizes

    moves, sizes = drive(1, 0)
    assert moves == [None, None] and sizes == [32, 32]
    moves, sizes = drive(1, 1)
    assert moves[0] is None and moves[1] is not None and sizes[0] > sizes[1]


class SimulatedRanks:
    """Ranks as threads with recorded clocks in one simulated time: a barrier (``Ibarrier``)
    brings every rank's clock to the latest one (the early ones idle, and a quota refills
    while idle), ``allgather`` gathers. Each rank's ``topology`` is enough for the probe."""

    def __init__(self, clocks):
        self.clocks, self.size = clocks, len(clocks)
        self.world = LockstepWorld(self.size)

    def topology(self, rank: int):
        world = self.world

        def ibarrier():
            times = world.comm(rank).allgather(self.clocks[rank].now())
            self.clocks[rank].idle(max(times) - self.clocks[rank].now())
            return SimpleNamespace(Test=lambda: True)
        comm = SimpleNamespace(allgather=world.comm(rank).allgather, Ibarrier=ibarrier)
        node = SimpleNamespace(Ibarrier=lambda: SimpleNamespace(Test=lambda: True))  # one rank per node
        return SimpleNamespace(rank=rank, size=self.size, world=comm, node=node, is_leader=True)

    def measured_splits(self, probe_of, monkeypatch, quota_of=lambda rank: None, threshold=0.05):
        """A MeasuredSplit built on every simulated rank (collective: threads)."""
        ranks = {}
        monkeypatch.setattr(speed_probe, "cpu_quota", lambda *a: quota_of(ranks[threading.get_ident()]))
        monkeypatch.setattr(speed_probe, "throttled_s", lambda *a: None)
        splits = [None] * self.size

        def build(rank):
            ranks[threading.get_ident()] = rank
            splits[rank] = MeasuredSplit(self.topology(rank), B, probe_of(rank), self.clocks[rank],
                                         threshold=threshold, rebalance_every=EVERY)
        threads = [threading.Thread(target=build, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return splits


@pytest.mark.parametrize("seed", range(5))
def test_identical_hosts_start_with_the_equal_split_through_the_probe(seed, monkeypatch):
    """The whole start (warm-up, timed passes, fit, noise margin, a second measurement when
    the first is uneven) on two identical simulated ranks with 10 % noise per pass: 32:32
    on both ranks, in 5 of 5 seeds."""
    rngs = [random.Random(400 + 10 * seed + r) for r in range(2)]
    clocks = [QuotaClock(1.0, 0.010) for _ in range(2)]
    ranks = SimulatedRanks(clocks)
    splits = ranks.measured_splits(
        lambda r: (lambda n: clocks[r].work(COMPUTE.time(n) * rngs[r].lognormvariate(0.0, 0.10))), monkeypatch)
    assert [s.batch_sizes for s in splits] == [[32, 32], [32, 32]], splits[0].describe()


def test_the_probe_measures_a_capped_host_at_its_share(monkeypatch):
    """Host 2 at half a core, 10 ms quota period, passes of 2 - 6.8 ms (shorter than the
    period: timed one by one, part of each runs at full speed).
    Timed over QUOTA_PERIODS periods and at least its CPU seconds over the quota's cores, its
    cost is measured at 2x host 1's and the split is the best one of the true costs."""
    clocks = [QuotaClock(1.0, 0.010), QuotaClock(0.5, 0.010)]
    cost = balance.RankCost(0.0004, 0.0001)
    ranks = SimulatedRanks(clocks)
    splits = ranks.measured_splits(lambda r: (lambda n: clocks[r].work(cost.time(n))), monkeypatch,
                                   quota_of=lambda r: (1.0, 0.010) if r == 0 else (0.5, 0.010))
    fast, slow = splits[0].costs
    assert slow.c / fast.c == pytest.approx(2.0, rel=0.02), splits[0].describe()
    assert slow.a / fast.a == pytest.approx(2.0, rel=0.02), splits[0].describe()
    truth = [cost, balance.RankCost(2 * cost.a, 2 * cost.c)]
    assert splits[0].batch_sizes == splits[1].batch_sizes == balance.solve_split(truth, B, 1)
    # the same passes timed one by one (no quota known): the capped host's per-step part fits
    # in the quota's slice of a period and is measured at the uncapped host's: it is missed
    clocks = [QuotaClock(1.0, 0.010), QuotaClock(0.5, 0.010)]
    ranks = SimulatedRanks(clocks)
    splits = ranks.measured_splits(lambda r: (lambda n: clocks[r].work(cost.time(n))), monkeypatch)
    assert splits[0].costs[1].a / splits[0].costs[0].a < 1.5, splits[0].describe()
