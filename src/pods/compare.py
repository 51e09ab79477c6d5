"""The paper's headline experiment, side by side: GRPO (n = m) against PODS (n = 4m, max-variance), and
optionally the random and max-reward rules, as a sweep (:mod:`pods.sweep`) over named arms with GRPO as
the baseline: the same seeds and training-time budget for every arm, evaluation off the clock.

Speed-ups come with 95% intervals over seeds (:mod:`pods.stats`: each seed's crossing time read off its
own monotone fit, Welch's interval on the log ratio): the paper's metric (time for GRPO to first reach 99%
of its plateau, over the time the arm needs to reach that accuracy) and the time to 50% / 90% of GRPO's
gain over the starting accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pods.config import ConfigError, TrainConfig
from pods.sweep import Arm, run_sweep

ARMS = ("grpo", "pods", "random", "max_reward")
BASELINE = "grpo"
# Configuration keys that arm_config sets for each arm: an override of them would be silently ignored.
ARM_KEYS = ("num_generations", "selection_rule", "seed", "output_dir", "resume_from", "eval_at_start")


def compare_arms(base: TrainConfig, names: list[str]) -> list[Arm]:
    """GRPO keeps all m it generates; the other arms generate 4m and keep m by their rule."""
    if BASELINE not in names:
        raise ConfigError("arms: the comparison is against GRPO, so include 'grpo'")
    m = base.num_generations_kept
    rules = {"grpo": "all", "pods": "max_variance", "random": "random", "max_reward": "max_reward"}
    arms = []
    for name in names:
        if name not in rules:
            raise ConfigError(f"arms: unknown arm {name!r}; choose from {', '.join(ARMS)}")
        n = m if name == "grpo" else 4 * m
        arms.append(Arm(name, {"num_generations": n, "selection_rule": rules[name]}))
    return arms


def run_comparison(
    base: TrainConfig,
    output_dir: Path,
    arms: list[str],
    seeds: list[int],
    *,
    resume_command: str | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train every arm for every seed and summarise against GRPO (see :func:`pods.sweep.run_sweep`)."""
    return run_sweep(
        base,
        compare_arms(base, arms),
        seeds,
        output_dir,
        baseline=BASELINE,
        resume_command=resume_command,
        trainer_kwargs=trainer_kwargs,
        log=log,
    )
