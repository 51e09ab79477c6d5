"""Agents: multi-turn rollouts with tools and environments in TRL's shapes (docs/agents.md).

:func:`multi_turn_engine` wraps a run's rollout engine when the run has ``tools`` or an ``environment_factory``;
:func:`sample_rollouts` is how the producer and the evaluation sample with either kind of engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pods.agents.episodes import EPISODE_STATS, Episodes, MultiTurnEngine, sample_rollouts
from pods.agents.formats import TOOL_FORMATS, ChatTemplateFormat, TextFormat, make_format
from pods.agents.tools import (
    EnvironmentReward,
    ToolAnswer,
    Toolbox,
    ToolCall,
    call_tools,
    environment_rewards,
    environment_tools,
    load_tools,
    tool_schemas,
)

__all__ = [
    "EPISODE_STATS",
    "TOOL_FORMATS",
    "ChatTemplateFormat",
    "EnvironmentReward",
    "Episodes",
    "MultiTurnEngine",
    "TextFormat",
    "ToolAnswer",
    "ToolCall",
    "Toolbox",
    "call_tools",
    "environment_rewards",
    "environment_tools",
    "load_environment_factory",
    "load_tools",
    "multi_turn_engine",
    "run_tools",
    "sample_rollouts",
    "tool_schemas",
]


def load_environment_factory(spec: str | None) -> Callable[[], Any] | None:
    """The class (or any callable) that ``file.py:Class`` / ``module:Class`` names, or None."""
    if spec is None:
        return None
    from pods.rewards.imported import import_function

    return import_function(spec, "environment_factory")


def run_tools(config: Any) -> list[str]:
    """The import paths of a run's tools: ``tools``, else its task's own (the embedded ``products`` task's
    calculator); none with ``dataset_name`` unless named."""
    if config.tools is not None or config.dataset_name is not None:
        return list(config.tools or [])
    from pods.data import get_task

    return list(get_task(config.task).tools)


def multi_turn_engine(
    engine: Any,
    config: Any,
    tokenizer: Any,
    prompt_style: str,
    *,
    tools: list[Callable[..., Any]] | None = None,
    environment_factory: Callable[[], Any] | None = None,
) -> Any:
    """``engine`` run turn by turn with the run's tools (``tools`` / ``environment_factory`` given here, else
    the config's import paths); ``engine`` itself for a run without any."""
    tools = list(tools) if tools is not None else load_tools(run_tools(config))
    if environment_factory is None:
        environment_factory = load_environment_factory(config.environment_factory)
    if not tools and environment_factory is None:
        return engine
    return MultiTurnEngine(
        engine,
        make_format(config.tool_format, tokenizer, prompt_style),
        tools=tools,
        environment_factory=environment_factory,
        max_tool_calling_iterations=config.max_tool_calling_iterations,
        tool_timeout=config.tool_timeout,
        max_completion_length=config.max_completion_length,
    )
