"""Task datasets: a registry of loaders that return ``datasets.Dataset`` rows with at least
``question``, ``answer`` (gold final answer, a string), ``solution`` and ``prompt``.

Built in: ``gsm8k``, ``math500``, ``math``, and ``arith`` (the embedded synthetic task, loaded lazily
from :mod:`pods.data.arith`). Add your own with :func:`register_task`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from pods.data.common import HubUnavailableError, MissingDataError, TaskDataError
from pods.data.gsm8k import load_gsm8k
from pods.data.math import load_math, load_math500

__all__ = [
    "HubUnavailableError",
    "MissingDataError",
    "TaskDataError",
    "available_tasks",
    "load_task",
    "register_task",
]

TaskLoader = Callable[..., Any]

_TASKS: dict[str, TaskLoader] = {
    "gsm8k": load_gsm8k,
    "math500": load_math500,
    "math": load_math,
    "arith": lambda **kw: importlib.import_module("pods.data.arith").load_arith(**kw),
}


def register_task(name: str, loader: TaskLoader) -> None:
    """Register ``loader(split=..., prompt_style=..., tokenizer=..., max_prompt_tokens=..., limit=...,
    seed=..., **kwargs) -> datasets.Dataset`` under ``name`` (replacing any earlier one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a task name must be a non-empty string, got {name!r}.")
    if not callable(loader):
        raise ValueError(f"the loader for task {name!r} must be callable, got {type(loader).__name__}.")
    _TASKS[name] = loader


def available_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_TASKS)


def load_task(
    name: str,
    split: str = "train",
    *,
    source: str | None = None,
    prompt_style: str = "chat",
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> Any:
    """Load task ``name``'s ``split`` as a ``datasets.Dataset`` with ``prompt`` and ``answer`` columns.

    ``source`` is a Hub name or a local file/folder (default: the task's Hub dataset); ``limit`` keeps
    the first N rows after filtering prompts longer than ``max_prompt_tokens`` (needs ``tokenizer``).
    """
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {available_tasks()}.")
    loader = _TASKS[name]
    options: dict[str, Any] = dict(
        split=split,
        prompt_style=prompt_style,
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        limit=limit,
        seed=seed,
        **kwargs,
    )
    if source is not None:
        options["source"] = source
    parameters = inspect.signature(loader).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(options) - set(parameters))
        if unknown:
            raise ValueError(
                f"task {name!r} does not accept option(s) {unknown}; it accepts {sorted(parameters)}."
            )
    return loader(**options)
