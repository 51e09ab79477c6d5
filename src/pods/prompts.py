"""Prompts in the paper's format: reason inside ``<think> </think>``, answer inside ``<answer> </answer>``.

Three styles:

- ``"chat"``: a list of messages (system + user) for the tokenizer's chat template (instruct models);
- ``"plain"``: one text, for base models without a chat template;
- ``"raw"``: the question as is.

Templates are filled with ``str.replace`` of ``{question}`` (and ``{system}`` in plain templates), so
questions and templates may contain LaTeX braces freely.
"""

from __future__ import annotations

from typing import Any

from pods.errors import ConfigError

__all__ = ["DEFAULT_PLAIN_TEMPLATE", "PROMPT_STYLES", "THINK_SYSTEM_PROMPT", "make_prompt", "render_prompt"]

THINK_SYSTEM_PROMPT = (
    "A conversation between a user and an assistant. The user asks a question and the assistant solves "
    "it. The assistant first reasons step by step inside <think> </think> tags and then gives the final "
    "answer inside <answer> </answer> tags, for example: <think> reasoning here </think> "
    "<answer> final answer here </answer>"
)

DEFAULT_PLAIN_TEMPLATE = "{system}\n\nUser: {question}\nAssistant:"

PROMPT_STYLES = ("chat", "plain", "raw")


def make_prompt(
    question: str,
    style: str = "chat",
    *,
    system_prompt: str | None = None,
    template: str | None = None,
) -> str | list[dict[str, str]]:
    """Build one prompt: chat messages (``style="chat"``), a plain text, or the raw question.

    ``system_prompt`` defaults to :data:`THINK_SYSTEM_PROMPT`; an empty string drops the system
    message. ``template`` must contain ``{question}``: for ``"chat"`` it shapes the user message, for
    ``"plain"`` the whole text (default :data:`DEFAULT_PLAIN_TEMPLATE`, which also uses ``{system}``).
    """
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; use one of {list(PROMPT_STYLES)}.")
    if not isinstance(question, str):
        raise ValueError(f"the question must be a string, got {type(question).__name__}.")
    if template is not None and "{question}" not in template:
        raise ValueError(f"the prompt template must contain the placeholder {{question}}; got {template!r}.")
    system = THINK_SYSTEM_PROMPT if system_prompt is None else system_prompt
    if style == "raw":
        return question
    if style == "plain":
        text = (template or DEFAULT_PLAIN_TEMPLATE).replace("{system}", system)
        return text.replace("{question}", question).lstrip()
    user = (template or "{question}").replace("{question}", question)
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": user}]


def render_prompt(prompt: str | list[dict[str, str]], tokenizer: Any) -> str:
    """The text the model sees: chat messages through the tokenizer's chat template (with the
    generation prompt), strings unchanged."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ValueError(
            "a prompt must be a string or a list of chat messages like "
            f"[{{'role': 'user', 'content': ...}}]; got {type(prompt).__name__}."
        )
    if tokenizer is None:
        raise ValueError("rendering chat messages needs a tokenizer (one with a chat template).")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"the tokenizer {name!r} has no chat template, so chat prompts cannot be rendered; "
            'use prompt_style="plain" (a text template for base models) or set tokenizer.chat_template.'
        )
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
