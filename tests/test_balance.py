"""Serial tests of mpidl.distributed.balance: batch sizes from speeds, splits, re-balancing."""

import math

import numpy as np
import pytest

from mpidl.distributed.balance import (batch_sizes, gather_speeds, measure_speed, parse_speeds,
                                       rebalance, split_counts)


def random_cases(seed, n_cases=400):
    """(speeds, B) pairs: 1..16 ranks, speeds spanning three orders of magnitude, B >= P."""
    rng = np.random.default_rng(seed)
    for _ in range(n_cases):
        ranks = int(rng.integers(1, 17))
        speeds = list(10.0 ** rng.uniform(-1.5, 1.5, size=ranks))
        global_batch = int(rng.integers(ranks, 40 * ranks + 2))
        yield speeds, global_batch


# ----------------------------------------------------------------------------- batch_sizes
def test_batch_sizes_properties_on_random_speeds():
    for speeds, total in random_cases(seed=0):
        sizes = batch_sizes(speeds, total)
        assert len(sizes) == len(speeds)
        assert sum(sizes) == total
        assert all(isinstance(b, int) and b >= 1 for b in sizes)
        shares = [total * s / sum(speeds) for s in speeds]
        if min(shares) >= 1:  # no rank pinned to one sample: proportional within one sample
            assert all(abs(b - share) < 1 for b, share in zip(sizes, shares)), (speeds, total)


def test_batch_sizes_pins_tiny_shares_to_one_and_shares_the_rest():
    # shares 0.4, 0.4, 2.2 of B=3: everybody computes one sample
    assert batch_sizes([0.4, 0.4, 2.2], 3) == [1, 1, 1]
    # shares ~0.001 each for the slow ranks: they get one, the fast one the rest
    assert batch_sizes([1, 1, 1, 1000], 1000) == [1, 1, 1, 997]
    sizes = batch_sizes([1, 1000], 50)
    assert sizes == [1, 49]


def test_batch_sizes_examples_and_symmetry():
    assert batch_sizes([1, 2, 2, 4], 64) == [7, 14, 14, 29]   # 7.1, 14.2, 14.2, 28.4
    assert batch_sizes([1, 1, 1], 10) == [4, 3, 3]            # ties go to the lower rank
    assert batch_sizes([3.0], 17) == [17]
    assert batch_sizes([2, 2, 2, 2], 4) == [1, 1, 1, 1]
    # only the ratios matter
    assert batch_sizes([1, 2, 5], 101) == batch_sizes([10, 20, 50], 101)
    # numpy inputs are fine
    assert batch_sizes(np.array([1.0, 3.0]), np.int64(8)) == [2, 6]


@pytest.mark.parametrize("speeds,total,match", [
    ([], 4, "empty"),
    ([1, 0], 4, r"speeds\[1\]"),
    ([1, -2], 4, r"speeds\[1\]"),
    ([1, float("nan")], 4, r"speeds\[1\]"),
    ([1, float("inf")], 4, r"speeds\[1\]"),
    ([1, 1, 1], 2, "smaller than the number of ranks"),
    ([1, 1], 0, "global_batch"),
    ([1, 1], 4.0, "global_batch"),
    ([1, 1], True, "global_batch"),
])
def test_batch_sizes_refuses_bad_input(speeds, total, match):
    with pytest.raises(ValueError, match=match):
        batch_sizes(speeds, total)


# ----------------------------------------------------------------------------- split_counts
def test_split_counts_for_a_last_smaller_batch():
    rng = np.random.default_rng(1)
    for _ in range(300):
        ranks = int(rng.integers(1, 12))
        proportions = [int(x) for x in rng.integers(1, 40, size=ranks)]
        total = int(rng.integers(0, sum(proportions) + 1))
        counts = split_counts(total, proportions)
        assert sum(counts) == total and all(c >= 0 for c in counts)
        for c, p in zip(counts, proportions):
            assert abs(c - total * p / sum(proportions)) < 1
    assert split_counts(3, [10, 10, 10, 10]) == [1, 1, 1, 0]   # zeros allowed
    assert split_counts(0, [1, 2]) == [0, 0]
    assert split_counts(10, [0, 1]) == [0, 10]
    assert split_counts(1000, [7, 14, 14, 29]) == [109, 219, 219, 453]  # data shares n_i = N b_i / B


@pytest.mark.parametrize("total,proportions,match", [
    (-1, [1], "total"), (3, [], "empty"), (3, [0, 0], "all zero"),
    (3, [1, -1], r"proportions\[1\]"), (3, [1, float("nan")], r"proportions\[1\]"),
])
def test_split_counts_refuses_bad_input(total, proportions, match):
    with pytest.raises(ValueError, match=match):
        split_counts(total, proportions)


# ----------------------------------------------------------------------------- parse_speeds
def test_parse_speeds():
    assert parse_speeds("1,2,2,4", 4) == [1.0, 2.0, 2.0, 4.0]
    assert parse_speeds(" 0.5 , 1.5 ", 2) == [0.5, 1.5]
    for text, size, match in [
        ("1,2,2", 4, "3 entries.*4 ranks"),
        ("1,2,x,4", 4, r"entry 2 \('x'\) is not a number"),
        ("", 1, "empty"),
        ("1,,2", 3, "entry 1"),
        ("1,0", 2, r"entry 1 \('0'\) must be a finite number > 0"),
        ("1,-3", 2, "entry 1"),
        ("1,inf", 2, "entry 1"),
        ("nan", 1, "entry 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_speeds(text, size)


# ----------------------------------------------------------------------------- measure_speed
def test_measure_speed_calls_warmup_then_repeats_and_synchronizes():
    calls, syncs = [], []
    speed = measure_speed(calls.append, probe_batch=8, repeats=3, warmup=2,
                          synchronize=lambda: syncs.append(len(calls)))
    assert calls == [8] * 5
    # every timed repeat is bracketed by a synchronize (start and stop of the clock)
    assert syncs == [2, 3, 3, 4, 4, 5]
    assert math.isfinite(speed) and speed > 0


def test_measure_speed_refuses_bad_arguments():
    with pytest.raises(ValueError, match="probe_batch"):
        measure_speed(lambda n: None, probe_batch=0)
    with pytest.raises(ValueError, match="repeats"):
        measure_speed(lambda n: None, probe_batch=4, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        measure_speed(lambda n: None, probe_batch=4, warmup=-1)


# ----------------------------------------------------------------------------- rebalance
def test_rebalance_gives_batches_inverse_to_time_per_sample():
    # 100 samples each; rank 1 took twice as long per sample as rank 0, rank 2 four times
    speeds = rebalance([1.0, 2.0, 4.0], [100, 100, 100])
    assert speeds == pytest.approx([100.0, 50.0, 25.0])  # samples per second
    sizes = batch_sizes(speeds, 70)
    assert sizes == [40, 20, 10]
    # ranks then finish a step together: b_i * t_i is the same for all
    times = [1.0 / s for s in speeds]
    assert [b * t for b, t in zip(sizes, times)] == pytest.approx([0.4] * 3)


def test_rebalance_uses_samples_over_seconds():
    # uneven shares last epoch: rank 0 computed 300 samples in 3 s, rank 1 100 in 2 s
    assert rebalance([3.0, 2.0], [300, 100]) == pytest.approx([100.0, 50.0])


def test_rebalance_smoothing_blends_with_rescaled_previous_speeds():
    # measured 1:1 (10 samples/s each); previous 3:1 in other units, rescaled to total 20
    # -> 15:5, blended half-half -> 12.5 : 7.5
    speeds = rebalance([1.0, 1.0], [10, 10], previous_speeds=[30.0, 10.0], smoothing=0.5)
    assert speeds == pytest.approx([12.5, 7.5])
    assert batch_sizes(speeds, 80) == [50, 30]
    # without smoothing the previous speeds do not matter
    assert rebalance([1.0, 1.0], [10, 10], previous_speeds=[30.0, 10.0]) == pytest.approx([10, 10])


def test_rebalance_keeps_previous_speeds_when_a_rank_computed_nothing():
    assert rebalance([1.0, 0.0], [10, 0], previous_speeds=[2.0, 1.0]) == [2.0, 1.0]
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] computed nothing"):
        rebalance([1.0, 0.0], [10, 0])


def test_rebalance_random_inputs_keep_batch_invariants():
    rng = np.random.default_rng(2)
    for _ in range(200):
        ranks = int(rng.integers(1, 9))
        samples = [int(n) for n in rng.integers(1, 500, size=ranks)]
        seconds = list(np.array(samples) * 10.0 ** rng.uniform(-4, -1, size=ranks))
        total = int(rng.integers(ranks, 50 * ranks))
        speeds = rebalance(seconds, samples)
        assert speeds == pytest.approx([n / c for n, c in zip(samples, seconds)])
        sizes = batch_sizes(speeds, total)
        assert sum(sizes) == total and min(sizes) >= 1


@pytest.mark.parametrize("args,kwargs,match", [
    (([1.0, -1.0], [1, 1]), {}, r"compute_seconds\[1\]"),
    (([1.0, float("nan")], [1, 1]), {}, r"compute_seconds\[1\]"),
    (([], []), {}, "empty"),
    (([1.0, 1.0], [1]), {}, "samples has 1"),
    (([1.0, 1.0], [1, -1]), {}, r"samples\[1\]"),
    (([1.0, 1.0], [1, 2.5]), {}, r"samples\[1\]"),
    (([1.0, 1.0], [1, 1]), dict(smoothing=1.0, previous_speeds=[1, 1]), "smoothing"),
    (([1.0, 1.0], [1, 1]), dict(smoothing=0.5), "needs previous_speeds"),
    (([1.0, 1.0], [1, 1]), dict(previous_speeds=[1.0]), "previous_speeds has 1"),
    (([1.0, 1.0], [1, 1]), dict(previous_speeds=[1.0, 0.0]), r"previous_speeds\[1\]"),
])
def test_rebalance_refuses_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rebalance(*args, **kwargs)


# ----------------------------------------------------------------------------- gather_speeds
class _FakeComm:
    """Stands in for an MPI communicator: the other ranks' speeds are fixed."""

    def __init__(self, others):
        self.others = others

    def allgather(self, value):
        return [value, *self.others]


def test_gather_speeds_validates_after_the_gather():
    assert gather_speeds(_FakeComm([2.0, 4.0]), 1) == [1.0, 2.0, 4.0]
    # another rank's bad speed raises here too (every rank sees the same list)
    with pytest.raises(ValueError, match=r"gathered speeds\[2\]"):
        gather_speeds(_FakeComm([2.0, float("nan")]), 1.0)
