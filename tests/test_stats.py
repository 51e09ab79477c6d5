"""Curve statistics: isotonic fit, crossings, bootstrap intervals, and speed-ups on synthetic curves whose
truth is known (one arm climbs clearly faster; both plateau with evaluation noise)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pods.stats import (
    accuracy_standard_error,
    bootstrap_ci,
    compare_curves,
    crossing_time,
    expanded_tail,
    isotonic,
    time_to_level,
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


def test_standard_error_over_problems() -> None:
    assert accuracy_standard_error(0.5, 100) == pytest.approx(0.05)
    assert accuracy_standard_error(0.9, 500) == pytest.approx(math.sqrt(0.09 / 500))
    assert accuracy_standard_error(1.0, 10) == 0.0


def test_bootstrap_interval_covers_the_mean_and_widens_for_few_seeds() -> None:
    values = [0.70, 0.74, 0.77, 0.72, 0.75]
    low, high = bootstrap_ci(values)
    assert low < np.mean(values) < high
    assert min(values) <= low and high <= max(values)
    assert expanded_tail(3) < expanded_tail(10) < 0.025  # fewer seeds: further out than 2.5%
    assert bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5)
    assert all(math.isnan(x) for x in bootstrap_ci([0.7]))  # one seed: no interval


def climb(tau: float, rng: np.random.Generator, budget: float = 80.0, noise: float = 0.02):
    """One seed's evaluations: 30% -> 77% with time constant ``tau``, every ~5 s, +-2 points of noise."""
    seconds = np.arange(0.0, budget + 1e-9, 5.0)
    seconds[1:] += rng.uniform(0, 0.8, seconds.size - 1)  # evaluations land after a step, not on the dot
    accuracy = 0.30 + 0.47 * (1 - np.exp(-seconds / tau)) + rng.normal(0, noise, seconds.size)
    accuracy[0] = 0.30  # every arm starts from the same model, evaluated greedily
    return seconds.tolist(), accuracy.tolist()


def verdicts(tau_arm: float, tau_baseline: float, seeds: int = 3, draws: int = 100) -> dict[str, list]:
    """Speed-up verdicts (and paper-metric values) of the arm over the baseline in ``draws`` noise draws."""
    out: dict[str, list] = {"paper": [], "paper_value": [], "gain_50": [], "gain_90": []}
    for draw in range(draws):
        rng = np.random.default_rng(draw)
        arm = [climb(tau_arm * rng.uniform(0.85, 1.15), rng) for _ in range(seeds)]
        baseline = [climb(tau_baseline * rng.uniform(0.85, 1.15), rng) for _ in range(seeds)]
        result = compare_curves(baseline, arm, resamples=300, seed=draw)
        for name in ("paper", "gain_50", "gain_90"):
            out[name].append(result[name].verdict)
        out["paper_value"].append(result["paper"].value)
    return out


def test_a_clearly_faster_arm_is_reported_faster_in_nearly_every_noise_draw() -> None:
    result = verdicts(tau_arm=10.0, tau_baseline=25.0)
    assert result["gain_50"].count("faster") >= 98
    assert result["gain_90"].count("faster") >= 98
    assert sum(v > 1 for v in result["paper_value"]) >= 98  # the paper's metric, on smoothed curves
    assert result["paper"].count("slower") == 0


def test_the_reverse_case_comes_out_slower() -> None:
    result = verdicts(tau_arm=25.0, tau_baseline=10.0)
    assert result["gain_50"].count("slower") >= 98
    assert result["gain_90"].count("slower") >= 98
    assert sum(v < 1 for v in result["paper_value"]) >= 98
    assert result["paper"].count("faster") == 0


def test_identical_arms_are_mostly_within_noise() -> None:
    """Same true curve for both arms: an interval that ignores the spread between seeds would claim a
    winner far more often than 1 time in 20."""
    result = verdicts(tau_arm=15.0, tau_baseline=15.0, draws=60)
    for name in ("paper", "gain_50", "gain_90"):
        assert result[name].count("within noise") >= 48, (name, result[name])


def test_time_to_level_and_an_arm_that_never_gets_there() -> None:
    rng = np.random.default_rng(0)
    runs = [climb(10.0, rng, noise=0.0) for _ in range(3)]
    level = 0.30 + 0.47 * (1 - math.exp(-1))  # the true curve reaches it at t = tau = 10 s
    estimate = time_to_level(runs, level, resamples=50)
    assert estimate.value == pytest.approx(10.0, abs=1.5)
    assert math.isinf(time_to_level(runs, 0.9, resamples=50).value)
    slow = [climb(400.0, rng, noise=0.0) for _ in range(3)]
    speedup = compare_curves(runs, slow, resamples=50)["gain_90"]
    assert speedup.value == 0.0 and speedup.verdict == "slower" and speedup.to_dict()["arm_seconds"] is None
    single = compare_curves(runs[:1], slow[:1], resamples=50)["gain_90"]  # one seed each: no interval
    assert single.value == 0.0 and single.verdict == "undetermined" and single.to_dict()["low"] is None
