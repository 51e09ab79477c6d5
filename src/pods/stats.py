"""Statistics of accuracy-against-time curves over seeds: intervals that keep their 95% with 2, 3 or 5
seeds, the plateau the paper's metric is read against, and speed-ups with verdicts.

A *run* is one seed's curve: ``(seconds, accuracy)``, evaluations at increasing training times (or steps).
An *arm* is a list of runs; seeds are independent repetitions, so every interval here is over seeds:

* a seed's **crossing time** of a level is read off its own isotonic fit (the best non-decreasing fit of
  its evaluations), interpolated between evaluations, so one noisy evaluation cannot decide it;
* a **speed-up** is the ratio of the two arms' geometric-mean crossing times; its interval is Welch's
  t-interval on the difference of the mean log crossing times (each seed one observation), so it holds
  whatever the seed-to-seed spread of each arm, with as few as 2 seeds per arm;
* **accuracy** statistics over seeds (at the budget, the best) get Student's t-interval.

docs/experiments.md ("Statistics") gives the argument and the simulated coverage (benchmarks/stats.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

Run = tuple[Sequence[float], Sequence[float]]  # (training seconds or steps, accuracy) of one seed

CONFIDENCE = 0.95
MAX_GRID_POINTS = 60
PLATEAU_WINDOW = 1 / 3  # the plateau: the mean accuracy over the last third of the run
PEAK_FRACTION = 0.99  # the paper's level: 99% of the baseline's peak (here: its plateau)
ACCURACY_RANGE = (0.0, 1.0)  # every accuracy interval and band is cut to it
GAIN_FRACTIONS = (0.5, 0.9)  # levels on the climb: the start plus 50% / 90% of the baseline's gain
STILL_CLIMBING = 0.05  # a baseline ending above its plateau by more than this share of its gain is climbing


# ---------------------------------------------------------------------------------------------- basics
def accuracy_standard_error(accuracy: float, num_problems: int) -> float:
    """Binomial standard error of an accuracy measured on ``num_problems`` problems (over problems).

    Exact for greedy pass@1; for the sampled protocol (k samples per problem, averaged) it is an upper
    bound, since averaging k samples can only shrink each problem's variance.
    """
    if num_problems <= 0:
        return float("nan")
    p = min(max(accuracy, 0.0), 1.0)
    return math.sqrt(p * (1 - p) / num_problems)


_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(64)


def t_quantile(probability: float, df: float | np.ndarray) -> np.ndarray:
    """Student's t quantile for real degrees of freedom >= 1 (Welch's interval has non-integer ones).

    With theta = arctan(t / sqrt(df)), P(0 < T < t) = K * integral_0^theta cos(phi)^(df - 1) dphi, where
    K = Gamma((df + 1) / 2) / (sqrt(pi) Gamma(df / 2)); the integral is smooth (Gauss-Legendre) and
    concave in theta, so Newton's method from theta = 0 climbs to the root without overshooting.
    """
    df = np.asarray(df, dtype=float)
    if np.any(~(df >= 1)):
        raise ValueError(f"t_quantile: degrees of freedom must be >= 1, got {df}")
    if not 0 < probability < 1:
        raise ValueError(f"t_quantile: probability must be in (0, 1), got {probability}")
    log_scale = [math.lgamma((d + 1) / 2) - math.lgamma(d / 2) - 0.5 * math.log(math.pi) for d in df.flat]
    scale = np.exp(np.reshape(log_scale, df.shape))
    target = abs(probability - 0.5)
    theta = np.zeros_like(df)
    for _ in range(100):
        phi = theta[..., None] * (_NODES + 1) / 2
        integral = theta / 2 * (_WEIGHTS * np.cos(phi) ** (df[..., None] - 1)).sum(axis=-1)
        step = (target - scale * integral) / (scale * np.cos(theta) ** (df - 1))
        theta = np.minimum(theta + step, math.pi / 2 * (1 - 1e-15))
        if np.all(np.abs(step) < 1e-14):
            break
    return math.copysign(1.0, probability - 0.5) * np.sqrt(df) * np.tan(theta)


@functools.lru_cache(maxsize=64)
def _t_two_sided(df: int) -> float:
    """The t quantile of a two-sided ``CONFIDENCE`` interval with integer degrees of freedom (cached)."""
    return float(t_quantile(0.5 + CONFIDENCE / 2, df))


@dataclass
class Estimate:
    """A point estimate with its 95% interval over seeds (NaN bounds: no interval, e.g. one seed)."""

    value: float
    low: float = float("nan")
    high: float = float("nan")

    def to_dict(self) -> dict[str, float | None]:
        return {key: _finite(getattr(self, key)) for key in ("value", "low", "high")}


def mean_interval(values: Sequence[float], bounds: tuple[float, float] | None = None) -> Estimate:
    """Mean over seeds with Student's t-interval: mean +- t(0.975, n - 1) s / sqrt(n). Unlike a bootstrap
    over seeds it reaches beyond the seeds' range, which it must to cover the mean with 2 or 3 seeds.
    ``bounds``: the range the mean can take (accuracies: (0, 1)); the interval is cut to it, which keeps
    every mean it covered and so cannot lower its coverage."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return Estimate(float("nan"))
    mean = float(data.mean())
    if data.size < 2:
        return Estimate(mean)
    half = _t_two_sided(data.size - 1) * float(data.std(ddof=1)) / math.sqrt(data.size)
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return Estimate(mean, low, high)


def welch_interval(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mean(first) - mean(second) over the last axis, with Welch's 95% t-interval (unequal variances,
    Welch-Satterthwaite degrees of freedom), vectorised over the leading axes; NaN bounds unless each
    sample has at least two values."""
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    na, nb = a.shape[-1], b.shape[-1]
    difference = a.mean(axis=-1) - b.mean(axis=-1)
    if na < 2 or nb < 2:
        nan = np.full_like(difference, np.nan)
        return difference, nan, nan
    va, vb = a.var(axis=-1, ddof=1) / na, b.var(axis=-1, ddof=1) / nb
    spread = va**2 / (na - 1) + vb**2 / (nb - 1)
    df = np.where(spread > 0, (va + vb) ** 2 / np.where(spread > 0, spread, 1.0), na + nb - 2)
    df = np.clip(df, min(na, nb) - 1, na + nb - 2)  # its exact bounds, against rounding
    half = t_quantile(0.5 + CONFIDENCE / 2, df) * np.sqrt(va + vb)
    return difference, difference - half, difference + half


# ---------------------------------------------------------------------------------------------- curves
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


def crossing_time(times: np.ndarray, curves: np.ndarray, level: np.ndarray | float) -> np.ndarray:
    """First time each (monotone) curve of ``curves`` [..., G] reaches ``level``, interpolated linearly
    between its evaluation ``times`` (broadcast to the curves); ``inf`` where it never does."""
    curves = np.asarray(curves, dtype=float)
    times = np.broadcast_to(np.asarray(times, dtype=float), curves.shape)
    level = np.broadcast_to(np.asarray(level, dtype=float), curves.shape[:-1])[..., None]
    reached = curves >= level - 1e-12
    first = np.argmax(reached, axis=-1)[..., None]
    before = np.clip(first - 1, 0, None)
    y0, y1 = np.take_along_axis(curves, before, -1)[..., 0], np.take_along_axis(curves, first, -1)[..., 0]
    t0, t1 = np.take_along_axis(times, before, -1)[..., 0], np.take_along_axis(times, first, -1)[..., 0]
    rise = np.where(y1 > y0, y1 - y0, 1.0)
    fraction = np.clip((level[..., 0] - y0) / rise, 0.0, 1.0)
    time = np.where(first[..., 0] == 0, times[..., 0], t0 + fraction * (t1 - t0))
    return np.where(reached.any(axis=-1), time, np.inf)


@dataclass
class Crossings:
    """When each seed first reached each level, read off its own isotonic fit: ``seconds`` [seeds, levels]
    (where it ``never`` did, its last evaluation's time: a lower bound), and ``early`` where it got there
    between the start and the first evaluation after it (the climb is not resolved: a linear guess)."""

    seconds: np.ndarray
    never: np.ndarray
    early: np.ndarray

    @classmethod
    def of(cls, runs: Sequence[Run], levels: Sequence[float]) -> Crossings:
        """Every run's crossings, computed together for the runs with as many evaluations as each other."""
        levels = np.asarray(levels, dtype=float)
        seconds = np.empty((len(runs), levels.size))
        never = np.empty_like(seconds, dtype=bool)
        early = np.empty_like(seconds, dtype=bool)
        lengths = [len(run[0]) for run in runs]
        for length in set(lengths):
            rows = [i for i, n in enumerate(lengths) if n == length]
            times = np.array([runs[i][0] for i in rows], dtype=float)[:, None, :]  # [s, 1, G]
            fits = isotonic(np.array([runs[i][1] for i in rows], dtype=float))[:, None, :]
            found = crossing_time(times, np.broadcast_to(fits, (len(rows), levels.size, length)), levels)
            never[rows] = np.isinf(found)
            seconds[rows] = np.where(never[rows], times[:, :, -1], found)
            second = times[:, :, min(1, length - 1)]
            early[rows] = ~never[rows] & (found > times[:, :, 0]) & (found <= second)
        return cls(seconds, never, early)


def common_grid(arms: Sequence[Sequence[Run]]) -> np.ndarray:
    """Times shared by every run of every arm: from the start to the earliest last evaluation, evenly
    spaced, about as many points as a run has evaluations."""
    start = max(float(run[0][0]) for runs in arms for run in runs)
    end = min(float(run[0][-1]) for runs in arms for run in runs)
    points = min(MAX_GRID_POINTS, max(2, int(np.median([len(run[0]) for runs in arms for run in runs]))))
    return np.linspace(start, max(start, end), points)


def evaluation_times(runs: Sequence[Run]) -> np.ndarray:
    """Every seed's evaluation times merged, within the span all seeds cover: the grid to draw an arm's
    mean curve on without smoothing away a dense stretch of evaluations (an early climb)."""
    start = max(float(run[0][0]) for run in runs)
    end = min(float(run[0][-1]) for run in runs)
    times = np.unique(np.concatenate([np.asarray(run[0], dtype=float) for run in runs]))
    return np.unique(np.concatenate([[start, end], times[(times >= start) & (times <= end)]]))


def on_grid(runs: Sequence[Run], grid: np.ndarray) -> np.ndarray:
    """``[seeds, G]``: each run linearly interpolated at the grid times."""
    return np.stack([np.interp(grid, np.asarray(s, float), np.asarray(a, float)) for s, a in runs])


def plateau(runs: Sequence[Run], window: float = PLATEAU_WINDOW) -> float:
    """The arm's plateau: its mean accuracy over the last ``window`` of the run, over seeds.

    The maximum of a smoothed curve sits above a flat plateau by its noise (a maximum of noisy values:
    half a point with 3 seeds and 500 problems); a mean over a stretch of the run is unbiased there. On a
    curve that rises and then falls it is where the run ends, not its best moment.
    """
    grid = common_grid([runs])
    mean = on_grid(runs, grid).mean(axis=0)
    return float(mean[grid >= grid[-1] - window * (grid[-1] - grid[0]) - 1e-9].mean())


def still_climbing(
    runs: Sequence[Run], window: float = PLATEAU_WINDOW, tolerance: float = STILL_CLIMBING
) -> bool:
    """Whether the arm ends above its plateau by more than ``tolerance`` of its gain (end - start) and, with
    two seeds or more, by more than noise (the plateau lies below the 95% interval of the seeds' final
    accuracies): its last ``window`` is then a climb, and levels read from it sit below where it ends."""
    grid = common_grid([runs])
    curves = on_grid(runs, grid)
    mean = curves.mean(axis=0)
    top, end = plateau(runs, window), mean_interval(curves[:, -1])
    beyond_noise = math.isnan(end.low) or top < end.low  # one seed: no interval, the tolerance alone
    return bool(mean[-1] - mean[0] > 0 and mean[-1] - top > tolerance * (mean[-1] - mean[0]) and beyond_noise)


def curve_levels(
    baseline: Sequence[Run],
    *,
    peak_fraction: float = PEAK_FRACTION,
    fractions: Sequence[float] = GAIN_FRACTIONS,
) -> dict[str, float]:
    """The accuracies the speed-ups are timed at, all from the baseline: ``paper`` = ``peak_fraction`` of
    its plateau (the paper's metric), ``gain_50``, ``gain_90``, ... = its start + f x (plateau - start)."""
    top = plateau(baseline)
    start = float(np.mean([run[1][0] for run in baseline]))
    levels = {"paper": peak_fraction * top}
    for fraction in fractions:
        levels[f"gain_{round(100 * fraction)}"] = start + fraction * (top - start)
    return levels


# ---------------------------------------------------------------------------------------------- speed-ups
@dataclass
class TimeEstimate(Estimate):
    """Seconds (or steps) for an arm's seeds to reach a level: the geometric mean over seeds with a
    t-interval on the log times. A seed that ``never`` reached it counts with its budget (a lower bound)."""

    never: int = 0
    seeds: int = 0

    def to_dict(self) -> dict[str, float | int | None]:
        return {**super().to_dict(), "never": self.never, "seeds": self.seeds}


def time_to_level(runs: Sequence[Run], level: float) -> TimeEstimate:
    """Training seconds (steps) for the arm's seeds to reach ``level``; ``inf`` when no seed did."""
    crossings = Crossings.of(runs, [level])
    seconds, never = crossings.seconds[:, 0], int(crossings.never.sum())
    if never == len(runs):
        return TimeEstimate(float("inf"), never=never, seeds=len(runs))
    if np.any(seconds <= 0):  # reached at the start: no climb to time
        return TimeEstimate(0.0, never=never, seeds=len(runs))
    logs = mean_interval(np.log(seconds))
    return TimeEstimate(
        math.exp(logs.value), math.exp(logs.low), math.exp(logs.high), never=never, seeds=len(runs)
    )


@dataclass
class Speedup(Estimate):
    """``baseline seconds / arm seconds`` to reach ``level`` (ratio of geometric means over seeds) with
    Welch's 95% interval on the log ratio; ``verdict`` says whether the interval excludes 1."""

    level: float = float("nan")
    baseline_seconds: float = float("nan")  # geometric means over seeds (never-reached seeds at their budget)
    arm_seconds: float = float("nan")
    baseline_never: int = 0  # seeds that never reached the level within their budget
    arm_never: int = 0
    early: int = 0  # seeds (both arms) that reached it before the first evaluation after the start
    baseline_per_seed: list[float] = field(default_factory=list)  # each seed's time (its budget: never)
    arm_per_seed: list[float] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """faster / slower / within noise; undetermined without an interval (one seed) or where a seed
        that never reached the level (only a lower bound on its time) could turn the answer."""
        if not math.isfinite(self.low) or not math.isfinite(self.high):
            return "undetermined"
        if self.low > 1 and not self.arm_never:  # a baseline seed's longer true time only adds to it
            return "faster"
        if self.high < 1 and not self.baseline_never:
            return "slower"
        if self.low <= 1 <= self.high and not self.arm_never and not self.baseline_never:
            return "within noise"
        return "undetermined"

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {
            **super().to_dict(),
            "verdict": self.verdict,
            "level": _finite(self.level),
            "baseline_seconds": _finite(self.baseline_seconds),
            "arm_seconds": _finite(self.arm_seconds),
            "baseline_never": self.baseline_never,
            "arm_never": self.arm_never,
            "early": self.early,
            "baseline_seconds_per_seed": [round(x, 3) for x in self.baseline_per_seed],
            "arm_seconds_per_seed": [round(x, 3) for x in self.arm_per_seed],
        }


def compare_curves(
    baseline: Sequence[Run],
    arm: Sequence[Run],
    *,
    levels: dict[str, float] | None = None,
    peak_fraction: float = PEAK_FRACTION,
    fractions: Sequence[float] = GAIN_FRACTIONS,
) -> dict[str, Speedup]:
    """Speed-ups of ``arm`` over ``baseline`` at each of ``levels`` (default :func:`curve_levels` of the
    baseline: ``paper``, ``gain_50``, ``gain_90``): the ratio of the geometric-mean crossing times, with
    Welch's interval on the log ratio. A level met at the start (the baseline did not climb) gives NaN."""
    if levels is None:
        levels = curve_levels(baseline, peak_fraction=peak_fraction, fractions=fractions)
    values = np.array(list(levels.values()), dtype=float)
    base, other = Crossings.of(baseline, values), Crossings.of(arm, values)
    timed = np.isfinite(values) & np.all(base.seconds > 0, axis=0) & np.all(other.seconds > 0, axis=0)
    with np.errstate(divide="ignore"):  # log(0) of an untimed level, replaced just below
        base_logs, arm_logs = np.log(base.seconds).T, np.log(other.seconds).T  # [levels, seeds]
    base_logs, arm_logs = np.where(timed[:, None], base_logs, 0.0), np.where(timed[:, None], arm_logs, 0.0)
    difference, low, high = welch_interval(base_logs, arm_logs)
    results = {}
    for i, (name, level) in enumerate(levels.items()):
        counts = {
            "level": float(level),
            "baseline_never": int(base.never[:, i].sum()),
            "arm_never": int(other.never[:, i].sum()),
            "early": int(base.early[:, i].sum() + other.early[:, i].sum()),
            "baseline_per_seed": base.seconds[:, i].tolist(),
            "arm_per_seed": other.seconds[:, i].tolist(),
        }
        if not timed[i]:
            results[name] = Speedup(float("nan"), **counts)
            continue
        results[name] = Speedup(
            math.exp(difference[i]),
            math.exp(low[i]),  # NaN stays NaN: no interval
            math.exp(high[i]),
            baseline_seconds=math.exp(base_logs[i].mean()),
            arm_seconds=math.exp(arm_logs[i].mean()),
            **counts,
        )
    return results


# ---------------------------------------------------------------------------------------------- plotting
def mean_curve_band(runs: Sequence[Run], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arm's mean curve on ``grid``, its isotonic fit (a guide for the eye), and a pointwise 95%
    half-width over seeds (t-interval; zero with one seed)."""
    curves = on_grid(runs, grid)
    mean = curves.mean(axis=0)
    if len(runs) < 2:
        return mean, isotonic(mean), np.zeros_like(mean)
    spread = curves.std(axis=0, ddof=1) / math.sqrt(len(runs))
    return mean, isotonic(mean), _t_two_sided(len(runs) - 1) * spread


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
