"""Task datasets: a registry of loaders that return ``datasets.Dataset`` rows with at least
``question``, ``answer`` (gold final answer, a string), ``solution`` and ``prompt``.

Each task is a :class:`Task`: its reader, prompt, training rewards and accuracy function. Built in:
``gsm8k``, ``math500``, ``math``, the embedded synthetic tasks ``arith`` and ``arith-hard``
(:mod:`pods.data.arith`) and the embedded tool task ``products`` (:mod:`pods.data.products`). Add your
own with :func:`register_task`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pods.data.arith import ARITH_HARD_TASK, ARITH_TASK
from pods.data.common import HubUnavailableError, MissingDataError, TaskDataError
from pods.data.gsm8k import read_gsm8k
from pods.data.math import read_math, read_math500
from pods.data.products import PRODUCTS_TASK
from pods.data.task import Task

__all__ = [
    "HubUnavailableError",
    "MissingDataError",
    "Task",
    "TaskDataError",
    "available_tasks",
    "get_task",
    "load_task",
    "register_task",
]


_MATH = {"reward_funcs": ("math_accuracy", "format", "tag"), "accuracy": "math_accuracy"}
_TASKS: dict[str, Task] = {
    "gsm8k": Task("gsm8k", read_gsm8k),
    "math500": Task("math500", read_math500, **_MATH),
    "math": Task("math", read_math, **_MATH),
    "arith": ARITH_TASK,
    "arith-hard": ARITH_HARD_TASK,
    "products": PRODUCTS_TASK,
}


def register_task(name: str, task: Task | Callable[..., Any], **fields: Any) -> None:
    """Register ``task`` under ``name`` (replacing any earlier one): a :class:`Task`, or a reader
    ``read(split, *, source=None, seed=0, **options) -> rows`` plus the :class:`Task` fields (rewards,
    accuracy function, prompt style) as keywords."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a task name must be a non-empty string, got {name!r}.")
    if not isinstance(task, Task):
        if not callable(task):
            raise ValueError(f"the reader for task {name!r} must be callable, got {type(task).__name__}.")
        task = Task(name, task, **fields)
    _TASKS[name] = task


def available_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """The task registered under ``name``."""
    if name not in _TASKS:
        raise TaskDataError(f"unknown task {name!r}; known tasks: {available_tasks()}.")
    return _TASKS[name]


def load_task(name: str, split: str = "train", **options: Any) -> Any:
    """Load task ``name``'s ``split`` as a ``datasets.Dataset`` with ``prompt`` and ``answer`` columns
    (options: :meth:`Task.load`)."""
    return get_task(name).load(split, **options)
