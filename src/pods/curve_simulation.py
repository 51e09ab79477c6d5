"""Synthetic experiments whose truth is known, to check :mod:`pods.stats`: accuracy-against-time curves that
saturate, each seed a little faster or slower than the next, every evaluation a binomial draw over its
problems; the arm's curve is the baseline's with time divided by a known speed-up.

Used by tests/test_stats.py (which asserts the error rates) and benchmarks/stats.py (which prints them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pods.stats import Run, compare_curves, mean_interval

METRICS = ("paper", "gain_50", "gain_90")


@dataclass(frozen=True)
class Scenario:
    """One seed's expected accuracy: ``start + (plateau - start) (1 - exp(-t v / tau))`` with the seed's
    speed ``v`` log-normal (``seed_spread``: its standard deviation in log), evaluated at the start and
    then every ``every`` seconds (each up to ``jitter`` s late: evaluations follow a step) to ``budget``."""

    start: float = 0.30
    plateau: float = 0.77
    tau: float = 15.0
    budget: float = 120.0
    every: float = 5.0
    problems: int = 500
    seed_spread: float = 0.15
    jitter: float = 0.8

    def accuracy(self, seconds: np.ndarray, speed: np.ndarray) -> np.ndarray:
        return self.start + (self.plateau - self.start) * (1 - np.exp(-seconds * speed / self.tau))

    def times(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """``[*shape, G]`` evaluation times: 0, then every ``every`` s, each a little late."""
        grid = np.arange(0.0, self.budget + 1e-9, self.every)
        times = np.broadcast_to(grid, (*shape, grid.size)).copy()
        times[..., 1:] += rng.uniform(0, self.jitter, (*shape, grid.size - 1))
        return times


def simulate(
    rng: np.random.Generator, scenario: Scenario, speedup: float, experiments: int, seeds: int
) -> list[tuple[list[Run], list[Run]]]:
    """``experiments`` pairs (baseline runs, arm runs) of ``seeds`` seeds each. Both arms start from the same
    evaluation of the same model (one draw per experiment), as every run of a sweep does."""

    def arm(speed_factor: float) -> tuple[np.ndarray, np.ndarray]:
        times = scenario.times(rng, (experiments, seeds))
        speed = speed_factor * np.exp(rng.normal(0.0, scenario.seed_spread, (experiments, seeds, 1)))
        accuracy = rng.binomial(scenario.problems, scenario.accuracy(times, speed)) / scenario.problems
        return times, accuracy

    (base_times, base_acc), (arm_times, arm_acc) = arm(1.0), arm(speedup)
    start = rng.binomial(scenario.problems, scenario.start, (experiments, 1)) / scenario.problems
    base_acc[..., 0], arm_acc[..., 0] = start, start
    return [
        (list(zip(base_times[e], base_acc[e], strict=True)), list(zip(arm_times[e], arm_acc[e], strict=True)))
        for e in range(experiments)
    ]


@dataclass
class Rates:
    """Shares of the simulated experiments: the interval covered the true speed-up; the verdict was
    faster, slower, or undetermined (the rest: within noise)."""

    coverage: float
    faster: float
    slower: float
    undetermined: float


def speedup_rates(
    scenario: Scenario, speedup: float, seeds: int, experiments: int, seed: int = 0
) -> dict[str, Rates]:
    """How often the speed-up intervals of :func:`pods.stats.compare_curves` cover ``speedup`` (the truth at
    every level, since the arm's curve is the baseline's sped up) and what verdicts they give."""
    results = [
        compare_curves(baseline, arm)
        for baseline, arm in simulate(np.random.default_rng(seed), scenario, speedup, experiments, seeds)
    ]
    rates = {}
    for metric in METRICS:
        found = [result[metric] for result in results]
        verdicts = [s.verdict for s in found]
        rates[metric] = Rates(
            coverage=float(np.mean([s.low <= speedup <= s.high for s in found])),
            faster=verdicts.count("faster") / experiments,
            slower=verdicts.count("slower") / experiments,
            undetermined=verdicts.count("undetermined") / experiments,
        )
    return rates


def accuracy_coverage(scenario: Scenario, seeds: int, experiments: int, seed: int = 0) -> dict[str, float]:
    """How often :func:`pods.stats.mean_interval` over seeds covers the expected accuracy at the budget (the
    last evaluation) and the expected best evaluation; the truths are averages over 100,000 seeds."""
    rng = np.random.default_rng(seed)

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        times = scenario.times(rng, (count,))
        speed = np.exp(rng.normal(0.0, scenario.seed_spread, (count, 1)))
        accuracy = rng.binomial(scenario.problems, scenario.accuracy(times, speed)) / scenario.problems
        return accuracy[:, -1], accuracy.max(axis=1)

    truth = [float(values.mean()) for values in draw(100_000)]
    final, best = (values.reshape(experiments, seeds) for values in draw(experiments * seeds))
    coverage = {}
    for name, values, true in (("accuracy_at_budget", final, truth[0]), ("best_accuracy", best, truth[1])):
        intervals = [mean_interval(row) for row in values]
        coverage[name] = float(np.mean([i.low <= true <= i.high for i in intervals]))
    return coverage


def binomial_margin(rate: float, experiments: int) -> float:
    """One-sided 95% simulation margin of a share estimated from ``experiments`` draws (1.645 standard errors)."""
    return 1.645 * math.sqrt(rate * (1 - rate) / experiments)
