"""Scoring completions with reward functions in TRL's signature and summing them into one reward each."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pods.errors import RewardFunctionError

RewardFunction = Callable[..., Sequence[float | None]]


def reward_name(fn: RewardFunction) -> str:
    """A function's own name (``__name__``, as TRL names a reward's metrics)."""
    return getattr(fn, "__name__", type(fn).__name__)


def reward_names(reward_funcs: Sequence[RewardFunction]) -> list[str]:
    """One distinct name per function, for its metrics and its column of rewards: its own name, or where two
    share one (``a.py:reward b.py:reward``), the name qualified by its file or module (``a.reward``, as TRL's
    dotted spelling writes it); then a number where even those are equal (two files ``x/r.py``, ``y/r.py``)."""
    own = [reward_name(fn) for fn in reward_funcs]
    names = [
        _qualified_name(fn) if own.count(name) > 1 else name
        for fn, name in zip(reward_funcs, own, strict=True)
    ]
    unique: list[str] = []
    for name in names:
        candidate, number = name, 1
        while candidate in unique:
            number += 1
            candidate = f"{name}_{number}"
        unique.append(candidate)
    return unique


def name_among(reward_funcs: Sequence[RewardFunction], fn: RewardFunction) -> str:
    """``fn``'s column name: its distinct name among the run's ``reward_funcs``, else its own name."""
    for candidate, name in zip(reward_funcs, reward_names(reward_funcs), strict=True):
        if candidate is fn:
            return name
    return reward_name(fn)


def _qualified_name(fn: RewardFunction) -> str:
    """``module.function``: an imported function's own (``a.py:reward`` -> ``a.reward``), or where it was defined."""
    qualified = getattr(fn, "qualified_name", None)
    if isinstance(qualified, str):
        return qualified
    module = getattr(fn, "__module__", None)
    return f"{module}.{reward_name(fn)}" if isinstance(module, str) and module else reward_name(fn)


def reward_columns(rows: Sequence[dict[str, Any]], repeat: int) -> dict[str, list[Any]]:
    """The keywords every reward function gets for ``rows``, each value once per completion (``repeat`` a row):
    every column but ``prompt`` of any row, None where a row lacks it (as ``datasets`` fills missing keys)."""
    keys = dict.fromkeys(key for row in rows for key in row if key != "prompt")
    return {key: [row.get(key) for row in rows for _ in range(repeat)] for key in keys}


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    weights: Sequence[float] | None,
    prompts: list[Any],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    timeout: float | None = None,
    conversations: list[list[dict[str, Any]]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of every reward function per completion: ``(total[N], {name: per_function[N]})``, each
    function under its distinct name (:func:`reward_names`).

    Each function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``
    with one entry per completion. A ``None`` score means "does not apply" and adds nothing, as in TRL;
    a completion that every function scores ``None`` is unscorable and its total is NaN (TRL's rule: it
    is left out of the group's mean and std and trained with advantage 0).
    A call that takes longer than ``timeout`` seconds raises :class:`RewardFunctionError`. ``conversations``
    (multi-turn episodes of chat prompts): what functions imported by path get as completions, TRL's messages.
    """
    from pods.rewards.imported import ImportedReward

    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
    total = torch.zeros(len(completions), dtype=torch.float64)
    per_function: dict[str, torch.Tensor] = {}
    for fn, weight, name in zip(reward_funcs, weights, reward_names(reward_funcs), strict=True):
        try:
            given = (
                conversations if conversations is not None and isinstance(fn, ImportedReward) else completions
            )
            scores = call_with_timeout(
                fn,
                timeout,
                prompts=prompts,
                completions=given,
                completion_ids=completion_ids,
                **columns,
            )
        except RewardTimeout:
            raise RewardFunctionError(
                f"reward function {name!r} did not return within reward_timeout = {timeout:g} s "
                f"(scoring {len(completions)} completions, the first {_excerpt(completions[0]) if completions else ''}); "
                "make it faster, or raise or remove reward_timeout"
            ) from None
        except Exception as error:  # a user's function: report which one, on which sample
            index = _first_failing_sample(fn, prompts, completions, completion_ids, columns)
            where = (
                f"completion {index}: {_excerpt(completions[index])}" if index is not None else "the batch"
            )
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(error).__name__}: {error} (on {where}; "
                f"columns given: {', '.join(sorted(columns)) or 'none'})"
            ) from error
        values = _as_scores(name, scores, completions)
        per_function[name] = values
        total += weight * torch.nan_to_num(values, nan=0.0)
    unscorable = torch.stack(list(per_function.values())).isnan().all(dim=0)
    return total.masked_fill(unscorable, float("nan")), per_function


class RewardTimeout(Exception):
    """A reward function call ran past its time limit."""


def call_with_timeout(fn: Callable[..., Any], timeout: float | None, **kwargs: Any) -> Any:
    """``fn(**kwargs)``, or :class:`RewardTimeout` after ``timeout`` seconds.

    The call runs on a daemon thread that is abandoned (not killed) on timeout: the run ends anyway, and a
    thread stuck in C code that holds the interpreter lock cannot be interrupted by any in-process means.
    """
    if timeout is None:
        return fn(**kwargs)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(**kwargs)
        except BaseException as error:  # handed back to the caller's thread below
            outcome["error"] = error

    worker = threading.Thread(target=run, name=f"reward-{reward_name(fn)}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardTimeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _first_failing_sample(
    fn: RewardFunction,
    prompts: list[Any],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
) -> int | None:
    """Re-run ``fn`` one completion at a time (error path only) to name the sample that breaks it."""
    for index in range(len(completions)):
        try:
            fn(
                prompts=prompts[index : index + 1],
                completions=completions[index : index + 1],
                completion_ids=completion_ids[index : index + 1],
                **{key: values[index : index + 1] for key, values in columns.items()},
            )
        except Exception:
            return index
    return None


def _as_scores(name: str, scores: object, completions: list[str]) -> torch.Tensor:
    if not isinstance(scores, Sequence) or isinstance(scores, str) or len(scores) != len(completions):
        size = len(scores) if isinstance(scores, Sequence) else type(scores).__name__
        raise RewardFunctionError(
            f"reward function {name!r} must return one score per completion ({len(completions)}), got {size}"
        )
    values = []
    for index, score in enumerate(scores):
        if score is None:
            values.append(float("nan"))
            continue
        try:
            value = float(score)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"reward function {name!r} returned {score!r} for completion {index} "
                f"({_excerpt(completions[index])}); scores must be numbers or None"
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value} for completion {index} "
                f"({_excerpt(completions[index])}); return a finite number (or None to skip)"
            )
        values.append(value)
    return torch.tensor(values, dtype=torch.float64)


def _excerpt(text: str, limit: int = 80) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")
