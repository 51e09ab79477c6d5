"""Tools in TRL's shape: plain callables (type hints and a docstring describe them to the model) and environments
(one instance per rollout, ``reset(**row)``, public methods as tools). Calls run with a time limit; whatever goes
wrong (an unknown tool, bad arguments, an exception, a hang) becomes the tool's answer as text, counted as an error.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pods.errors import ConfigError

__all__ = [
    "EnvironmentReward",
    "ToolAnswer",
    "ToolCall",
    "Toolbox",
    "bind_text_arguments",
    "call_tools",
    "environment_rewards",
    "environment_tools",
    "load_tools",
    "tool_schemas",
]

# what a reward or a tool list never sees as a tool: the environment's protocol, not actions the model takes
ENVIRONMENT_PROTOCOL = ("reset", "get_reward", "close")


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its keyword arguments, or why the text is not a call."""

    name: str
    arguments: dict[str, Any]
    invalid: str | None = None  # why the call could not be read (answered as an error, not run)
    text_arguments: str | None = None  # the text format's arguments, bound to the tool's parameters when run


@dataclass(frozen=True)
class ToolAnswer:
    """What goes back to the model for one call: the result as text, and whether it is an error."""

    name: str
    text: str
    failed: bool


class Toolbox:
    """The tools one rollout may call, by name: the run's tools plus its own environment's public methods."""

    def __init__(self, tools: list[Callable[..., Any]], environment: Any = None) -> None:
        self.environment = environment
        members = [*tools, *(environment_tools(environment) if environment is not None else [])]
        self.tools: dict[str, Callable[..., Any]] = {}
        for tool in members:
            name = tool_name(tool)
            if name in self.tools:
                raise ConfigError(
                    f"tools: two tools are named {name!r}; the model calls tools by name, so give each its own"
                )
            self.tools[name] = tool


def tool_name(tool: Callable[..., Any]) -> str:
    """The name the model calls ``tool`` by (its ``__name__``)."""
    name = getattr(tool, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"tools: {tool!r} has no name the model can call; pass a named function or method")
    return name


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """An environment's public methods (not ``reset``, ``get_reward`` or ``close``), as bound methods: TRL's rule."""
    methods = []
    for name in sorted(dir(type(environment))):
        if name.startswith("_") or name in ENVIRONMENT_PROTOCOL:
            continue
        member = getattr(environment, name, None)
        if inspect.ismethod(member):
            methods.append(member)
    return methods


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, from its type hints and docstring, as chat templates render them
    (transformers' ``get_json_schema``); a tool it cannot describe is named with the fix."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:  # transformers raises its own TypeError subclasses with a clear text
            raise ConfigError(
                f"tools: cannot describe {tool_name(tool)!r} to the model ({error}); give every argument a type "
                "hint and the function a docstring with an Args: section, as transformers' chat templates need"
            ) from None
    return schemas


def load_tools(specs: list[str] | None, key: str = "tools") -> list[Callable[..., Any]]:
    """The callables that ``file.py:function`` / ``module:function`` specs name (as reward functions are named)."""
    from pods.rewards.imported import import_function

    return [import_function(spec, key) for spec in specs or []]


def call_tools(
    toolboxes: list[Toolbox], calls: list[list[ToolCall]], timeout: float | None
) -> list[list[ToolAnswer]]:
    """Run every call of every rollout at once, one thread each, and wait at most ``timeout`` seconds for all
    (None: no limit). A call still running then is answered with a timeout error; its thread is left behind
    (a daemon: Python cannot stop a thread), so a hung tool costs ``timeout`` once per turn, not once per call."""
    slots: list[list[Any]] = [[None] * len(row) for row in calls]
    threads = []
    for row, (toolbox, row_calls) in enumerate(zip(toolboxes, calls, strict=True)):
        for index, call in enumerate(row_calls):
            thread = threading.Thread(
                target=_run_into, args=(slots[row], index, toolbox, call), daemon=True, name="pods-tool"
            )
            thread.start()
            threads.append(thread)
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    answers = []
    for row_calls, row_slots in zip(calls, slots, strict=True):
        row_answers = []
        for call, slot in zip(row_calls, row_slots, strict=True):
            if slot is None:  # still running
                slot = ToolAnswer(call.name, f"error: {call.name} did not answer within {timeout:g} s", True)
            row_answers.append(slot)
        answers.append(row_answers)
    return answers


def _run_into(slots: list[Any], index: int, toolbox: Toolbox, call: ToolCall) -> None:
    slots[index] = run_call(toolbox, call)


def run_call(toolbox: Toolbox, call: ToolCall) -> ToolAnswer:
    """One call's answer: the tool's result as text, or the error text (unreadable call, unknown tool, arguments
    the tool does not take, an exception it raised)."""
    if call.invalid is not None:
        return ToolAnswer(call.name, f"error: {call.invalid}", True)
    tool = toolbox.tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(toolbox.tools)) or "none"
        return ToolAnswer(call.name, f"error: no tool named {call.name!r} (tools: {known})", True)
    arguments = call.arguments
    try:
        if call.text_arguments is not None:
            arguments = bind_text_arguments(tool, call.text_arguments)
        inspect.signature(tool).bind(**arguments)
    except (TypeError, ValueError) as error:
        return ToolAnswer(call.name, f"error: bad arguments for {call.name}: {error}", True)
    try:
        result = tool(**arguments)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
    except Exception as error:  # the tool's failure is the model's information, not the run's
        return ToolAnswer(call.name, f"error: {type(error).__name__}: {error}", True)
    return ToolAnswer(call.name, result if isinstance(result, str) else str(result), False)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class EnvironmentReward:
    """An environment's own reward (TRL: an environment with ``get_reward`` owns it): ``get_reward()`` of each
    episode's environment, a reward function named after the environment's class (it pickles as that name)."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(
        self, prompts: list[Any], completions: list[Any], environments: list[Any] | None = None, **_: Any
    ):
        if environments is None:
            raise ValueError(f"{self.__name__}: the environment's reward needs its environments")
        return [float(environment.get_reward()) for environment in environments]


def environment_rewards(environment_factory: Callable[[], Any] | None) -> list[EnvironmentReward]:
    """``[EnvironmentReward]`` where the factory's environments define ``get_reward`` (one probe instance, as TRL
    checks), else ``[]``."""
    if environment_factory is None:
        return []
    kind = environment_factory if isinstance(environment_factory, type) else type(environment_factory())
    return [EnvironmentReward(kind.__name__)] if callable(getattr(kind, "get_reward", None)) else []


def bind_text_arguments(tool: Callable[..., Any], text: str) -> dict[str, Any]:
    """Keyword arguments for ``tool`` from the text between its parentheses: the whole text for a tool of one
    parameter, else comma-separated values in the parameters' order; ints, floats and bools converted by the type
    hints. Raises ValueError naming what does not fit."""
    parameters = list(inspect.signature(tool).parameters.values())
    if not parameters:
        if text:
            raise ValueError(f"{tool.__name__} takes no arguments, got {text!r}")
        return {}
    values = [text] if len(parameters) == 1 else ([v.strip() for v in text.split(",")] if text else [])
    required = [p for p in parameters if p.default is inspect.Parameter.empty]
    if not len(required) <= len(values) <= len(parameters):
        raise ValueError(f"{tool.__name__} takes {len(parameters)} arguments, got {len(values)}")
    return {p.name: _convert(value, p) for p, value in zip(parameters, values, strict=False)}


def _convert(value: str, parameter: inspect.Parameter) -> Any:
    kind = parameter.annotation
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)  # postponed annotations
    try:
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError
            return value.lower() == "true"
        if kind in (int, float):
            return kind(value)
    except ValueError:
        raise ValueError(f"{parameter.name} must be {kind.__name__}, got {value!r}") from None
    return value
