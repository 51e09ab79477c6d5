"""How tool calls look in the model's text, and how answers go back, as token ids.

Two formats:

- ``chat_template`` (TRL's shape): the tools are rendered into the prompt by the tokenizer's chat template; a
  model turn ends at EOS; its calls are read by the tokenizer's own ``parse_response`` where it has a response
  template (transformers >= 5), else from Hermes-style ``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen3 and
  most open models); answers are the chat template's tool messages, as the template renders them after a call.
- ``text`` (pods' own, for base models without a chat template, the embedded ``products`` task's): the model
  writes ``<call>name(arguments)</call>``, its turn ends there, and the answer ``<result>text</result>`` follows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from pods.agents.tools import ToolAnswer, ToolCall
from pods.errors import ConfigError

__all__ = [
    "TOOL_FORMATS",
    "AutoFormat",
    "ChatTemplateFormat",
    "TextFormat",
    "ToolFormat",
    "Turn",
    "make_format",
]

TOOL_FORMATS = ("auto", "chat_template", "text")


class ToolFormat(Protocol):
    """What the multi-turn engine needs to know of a tool-call format."""

    stop_strings: tuple[str, ...]  # strings that end a model turn (besides EOS)

    def render(self, prompt: Any, schemas: list[dict[str, Any]]) -> str:
        """The prompt text the model sees first (the tools described where the format does)."""
        ...

    def read_turn(self, turn_ids: list[int], context_ids: list[int]) -> Turn:
        """One model turn (its token ids, after ``context_ids``): its calls (none ends the episode) and its message."""
        ...

    def answer_ids(self, answers: list[ToolAnswer]) -> list[int]:
        """The tokens that follow a turn's calls: their answers, and whatever opens the model's next turn."""
        ...


@dataclass(frozen=True)
class Turn:
    """A model turn as a format reads it: the tool calls it makes, and the turn as a chat message in TRL's shape
    (``content``, ``tool_calls``), what rewards get as completions of chat prompts; None for text episodes."""

    calls: list[ToolCall]
    message: dict[str, Any] | None = None


class TextFormat:
    """``<call>name(arguments)</call>`` then ``<result>text</result>``: a format small models learn in minutes."""

    CALL = re.compile(r"<call>(.*?)</call>", re.DOTALL)
    SIGNATURE = re.compile(r"\s*([A-Za-z_]\w*)\s*\((.*)\)\s*", re.DOTALL)
    stop_strings = ("</call>",)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, prompt: Any, schemas: list[dict[str, Any]]) -> str:
        from pods.prompts import render_prompt

        return render_prompt(prompt, self.tokenizer)

    def read_turn(self, turn_ids: list[int], context_ids: list[int]) -> Turn:
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        calls = []
        for body in self.CALL.findall(text):
            match = self.SIGNATURE.fullmatch(body)
            if match is None:
                calls.append(
                    ToolCall("?", {}, f"cannot read the call {body.strip()!r}; write name(arguments)")
                )
            else:
                calls.append(ToolCall(match.group(1), {}, text_arguments=match.group(2).strip()))
        return Turn(calls)  # text prompts: rewards get the episode's text

    def answer_ids(self, answers: list[ToolAnswer]) -> list[int]:
        text = "".join(f"<result>{answer.text}</result>" for answer in answers)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class ChatTemplateFormat:
    """TRL's shape: tools in the chat template, calls parsed as transformers parses them, answers as tool messages."""

    HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    stop_strings: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                "tool_format: chat_template needs a tokenizer with a chat template that renders tools; this one "
                "has none. Set tokenizer.chat_template, or use tool_format: text with a plain prompt"
            )
        self.tokenizer = tokenizer
        self.has_parser = bool(
            getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
        )
        if not self.has_parser and "<tool_call>" not in template:
            raise ConfigError(
                "tool_format: chat_template: the tokenizer has no response template (transformers' "
                "parse_response) and its chat template does not write <tool_call> blocks, so the model's tool "
                "calls cannot be read; set tokenizer.response_template (TRL's add_response_schema does it for "
                "known models)"
            )
        self._call_turns: dict[str, list[int]] = {}  # tool name -> a call turn's tokens up to its EOS

    def render(self, prompt: Any, schemas: list[dict[str, Any]]) -> str:
        if not isinstance(prompt, list):
            raise ConfigError(
                "tool_format: chat_template renders the tools into chat prompts, but this prompt is text; use "
                "prompt_style: chat (or conversational data), or tool_format: text"
            )
        return self.tokenizer.apply_chat_template(
            prompt, tools=schemas or None, add_generation_prompt=True, tokenize=False
        )

    def read_turn(self, turn_ids: list[int], context_ids: list[int]) -> Turn:
        """The turn as TRL reads it: the tokenizer's own ``parse_response`` where it has a response template, else
        the calls in its ``<tool_call>`` blocks and the text outside them."""
        if self.has_parser:
            message = dict(self.tokenizer.parse_response(turn_ids, prefix=context_ids))
            message.setdefault("role", "assistant")
            return Turn([_message_call(call) for call in (message.get("tool_calls") or [])], message)
        calls = []
        for body in self.HERMES.findall(self.tokenizer.decode(turn_ids, skip_special_tokens=False)):
            try:
                call = json.loads(body)
            except json.JSONDecodeError as error:
                calls.append(ToolCall("?", {}, f"the tool call is not valid JSON ({error.msg})"))
                continue
            calls.append(_message_call({"function": call} if isinstance(call, dict) else call))
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": self.HERMES.sub("", text).strip()}
        readable = [c for c in calls if c.invalid is None]
        if readable:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in readable
            ]
        return Turn(calls, message)

    def answer_ids(self, answers: list[ToolAnswer]) -> list[int]:
        """The tokens the chat template writes after an assistant turn with calls for these tool messages (the
        difference of two renderings, cut after the turn's EOS, as TRL computes it)."""
        messages = [{"role": "tool", "name": a.name, "content": a.text} for a in answers]
        call = {"type": "function", "function": {"name": answers[0].name, "arguments": {}}}
        turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        render = self.tokenizer.apply_chat_template
        if answers[0].name not in self._call_turns:  # the same for every answer of that tool: render it once
            before = list(render(turn, add_generation_prompt=False, tokenize=True, return_dict=False))
            eos = [i for i, token in enumerate(before) if token == self.tokenizer.eos_token_id]
            self._call_turns[answers[0].name] = before[: eos[-1] + 1] if eos else before
        before = self._call_turns[answers[0].name]
        after = list(render(turn + messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        if after[: len(before)] != before:
            raise ConfigError(
                "tool_format: chat_template: the chat template renders an assistant turn differently once tool "
                "messages follow it, so the tool answers' tokens cannot be appended to what the model wrote"
            )
        return after[len(before) :]


def _message_call(call: Any) -> ToolCall:
    """A ToolCall from a parsed message's ``{"type": "function", "function": {"name", "arguments"}}``."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return ToolCall("?", {}, f"cannot read the tool call {call!r}: it needs a name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(function["name"], {}, f"the arguments are not valid JSON ({error.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(function["name"], {}, f"the arguments must be an object, got {arguments!r}")
    return ToolCall(function["name"], arguments)


class AutoFormat:
    """``auto``: ``chat_template`` for chat prompts (lists of messages), ``text`` for text prompts, chosen by the
    prompts themselves (a ``dataset_name`` run's chat prompts are chat whatever its task's prompt style) when the
    first is rendered; :meth:`render` comes first in an episode, so the other methods go to the chosen format."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chosen: ToolFormat | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return () if self.chosen is None else self.chosen.stop_strings

    def render(self, prompt: Any, schemas: list[dict[str, Any]]) -> str:
        kind = ChatTemplateFormat if isinstance(prompt, list) else TextFormat
        if self.chosen is None:
            self.chosen = kind(self.tokenizer)
        elif not isinstance(self.chosen, kind):
            raise ConfigError(
                "tool_format: auto: the prompts mix chat messages and text, so no one call format fits them; "
                "make them all one kind, or set tool_format"
            )
        return self.chosen.render(prompt, schemas)

    def read_turn(self, turn_ids: list[int], context_ids: list[int]) -> Turn:
        assert self.chosen is not None, "render a prompt first"
        return self.chosen.read_turn(turn_ids, context_ids)

    def answer_ids(self, answers: list[ToolAnswer]) -> list[int]:
        assert self.chosen is not None, "render a prompt first"
        return self.chosen.answer_ids(answers)


def make_format(name: str, tokenizer: Any, prompt_style: str) -> ToolFormat:
    """The format called ``name``; ``auto`` is ``chat_template`` for chat prompts and ``text`` otherwise, by the
    prompts (:class:`AutoFormat`; ``prompt_style`` is the task's, which a ``dataset_name`` run's prompts need not
    follow)."""
    if name not in TOOL_FORMATS:
        raise ConfigError(f"tool_format: unknown value {name!r}; choose one of {', '.join(TOOL_FORMATS)}")
    if name == "auto":
        return AutoFormat(tokenizer)
    return ChatTemplateFormat(tokenizer) if name == "chat_template" else TextFormat(tokenizer)
