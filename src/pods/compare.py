"""The paper's headline experiment, side by side: GRPO (n = m) against PODS (n = 4m, max-variance), and
optionally the random and max-reward rules, each arm under the same training wall-clock budget and the
same seeds, evaluated periodically with evaluation time excluded from the clock.

Speed-up (the paper's metric): the training time GRPO needs to first reach 99% of its own best accuracy,
divided by the time PODS needs to reach that same accuracy.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pods.config import ConfigError, TrainConfig
from pods.plotting import mean_curve, plot_comparison

ARMS = ("grpo", "pods", "random", "max_reward")
# Configuration keys that arm_config sets for each arm: an override of them would be silently ignored.
ARM_KEYS = ("num_generations", "selection_rule", "seed", "output_dir", "resume_from", "eval_at_start")


@dataclass
class ArmRun:
    arm: str
    seed: int
    run_dir: Path
    seconds: list[float]
    accuracy: list[float]
    steps: int
    seconds_per_step: float
    seconds_generate: float
    seconds_update: float


def arm_config(base: TrainConfig, arm: str, seed: int, output_dir: Path) -> TrainConfig:
    """The base configuration turned into one arm: GRPO keeps all m it generates; the others generate 4m."""
    m = base.num_generations_kept
    settings = {"grpo": (m, "all"), "pods": (4 * m, "max_variance"), "random": (4 * m, "random")}
    settings["max_reward"] = (4 * m, "max_reward")
    if arm not in settings:
        raise ConfigError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    n, rule = settings[arm]
    values = base.to_dict()
    values.update(
        num_generations=n, selection_rule=rule, seed=seed, output_dir=str(output_dir), resume_from=None
    )
    values["eval_at_start"] = True
    return TrainConfig.from_dict(values)


def time_to_reach(seconds: list[float], accuracy: list[float], target: float) -> float | None:
    """First training time at which ``accuracy`` reaches ``target`` (None if it never does)."""
    for time_point, value in zip(seconds, accuracy, strict=True):
        if value >= target - 1e-12:
            return time_point
    return None


def speedup(grpo: tuple[list[float], list[float]], other: tuple[list[float], list[float]]) -> dict[str, Any]:
    """The paper's metric on two accuracy-vs-time curves."""
    target = 0.99 * max(grpo[1])
    grpo_time, other_time = time_to_reach(*grpo, target), time_to_reach(*other, target)
    result: dict[str, Any] = {
        "target_accuracy": target,
        "grpo_seconds": grpo_time,
        "other_seconds": other_time,
    }
    if other_time is None:
        result.update(speedup=None, note="never reached GRPO's 99%-of-peak accuracy within the budget")
    elif grpo_time == 0 or other_time == 0:
        result.update(speedup=None, note="the target was already met at the start (no learning to time)")
    else:
        result["speedup"] = grpo_time / other_time
    return result


def run_comparison(
    base: TrainConfig,
    output_dir: Path,
    arms: list[str],
    seeds: list[int],
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train every arm for every seed (one after the other, so each gets the whole machine) and summarise."""
    from pods.trainer import PODSTrainer

    if "grpo" not in arms:
        raise ConfigError("arms: the comparison is against GRPO, so include 'grpo'")
    for arm in arms:
        if arm not in ARMS:
            raise ConfigError(f"arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    output_dir.mkdir(parents=True, exist_ok=True)
    base.save(output_dir / "base_config.yaml")
    runs: list[ArmRun] = []
    total = len(arms) * len(seeds)
    for index, (seed, arm) in enumerate((seed, arm) for seed in seeds for arm in arms):
        run_dir = output_dir / f"{arm}-seed{seed}"
        config = arm_config(base, arm, seed, run_dir)
        log(
            f"[{index + 1}/{total}] {arm}, seed {seed}: n={config.num_generations}, m={config.num_generations_kept}, "
            f"rule={config.selection_rule}, budget {_budget(config)} -> {run_dir}"
        )
        result = PODSTrainer(config).train()
        runs.append(_arm_run(arm, seed, result.output_dir))
        log(f"    best accuracy {max(runs[-1].accuracy):.1%} after {result.steps} steps")
    summary = summarise(runs, arms)
    _write_outputs(output_dir, runs, summary, base)
    return summary


def summarise(runs: list[ArmRun], arms: list[str]) -> dict[str, Any]:
    curves = {arm: [(r.seconds, r.accuracy) for r in runs if r.arm == arm] for arm in arms}
    mean_curves = {arm: mean_curve(c)[:2] for arm, c in curves.items()}
    summary: dict[str, Any] = {"arms": {}, "speedup_vs_grpo": {}, "speedup_per_seed": {}}
    for arm in arms:
        arm_runs = [r for r in runs if r.arm == arm]
        seconds, mean = mean_curves[arm]
        summary["arms"][arm] = {
            "seeds": [r.seed for r in arm_runs],
            "initial_accuracy": mean[0],
            "peak_accuracy": max(mean),
            "peak_seconds": seconds[mean.index(max(mean))],
            "final_accuracy": mean[-1],
            "peak_accuracy_per_seed": [max(r.accuracy) for r in arm_runs],
            "steps": [r.steps for r in arm_runs],
            "seconds_per_step": _mean([r.seconds_per_step for r in arm_runs]),
            "seconds_generate_per_step": _mean([r.seconds_generate for r in arm_runs]),
            "seconds_update_per_step": _mean([r.seconds_update for r in arm_runs]),
        }
    for arm in arms:
        if arm == "grpo":
            continue
        summary["speedup_vs_grpo"][arm] = speedup(mean_curves["grpo"], mean_curves[arm])
        per_seed = []
        for grpo_run in (r for r in runs if r.arm == "grpo"):
            twin = next((r for r in runs if r.arm == arm and r.seed == grpo_run.seed), None)
            if twin is not None:
                value = speedup((grpo_run.seconds, grpo_run.accuracy), (twin.seconds, twin.accuracy))
                per_seed.append({"seed": grpo_run.seed, **value})
        summary["speedup_per_seed"][arm] = per_seed
    return summary


def _arm_run(arm: str, seed: int, run_dir: Path) -> ArmRun:
    from pods.metrics import read_jsonl

    evals = read_jsonl(run_dir / "eval.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return ArmRun(
        arm=arm,
        seed=seed,
        run_dir=run_dir,
        seconds=[row["train_seconds"] for row in evals],
        accuracy=[row["accuracy"] for row in evals],
        steps=len(metrics),
        seconds_per_step=_mean([row["seconds_step"] for row in metrics]),
        seconds_generate=_mean([row["seconds_generate"] for row in metrics]),
        seconds_update=_mean([row["seconds_update"] for row in metrics]),
    )


def _write_outputs(output_dir: Path, runs: list[ArmRun], summary: dict[str, Any], base: TrainConfig) -> None:
    with (output_dir / "accuracy_vs_time.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["arm", "seed", "eval_index", "train_seconds", "accuracy"])
        for run in runs:
            for index, (seconds, accuracy) in enumerate(zip(run.seconds, run.accuracy, strict=True)):
                writer.writerow([run.arm, run.seed, index, f"{seconds:.3f}", f"{accuracy:.6f}"])
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    curves = {arm: [(r.seconds, r.accuracy) for r in runs if r.arm == arm] for arm in summary["arms"]}
    title = f"{base.task}: GRPO n=m={base.num_generations_kept} vs PODS n={4 * base.num_generations_kept}, m={base.num_generations_kept}"
    plot_comparison(curves, output_dir / "accuracy_vs_time.png", title)


def _budget(config: TrainConfig) -> str:
    parts = [f"{config.max_time:.0f} s of training"] if config.max_time else []
    return " or ".join([*parts, f"{config.max_steps} steps"] if config.max_steps else parts)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
