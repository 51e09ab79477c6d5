"""Plots of saved runs: accuracy and reward against training wall-clock and against steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from pods.errors import ConfigError
from pods.metrics import read_jsonl


class RunNotFoundError(ConfigError):
    """A folder given to plot is not a pods run."""


def load_run(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """``(metrics rows, eval rows)`` of a run folder written by ``pods train``."""
    run_dir = Path(run_dir)
    metrics, evals = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    if not metrics.is_file() and not evals.is_file():
        raise RunNotFoundError(f"{run_dir} is not a pods run folder (no metrics.jsonl or eval.jsonl in it)")
    return (read_jsonl(metrics) if metrics.is_file() else []), (read_jsonl(evals) if evals.is_file() else [])


# Metrics renamed since runs were first written (to TRL's names, commit fa0ed00): new name -> old name.
OLD_METRIC_NAMES = {"reward": "reward_mean_all"}


def metric_column(rows: list[dict], key: str, path: Path) -> list[float]:
    """``key`` of every row read from ``path`` (under its old name in files written before the renames);
    a one-line error naming the file and the row if a row has neither name."""
    old = OLD_METRIC_NAMES.get(key)
    values = []
    for number, row in enumerate(rows, start=1):
        name = key if key in row else old if old in row else None
        if name is None:
            raise ConfigError(
                f"{path}: row {number} has no '{key}'{f' (nor its old name {old!r})' if old else ''}; "
                "pods plot reads the metrics.jsonl and eval.jsonl that pods train writes (see docs/metrics.md)"
            )
        values.append(math.nan if row[name] is None else row[name])  # null: a non-finite value was logged
    return values


def plot_runs(
    run_dirs: Sequence[str | Path], output: str | Path, labels: Sequence[str] | None = None
) -> Path:
    """Four panels (accuracy and mean reward, against training seconds and against steps) for each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [Path(d).name for d in run_dirs]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for run_dir, label in zip(run_dirs, labels, strict=True):
        metrics, evals = load_run(run_dir)
        metrics_file, eval_file = Path(run_dir) / "metrics.jsonl", Path(run_dir) / "eval.jsonl"
        for column, x_key in enumerate(("train_seconds", "step")):
            if evals:
                accuracy = [100 * value for value in metric_column(evals, "accuracy", eval_file)]
                axes[0, column].plot(metric_column(evals, x_key, eval_file), accuracy, "o-", label=label)
            if metrics:
                rewards = _smooth(metric_column(metrics, "reward", metrics_file))
                axes[1, column].plot(metric_column(metrics, x_key, metrics_file), rewards, label=label)
    for column, x_label in enumerate(("training wall-clock (s, evaluation excluded)", "step")):
        axes[0, column].set(xlabel=x_label, ylabel="held-out accuracy (%)")
        axes[1, column].set(xlabel=x_label, ylabel="mean reward of all n rollouts (smoothed)")
        for row in range(2):
            axes[row, column].grid(alpha=0.3)
            if axes[row, column].get_legend_handles_labels()[0]:  # a run without evaluations: nothing to name
                axes[row, column].legend(fontsize=8)
    figure.tight_layout()
    output = Path(output)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def plot_sweep_curves(
    curves: dict[str, list[tuple[list[float], list[float]]]],
    output: str | Path,
    title: str,
    target: float | None = None,
) -> Path:
    """Accuracy against training time per arm: every seed's evaluations (dots), their mean (line) with its
    95% band over seeds (shaded, t-interval), its isotonic fit (dashed, a guide for the eye) and the
    ``target`` accuracy the speed-ups time (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from pods.stats import ACCURACY_RANGE, evaluation_times, mean_curve_band

    figure, axis = plt.subplots(figsize=(8, 5))
    for arm, runs in curves.items():
        grid = evaluation_times(runs)
        mean, fitted, band = mean_curve_band(runs, grid)
        label = f"{arm} ({len(runs)} seed{'s' if len(runs) != 1 else ''})"
        (line,) = axis.plot(grid, 100 * mean, "-", linewidth=1, label=label)
        low, high = np.clip(mean - band, *ACCURACY_RANGE), np.clip(mean + band, *ACCURACY_RANGE)
        axis.fill_between(grid, 100 * low, 100 * high, alpha=0.15, color=line.get_color())
        axis.plot(grid, 100 * fitted, "--", color=line.get_color(), linewidth=1.5)
        for seconds, accuracy in runs:  # every evaluation of every seed
            axis.plot(
                seconds, 100 * np.asarray(accuracy), ".", markersize=3, alpha=0.35, color=line.get_color()
            )
    if target is not None:
        axis.axhline(
            100 * target, color="gray", linestyle=":", linewidth=1, label=f"target {100 * target:.1f}%"
        )
    axis.set(
        xlabel="training wall-clock (s, evaluation excluded)",
        ylabel="held-out accuracy (%)",
        title=title + "\n(dashed: monotone fit of the mean; speed-ups are read off each seed's own fit)",
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(figure, output)


def plot_sweep_values(summary: dict, swept_keys: list[str], output: str | Path) -> Path:
    """Accuracy at the budget (mean and 95% interval over seeds) against the first swept key's value, one
    line per value of the second key; arms without a numeric value (e.g. ``auto``, named arms) are drawn
    as horizontal lines with their interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = swept_keys[0]
    lines: dict[str, list[tuple[float, dict]]] = {}
    flat: list[tuple[str, dict]] = []
    for arm, row in summary["arms"].items():
        value = row["overrides"].get(key)
        rest = ",".join(f"{k}={row['overrides'].get(k)}" for k in swept_keys[1:])
        if isinstance(value, int | float) and not isinstance(value, bool):
            lines.setdefault(rest, []).append((float(value), row["accuracy_at_budget"]))
        else:
            flat.append((arm, row["accuracy_at_budget"]))
    numeric = bool(lines)
    if not numeric:  # categorical: every arm at its own position
        lines = {"": [(float(i), acc) for i, (_, acc) in enumerate(flat)]}
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, points in lines.items():
        points.sort(key=lambda item: item[0])
        xs = [x for x, _ in points]
        ys = [100 * acc["value"] for _, acc in points]
        errors = [  # no bar where a single seed gives no interval
            [
                100 * (acc["value"] - (acc["low"] if acc["low"] is not None else acc["value"]))
                for _, acc in points
            ],
            [
                100 * ((acc["high"] if acc["high"] is not None else acc["value"]) - acc["value"])
                for _, acc in points
            ],
        ]
        axis.errorbar(xs, ys, yerr=errors, fmt="o-", capsize=4, label=label or None)
    if numeric:
        for index, (arm, acc) in enumerate(flat):
            color = f"C{len(lines) + index}"  # apart from the lines' colours
            axis.axhline(100 * acc["value"], linestyle="--", linewidth=1, label=arm, color=color)
            if acc["low"] is not None:
                axis.axhspan(100 * acc["low"], 100 * acc["high"], alpha=0.1, color=color)
        values = sorted({x for pts in lines.values() for x, _ in pts})
        if values and all(x > 0 for x in values):  # log scale, ticked at the swept values as written
            axis.set_xscale("log", base=2 if all(float(x).is_integer() for x in values) else 10)
            axis.set_xticks(values, [f"{x:g}" for x in values])
            axis.minorticks_off()
    else:
        axis.set_xticks(range(len(flat)), [arm for arm, _ in flat], rotation=20, fontsize=8)
    axis.set(xlabel=key, ylabel="accuracy at the budget (%)", title="mean over seeds, 95% interval")
    axis.grid(alpha=0.3)
    if any(axis.get_legend_handles_labels()[1]):
        axis.legend(fontsize=8)
    return _save(figure, output)


TIMELINE_COLOURS = {
    "generate": "tab:orange",
    "score": "tab:red",
    "select": "tab:purple",
    "update": "tab:blue",
    "sync": "tab:green",
    "wait_for_rollouts": "lightgrey",
}


def plot_timeline(
    run_dirs: Sequence[str | Path], output: str | Path, steps: tuple[int, int] = (5, 15)
) -> Path:
    """When each phase of steps ``steps[0]`` .. ``steps[1]`` ran, one row per process (the trainer; with
    ``async_generation`` also the rollout worker), one panel per run, on one time scale: where generation and
    the update overlap and where a side waits. From the ``timeline`` metrics.jsonl logs."""
    import matplotlib.pyplot as plt

    runs = [(Path(path), read_jsonl(Path(path) / "metrics.jsonl")) for path in run_dirs]
    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 + 1.1 * len(runs)), squeeze=False, sharex=True)
    seen: set[str] = set()
    for axis, (path, rows) in zip(axes[:, 0], runs, strict=True):
        chosen = [row for row in rows if steps[0] <= row["step"] <= steps[1]]
        if not chosen or "timeline" not in chosen[0]:
            raise ConfigError(f"{path}/metrics.jsonl has no timeline for steps {steps[0]}-{steps[1]}")
        lanes = {"trainer": [span for row in chosen for span in row["timeline"]]}
        if "pods/async/worker_timeline" in chosen[0]:
            lanes = {
                "rollout worker": [s for row in chosen for s in row["pods/async/worker_timeline"]],
                **lanes,
            }
        origin = min(span[1] for spans in lanes.values() for span in spans)
        for lane, spans in enumerate(lanes.values()):
            for phase, start, end in spans:
                label = phase if phase not in seen else None
                seen.add(phase)
                axis.barh(lane, end - start, left=start - origin, color=TIMELINE_COLOURS.get(phase, "black"),
                          edgecolor="white", linewidth=0.3, label=label)  # fmt: skip
        axis.set_yticks(range(len(lanes)), list(lanes))
        per_step = sum(row["seconds_step"] for row in chosen) / len(chosen)
        mode = "async" if "pods/async/worker_timeline" in chosen[0] else "sync"
        axis.set_title(
            f"{_run_label(path, [p for p, _ in runs])} ({mode}): steps {steps[0]}-{steps[1]}, "
            f"{per_step:.2f} s per step",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel("seconds (wall clock)")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return _save(figure, output)


def _run_label(path: Path, paths: Sequence[Path]) -> str:
    """A run's folder name, with its parent's where two runs share the name (a sweep's arm/seed0)."""
    if sum(other.name == path.name for other in paths) > 1:
        return f"{path.parent.name}/{path.name}"
    return path.name


def _save(figure, output: str | Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    output = Path(output)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for index in range(len(values)):
        chunk = values[max(0, index - window + 1) : index + 1]
        out.append(sum(chunk) / len(chunk))
    return out
