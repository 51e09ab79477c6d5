"""Plots of saved runs: accuracy and reward against training wall-clock and against steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pods.metrics import read_jsonl


class RunNotFoundError(ValueError):
    """A folder given to plot is not a pods run."""


def load_run(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """``(metrics rows, eval rows)`` of a run folder written by ``pods train``."""
    run_dir = Path(run_dir)
    metrics, evals = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    if not metrics.is_file() and not evals.is_file():
        raise RunNotFoundError(f"{run_dir} is not a pods run folder (no metrics.jsonl or eval.jsonl in it)")
    return (read_jsonl(metrics) if metrics.is_file() else []), (read_jsonl(evals) if evals.is_file() else [])


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
        for column, x_key in enumerate(("train_seconds", "step")):
            if evals:
                axes[0, column].plot(
                    [r[x_key] for r in evals], [100 * r["accuracy"] for r in evals], "o-", label=label
                )
            if metrics:
                axes[1, column].plot(
                    [r[x_key] for r in metrics], _smooth([r["reward"] for r in metrics]), label=label
                )
    for column, x_label in enumerate(("training wall-clock (s, evaluation excluded)", "step")):
        axes[0, column].set(xlabel=x_label, ylabel="held-out accuracy (%)")
        axes[1, column].set(xlabel=x_label, ylabel="mean reward of all n rollouts (smoothed)")
        for row in range(2):
            axes[row, column].grid(alpha=0.3)
            axes[row, column].legend(fontsize=8)
    figure.tight_layout()
    output = Path(output)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def plot_comparison(
    curves: dict[str, list[tuple[list[float], list[float]]]], output: str | Path, title: str
) -> Path:
    """Accuracy against training time per arm: the mean over seeds with the min-max spread shaded.

    ``curves[arm]`` holds one ``(seconds, accuracy)`` pair of lists per seed, evaluation k of every seed
    being averaged together (evaluations happen every fixed amount of training time).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5))
    for arm, runs in curves.items():
        seconds, mean, low, high = mean_curve(runs)
        axis.plot(
            seconds,
            [100 * a for a in mean],
            "o-",
            markersize=3,
            label=f"{arm} ({len(runs)} seed{'s' if len(runs) != 1 else ''})",
        )
        axis.fill_between(seconds, [100 * a for a in low], [100 * a for a in high], alpha=0.2)
    axis.set(
        xlabel="training wall-clock (s, evaluation excluded)", ylabel="held-out accuracy (%)", title=title
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    output = Path(output)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def mean_curve(
    runs: list[tuple[list[float], list[float]]],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Average the k-th evaluation over seeds (up to the shortest run): seconds, mean, min, max."""
    length = min(len(seconds) for seconds, _ in runs)
    seconds = [sum(run[0][k] for run in runs) / len(runs) for k in range(length)]
    values = [[run[1][k] for run in runs] for k in range(length)]
    return seconds, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for index in range(len(values)):
        chunk = values[max(0, index - window + 1) : index + 1]
        out.append(sum(chunk) / len(chunk))
    return out
