"""Curve statistics: the pieces (isotonic fit, crossings, t quantiles, intervals, plateau) against
independent references, and the whole by simulation: synthetic experiments whose true speed-up is known
(pods.curve_simulation: saturating curves, binomial noise over 500 problems, an evaluation every 5 s, each
seed's speed varied), where a 95% interval must cover the truth and two identical arms must rarely get a
verdict, with 2, 3 and 5 seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pods.curve_simulation import METRICS, Scenario, accuracy_coverage, binomial_margin, speedup_rates
from pods.stats import (
    accuracy_standard_error,
    compare_curves,
    crossing_time,
    curve_levels,
    evaluation_times,
    isotonic,
    mean_interval,
    plateau,
    still_climbing,
    t_quantile,
    time_to_level,
    welch_interval,
)


def pool_adjacent_violators(values: list[float]) -> list[float]:
    """Textbook isotonic regression, the reference for the vectorised formula."""
    blocks: list[list[float]] = []
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def test_isotonic_matches_pool_adjacent_violators() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        values = rng.normal(size=rng.integers(1, 16))
        assert np.allclose(isotonic(values), pool_adjacent_violators(list(values)))
    rows = rng.normal(size=(4, 9))  # vectorised over rows
    assert np.allclose(isotonic(rows), [pool_adjacent_violators(list(r)) for r in rows])


def test_crossing_time_interpolates_and_says_never() -> None:
    grid = np.array([0.0, 10.0, 20.0])
    curve = np.array([0.2, 0.4, 0.6])
    assert crossing_time(grid, curve, 0.5) == pytest.approx(15.0)
    assert crossing_time(grid, curve, 0.1) == 0.0
    assert math.isinf(crossing_time(grid, curve, 0.7))
    times = np.array([[0.0, 10.0, 20.0], [0.0, 4.0, 8.0]])  # each row its own evaluation times
    assert crossing_time(times, np.stack([curve, curve]), 0.5) == pytest.approx([15.0, 6.0])


def test_evaluation_times_keep_a_dense_early_stretch() -> None:
    runs = [([0.0, 1.0, 2.0, 30.0, 60.0], [0.3] * 5), ([0.0, 1.2, 2.1, 30.4, 58.0], [0.3] * 5)]
    merged = [0.0, 1.0, 1.2, 2.0, 2.1, 30.0, 30.4, 58.0]  # up to the earliest end
    assert evaluation_times(runs).tolist() == merged


def test_standard_error_over_problems() -> None:
    assert accuracy_standard_error(0.5, 100) == pytest.approx(0.05)
    assert accuracy_standard_error(0.9, 500) == pytest.approx(math.sqrt(0.09 / 500))
    assert accuracy_standard_error(1.0, 10) == 0.0


def test_t_quantile_matches_closed_forms_and_tables() -> None:
    p = 0.975
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    table = {3: 3.18245, 5: 2.57058, 10: 2.22814, 30: 2.04227, 10**7: 1.95996}  # printed t tables
    for df, quantile in table.items():
        assert t_quantile(p, df) == pytest.approx(quantile, abs=1e-5)
    assert t_quantile(0.025, 3) == pytest.approx(-3.18245, abs=1e-5)
    between = t_quantile(p, np.array([2.0, 2.5, 3.0]))  # Welch's degrees of freedom are not integers
    assert between[0] > between[1] > between[2]
    with pytest.raises(ValueError, match=">= 1"):
        t_quantile(p, 0.5)


def test_mean_interval_is_students_t_and_reaches_beyond_the_seeds() -> None:
    estimate = mean_interval([0.70, 0.74])
    half = 12.7062 * 0.028284 / math.sqrt(2)  # t(0.975, 1) x s / sqrt(n)
    assert (estimate.value, estimate.low, estimate.high) == pytest.approx(
        (0.72, 0.72 - half, 0.72 + half), abs=1e-4
    )
    assert estimate.low < 0.70 and estimate.high > 0.74  # a bootstrap over seeds cannot leave [0.70, 0.74]
    single = mean_interval([0.7])
    assert single.value == 0.7 and math.isnan(single.low) and single.to_dict()["high"] is None


def test_an_accuracy_interval_is_cut_to_the_possible_range_and_other_intervals_are_not() -> None:
    """Seeds at 1.8% to 23% (an arm that only some seeds got moving): the t-interval reaches below 0,
    which no accuracy can; cut to [0, 1]. A mean of log times has no such bound."""
    seeds = [0.15, 0.062, 0.048, 0.23, 0.018]
    free, cut = mean_interval(seeds), mean_interval(seeds, bounds=(0.0, 1.0))
    assert free.low < 0 and cut.low == 0.0
    assert (cut.value, cut.high) == (free.value, free.high)
    high = mean_interval([0.99, 0.90], bounds=(0.0, 1.0))
    assert high.high == 1.0 and high.low == mean_interval([0.99, 0.90]).low
    logs = mean_interval([-0.5, 0.7])
    assert logs.low < -1  # log speed-ups and log times are unbounded: nothing is cut


def test_welch_interval_matches_a_reference() -> None:
    # Reference: scipy.stats.ttest_ind(first, second, equal_var=False).confidence_interval(), df = 4.0702.
    difference, low, high = welch_interval(np.array([1.0, 1.3, 0.9]), np.array([0.2, 0.5, 0.4, 0.1]))
    assert (difference, low, high) == pytest.approx((0.76667, 0.35047, 1.18286), abs=1e-4)
    rows = welch_interval(np.array([[1.0, 2.0], [3.0, 5.0]]), np.array([[0.0, 1.0], [1.0, 1.0]]))
    assert rows[0] == pytest.approx([1.0, 3.0])  # vectorised over rows
    assert all(math.isnan(x) for x in welch_interval(np.array([1.0]), np.array([0.0, 1.0]))[1:])


def flat_runs(rng: np.random.Generator, level: float, seeds: int = 3) -> list:
    seconds = np.arange(0.0, 121.0, 5.0)
    return [(seconds, rng.binomial(500, level, seconds.size) / 500) for _ in range(seeds)]


def test_plateau_is_unbiased_on_a_flat_curve_unlike_the_smoothed_maximum() -> None:
    rng = np.random.default_rng(0)
    found = [plateau(flat_runs(rng, 0.77)) for _ in range(300)]
    smoothed_maximum = [
        isotonic(np.mean([a for _, a in flat_runs(rng, 0.77)], axis=0)).max() for _ in range(300)
    ]
    assert abs(np.mean(found) - 0.77) < 0.001  # each estimate's noise is 0.4 points; their mean's, 0.02
    assert np.mean(smoothed_maximum) - 0.77 > 0.003  # the superseded peak: biased up by its noise
    seconds = np.arange(0.0, 121.0, 5.0)
    climbing = 0.3 + 0.004 * seconds  # still climbing at the end: the mean of the last 40 s, 80-120 s
    assert plateau([(seconds, climbing)]) == pytest.approx(0.3 + 0.004 * 100)


def test_a_baseline_still_climbing_at_its_end_is_told_from_one_on_its_plateau() -> None:
    rng = np.random.default_rng(1)
    seconds = np.arange(0.0, 121.0, 5.0)
    ramp = 0.3 + 0.004 * seconds  # ends at 78%, its "plateau" (80-120 s) 70%: 17% of its gain below the end
    assert still_climbing([(seconds, ramp)])
    flat = np.mean([still_climbing(flat_runs(rng, 0.77, seeds=5)) for _ in range(400)])
    assert flat < 0.05  # on a flat curve the seeds' end passes the plateau by noise at most 2.5% of the time
    risen = np.minimum(0.01 + 0.03 * seconds, 0.9)  # 1% -> 90% by 30 s, then flat: a plateau
    noisy = [(seconds, rng.binomial(500, risen) / 500) for _ in range(5)]
    assert not still_climbing(noisy)
    late = np.clip(0.01 + 0.03 * (seconds - 60), 0.01, 0.9)  # flat until 60 s, at 90% only at 90 s
    assert still_climbing([(seconds, rng.binomial(500, late) / 500) for _ in range(5)])
    assert not still_climbing([(seconds, 0.9 - 0.004 * seconds)])  # a falling curve has no gain to climb


def test_levels_come_from_the_baseline_plateau_and_start() -> None:
    seconds = np.arange(0.0, 61.0, 5.0)
    curve = np.minimum(0.2 + 0.02 * seconds, 0.6)  # 20% -> 60% (reached at 20 s), then flat
    levels = curve_levels([(seconds, curve)])
    assert levels == pytest.approx({"paper": 0.594, "gain_50": 0.4, "gain_90": 0.56})
    assert time_to_level([(seconds, curve)], levels["gain_50"]).value == pytest.approx(10.0)


def climb(tau: float, rng: np.random.Generator, budget: float = 80.0) -> tuple[list[float], list[float]]:
    """One seed: 30% -> 77% with time constant ``tau`` (varied +-15%), every ~5 s, binomial over 500 problems."""
    seconds = np.arange(0.0, budget + 1e-9, 5.0)
    seconds[1:] += rng.uniform(0, 0.8, seconds.size - 1)
    truth = 0.30 + 0.47 * (1 - np.exp(-seconds / (tau * rng.uniform(0.85, 1.15))))
    accuracy = rng.binomial(500, truth) / 500
    accuracy[0] = 0.30  # every arm starts from the same model, evaluated greedily
    return seconds.tolist(), accuracy.tolist()


def test_a_clearly_faster_arm_is_faster_and_the_reverse_slower() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        fast, slow = [climb(10.0, rng) for _ in range(3)], [climb(25.0, rng) for _ in range(3)]
        forward, backward = compare_curves(slow, fast), compare_curves(fast, slow)
        assert forward["gain_50"].verdict == forward["gain_90"].verdict == "faster"
        assert backward["gain_50"].verdict == backward["gain_90"].verdict == "slower"
        assert forward["gain_90"].value == pytest.approx(1 / backward["gain_90"].value, rel=0.3)


def test_an_arm_that_never_gets_there_is_slower_and_one_seed_is_undetermined() -> None:
    rng = np.random.default_rng(1)
    runs, stalled = [climb(10.0, rng) for _ in range(3)], [climb(400.0, rng) for _ in range(3)]
    speedup = compare_curves(runs, stalled)["gain_90"]
    assert speedup.arm_never == 3 and speedup.verdict == "slower" and speedup.high < 1
    assert math.isinf(time_to_level(stalled, speedup.level).value)
    reverse = compare_curves(stalled, runs, levels={"gain_90": speedup.level})["gain_90"]
    assert reverse.baseline_never == 3 and reverse.verdict == "faster"
    single = compare_curves(runs[:1], stalled[:1])["gain_90"]  # one seed each: no interval
    assert single.verdict == "undetermined" and single.to_dict()["low"] is None


def test_a_seed_that_never_got_there_makes_an_opposite_verdict_undetermined() -> None:
    """A seed that never reached the level counts with its budget, a lower bound on its time: it can only
    make its arm look faster than it is, so it may not turn the verdict in that arm's favour."""
    rng = np.random.default_rng(2)
    fast = [climb(8.0, rng) for _ in range(3)]
    mixed = [climb(20.0, rng) for _ in range(2)] + [climb(400.0, rng)]  # one seed stalls
    level = curve_levels(fast)["gain_90"]
    assert compare_curves(fast, mixed, levels={"x": level})["x"].verdict == "slower"  # the bound only helps
    backward = compare_curves(mixed, fast, levels={"x": level})["x"]
    assert backward.baseline_never == 1 and backward.low > 1 and backward.verdict == "faster"
    seconds = np.arange(0.0, 81.0, 5.0)
    quick = [(seconds, np.minimum(0.3 + 0.04 * seconds, 0.77)) for _ in range(2)]  # at 70% after 10 s
    quick.append((seconds, np.minimum(0.3 + 0.002 * seconds, 0.77)))  # never reaches 70% within 80 s
    slow = [climb(20.0, rng) for _ in range(3)]  # at 70% after about 38 s
    speedup = compare_curves(slow, quick, levels={"x": 0.7})["x"]
    assert speedup.arm_never == 1 and speedup.high > 1 and speedup.verdict == "undetermined"


def test_a_climb_finished_before_the_first_evaluation_is_flagged() -> None:
    rng = np.random.default_rng(3)
    result = compare_curves([climb(20.0, rng) for _ in range(3)], [climb(1.0, rng) for _ in range(3)])
    assert result["gain_50"].early == 3 and result["gain_50"].to_dict()["early"] == 3
    similar = compare_curves([climb(20.0, rng) for _ in range(3)], [climb(15.0, rng) for _ in range(3)])
    assert similar["gain_50"].early == 0


# ---------------------------------------------------------------------------------------------- simulation
EXPERIMENTS = 400  # per cell: a share's simulation margin is then about 2 points (binomial_margin)


@pytest.mark.slow
@pytest.mark.parametrize("seeds", [2, 3, 5])
def test_identical_arms_rarely_get_a_verdict_and_a_2x_speedup_is_covered(seeds: int) -> None:
    scenario = Scenario()
    same = speedup_rates(scenario, 1.0, seeds, EXPERIMENTS, seed=seeds)
    double = speedup_rates(scenario, 2.0, seeds, EXPERIMENTS, seed=100 + seeds)
    for metric in METRICS:
        wrong = same[metric].faster + same[metric].slower
        assert wrong <= 0.05 + binomial_margin(0.05, EXPERIMENTS), (metric, same[metric])
        assert double[metric].coverage >= 0.93 - binomial_margin(0.93, EXPERIMENTS), (metric, double[metric])
        wrong_way = double[metric].slower  # a 95% interval errs on this side at most 2.5% of the time
        assert wrong_way <= 0.025 + binomial_margin(0.025, EXPERIMENTS), (metric, double[metric])
    power = {2: 0.15, 3: 0.6, 5: 0.9}[seeds]  # an interval too wide to say anything would pass the above
    assert double["gain_50"].faster >= power and double["gain_90"].faster >= power, double


@pytest.mark.slow
def test_a_1_5x_speedup_is_covered_with_three_seeds() -> None:
    rates = speedup_rates(Scenario(), 1.5, 3, EXPERIMENTS, seed=7)
    for metric in METRICS:
        assert rates[metric].coverage >= 0.93 - binomial_margin(0.93, EXPERIMENTS), (metric, rates[metric])


@pytest.mark.parametrize("seeds", [2, 3, 5])
def test_accuracy_intervals_cover_the_expected_accuracy(seeds: int) -> None:
    coverage = accuracy_coverage(Scenario(), seeds, 1000, seed=seeds)
    for name, share in coverage.items():
        assert share >= 0.93 - binomial_margin(0.93, 1000), (name, share)
