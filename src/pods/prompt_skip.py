"""Skipping prompts before rollout (GRESO; Zheng et al., arXiv 2506.02177), as pure functions.

A prompt whose recent groups had all-equal rewards is likely to have them again, so generating for it again
is likely wasted. GRESO keeps, per prompt, how many of its most recent groups in a row were zero-variance
and of which kind: **solved** (all rewards equal and at least ``solved_reward``, 0.5: all correct with an
accuracy reward) or **failed** (all equal and below it). Before generation a candidate prompt with a streak
of z such groups is kept with probability ``max(p ** z, min_keep_probability)`` and skipped otherwise; a
prompt never seen, or whose last group was informative, is always kept. The floor (0.01) is the
exploration that retries skipped prompts: a prompt can become informative again as the policy changes.

``p`` is an exploration rate per kind that adapts after every step: when the fraction of this step's groups
that were solved zero-variance reaches its target (a third of ``target_zero_variance``), ``p_solved`` drops by
0.01 (skip more), else it rises by 0.01; the same for failed groups with two thirds of the target (hard
prompts get more exploration: they are the ones the policy may learn to solve). Both stay in [0.05, 0.95]
and start at 0.5. As in GRESO, the rates adapt only once the run is past its first epoch.

What happens to a skipped prompt is ``prompt_skip_mode``: ``shrink`` (default) generates for the candidates
kept only, so a step (or a filter's round) generates fewer rollouts; ``replace`` draws further candidates until
as many as asked are kept, so a step generates as much as without skipping, for prompts more likely to
carry a signal. Every process generates for the same number of prompts in a round (engines and reward
gathering may need all of them): a process that kept fewer generates for its first skipped ones too.

GRESO's thresholds for non-binary rewards are options: with ``solved_mean`` (GRESO: 0.98) a group whose mean
reward is at least that counts as solved whether or not its rewards are equal, with ``failed_mean`` (0.11)
one at or below it as failed.

The history is trainer state: :meth:`PromptHistory.to_state` is JSON-able and goes into every checkpoint.
The random draws come from a generator the caller seeds from (seed, step, process, round), so a resumed
run skips exactly what an uninterrupted one skips.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pods.advantages import zero_variance_groups
from pods.config import PROMPT_SKIPS

__all__ = [
    "FAILED",
    "INFORMATIVE",
    "PROMPT_SKIPS",
    "SOLVED",
    "GresoSettings",
    "PromptHistory",
    "SkippedPrompts",
    "adapt_exploration",
    "group_outcomes",
    "keep_probabilities",
    "record_outcomes",
    "round_prompts",
    "skip_candidates",
]

INFORMATIVE, SOLVED, FAILED = 0, 1, 2  # what one group of a prompt looked like


@dataclass(frozen=True)
class GresoSettings:
    """GRESO's constants (its defaults); ``target_zero_variance`` is the one a run configures."""

    target_zero_variance: float = 0.25  # fraction of zero-variance groups the rates steer towards
    initial_exploration: float = 0.5
    min_exploration: float = 0.05
    max_exploration: float = 0.95
    exploration_step: float = 0.01
    min_keep_probability: float = 0.01  # the exploration floor: every prompt is retried at least this often
    solved_reward: float = 0.5  # a zero-variance group at or above this reward is "solved", below "failed"
    max_candidate_batches: int = 8  # replace mode: candidates scanned per round, at most this many batches
    solved_mean: float | None = None  # a group whose mean reward is at least this is solved (GRESO: 0.98)
    failed_mean: float | None = None  # a group whose mean reward is at most this is failed (GRESO: 0.11)

    def __post_init__(self) -> None:
        if not 0 <= self.target_zero_variance < 1:
            raise ValueError(f"target_zero_variance must be in [0, 1), got {self.target_zero_variance}.")
        if not 0 < self.min_exploration <= self.initial_exploration <= self.max_exploration <= 1:
            raise ValueError("exploration rates must satisfy 0 < min <= initial <= max <= 1.")
        if not 0 < self.min_keep_probability <= 1 or self.max_candidate_batches < 1:
            raise ValueError("min_keep_probability must be in (0, 1] and max_candidate_batches at least 1.")
        if None not in (self.solved_mean, self.failed_mean) and self.failed_mean >= self.solved_mean:
            raise ValueError(
                f"failed_mean ({self.failed_mean}) must be below solved_mean ({self.solved_mean})."
            )

    @property
    def targets(self) -> dict[int, float]:
        """Target fraction of solved and of failed zero-variance groups (GRESO: a third and two thirds)."""
        return {SOLVED: self.target_zero_variance / 3, FAILED: self.target_zero_variance * 2 / 3}


def greso_settings(config: Any) -> GresoSettings | None:
    """GRESO's settings from a run's config (``pods train``'s or the TRL drop-in's: the same ``prompt_skip*``
    names), or None without ``prompt_skip: greso``."""
    if config.prompt_skip != "greso":
        return None
    return GresoSettings(
        config.prompt_skip_target,
        solved_mean=config.prompt_skip_solved_mean,
        failed_mean=config.prompt_skip_failed_mean,
    )


@dataclass(frozen=True)
class PromptHistory:
    """Per prompt id, its current streak ``(SOLVED or FAILED, consecutive groups)``; and the two exploration rates."""

    streaks: dict[int, tuple[int, int]] = field(default_factory=dict)
    exploration: dict[int, float] = field(default_factory=lambda: {SOLVED: 0.5, FAILED: 0.5})

    @classmethod
    def start(cls, settings: GresoSettings) -> PromptHistory:
        rate = settings.initial_exploration
        return cls({}, {SOLVED: rate, FAILED: rate})

    def to_state(self) -> dict[str, Any]:
        """A JSON-able form, for the checkpoint (prompts sorted by id)."""
        return {
            "exploration_solved": self.exploration[SOLVED],
            "exploration_failed": self.exploration[FAILED],
            "streaks": [[prompt, kind, count] for prompt, (kind, count) in sorted(self.streaks.items())],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, settings: GresoSettings) -> PromptHistory:
        """The history :meth:`to_state` wrote, or a fresh one for ``None`` (a run's start)."""
        if state is None:
            return cls.start(settings)
        streaks = {int(prompt): (int(kind), int(count)) for prompt, kind, count in state["streaks"]}
        return cls(streaks, {SOLVED: state["exploration_solved"], FAILED: state["exploration_failed"]})


@dataclass(frozen=True)
class SkippedPrompts:
    """What the skip stage chose for one round: ``ids`` to generate for, and how many candidates it skipped
    (not generated)."""

    ids: list[int]
    skipped: int


def group_outcomes(rewards: torch.Tensor, settings: GresoSettings | None = None) -> torch.Tensor:
    """``LongTensor[G]`` of ``INFORMATIVE``, ``SOLVED`` or ``FAILED`` for each group of ``rewards[G, n]``: all
    rewards equal and at least / below ``solved_reward``; or, where ``solved_mean`` / ``failed_mean`` are set, a
    mean at least / at most that (unscorable completions left out)."""
    settings = settings or GresoSettings()
    equal = zero_variance_groups(rewards)
    mean = torch.nan_to_num(rewards.to(torch.float64).nanmean(dim=1), nan=float("-inf"))
    if settings.solved_mean is None:
        solved = equal & (mean >= settings.solved_reward)
    else:
        solved = mean >= settings.solved_mean
    if settings.failed_mean is None:
        failed = equal & (mean < settings.solved_reward)
    else:
        failed = mean <= settings.failed_mean
    outcome = torch.full_like(mean, INFORMATIVE, dtype=torch.long)
    return outcome.masked_fill(failed, FAILED).masked_fill(solved, SOLVED)


def keep_probabilities(history: PromptHistory, ids: list[int], settings: GresoSettings) -> torch.Tensor:
    """``float64[len(ids)]``: each candidate's probability of being generated for, ``max(p ** z, floor)``."""
    probabilities = []
    for prompt in ids:
        kind, count = history.streaks.get(prompt, (INFORMATIVE, 0))
        keep = 1.0 if count == 0 else max(history.exploration[kind] ** count, settings.min_keep_probability)
        probabilities.append(keep)
    return torch.tensor(probabilities, dtype=torch.float64)


def skip_candidates(
    ids: list[int], history: PromptHistory, settings: GresoSettings, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """One batch of candidates split into (kept, skipped), each candidate kept with its probability, in order."""
    draws = torch.rand(len(ids), generator=generator, dtype=torch.float64)
    keep = (draws < keep_probabilities(history, ids, settings)).tolist()
    return [p for p, k in zip(ids, keep, strict=True) if k], [
        p for p, k in zip(ids, keep, strict=True) if not k
    ]


def round_prompts(
    draw: Callable[[int], list[int]],
    size: int,
    *,
    settings: GresoSettings | None,
    history: PromptHistory | None,
    generator: torch.Generator | None,
    mode: str = "shrink",
    most: Callable[[int], int] = lambda value: value,
) -> SkippedPrompts:
    """The prompts one round generates for on this process, from ``draw(count)`` (the next candidates of the
    stream): ``size`` of them without skipping; with GRESO (``settings``), in ``shrink`` mode the ``size``
    candidates it keeps, in ``replace`` mode the first ``size`` it keeps over further draws of ``size`` (at most
    ``max_candidate_batches``). ``most(value)`` is the largest value over processes: every process draws and
    generates as many as the busiest (topping up with its first skipped candidates), so that rounds and
    cursors stay in step."""
    if settings is None or history is None:
        return SkippedPrompts(ids=draw(size), skipped=0)
    kept: list[int] = []
    skipped: list[int] = []
    if mode == "shrink":
        kept, skipped = skip_candidates(draw(size), history, settings, generator)
        count = most(max(len(kept), 1))
    elif mode == "replace":
        for _ in range(settings.max_candidate_batches):
            more_kept, more_skipped = skip_candidates(draw(size), history, settings, generator)
            kept, skipped = kept + more_kept, skipped + more_skipped
            if most(size - len(kept)) <= 0:
                break
        kept, count = kept[:size], size
    else:
        raise ValueError(f"unknown prompt_skip_mode {mode!r}; choose shrink or replace.")
    forced = skipped[: count - len(kept)]  # topped up with the first skipped: generated after all
    return SkippedPrompts(ids=kept + forced, skipped=len(skipped) - len(forced))


def record_outcomes(history: PromptHistory, ids: list[int], outcomes: list[int]) -> PromptHistory:
    """The history after groups with these ``outcomes`` (in order; a prompt may appear twice) were seen."""
    streaks = dict(history.streaks)
    for prompt, outcome in zip(ids, outcomes, strict=True):
        kind, count = streaks.pop(prompt, (INFORMATIVE, 0))
        if outcome != INFORMATIVE:
            streaks[prompt] = (outcome, count + 1 if kind == outcome else 1)
    return replace(history, streaks=streaks)


def adapt_exploration(history: PromptHistory, outcomes: list[int], settings: GresoSettings) -> PromptHistory:
    """Move each exploration rate one step: down (skip more) when this step's fraction of its kind of
    zero-variance groups reached the target, up otherwise; clamped to [min, max]."""
    if not outcomes:
        return history
    exploration = dict(history.exploration)
    for kind, target in settings.targets.items():
        fraction = sum(outcome == kind for outcome in outcomes) / len(outcomes)
        step = -settings.exploration_step if fraction >= target else settings.exploration_step
        rate = exploration[kind] + step
        exploration[kind] = min(max(rate, settings.min_exploration), settings.max_exploration)
    return replace(history, exploration=exploration)
