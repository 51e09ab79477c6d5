"""Statistics of accuracy-against-time curves over seeds: standard errors, bootstrap intervals, smoothed
curves, and speed-ups that evaluation noise cannot flip.

A *run* is one seed's curve: ``(seconds, accuracy)``, evaluations at increasing training times. An *arm*
is a list of runs. Curve statistics are read off the arm's **smoothed mean curve**: every run is
interpolated onto a common time grid, averaged over seeds, lightly smoothed (a 3-point moving average)
and made monotone (isotonic regression, the best non-decreasing fit), so "the first time the curve
reaches a level" is decided by the climb, not by a noise spike on the plateau. Intervals (95%) are
bootstraps over seeds: each arm's seeds are resampled with replacement and the statistic recomputed;
the percentiles are expanded for small numbers of seeds (see :func:`expanded_tail`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Run = tuple[Sequence[float], Sequence[float]]  # (training seconds, accuracy) of one seed

RESAMPLES = 1000
MAX_GRID_POINTS = 60


def accuracy_standard_error(accuracy: float, num_problems: int) -> float:
    """Binomial standard error of an accuracy measured on ``num_problems`` problems (over problems).

    Exact for greedy pass@1; for the sampled protocol (k samples per problem, averaged) it is an upper
    bound, since averaging k samples can only shrink each problem's variance.
    """
    if num_problems <= 0:
        return float("nan")
    p = min(max(accuracy, 0.0), 1.0)
    return math.sqrt(p * (1 - p) / num_problems)


def bootstrap_ci(
    values: Sequence[float],
    statistic: Callable[[np.ndarray], float] = np.mean,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """95% expanded percentile bootstrap interval of ``statistic`` over ``values`` (one value per seed);
    NaN with fewer than two values (a single seed says nothing about the spread between seeds)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    draws = data[rng.integers(0, data.size, size=(resamples, data.size))]
    stats = np.array([statistic(data), *(statistic(row) for row in draws)])
    return _estimate(stats, data.size)[1:]


def isotonic(values: np.ndarray) -> np.ndarray:
    """Best non-decreasing least-squares fit of each row of ``values`` ([..., G]), vectorised over rows.

    Uses the min-max formula fit[i] = max_{j<=i} min_{k>=i} mean(values[j..k]) (exact; O(G^2) per row).
    """
    y = np.asarray(values, dtype=float)
    g = y.shape[-1]
    cumulative = np.concatenate([np.zeros((*y.shape[:-1], 1)), np.cumsum(y, axis=-1)], axis=-1)
    j, k = np.arange(g)[:, None], np.arange(g)[None, :]
    lengths = np.where(k >= j, k - j + 1, 1)
    means = (cumulative[..., None, 1:] - cumulative[..., :-1, None]) / lengths  # [..., j, k]
    means = np.where(k >= j, means, np.inf)
    suffix_min = np.flip(np.minimum.accumulate(np.flip(means, axis=-1), axis=-1), axis=-1)  # min over k >= i
    suffix_min = np.where(k >= j, suffix_min, -np.inf)  # [..., j, i], valid for j <= i
    return suffix_min.max(axis=-2)


def smooth(values: np.ndarray) -> np.ndarray:
    """A 3-point moving average (the first point, the start, kept as measured), then made monotone."""
    y = np.asarray(values, dtype=float)
    if y.shape[-1] < 3:
        return isotonic(y)
    averaged = y.copy()
    averaged[..., 1:-1] = (y[..., :-2] + y[..., 1:-1] + y[..., 2:]) / 3
    averaged[..., -1] = (y[..., -2] + y[..., -1]) / 2
    return isotonic(averaged)


def common_grid(arms: Sequence[Sequence[Run]]) -> np.ndarray:
    """Times shared by every run of every arm: from 0 to the earliest last evaluation, evenly spaced."""
    end = min(float(run[0][-1]) for runs in arms for run in runs)
    points = min(MAX_GRID_POINTS, max(2, int(np.median([len(run[0]) for runs in arms for run in runs]))))
    return np.linspace(0.0, end, points)


def on_grid(runs: Sequence[Run], grid: np.ndarray) -> np.ndarray:
    """``[seeds, G]``: each run linearly interpolated at the grid times."""
    return np.stack([np.interp(grid, np.asarray(s, float), np.asarray(a, float)) for s, a in runs])


def crossing_time(grid: np.ndarray, curves: np.ndarray, level: np.ndarray | float) -> np.ndarray:
    """First time each (monotone) curve of ``curves`` [..., G] reaches ``level``, interpolated between grid
    points; ``inf`` where it never does within the grid."""
    curves = np.asarray(curves, dtype=float)
    level = np.broadcast_to(np.asarray(level, dtype=float), curves.shape[:-1])[..., None]
    reached = curves >= level - 1e-12
    first = np.argmax(reached, axis=-1)
    ever = reached.any(axis=-1)
    before = np.clip(first - 1, 0, None)
    y0 = np.take_along_axis(curves, before[..., None], -1)[..., 0]
    y1 = np.take_along_axis(curves, first[..., None], -1)[..., 0]
    t0, t1 = grid[before], grid[first]
    rise = np.where(y1 > y0, y1 - y0, 1.0)
    fraction = np.clip((level[..., 0] - y0) / rise, 0.0, 1.0)
    time = np.where(first == 0, grid[0], t0 + fraction * (t1 - t0))
    return np.where(ever, time, np.inf)


@dataclass
class Estimate:
    """A point estimate with its bootstrap interval (over seeds)."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float | None]:
        return {key: _finite(getattr(self, key)) for key in ("value", "low", "high")}


@dataclass
class Speedup(Estimate):
    """``baseline seconds / arm seconds`` to reach a level; ``verdict`` says whether the interval excludes 1."""

    level: float = float("nan")
    baseline_seconds: float = float("nan")
    arm_seconds: float = float("nan")  # inf: the arm never reached the level within the budget

    @property
    def verdict(self) -> str:
        if not math.isfinite(self.low) or not math.isfinite(self.high):
            return "undetermined"
        if self.low > 1:
            return "faster"
        if self.high < 1:
            return "slower"
        return "within noise"

    def to_dict(self) -> dict[str, float | str | None]:
        return {
            **super().to_dict(),
            "verdict": self.verdict,
            "level": _finite(self.level),
            "baseline_seconds": _finite(self.baseline_seconds),
            "arm_seconds": _finite(self.arm_seconds),
        }


def _resampled_means(curves: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """``[1 + resamples, G]``: the mean over seeds, then the means of seed resamples (with replacement)."""
    seeds = curves.shape[0]
    picks = rng.integers(0, seeds, size=(resamples, seeds))
    return np.concatenate([curves.mean(axis=0, keepdims=True), curves[picks].mean(axis=1)])


# Student's t quantile at 0.975 by degrees of freedom (for the small-sample expansion below).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def expanded_tail(seeds: int) -> float:
    """Tail probability of the *expanded* percentile bootstrap (Hesterberg) for a 95% interval over
    ``seeds`` samples: the plain percentile interval is too narrow with few seeds (its spread is that of
    a variance divided by n, not n - 1, and it uses normal instead of t quantiles), so the percentiles are
    moved out to the normal quantile sqrt(n / (n - 1)) x t(0.975, n - 1). With 3 seeds this is nearly the
    whole range of the resamples."""
    if seeds < 2:
        return 0.0
    z = math.sqrt(seeds / (seeds - 1)) * _T975.get(seeds - 1, 1.96 + 2.5 / (seeds - 1))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _estimate(values: np.ndarray, seeds: int) -> tuple[float, float, float]:
    """Point value (row 0) and expanded percentile interval of the resamples (rows 1..), ignoring
    undefined ones."""
    tail, rest = expanded_tail(seeds), values[1:][~np.isnan(values[1:])]
    if np.isnan(values[0]) or rest.size == 0 or seeds < 2:  # one seed: no spread to measure
        return float(values[0]), float("nan"), float("nan")
    low, high = np.quantile(rest, [tail, 1 - tail], method="inverted_cdf")
    return float(values[0]), float(low), float(high)


def compare_curves(
    baseline: Sequence[Run],
    arm: Sequence[Run],
    *,
    fractions: Sequence[float] = (0.5, 0.9),
    peak_fraction: float = 0.99,
    resamples: int = RESAMPLES,
    seed: int = 0,
    grid: np.ndarray | None = None,
) -> dict[str, Speedup]:
    """Speed-ups of ``arm`` over ``baseline`` read off smoothed mean curves, with bootstrap intervals.

    ``paper``: the paper's metric, the time the baseline needs to first reach ``peak_fraction`` of its own
    (smoothed) best, over the time the arm needs to reach that accuracy. ``gain_50``, ``gain_90``, ...:
    the same ratio at the level start + f x (the baseline's best - start), i.e. a fraction of the
    baseline's gain; these levels lie on the climb, where noise cannot move the crossing much. An arm
    that never reaches a level gets speed-up 0 in that resample (the interval then says "slower").
    """
    grid = common_grid([baseline, arm]) if grid is None else grid
    rng = np.random.default_rng(seed)
    base = smooth(_resampled_means(on_grid(baseline, grid), resamples, rng))
    other = smooth(_resampled_means(on_grid(arm, grid), resamples, rng))
    best, start = base.max(axis=-1), base[..., 0]
    levels = {"paper": peak_fraction * best}
    for fraction in fractions:
        levels[f"gain_{round(100 * fraction)}"] = start + fraction * (best - start)
    results = {}
    for name, level in levels.items():
        base_time, arm_time = crossing_time(grid, base, level), crossing_time(grid, other, level)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(np.isinf(arm_time), 0.0, base_time / np.maximum(arm_time, 1e-9))
        ratio = np.where(base_time > 0, ratio, np.nan)  # the baseline met the level at the start: no climb
        value, low, high = _estimate(ratio, min(len(baseline), len(arm)))
        results[name] = Speedup(
            value,
            low,
            high,
            level=float(level[0]),
            baseline_seconds=float(base_time[0]),
            arm_seconds=float(arm_time[0]),
        )
    return results


def time_to_level(
    runs: Sequence[Run],
    level: float,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
    grid: np.ndarray | None = None,
) -> Estimate:
    """Training seconds for the arm's smoothed mean curve to reach ``level`` (inf: never), with its interval."""
    grid = common_grid([runs]) if grid is None else grid
    curves = smooth(_resampled_means(on_grid(runs, grid), resamples, np.random.default_rng(seed)))
    return Estimate(*_estimate(crossing_time(grid, curves, level), len(runs)))


def smoothed_mean_curve(runs: Sequence[Run], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arm's mean curve on ``grid``, its smoothed (monotone) version, and a pointwise 95% band of the
    mean over seeds (normal approximation: mean +- 1.96 standard errors over seeds)."""
    curves = on_grid(runs, grid)
    mean = curves.mean(axis=0)
    spread = curves.std(axis=0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1 else np.zeros_like(mean)
    return mean, smooth(mean), 1.96 * spread


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
