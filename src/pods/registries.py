"""The names a configuration refers to that live in registries (selection rules, reward functions, tasks),
checked against those registries. Kept out of :mod:`pods.config`, which stays free of the registries' imports
(and of the import cycle config -> data -> config)."""

from __future__ import annotations

from pods.config import TrainConfig, require_choice
from pods.data import available_tasks
from pods.rewards import REWARD_FUNCTIONS
from pods.rewards.imported import is_builtin_name
from pods.selection import available_rules


def check_names(config: TrainConfig) -> None:
    """Raise ``ConfigError`` for a selection rule, reward function or task name that no registry knows (reward
    functions by import path are checked when they are imported)."""
    require_choice(config.selection_rule, tuple(available_rules()), "selection_rule")
    for name in config.reward_funcs or ():
        if is_builtin_name(name):
            require_choice(name, tuple(REWARD_FUNCTIONS), "reward_funcs")
    if config.dataset_name is not None:
        return  # your own data replaces the task
    require_choice(config.task, tuple(available_tasks()), "task")
    if config.eval_task is not None:
        require_choice(config.eval_task, tuple(available_tasks()), "eval_task")
