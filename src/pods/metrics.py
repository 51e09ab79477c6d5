"""Metric logs: one JSON object per line, append-only, trimmed back to a checkpoint's step on resume
so that a resumed run has no duplicated or missing rows; and the reward metrics both trainers log
(TRL's names where TRL has the metric, ``pods/...`` for the kept-versus-all ones; see docs/metrics.md)."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Metrics that measure the machine rather than the learning: they differ between two identical runs.
TIMING_KEYS = (
    "train_seconds",
    "seconds_generate",
    "seconds_score",
    "seconds_select",
    "seconds_update",
    "seconds_sync",
    "seconds_step",
    "tokens_per_second",
    "peak_memory_mb",
    "eval_seconds",
    "wall_time",
    "timeline",
    "seconds_wait_for_rollouts",
    "pods/async/worker_idle_seconds",
    "pods/async/worker_timeline",
    "pods/async/worker_seconds_select",
    "pods/async/worker_seconds_generate",
    "pods/async/worker_seconds_score",
)


def reward_metrics(rewards: torch.Tensor, kept_rewards: torch.Tensor) -> dict[str, float]:
    """Reward statistics of a step from every process's ``rewards[G, n]`` and ``kept_rewards[G, m]``.

    ``reward``, ``reward_std`` (whole-batch std) and ``frac_reward_zero_std`` mean what they mean in TRL
    (over all n; NaN = unscorable completions are left out); ``pods/..._kept`` are the same over the m
    kept, and ``pods/group_reward_std[_kept]`` is the mean within-group std, the quantity PODS raises.
    """
    from pods.advantages import nanstd, zero_variance_groups

    metrics: dict[str, float] = {}
    for suffix, values in (("", rewards), ("_kept", kept_rewards)):
        values = values.to(torch.float64)
        prefix = "pods/" if suffix else ""
        metrics[f"{prefix}reward{suffix}"] = values.nanmean().item()
        metrics[f"{prefix}reward_std{suffix}"] = nanstd(values.reshape(1, -1), dim=1).item()
        metrics[f"{prefix}frac_reward_zero_std{suffix}"] = zero_variance_groups(values).double().mean().item()
        metrics[f"pods/group_reward_std{suffix}"] = nanstd(values, dim=1).mean().item()
    return metrics


class JsonlLog:
    """Append-only JSON-lines file of metric rows keyed by ``step``."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def append(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as handle:
                handle.write(json.dumps(_plain(row)) + "\n")

    def reset(self) -> None:
        """Start an empty log (a fresh run)."""
        if self.enabled:
            self.path.write_text("")

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (written by a run that crashed after its last checkpoint)."""
        if self.enabled and self.path.is_file():
            kept = [row for row in read_jsonl(self.path) if row.get("step", 0) <= step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
            tmp.replace(self.path)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (crash mid-write) is ignored."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Python scalars only, non-finite floats as null (valid JSON)."""
    clean = {}
    for key, value in row.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        clean[key] = value
    return clean


class StepTimer:
    """Seconds spent in each phase of a step: ``with timer("generate"): ...``; and when each ran (``spans``:
    phase, wall-clock start and end), for a timeline of the run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, wall = time.perf_counter(), time.time()
        yield
        elapsed = time.perf_counter() - start
        self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
        self.spans.append((phase, round(wall, 4), round(wall + elapsed, 4)))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def peak_memory_mb() -> float:
    """Peak accelerator memory since the last call (GPU), else the process's peak resident memory (CPU)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def trackers_closed(accelerator: Any, enabled: bool) -> Iterator[None]:
    """Flush and close accelerate's trackers (TensorBoard, W&B, ...) however the block ends: done, stopped or
    failed."""
    try:
        yield
    finally:
        if enabled:
            accelerator.end_training()
