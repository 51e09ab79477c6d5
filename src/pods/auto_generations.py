"""``num_generations: auto``: the trainer picks n (rollouts generated per prompt) as it runs, to maximise
the expected learning signal per second of training. The model (docs/auto-generations.md):

* cost of a step with n:  ``seconds(n) = a + b n``; ``b`` (generating, scoring and selecting one more
  rollout per prompt) and ``a`` (what does not depend on n: the update on the m kept rows, the rollout
  engine's weight sync, any fixed generation overhead) are fitted to the step timer's measurements at
  the n tried so far;
* signal of a step with n: the expected variance of the m rewards the selection rule keeps, relative
  to the largest possible (a group whose kept rewards are all equal gives no gradient). Rewards are
  counted as successes and failures; the success rate p of a prompt varies across prompts as a
  Beta(alpha, beta) distribution fitted (maximum likelihood, beta-binomial) to the groups seen recently,
  so the share of groups with any variance grows with n as ``1 - E[p^n] - E[(1 - p)^n]`` (when no group
  had a success, or none a failure, the rate is taken at its 95% bound instead: :func:`fit_success_rates`);
* with a rollout worker (``async_generation``) generating overlaps the update: ``seconds(n) = max(g + b n, u)``,
  g and b fitted to the worker's generation time, u the trainer's own time per step; rollouts that fit in the
  update's shadow cost nothing, so n grows until generating fills the update's time;
* choice: ``argmax_n signal(n) / seconds(n)`` over ``num_generations_min .. num_generations_max``,
  re-decided every ``num_generations_every`` steps after two exploratory windows (n = 2m and 4m, within
  bounds), so that both cost parameters can be measured.

Everything here but :class:`AutoGenerations` is a pure function of its arguments.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MODELLED_RULES = ("max_variance", "max_reward", "random")
EXPLORE_FACTORS = (2, 4)  # exploratory windows at n = 2m, then 4m (clamped to the bounds)
WINDOW_DECISIONS = 4  # groups of the last 4 decision windows inform the success-rate distribution
TIMING_SAMPLES = 10  # the median of the last 10 step timings at each n
GROWS_WITH_N = ("generate", "score", "select")  # step phases whose time grows with n; the rest is fixed
POINT_MASS = 1e6  # Beta concentration that stands for "every prompt has this rate"


# ---------------------------------------------------------------------------------------------- the model
def fit_beta_binomial(successes: Sequence[int], trials: Sequence[int]) -> tuple[float, float]:
    """Maximum-likelihood ``(alpha, beta)`` of a Beta distribution of success rates across prompts, from
    groups with ``successes[i]`` of ``trials[i]`` (a grid over the mean and the concentration)."""
    import torch

    if not successes:
        return 1.0, 1.0  # nothing seen: a uniform distribution
    pairs: dict[tuple[int, int], int] = {}
    for c, t in zip(successes, trials, strict=True):
        pairs[(int(c), int(t))] = pairs.get((int(c), int(t)), 0) + 1
    c = torch.tensor([k[0] for k in pairs], dtype=torch.float64)
    t = torch.tensor([k[1] for k in pairs], dtype=torch.float64)
    weight = torch.tensor(list(pairs.values()), dtype=torch.float64)
    mean = torch.linspace(0.0025, 0.9975, 200, dtype=torch.float64)[:, None, None]
    concentration = torch.logspace(-1, 3, 49, dtype=torch.float64)[None, :, None]
    alpha, beta = mean * concentration, (1 - mean) * concentration
    log_likelihood = (_log_beta(c + alpha, t - c + beta) - _log_beta(alpha, beta)) @ weight
    best = int(torch.argmax(log_likelihood))
    i, j = divmod(best, concentration.numel())
    return float(alpha[i, j, 0]), float(beta[i, j, 0])


def fit_success_rates(successes: Sequence[int], trials: Sequence[int]) -> tuple[float, float, str]:
    """``(alpha, beta)`` of the success rates across prompts and how they were found: the beta-binomial fit,
    unless no group had a success (or none a failure). Then the likelihood has no maximum (it grows as the
    rates go to 0 or 1) and a fit would stop at a corner of its grid; instead every prompt gets the most
    optimistic rate the data allow: the one-sided 95% bound of a rate with 0 successes (failures) in all
    the trials, 1 - 0.05^(1 / trials), a point mass (a rate that is merely small: the choice is then the
    model's limit for a rare success, e.g. the largest n for max_variance, whatever the exact rate)."""
    total = sum(trials)
    if successes and not any(successes):
        rate = 1 - 0.05 ** (1 / total)
        note = f"no group had a success: every prompt at p = {rate:.4g}, the 95% upper bound"
    elif successes and all(c == t for c, t in zip(successes, trials, strict=True)):
        rate = 0.05 ** (1 / total)
        note = f"no group had a failure: every prompt at p = {rate:.4g}, the 95% lower bound"
    else:
        return (*fit_beta_binomial(successes, trials), "beta-binomial fit")
    return rate * POINT_MASS, (1 - rate) * POINT_MASS, note


def _log_beta(a, b):
    return a.lgamma() + b.lgamma() - (a + b).lgamma()


def success_count_probabilities(n: int, alpha: float, beta: float) -> list[float]:
    """P(c successes of n) for c = 0..n when p ~ Beta(alpha, beta) (the beta-binomial)."""
    out = []
    for c in range(n + 1):
        log_choose = math.lgamma(n + 1) - math.lgamma(c + 1) - math.lgamma(n - c + 1)
        log_ratio = _lbeta(c + alpha, n - c + beta) - _lbeta(alpha, beta)
        out.append(math.exp(log_choose + log_ratio))
    return out


def _lbeta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def informative_fraction(n: int, alpha: float, beta: float) -> float:
    """Expected share of groups of n with any reward variance: ``1 - E[p^n] - E[(1 - p)^n]``."""
    return (
        1.0
        - math.exp(_lbeta(alpha + n, beta) - _lbeta(alpha, beta))
        - math.exp(_lbeta(alpha, beta + n) - _lbeta(alpha, beta))
    )


def kept_variance(c: int, n: int, m: int, rule: str) -> float:
    """Expected unbiased variance of the m binary rewards that ``rule`` keeps from c successes of n,
    relative to the largest possible (an even split)."""

    def variance(k: float) -> float:
        return k * (m - k) / (m * (m - 1))

    best = variance(m // 2)
    low, high = max(0, m - (n - c)), min(c, m)  # feasible numbers of successes among the kept
    if rule == "max_variance":
        k = min(max(m // 2, low), high)
        return variance(k) / best
    if rule == "max_reward":
        return variance(high) / best
    if rule == "random":  # k is hypergeometric: m drawn without replacement from c successes of n
        total = math.comb(n, m)
        return sum(math.comb(c, k) * math.comb(n - c, m - k) * variance(k) for k in range(low, high + 1)) / (
            total * best
        )
    raise ValueError(f"num_generations: auto models the rules {', '.join(MODELLED_RULES)}, not {rule!r}")


def expected_signal(n: int, m: int, alpha: float, beta: float, rule: str) -> float:
    """Expected kept variance (relative to the largest possible) of one group of n, over p ~ Beta."""
    probabilities = success_count_probabilities(n, alpha, beta)
    return sum(p * kept_variance(c, n, m, rule) for c, p in enumerate(probabilities))


def fit_step_cost(generate_seconds: dict[int, float], other_seconds: float) -> tuple[float, float]:
    """``(a, b)`` of ``seconds(n) = a + b n``: b from a least-squares line through the generation time
    measured at each n (through the origin when only one n was measured: no fixed overhead assumed),
    a = the line's intercept (>= 0) + the seconds that do not depend on n (the update)."""
    ns = sorted(generate_seconds)
    if len(ns) == 1:
        return other_seconds, generate_seconds[ns[0]] / ns[0]
    mean_n = sum(ns) / len(ns)
    mean_s = sum(generate_seconds[n] for n in ns) / len(ns)
    slope = sum((n - mean_n) * (generate_seconds[n] - mean_s) for n in ns) / sum(
        (n - mean_n) ** 2 for n in ns
    )
    slope = max(slope, 1e-9)
    intercept = max(0.0, mean_s - slope * mean_n)
    return intercept + other_seconds, slope


@dataclass
class Decision:
    """One choice of n with everything it was computed from."""

    step: int
    num_generations: int
    reason: str
    groups: int = 0
    alpha: float = float("nan")
    beta: float = float("nan")
    mean_success_rate: float = float("nan")
    seconds_fixed: float = float("nan")  # a: seconds per step that do not grow with n
    seconds_per_generation: float = float("nan")  # b: seconds per step per extra rollout per prompt
    measured_generate_seconds: dict[int, float] = field(default_factory=dict)
    measured_other_seconds: float = float("nan")
    predicted: dict[int, dict[str, float]] = field(default_factory=dict)  # n -> signal, seconds, per second

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["measured_generate_seconds"] = {str(k): v for k, v in self.measured_generate_seconds.items()}
        values["predicted"] = {str(k): v for k, v in self.predicted.items()}
        return values


def choose_num_generations(
    *,
    step: int,
    m: int,
    low: int,
    high: int,
    rule: str,
    successes: Sequence[int],
    trials: Sequence[int],
    generate_seconds: dict[int, float],
    other_seconds: float,
    overlapped: bool = False,
) -> Decision:
    """The n in ``low .. high`` with the most expected learning signal per second (ties: the smaller n); with
    ``overlapped`` (a rollout worker) a step takes the longer of generating and the rest, not their sum."""
    alpha, beta, rates = fit_success_rates(successes, trials)
    a, b = fit_step_cost(generate_seconds, 0.0 if overlapped else other_seconds)

    def step_seconds(n: int) -> float:
        return max(a + b * n, other_seconds) if overlapped else a + b * n

    best_n, best_rate, predicted = low, -1.0, {}
    for n in range(low, high + 1):
        signal = expected_signal(n, m, alpha, beta, rule)
        seconds = step_seconds(n)
        rate = signal / seconds
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
        if n in _shown(low, high):
            predicted[n] = {"signal": signal, "seconds": seconds, "signal_per_second": rate}
    predicted[best_n] = {
        "signal": expected_signal(best_n, m, alpha, beta, rule),
        "seconds": step_seconds(best_n),
        "signal_per_second": best_rate,
    }
    overlap = ", generation overlapping the update" if overlapped else ""
    return Decision(
        step=step,
        num_generations=best_n,
        reason=f"most expected signal per second ({rates}{overlap})",
        groups=len(successes),
        alpha=alpha,
        beta=beta,
        mean_success_rate=alpha / (alpha + beta),
        seconds_fixed=a,
        seconds_per_generation=b,
        measured_generate_seconds=dict(generate_seconds),
        measured_other_seconds=other_seconds,
        predicted=dict(sorted(predicted.items())),
    )


def _shown(low: int, high: int) -> set[int]:
    """The n values whose predictions a decision records: the bounds and the powers of two between."""
    return {low, high} | {2**k for k in range(1, 12) if low <= 2**k <= high}


# ---------------------------------------------------------------------------------------------- the state
class AutoGenerations:
    """What the trainer keeps between steps: the observations, the schedule and the current n."""

    def __init__(self, m: int, low: int, high: int, rule: str, every: int, overlapped: bool = False) -> None:
        self.m, self.low, self.high, self.rule, self.every = m, low, high, rule, every
        self.overlapped = overlapped  # a rollout worker generates while the trainer updates
        self.explore = [min(max(factor * m, low), high) for factor in EXPLORE_FACTORS]
        self.current = self.explore[0]
        self.observations: list[dict[str, Any]] = []

    @classmethod
    def of(cls, config: Any) -> AutoGenerations | None:
        """The chooser a :class:`~pods.config.TrainConfig` asks for (``num_generations: auto``), else None."""
        if config.num_generations != "auto":
            return None
        low, high = config.generation_bounds
        return cls(
            config.num_generations_kept,
            low,
            high,
            config.selection_rule,
            config.num_generations_every,
            overlapped=config.async_generation,
        )

    def first_decision(self) -> Decision:
        """The n of the first steps, before anything is measured (the first exploratory window)."""
        return Decision(step=0, num_generations=self.explore[0], reason="exploring (window 1)")

    def observe(
        self, step: int, n: int, successes: Sequence[int], seconds: dict[str, float]
    ) -> dict[str, Any]:
        """Record step ``step`` (1-based, after it ran) with n rollouts per prompt and the seconds of each of
        its phases: generating, scoring and selecting grow with n, everything else (the update, the engine's
        weight sync, ...) is the step's fixed cost. Returns the log row."""
        row = {
            "step": step,
            "kind": "observation",
            "num_generations": n,
            "successes": [int(c) for c in successes],
            "seconds_generate": sum(v for k, v in seconds.items() if k in GROWS_WITH_N),
            "seconds_other": sum(v for k, v in seconds.items() if k not in GROWS_WITH_N),
        }
        self.observations.append(row)
        return row

    def decide(self, step: int) -> Decision | None:
        """A new decision after ``step`` steps when one is due (every ``every`` steps), else None."""
        if step % self.every:
            return None
        window = step // self.every
        if window < len(self.explore):
            self.current = self.explore[window]
            return Decision(
                step=step, num_generations=self.current, reason=f"exploring (window {window + 1})"
            )
        recent = [row for row in self.observations if row["step"] > step - WINDOW_DECISIONS * self.every]
        successes = [c for row in recent for c in row["successes"]]
        trials = [row["num_generations"] for row in recent for _ in row["successes"]]
        by_n: dict[int, list[float]] = {}
        for row in self.observations:
            by_n.setdefault(row["num_generations"], []).append(row["seconds_generate"])
        generate = {n: statistics.median(values[-TIMING_SAMPLES:]) for n, values in by_n.items()}
        other = statistics.median([row["seconds_other"] for row in self.observations[-TIMING_SAMPLES:]])
        decision = choose_num_generations(
            step=step,
            m=self.m,
            low=self.low,
            high=self.high,
            rule=self.rule,
            successes=successes,
            trials=trials,
            generate_seconds=generate,
            other_seconds=other,
            overlapped=self.overlapped,
        )
        self.current = decision.num_generations
        return decision

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Replay a log written by an earlier part of this run (exact resume). A step logged twice (a log
        that an earlier version kept across a fresh start) counts once, as last written."""
        latest = {(row.get("kind"), row.get("step")): row for row in rows}
        for row in sorted(latest.values(), key=lambda row: (row["step"], row.get("kind") == "decision")):
            if row.get("kind") == "observation":
                self.observations.append(row)
            elif row.get("kind") == "decision":
                self.current = int(row["num_generations"])
