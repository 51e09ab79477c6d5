"""Summarising a sweep: each run's evaluations and timings, per-arm accuracies and speed-ups with 95% intervals
over seeds (:mod:`pods.stats`), the evaluations as CSV, the plots, and the table ``pods sweep`` prints."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pods.config import TrainConfig
from pods.errors import ConfigError
from pods.metrics import read_jsonl
from pods.stats import (
    ACCURACY_RANGE,
    accuracy_standard_error,
    compare_curves,
    curve_levels,
    mean_interval,
    plateau,
    still_climbing,
    time_to_level,
)
from pods.sweep.plan import Arm, resolve_baselines


@dataclass
class SeedRun:
    """One finished training run of an arm: its evaluations and its step timings."""

    arm: str
    seed: int
    run_dir: Path
    steps_at_eval: list[int]
    seconds: list[float]
    accuracy: list[float]
    num_problems: list[int]
    steps: int
    seconds_step: float
    seconds_generate: float
    seconds_update: float
    mean_num_generations: float
    extra: dict[str, Any] = field(default_factory=dict)
    rollouts_generated: int | None = None  # over the run (None: a run logged before the metric existed)
    groups_with_signal: int | None = None  # groups trained on with a spread, over the run


def load_seed_run(arm: str, seed: int, run_dir: Path) -> SeedRun:
    """Read one run folder's evaluations and per-step timings."""
    evals = read_jsonl(run_dir / "eval.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not evals:
        raise ConfigError(f"{run_dir} has no evaluations (eval.jsonl): a sweep needs evaluations to compare")
    mean = lambda key: sum(row.get(key, 0.0) for row in metrics) / max(1, len(metrics))  # noqa: E731
    return SeedRun(
        arm=arm,
        seed=seed,
        run_dir=run_dir,
        steps_at_eval=[row["step"] for row in evals],
        seconds=[row["train_seconds"] for row in evals],
        accuracy=[row["accuracy"] for row in evals],
        num_problems=[row.get("num_problems", 0) for row in evals],
        steps=len(metrics),
        seconds_step=mean("seconds_step"),
        seconds_generate=mean("seconds_generate"),
        seconds_update=mean("seconds_update"),
        mean_num_generations=mean("num_generations"),
        rollouts_generated=_total(metrics, "pods/rollouts_generated"),
        groups_with_signal=_total(metrics, "pods/groups_trained_with_signal"),
    )


def _total(metrics: list[dict[str, Any]], key: str) -> int | None:
    """The sum of a per-step count over the run, or None where a step did not log it."""
    values = [row.get(key) for row in metrics]
    return None if not values or None in values else int(sum(values))


def summarise(
    runs: list[SeedRun], arms: list[Arm], baseline: str, target: float | None = None
) -> dict[str, Any]:
    """Per arm: accuracy at the budget and best accuracy (mean, 95% interval over seeds, standard error
    over problems), time to the target accuracy, and speed-ups against the baseline per second and per step."""
    by_arm = {arm.name: [r for r in runs if r.arm == arm.name] for arm in arms}
    by_arm = {name: arm_runs for name, arm_runs in by_arm.items() if arm_runs}
    baselines = resolve_baselines(arms, baseline)
    summary: dict[str, Any] = {"baseline": baseline, "arms": {}}
    levels = {name: curve_levels(_curves(by_arm[name])) for name in set(baselines.values()) & set(by_arm)}
    targets = {name: target if target is not None else found["paper"] for name, found in levels.items()}
    if len(set(baselines.values())) == 1 and targets:  # one baseline: one target for every arm
        summary["target_accuracy"] = next(iter(targets.values()))
        summary["target_is"] = "given" if target is not None else "99% of the baseline's plateau"
    for arm in arms:
        arm_runs = by_arm.get(arm.name)
        if not arm_runs:
            continue
        base_name = baselines.get(arm.name)
        base_runs = by_arm.get(base_name)
        final = [r.accuracy[-1] for r in arm_runs]
        best = [max(r.accuracy) for r in arm_runs]
        se = [accuracy_standard_error(r.accuracy[-1], r.num_problems[-1]) for r in arm_runs]
        row: dict[str, Any] = {
            "overrides": arm.overrides,
            "seeds": [r.seed for r in arm_runs],
            "start_accuracy": sum(r.accuracy[0] for r in arm_runs) / len(arm_runs),
            "accuracy_at_budget": mean_interval(final, bounds=ACCURACY_RANGE).to_dict(),
            "accuracy_at_budget_per_seed": final,
            "accuracy_at_budget_se_over_problems": (sum(s * s for s in se) ** 0.5) / len(se),
            "best_accuracy": mean_interval(best, bounds=ACCURACY_RANGE).to_dict(),
            "best_accuracy_per_seed": best,
            "train_seconds": [r.seconds[-1] for r in arm_runs],
            "steps": [r.steps for r in arm_runs],
            "seconds_per_step": _mean([r.seconds_step for r in arm_runs]),
            "seconds_generate_per_step": _mean([r.seconds_generate for r in arm_runs]),
            "seconds_update_per_step": _mean([r.seconds_update for r in arm_runs]),
            "mean_num_generations": _mean([r.mean_num_generations for r in arm_runs]),
            **rollout_counts(arm_runs),
        }
        if base_name in targets:
            row["baseline"] = base_name
            row["target_accuracy"] = targets[base_name]
            row["seconds_to_target"] = time_to_level(_curves(arm_runs), targets[base_name]).to_dict()
        if base_runs and arm.name != base_name:  # the same levels per second and per step
            row["speedup_levels"] = levels[base_name]
            for key, by_step in (("speedup", False), ("speedup_per_step", True)):
                found = compare_curves(
                    _curves(base_runs, by_step), _curves(arm_runs, by_step), levels=levels[base_name]
                )
                row[key] = {name: value.to_dict() for name, value in found.items()}
        summary["arms"][arm.name] = row
    summary["auto_vs_best_fixed"] = auto_against_best_fixed(summary["arms"])
    summary["baselines_still_climbing"] = {
        name: plateau(_curves(by_arm[name]))
        for name in sorted(levels)
        if still_climbing(_curves(by_arm[name]))
    }
    return summary


def rollout_counts(runs: list[SeedRun]) -> dict[str, float]:
    """Rollouts generated per step and per group trained with a signal (each seed's, then their mean): what a
    step's generation cost, and what one useful group cost. Empty for runs that did not log the counts."""
    if any(r.rollouts_generated is None or not r.groups_with_signal or not r.steps for r in runs):
        return {}
    return {
        "rollouts_per_step": _mean([r.rollouts_generated / r.steps for r in runs]),
        "rollouts_per_useful_group": _mean([r.rollouts_generated / r.groups_with_signal for r in runs]),
    }


def auto_against_best_fixed(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each ``num_generations: auto`` arm: the fixed-n arm (same other keys) with the best accuracy at
    the budget, and whether auto's mean lies within that arm's 95% interval or above it."""
    out = []
    for name, row in rows.items():
        keys = row["overrides"]
        if keys.get("num_generations") != "auto":
            continue
        rest = {k: v for k, v in keys.items() if k != "num_generations"}
        fixed = {
            other: r
            for other, r in rows.items()
            if isinstance(r["overrides"].get("num_generations"), int)
            and {k: v for k, v in r["overrides"].items() if k != "num_generations"} == rest
        }
        if not fixed:
            continue
        best = max(fixed, key=lambda other: fixed[other]["accuracy_at_budget"]["value"])
        auto, interval = row["accuracy_at_budget"]["value"], fixed[best]["accuracy_at_budget"]
        low = interval["low"] if interval["low"] is not None else interval["value"]
        out.append(
            {
                "auto": name,
                "best_fixed": best,
                "auto_accuracy": auto,
                "best_fixed_accuracy": interval,
                "within_or_better": auto >= low,
            }
        )
    return out


def summarise_and_write(
    runs: list[SeedRun],
    arms: list[Arm],
    baseline: str,
    target: float | None,
    swept_keys: Sequence[str],
    output_dir: Path,
    base: TrainConfig,
) -> dict[str, Any] | None:
    """Write the CSV, summary and plots of the runs so far (None when no run has finished)."""
    if not runs:
        return None
    summary = summarise(runs, arms, baseline, target)
    summary["runs_finished"] = len(runs)
    write_evaluations_csv(runs, arms, swept_keys, output_dir / "evaluations.csv")
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from pods.plotting import plot_sweep_curves, plot_sweep_values

    curves = {arm.name: _curves([r for r in runs if r.arm == arm.name]) for arm in arms}
    title = f"{base.dataset_name or base.task}: accuracy against training time (mean over seeds, 95% band)"
    plot_sweep_curves(
        {k: v for k, v in curves.items() if v},
        output_dir / "accuracy_vs_time.png",
        title,
        target=summary.get("target_accuracy"),
    )
    if swept_keys:
        plot_sweep_values(summary, list(swept_keys), output_dir / f"accuracy_vs_{swept_keys[0]}.png")
    return summary


def write_evaluations_csv(
    runs: list[SeedRun], arms: list[Arm], swept_keys: Sequence[str], path: Path
) -> None:
    overrides = {arm.name: arm.overrides for arm in arms}
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "arm",
                *swept_keys,
                "seed",
                "eval_index",
                "step",
                "train_seconds",
                "accuracy",
                "accuracy_se",
                "num_problems",
            ]
        )
        for run in runs:
            for index, (step, seconds, accuracy, problems) in enumerate(
                zip(run.steps_at_eval, run.seconds, run.accuracy, run.num_problems, strict=True)
            ):
                keys = [overrides[run.arm].get(key, "") for key in swept_keys]
                se = accuracy_standard_error(accuracy, problems)
                writer.writerow(
                    [
                        run.arm,
                        *keys,
                        run.seed,
                        index,
                        step,
                        f"{seconds:.3f}",
                        f"{accuracy:.6f}",
                        f"{se:.6f}",
                        problems,
                    ]
                )


def _curves(runs: list[SeedRun], by_step: bool = False) -> list[tuple[list[float], list[float]]]:
    return [([float(s) for s in (r.steps_at_eval if by_step else r.seconds)], r.accuracy) for r in runs]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def budget_text(config: TrainConfig) -> str:
    parts = [f"{config.max_time:.0f} s of training"] if config.max_time else []
    return " or ".join([*parts, f"{config.max_steps} steps"] if config.max_steps else parts)


# ---------------------------------------------------------------------------------------------- report
def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table plus one line per speed-up, with intervals and verdicts."""
    target = summary.get("target_accuracy")
    reach_header = f"seconds to {_pct(target)}" if target is not None else "seconds to its baseline's target"
    lines = [
        f"| arm | accuracy at budget (95% CI) | best accuracy | {reach_header} | "
        "s/step (generate + update) | rollouts per step (per useful group) | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, row in summary["arms"].items():
        at, best = row["accuracy_at_budget"], row["best_accuracy"]
        reach = _seconds(row.get("seconds_to_target") or {})
        if target is None and "target_accuracy" in row:
            reach += f" (to {_pct(row['target_accuracy'])})"
        lines.append(
            f"| {arm} | {_pct_ci(at)} +-{100 * row['accuracy_at_budget_se_over_problems']:.1f} over problems | "
            f"{_pct_ci(best)} | {reach} | "
            f"{row['seconds_per_step']:.2f} ({row['seconds_generate_per_step']:.2f} + "
            f"{row['seconds_update_per_step']:.2f}) | {_rollouts(row)} | {', '.join(map(str, row['steps']))} |"
        )
    for item in summary.get("auto_vs_best_fixed", []):
        best = item["best_fixed_accuracy"]
        verdict = (
            "within its 95% interval or better" if item["within_or_better"] else "below its 95% interval"
        )
        lines.append(
            f"\n{item['auto']} against the best fixed n ({item['best_fixed']}, {_pct_ci(best)} at the budget): "
            f"{_pct(item['auto_accuracy'])}, {verdict}"
        )
    for name, top in summary.get("baselines_still_climbing", {}).items():
        end = summary["arms"][name]["accuracy_at_budget"]["value"]
        lines.append(
            f"\nNote: the baseline {name} is still climbing at the end of its budget: its plateau (its mean over "
            f"the last third of the run, {_pct(top)}) is below where it ends ({_pct(end)}), so the levels below "
            "are read on its climb, not at its peak; a longer budget would give the paper's level its meaning."
        )
    for arm, row in summary["arms"].items():
        if "speedup" not in row:
            continue
        baseline = row["baseline"]
        lines.append(
            f"\n{arm} vs {baseline} (speed-up = {baseline}'s time / {arm}'s time to the accuracy named, "
            "geometric means over seeds, Welch's 95% interval):"
        )
        for unit, key in (("per second", "speedup"), ("per step", "speedup_per_step")):
            parts = [f"{_metric_name(name, value)} {_speedup(value)}" for name, value in row[key].items()]
            lines.append(f"  {unit}: " + "; ".join(parts))
    return "\n".join(lines)


def _rollouts(row: dict[str, Any]) -> str:
    if "rollouts_per_step" not in row:
        return "-"
    return f"{row['rollouts_per_step']:.0f} ({row['rollouts_per_useful_group']:.1f})"


def _metric_name(name: str, value: dict[str, Any]) -> str:
    what = "99% of the plateau, the paper's" if name == "paper" else f"{name.split('_')[1]}% of the gain"
    return f"to {_pct(value['level'])} ({what})"


def _speedup(value: dict[str, Any]) -> str:
    if value["value"] is None:
        return "n/a (the baseline did not climb)"
    if value["low"] is None:
        text = f"{value['value']:.2f}x (undetermined: one seed gives no interval)"
    else:
        text = f"{value['value']:.2f}x ({value['low']:.2f}-{value['high']:.2f}, {value['verdict']})"
    notes = []
    if value["arm_never"]:
        notes.append(f"the arm never reached it in {value['arm_never']} seed(s)")
    if value["baseline_never"]:
        notes.append(f"the baseline never reached it in {value['baseline_never']} seed(s)")
    if value["early"]:
        notes.append(f"{value['early']} seed(s) reached it before their first evaluation: evaluate earlier")
    return text + (f" [{'; '.join(notes)}]" if notes else "")


def _seconds(value: dict[str, Any]) -> str:
    if not value:
        return "-"
    if value.get("value") is None:
        return "never"
    if value["value"] == 0:
        return "0 (met at the start)"
    never = f", {value['never']} of {value['seeds']} seeds never" if value.get("never") else ""
    at_least = ">=" if value.get("never") else ""
    if value.get("low") is None:
        return f"{at_least}{value['value']:.0f}{never}"
    return f"{at_least}{value['value']:.0f} ({value['low']:.0f}-{value['high']:.0f}{never})"


def _pct_ci(value: dict[str, Any]) -> str:
    interval = "" if value["low"] is None else f" ({_pct(value['low'])}-{_pct(value['high'])})"
    return _pct(value["value"]) + interval


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
