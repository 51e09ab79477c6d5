"""What a run reads from its configuration besides the model: its reward functions, the function evaluation reports
as accuracy, and the rows of your own dataset (``dataset_name``); the built-in tasks' rows stay with the trainer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pods.config import TrainConfig
from pods.data.common import TaskDataError
from pods.errors import ConfigError

__all__ = [
    "accuracy_function",
    "accuracy_spec",
    "check_reward_columns",
    "dataset_rows",
    "no_held_out_evaluation",
    "reward_functions",
]

CHECKER_NAMES = ("accuracy", "math_accuracy")  # the built-ins that read the answer column


def reward_functions(config: TrainConfig) -> list[Callable[..., Any]]:
    """The run's reward functions, in order: the reward model (TRL's script puts it first), then ``reward_funcs``
    (the task's where unset), each a built-in name, an import path or a model."""
    from pods.data import get_task
    from pods.rewards.imported import resolve_reward

    names = config.reward_funcs or ([] if config.dataset_name else list(get_task(config.task).reward_funcs))
    model_path = config.reward_model_name_or_path
    model = [resolve_reward(model_path, "reward_model_name_or_path")] if model_path else []
    return model + [resolve_reward(name) for name in names]


def accuracy_function(config: TrainConfig, reward_funcs: list[Callable[..., Any]]) -> Callable[..., Any]:
    """``accuracy_reward`` (one of the run's rewards by name, or any spec), else the task's accuracy function, or
    with ``dataset_name`` the first of ``reward_funcs``."""
    from pods.data import get_task
    from pods.rewards.imported import resolve_reward
    from pods.scoring import reward_name, reward_names

    spec = config.accuracy_reward
    if spec is None and config.dataset_name is None:
        return get_task(config.eval_task or config.task).accuracy_function()
    if spec is None:
        spec = config.reward_funcs[0] if config.reward_funcs else config.reward_model_name_or_path
    offset = 1 if config.reward_model_name_or_path else 0
    given_specs = [config.reward_model_name_or_path] * offset + list(config.reward_funcs or [])
    names = reward_names(reward_funcs)  # distinct (a.reward, b.reward) where two share a name
    for index, (fn, name) in enumerate(zip(reward_funcs, names, strict=True)):
        given = given_specs[index] if index < len(given_specs) else None  # the Python API's own: no spec
        if spec in (given, name):
            return fn
    for fn in reward_funcs:  # a shared name (reward for a.py:reward) is the first function of that name
        if spec == reward_name(fn):
            return fn
    return resolve_reward(spec, "accuracy_reward")


def accuracy_spec(config: TrainConfig) -> str | None:
    """``accuracy_reward`` as a spec another command can import: a name of one of ``reward_funcs``
    (``exact`` for ``rewards.py:exact``) becomes that entry; with ``dataset_name`` the default is the first."""
    model = [config.reward_model_name_or_path] if config.reward_model_name_or_path else []
    specs = list(config.reward_funcs or []) + model
    spec = config.accuracy_reward
    if spec is None:
        return specs[0] if config.dataset_name is not None and specs else None
    by_name = {
        s.rpartition(":")[2] if ":" in s else s.rpartition(".")[2]: s for s in specs if not Path(s).is_dir()
    }
    return spec if spec in specs else by_name.get(spec, spec)


def dataset_rows(
    config: TrainConfig, split: str, *, tokenizer: Any, limit: int | None
) -> list[dict[str, Any]]:
    """``split`` of ``dataset_name`` as rows with a ``prompt`` and every column (:mod:`pods.data.user`)."""
    from pods.data.user import load_dataset_rows

    return load_dataset_rows(
        config.dataset_name,
        split,
        config=config.dataset_config,
        prompt_column=config.prompt_column,
        prompt_template=config.prompt_template,
        answer_column=config.answer_column,
        system_prompt=config.system_prompt,
        prompt_style=config.prompt_style,
        tokenizer=tokenizer,
        max_prompt_tokens=config.max_prompt_length,
        limit=limit,
        seed=config.seed,
    )


def no_held_out_evaluation(config: TrainConfig) -> str | None:
    """Why a run on ``dataset_name`` evaluates on nothing held out: the source has no split ``test`` and
    ``dataset_test_split`` was left at it (a single file is the one split ``train``). TRL's script trains on such
    data and evaluates on nothing; a ``dataset_test_split`` set to a split the source lacks stays an error."""
    from pods.data.user import dataset_splits

    default = TrainConfig.__dataclass_fields__["dataset_test_split"].default
    if config.dataset_name is None or config.dataset_test_split != default:
        return None
    splits = dataset_splits(config.dataset_name, config.dataset_config)
    if default in splits:
        return None
    return (
        f"no held-out evaluation: dataset_name {config.dataset_name!r} has no split {default!r} (it has "
        f"{', '.join(splits)}); set dataset_test_split, or add a {default}.jsonl beside a train.jsonl in a folder"
    )


def check_reward_columns(
    reward_funcs: list[Callable[..., Any]], rows: list[dict[str, Any]], what: str, extra: tuple[str, ...] = ()
) -> None:
    """Before training: the built-in checkers need an ``answer`` column, and a function without ``**kwargs`` must
    name every column it receives (each row's columns reach every reward function as keywords)."""
    from pods.rewards import REWARD_FUNCTIONS
    from pods.rewards.imported import ImportedReward
    from pods.scoring import reward_name

    if not rows:
        raise TaskDataError(f"{what} has no rows (after dropping prompts over max_prompt_length tokens)")
    columns = sorted({key for row in rows for key in row} - {"prompt"})  # any row's reaches every reward
    checkers = {REWARD_FUNCTIONS[name] for name in CHECKER_NAMES}
    for fn in reward_funcs:
        if fn in checkers and "answer" not in columns:
            raise ConfigError(
                f"reward {reward_name(fn)!r} reads the gold answer from an 'answer' column, which {what} lacks "
                f"(columns: {', '.join(columns)}); set answer_column to the column that holds it"
            )
        target = fn.function if isinstance(fn, ImportedReward) else fn
        try:
            parameters = inspect.signature(target).parameters
        except (TypeError, ValueError):  # no signature to read: its call will tell
            continue
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            continue
        passed = ("prompts", "completions", "completion_ids", *extra, *columns)  # extra: environments
        missing = [c for c in passed if c not in parameters]
        if missing:
            raise ConfigError(
                f"reward function {reward_name(fn)!r} does not accept {', '.join(missing)}; every reward is called "
                "as fn(prompts, completions, completion_ids, **columns): add **kwargs to its parameters"
            )
