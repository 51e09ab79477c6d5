"""A task is one object: where its rows come from, how its prompt reads, how completions are rewarded
during training and how accuracy is judged at evaluation (as nanochat's tasks do)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pods.data.common import TaskDataError, finish_rows

__all__ = ["Task"]

Reader = Callable[..., Any]
"""``read(split, *, source=None, seed=0, **options) -> rows``: dicts with at least ``question`` and
``answer`` (a list, a ``datasets.Dataset`` or a generator, read only as far as a ``limit`` needs);
``source`` and ``seed`` are passed only if accepted."""


@dataclass(frozen=True)
class Task:
    """A task: its reader, its prompt, its training rewards and its accuracy function."""

    name: str
    read: Reader
    reward_funcs: tuple[str, ...] = ("accuracy", "format", "tag")  # names in pods.rewards.REWARD_FUNCTIONS
    accuracy: str = "accuracy"  # the reward function that judges correctness at evaluation
    prompt_style: str = "chat"  # chat, plain or raw, when the run does not choose
    plain_template: str | None = None  # the plain-style prompt (default: pods.prompts.DEFAULT_PLAIN_TEMPLATE)
    max_new_tokens: int = 512  # completion budget at evaluation, when the run does not choose
    tools: tuple[str, ...] = ()  # import paths of the tools its episodes call, when the run names none

    def load(
        self,
        split: str = "train",
        *,
        source: str | None = None,
        prompt_style: str | None = None,
        tokenizer: Any = None,
        max_prompt_tokens: int | None = None,
        limit: int | None = None,
        seed: int = 0,
        shuffle: bool = False,
        system_prompt: str | None = None,
        template: str | None = None,
        **options: Any,
    ) -> Any:
        """``split`` as a ``datasets.Dataset`` with a ``prompt`` column; ``options`` go to the reader.

        ``limit`` keeps the first N rows after dropping prompts longer than ``max_prompt_tokens`` tokens
        (counted with ``tokenizer``); ``shuffle`` shuffles them first, by ``seed``.
        """
        parameters = inspect.signature(self.read).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        unknown = sorted(set(options) - set(parameters)) if not takes_any else []
        if unknown:
            own = set(inspect.signature(Task.load).parameters) - {"self", "options"}
            accepted = sorted(own | set(parameters) - {"kwargs"})
            raise TaskDataError(
                f"task {self.name!r} does not accept option(s) {unknown}; it accepts {accepted}."
            )
        if source is not None:
            if "source" not in parameters and not takes_any:
                raise TaskDataError(
                    f"task {self.name!r} is generated, not read from a file or the Hub; drop source={source!r}."
                )
            options["source"] = source
        if "seed" in parameters or takes_any:
            options["seed"] = seed
        rows = (dict(row) for row in self.read(split, **options))  # drawn lazily: a limit stops the reader
        style = prompt_style or self.prompt_style
        return finish_rows(
            rows,
            prompt_style=style,
            tokenizer=tokenizer,
            max_prompt_tokens=max_prompt_tokens,
            limit=limit,
            seed=seed,
            shuffle=shuffle,
            system_prompt=system_prompt,
            template=template if template is not None or style != "plain" else self.plain_template,
        )

    def reward_functions(self) -> list[Callable[..., list[float]]]:
        """The training reward functions, looked up by name."""
        from pods.rewards import get_reward_functions

        return get_reward_functions(list(self.reward_funcs))

    def accuracy_function(self) -> Callable[..., list[float]]:
        """The reward function that judges a completion correct (1.0) or not."""
        from pods.rewards import REWARD_FUNCTIONS

        return REWARD_FUNCTIONS[self.accuracy]
