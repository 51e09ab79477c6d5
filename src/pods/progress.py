"""Live progress of a training run (rich): a bar over the step or time budget and the latest metrics."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text


class TrainingProgress:
    """Shows step, reward, accuracy and the generation/update time split; prints messages above the bar."""

    def __init__(self, enabled: bool, max_steps: int | None, max_time: float | None) -> None:
        self.enabled = enabled
        self.by_time = max_time is not None
        self.total = float(max_time) if max_time is not None else float(max_steps or 1)
        self.max_steps = max_steps
        self.console = Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]step {task.fields[step]}"),
            BarColumn(),
            TextColumn("{task.fields[budget]}", markup=False),
            TextColumn("{task.fields[metrics]}", markup=False),
            TimeElapsedColumn(),
            console=self.console,
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=self.total, step=0, budget="", metrics="")

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, step: int, train_seconds: float, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        budget = f"{train_seconds:.0f}/{self.total:.0f}s" if self.by_time else f"{step}/{self.max_steps}"
        text = (
            f"reward {metrics.get('reward', 0):.3f} (kept {metrics.get('pods/reward_kept', 0):.3f})  "
            f"acc {metrics.get('accuracy', 0):.3f}  "
            f"gen {metrics.get('seconds_generate', 0):.2f}s upd {metrics.get('seconds_update', 0):.2f}s"
        )
        if "tools/call_frequency" in metrics:  # multi-turn rollouts: calls per rollout, their errors, turns
            text += (
                f"  tools {metrics['tools/call_frequency']:.2f}/rollout "
                f"(err {metrics['tools/failure_frequency']:.0%}) turns {metrics['tools/mean_turns']:.2f}"
            )
        done = min(train_seconds if self.by_time else step, self.total)
        self._progress.update(self._task, completed=done, step=step, budget=budget, metrics=text)

    def message(self, text: str) -> None:
        """Print ``text`` above the bar as written (``pods[vllm]`` is not rich markup), unwrapped."""
        if self.enabled:
            self._progress.console.print(Text(text), soft_wrap=True)  # the terminal wraps, not rich
