"""Serial tests of mpidl.distributed.split.balance: the cost model, the split solver, re-splits."""

import itertools
import math

import numpy as np
import pytest

from mpidl.distributed.split import balance
from mpidl.distributed.split.balance import (RankCost, choose_split, confirm_resplit, costs_from_speeds,
                                             equal_split, fit_cost, parse_speeds, refit_cost, scale_cost,
                                             solve_split, split_counts, step_time)


def random_costs(rng, ranks):
    """Per-sample costs over two orders of magnitude; fixed parts from 0 to a few samples' worth."""
    c = 10.0 ** rng.uniform(-4, -2, size=ranks)
    a = c * rng.uniform(0, 5, size=ranks) * (rng.random(ranks) < 0.8)
    return [RankCost(float(x), float(y)) for x, y in zip(a, c)]


def brute_force(costs, total):
    """min over every split of ``total`` into len(costs) integers >= 0 of max_i t_i(b_i)."""
    best = math.inf
    for cut in itertools.combinations(range(total + len(costs) - 1), len(costs) - 1):
        bounds = (-1,) + cut + (total + len(costs) - 1,)
        split = [bounds[k + 1] - bounds[k] - 1 for k in range(len(costs))]
        best = min(best, step_time(costs, split))
    return best


# ----------------------------------------------------------------------------- the solver
def test_solve_split_is_optimal_on_small_cases_checked_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        ranks = int(rng.integers(1, 5))
        total = int(rng.integers(0, 13))
        costs = random_costs(rng, ranks)
        split = solve_split(costs, total)
        assert sum(split) == total and all(isinstance(b, int) and b >= 0 for b in split)
        assert step_time(costs, split) == pytest.approx(brute_force(costs, total), rel=1e-12), (costs, total)


def test_solve_split_sums_to_the_total_on_large_random_cases():
    rng = np.random.default_rng(1)
    for _ in range(200):
        ranks = int(rng.integers(1, 200))
        total = int(rng.integers(0, 5000))
        split = solve_split(random_costs(rng, ranks), total)
        assert sum(split) == total and min(split) >= 0 and len(split) == ranks


def test_a_fixed_cost_moves_samples_to_the_rank_without_one():
    """Proportional to 'samples per second at 32' gives the fast rank too few: with a fixed
    part, the slow rank's speed at a small batch is lower than at 32."""
    fast, slow = RankCost(0.0, 1e-3), RankCost(20e-3, 1e-3)
    split = solve_split([fast, slow], 64)
    assert split == [42, 22]  # 42 ms each: t_fast = 42 ms, t_slow = 20 + 22 ms
    speeds_at_32 = [32 / fast.time(32), 32 / slow.time(32)]
    proportional = split_counts(64, speeds_at_32)
    assert step_time([fast, slow], proportional) > step_time([fast, slow], split)


def test_solve_split_examples_and_edge_cases():
    assert solve_split(costs_from_speeds([1, 2, 2, 4]), 63) == [7, 14, 14, 28]
    assert solve_split(costs_from_speeds([1, 1, 1]), 10) == [4, 3, 3]  # ties go to the lower rank
    assert solve_split([RankCost(1.0, 1.0)], 17) == [17]  # one rank takes everything
    assert solve_split(costs_from_speeds([1, 1]), 0) == [0, 0]
    # a rank so slow that even one sample would exceed the others' time gets none
    assert solve_split([RankCost(0, 1e-3), RankCost(0, 1.0)], 10) == [10, 0]
    # only the ratios of the costs matter
    assert solve_split(costs_from_speeds([1, 2, 5]), 101) == solve_split(costs_from_speeds([10, 20, 50]), 101)


@pytest.mark.parametrize("costs, total, match", [
    ([], 4, "must not be empty"),
    ([RankCost(0, 1)], -1, "total must be an integer >= 0"),
    ([RankCost(0, 1)], 2.5, "total must be an integer >= 0"),
    ([(0, 1)], 4, r"costs\[0\] must be a RankCost"),
])
def test_solve_split_refuses_bad_input(costs, total, match):
    with pytest.raises(ValueError, match=match):
        solve_split(costs, total)


@pytest.mark.parametrize("a, c, match", [
    (-1.0, 1.0, "cost a"), (float("nan"), 1.0, "cost a"), (0.0, 0.0, "cost c"),
    (0.0, -1.0, "cost c"), (0.0, float("inf"), "cost c"), (True, 1.0, "cost a"),
])
def test_rank_cost_refuses_bad_values(a, c, match):
    with pytest.raises(ValueError, match=match):
        RankCost(a, c)


def test_a_zero_speed_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match=r"speeds\[1\] must be a finite number > 0"):
        costs_from_speeds([1.0, 0.0])


# ----------------------------------------------------------------------------- equal unless unequal
def test_choose_split_keeps_the_equal_split_unless_measurably_better():
    nearly = [RankCost(1e-3, 1.00e-3), RankCost(1e-3, 1.03e-3)]  # 3 % apart: noise
    split, predicted = choose_split(nearly, 64, threshold=0.05)
    assert split == [32, 32] and predicted == step_time(nearly, [32, 32])
    uneven = [RankCost(1e-3, 1e-3), RankCost(2e-3, 2e-3)]  # a 1:2 pair: a real difference
    split, predicted = choose_split(uneven, 64, threshold=0.05)
    assert split == solve_split(uneven, 64) and split[0] > split[1]
    assert predicted < 0.95 * step_time(uneven, [32, 32])
    # with threshold 0 the optimum is always taken
    assert choose_split(nearly, 64, threshold=0.0)[0] == solve_split(nearly, 64)


def test_choose_split_against_the_current_split_is_hysteresis():
    costs = [RankCost(0, 1.0), RankCost(0, 1.02)]
    current = [31, 33]  # 3 % worse than the optimum: not worth a change
    assert choose_split(costs, 64, 0.05, current=current)[0] == current
    far = [20, 44]
    assert choose_split(costs, 64, 0.05, current=far)[0] == solve_split(costs, 64)
    with pytest.raises(ValueError, match="does not split 64"):
        choose_split(costs, 64, 0.05, current=[1, 2])
    with pytest.raises(ValueError, match="threshold"):
        choose_split(costs, 64, 1.5)


def test_equal_split():
    assert equal_split(10, 3) == [4, 3, 3] and equal_split(2, 4) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="ranks"):
        equal_split(4, 0)


# ----------------------------------------------------------------------------- fitting
def test_fit_cost_recovers_a_line_through_noisy_passes():
    rng = np.random.default_rng(2)
    sizes, times = [], []
    for b in (8, 16, 32):
        for _ in range(5):
            sizes.append(b)
            times.append(2e-3 + 0.5e-3 * b)
    times[3] *= 3.0  # one disturbed pass: the median per size ignores it
    cost = fit_cost(sizes, times)
    assert cost.a == pytest.approx(2e-3, rel=1e-9) and cost.c == pytest.approx(0.5e-3, rel=1e-9)
    noisy = [t * (1 + 0.01 * rng.standard_normal()) for t in times]
    cost = fit_cost(sizes, noisy)
    assert cost.a == pytest.approx(2e-3, rel=0.2) and cost.c == pytest.approx(0.5e-3, rel=0.05)


def test_fit_cost_falls_back_to_a_line_through_the_origin():
    assert fit_cost([16, 16], [4.0, 4.0]) == RankCost(0.0, 0.25)  # one size: a = 0
    cost = fit_cost([8, 16], [4.0, 4.0])  # no growth (noise): a = 0, least squares slope
    assert cost.a == 0.0 and cost.c == pytest.approx((8 * 4 + 16 * 4) / (64 + 256))


def test_fit_cost_refuses_bad_input():
    with pytest.raises(ValueError, match="entries"):
        fit_cost([8, 16], [1.0])
    with pytest.raises(ValueError, match=r"seconds\[0\]"):
        fit_cost([8], [0.0])
    with pytest.raises(ValueError, match=r"batch_sizes\[0\]"):
        fit_cost([0], [1.0])


def test_scale_cost_keeps_the_models_shape():
    cost = scale_cost(RankCost(2.0, 1.0), [8, 8, 8], [20.0, 21.0, 19.0])  # predicted 10, measured 20
    assert cost == RankCost(4.0, 2.0)
    # several sizes: the median of measured / predicted (8: 10 -> 20 and 30; 18: 20 -> 44)
    assert scale_cost(RankCost(2.0, 1.0), [8, 8, 18], [20.0, 30.0, 44.0]) == RankCost(4.4, 2.2)
    with pytest.raises(ValueError, match="entries"):
        scale_cost(RankCost(2.0, 1.0), [8, 8], [20.0])
    with pytest.raises(ValueError, match=r"batch_sizes\[0\]"):
        scale_cost(RankCost(2.0, 1.0), [0], [20.0])


def test_refit_cost_separates_a_from_c_with_the_two_sizes_around_a_resplit():
    # the probe thought a = 1 ms, c = 0.1 ms; the steps really take 4 ms + 0.2 ms per sample,
    # 20 steps at 46 samples, then 20 at 18 (one of them disturbed): the line through the two
    # medians is the truth
    truth, prior = RankCost(4e-3, 0.2e-3), RankCost(1e-3, 0.1e-3)
    sizes = [46] * 20 + [18] * 20
    times = [truth.time(b) for b in sizes]
    times[25] *= 5
    cost = refit_cost(prior, sizes, times)
    assert cost.a == pytest.approx(truth.a, rel=1e-9) and cost.c == pytest.approx(truth.c, rel=1e-9)


def test_refit_cost_with_one_size_scales_the_previous_model_through_it():
    prior = RankCost(2e-3, 0.5e-3)  # predicts 10 ms at 16
    assert refit_cost(prior, [16] * 8, [20e-3] * 8) == scale_cost(prior, [16] * 8, [20e-3] * 8)
    # sizes too close to separate a from c (48 vs 46; 30 is seen in too few steps to be a
    # point): the model is scaled through all the steps
    sizes = [48] * 3 + [46] * 5 + [30] * 2
    assert refit_cost(prior, sizes, [0.1] * 10) == scale_cost(prior, sizes, [0.1] * 10)


def test_refit_cost_does_not_take_a_slow_phase_for_a_slope():
    # The probe measured the shape over 16..64 samples. The steps: 20 at 19 samples during a
    # slow phase of the machine (1.6x), then 20 at 12 samples at the usual speed. A line
    # through the two medians would have a negative intercept; sizes 12..19 span too little
    # to tell, so the probe's shape is kept and scaled.
    probe = RankCost(12e-3, 1.2e-3)
    sizes = [19] * 20 + [12] * 20
    times = [1.6 * probe.time(19)] * 20 + [probe.time(12)] * 20
    cost = refit_cost(probe, sizes, times)
    assert cost.a / cost.c == pytest.approx(probe.a / probe.c, rel=1e-12)
    assert 1.0 <= cost.c / probe.c <= 1.6


def test_refit_cost_ignores_empty_steps_and_keeps_the_model_without_data():
    prior = RankCost(2e-3, 0.5e-3)
    assert refit_cost(prior, [0] * 10, [1e-6] * 10) == prior
    assert refit_cost(prior, [], []) == prior
    assert refit_cost(prior, [16, 16], [1.0, 1.0]) == prior  # fewer than MIN_STEPS_PER_SIZE steps


def test_refit_cost_refuses_bad_input():
    prior = RankCost(2e-3, 0.5e-3)
    with pytest.raises(ValueError, match="entries"):
        refit_cost(prior, [8, 8, 8], [1.0])
    with pytest.raises(ValueError, match=r"batch_sizes\[1\]"):
        refit_cost(prior, [8, -1], [1.0, 1.0])
    with pytest.raises(ValueError, match="previous must be a RankCost"):
        refit_cost((2e-3, 0.5e-3), [8], [1.0])
    with pytest.raises(ValueError, match=r"seconds\[0\]"):
        refit_cost(prior, [8, 8, 8], [0.0, 1.0, 1.0])


def test_a_resplit_needs_its_gain_twice_or_a_large_gain_once():
    assert not confirm_resplit(0.07, 0.05, proposed_before=False)  # one noisy period: wait
    assert confirm_resplit(0.07, 0.05, proposed_before=True)       # the next one agrees
    assert confirm_resplit(0.11, 0.05, proposed_before=False)      # far outside the margin
    assert not confirm_resplit(0.04, 0.05, proposed_before=True)   # within the margin: never
    with pytest.raises(ValueError, match="gain"):
        confirm_resplit(float("nan"), 0.05, False)


# ----------------------------------------------------------------------------- split_counts
def test_split_counts_for_a_last_smaller_batch():
    rng = np.random.default_rng(1)
    for _ in range(300):
        ranks = int(rng.integers(1, 12))
        proportions = [int(x) for x in rng.integers(0, 40, size=ranks)]
        if sum(proportions) == 0:
            continue
        total = int(rng.integers(0, sum(proportions) + 1))
        counts = split_counts(total, proportions)
        assert sum(counts) == total and all(c >= 0 for c in counts)
        for c, p in zip(counts, proportions):
            assert abs(c - total * p / sum(proportions)) < 1


@pytest.mark.parametrize("total, proportions, match", [
    (-1, [1], "total"), (3, [], "empty"), (3, [1, -1], r"proportions\[1\]"),
    (3, [0, 0], "all zero"), (3, [1, float("nan")], r"proportions\[1\]"),
])
def test_split_counts_refuses_bad_input(total, proportions, match):
    with pytest.raises(ValueError, match=match):
        split_counts(total, proportions)


# ----------------------------------------------------------------------------- --speeds
def test_parse_speeds():
    assert parse_speeds("1, 2,4", 3) == [1.0, 2.0, 4.0]
    for text, world, match in [("", 2, "empty"), ("1,x", 2, "not a number"), ("1,0", 2, "must be a finite"),
                               ("1,inf", 2, "must be a finite"), ("1,2,3", 2, "3 entries")]:
        with pytest.raises(ValueError, match=match):
            parse_speeds(text, world)


def test_a_minimum_per_rank_is_honoured_and_still_optimal():
    rng = np.random.default_rng(3)
    for _ in range(200):
        ranks = int(rng.integers(1, 5))
        total = int(rng.integers(ranks, 13))
        costs = random_costs(rng, ranks)
        split = solve_split(costs, total, minimum=1)
        assert sum(split) == total and min(split) >= 1
        best = math.inf
        for cut in itertools.combinations(range(1, total), ranks - 1):
            bounds = (0,) + cut + (total,)
            best = min(best, step_time(costs, [bounds[k + 1] - bounds[k] for k in range(ranks)]))
        assert step_time(costs, split) == pytest.approx(best, rel=1e-12)
    assert solve_split([RankCost(0, 1e-3), RankCost(0, 1.0)], 10, minimum=1) == [9, 1]
    with pytest.raises(ValueError, match="cannot give each of the 3 ranks 1"):
        solve_split(costs_from_speeds([1, 1, 1]), 2, minimum=1)


def test_relative_spread_is_the_interquartile_range_over_the_median():
    assert balance.relative_spread([1.0]) == 0.0
    assert balance.relative_spread([2.0, 2.0, 2.0]) == 0.0
    # quartiles (inclusive) of 1..5 are 2 and 4, median 3
    assert balance.relative_spread([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx(2.0 / 3.0)
    with pytest.raises(ValueError, match="seconds"):
        balance.relative_spread([1.0, -1.0])
    # the standard error of a difference of two medians shrinks with sqrt(n)
    few = balance.timing_noise([5.0, 1.0, 3.0, 2.0, 4.0])
    many = balance.timing_noise([5.0, 1.0, 3.0, 2.0, 4.0] * 4)
    assert few == pytest.approx(math.sqrt(2) * 1.2533 / 1.349 * (2 / 3) / math.sqrt(5))
    assert many == pytest.approx(few / 2, rel=0.05)


def test_a_gain_within_the_measurement_spread_keeps_the_equal_split():
    # rank 1 is predicted 20 % slower: the optimal split is ~9 % faster than equal
    costs = [balance.RankCost(0.0, 1.0), balance.RankCost(0.0, 1.2)]
    best, _ = balance.choose_split(costs, 20, threshold=0.05)
    assert best != [10, 10]
    kept, t = balance.choose_split(costs, 20, threshold=0.05, noise=0.25)
    assert kept == [10, 10] and t == pytest.approx(12.0)
    again, _ = balance.choose_split(costs, 20, threshold=0.05, noise=0.01)
    assert again == best
    with pytest.raises(ValueError, match="noise"):
        balance.choose_split(costs, 20, noise=-0.1)
