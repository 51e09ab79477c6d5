"""Prompts: the paper's system message, chat / plain / raw styles, rendering with chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from pods.prompts import DEFAULT_PLAIN_TEMPLATE, THINK_SYSTEM_PROMPT, make_prompt, render_prompt

QUESTION = "What is {x} if $\\frac{x}{2} = 3$?"  # braces must survive templating


def test_a_completion_shaped_like_the_system_prompts_example_earns_the_full_format_rewards() -> None:
    """The prompt and the format rewards must ask for the same thing: its own example scores 0.1 + 0.1."""
    from pods.rewards import format_reward, tag_reward

    example = THINK_SYSTEM_PROMPT.split("for example:")[1].strip()
    assert format_reward(["p"], [example]) == [pytest.approx(0.1)]
    assert tag_reward(["p"], [example]) == [pytest.approx(0.1)]


def test_chat_style_gives_system_and_user_messages() -> None:
    assert make_prompt(QUESTION) == [
        {"role": "system", "content": THINK_SYSTEM_PROMPT},
        {"role": "user", "content": QUESTION},
    ]
    custom = make_prompt(QUESTION, "chat", system_prompt="Be brief.", template="Solve: {question}")
    assert custom == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Solve: " + QUESTION},
    ]
    assert make_prompt(QUESTION, system_prompt="") == [{"role": "user", "content": QUESTION}]


def test_plain_and_raw_styles() -> None:
    plain = make_prompt(QUESTION, "plain")
    assert plain == DEFAULT_PLAIN_TEMPLATE.replace("{system}", THINK_SYSTEM_PROMPT).replace(
        "{question}", QUESTION
    )
    assert plain.endswith("Assistant:") and QUESTION in plain
    assert make_prompt(QUESTION, "plain", template="Q: {question}\nA:") == f"Q: {QUESTION}\nA:"
    assert make_prompt(QUESTION, "raw") == QUESTION


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"style": "fancy"}, "unknown prompt style 'fancy'"),
        ({"style": "plain", "template": "no placeholder"}, r"must contain the placeholder \{question\}"),
    ],
)
def test_bad_prompt_options_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_prompt(QUESTION, **kwargs)


def test_render_prompt_applies_the_chat_template() -> None:
    from pods.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    text = render_prompt(make_prompt("2+2?"), tokenizer)
    assert text == f"<|system|>{THINK_SYSTEM_PROMPT}<|end|><|user|>2+2?<|end|><|assistant|>"
    assert render_prompt("already text", tokenizer) == "already text"


def test_render_prompt_with_the_real_qwen_tokenizer(shared_data: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "qwen2.5")
    text = render_prompt(make_prompt("2+2?"), tokenizer)
    assert text.startswith("<|im_start|>system\n" + THINK_SYSTEM_PROMPT)
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_render_prompt_without_a_chat_template_says_to_use_plain() -> None:
    from pods.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match='prompt_style="plain"'):
        render_prompt(make_prompt("2+2?"), tokenizer)
    with pytest.raises(ValueError, match="string or a list of chat messages"):
        render_prompt({"role": "user"}, tokenizer)  # type: ignore[arg-type]
