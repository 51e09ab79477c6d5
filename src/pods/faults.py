"""Fault injection: named points on the rollout side where a test makes a process die, reached by the code's own
events rather than by a timer (docs/reliability.md). ``PODS_FAULT=<point>`` arms one point for a run (the rollout
worker inherits it): there the rollout worker or the vLLM server pods started is killed (SIGKILL), by itself or by
the trainer; ``PODS_FAULT=<point>:<SIGNAL>`` instead sends SIGNAL (SIGTERM, SIGINT, SIGKILL) to the process that
reaches the point; ``<point>@K`` fires the K-th time a process reaches it (default the first), and only then.
With ``PODS_FAULT_RANK=R`` only trainer process R (and its worker) fires, under ``accelerate launch``. Before it
acts a point writes its name to the file ``PODS_FAULT_MARK`` names, so that a test knows it fired.
Unarmed, a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

__all__ = ["FAULT_ENV", "FAULT_MARK_ENV", "FAULT_RANK_ENV", "POINTS", "fault_point", "reset"]

FAULT_ENV = "PODS_FAULT"
FAULT_MARK_ENV = "PODS_FAULT_MARK"
FAULT_RANK_ENV = "PODS_FAULT_RANK"

POINTS = {
    "worker_start": "the rollout worker, starting, before it has built its model and engine",
    "worker_waiting_for_weights": "the rollout worker, waiting for the weights its next batch is sampled by",
    "worker_generating": "the rollout worker, between sampling a batch and its behaviour log-probs",
    "worker_scoring": "the rollout worker, scoring a batch",
    "worker_queue_full": "the rollout worker, sending a batch the trainer does not read yet (the pipe is full)",
    "trainer_waiting_for_rollouts": "the trainer, waiting for its step's batch",
    "trainer_publishing": "the trainer, between copying the weights for the worker and saying so",
    "trainer_checkpointing": "the trainer, writing a checkpoint",
    "trainer_final_evaluation": "the trainer, in the evaluation after the last step",
    "server_generating": "a vLLM server pods started, while a generation request waits for its answer",
}
_reached: dict[str, int] = {}  # times each armed point was reached in this process


def fault_point(name: str, kill: Callable[[], None] | None = None) -> None:
    """Where ``PODS_FAULT`` arms ``name``: kill the process this point is about (``kill()``; without one, the
    process that reaches the point), or send this process the signal the setting names."""
    armed = os.environ.get(FAULT_ENV)
    if not armed:
        return
    point, _, action = armed.partition(":")
    point, _, times = point.partition("@")
    rank = os.environ.get(FAULT_RANK_ENV)
    if point != name or (rank is not None and os.environ.get("RANK", "0") != rank):
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != int(times or 1):
        return
    mark = os.environ.get(FAULT_MARK_ENV)
    if mark:
        Path(mark).write_text(name)
    if action:
        os.kill(os.getpid(), signal.Signals[action])
    elif kill is not None:
        kill()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Forget how often each point was reached (a test that runs several trainings in one process)."""
    _reached.clear()
