"""The paper's format and tag rewards (DESIGN.md section 2), small bonuses added to accuracy.

- ``format_reward``: 0.1 x max(0, 1 - 0.01 x characters outside the ``<think>...</think>
  <answer>...</answer>`` block). Without such a block (the four tags in that order) it is 0.
  Whitespace does not count as a character outside the block.
- ``tag_reward``: 0.025 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` that
  appears exactly once (0.1 in all).

Both are plain ``str.find``/``str.count`` scans: linear time, and they never raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pods.rewards.extract import completion_text

__all__ = ["TAGS", "format_reward", "format_score", "tag_reward", "tag_score"]

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
FORMAT_WEIGHT = 0.1
FORMAT_PENALTY_PER_CHAR = 0.01
TAG_WEIGHT = 0.1


def _visible_chars(text: str) -> int:
    return len(text) - sum(text.count(c) for c in " \t\n\r")


def format_score(text: str) -> float:
    """Format reward of one completion text (see the module docstring)."""
    think = text.find("<think>")
    think_end = text.find("</think>", think) if think >= 0 else -1
    ans = text.find("<answer>", think_end) if think_end >= 0 else -1
    ans_end = text.find("</answer>", ans) if ans >= 0 else -1
    if ans_end < 0:
        return 0.0
    outside = text[:think] + text[think_end + len("</think>") : ans] + text[ans_end + len("</answer>") :]
    return FORMAT_WEIGHT * max(0.0, 1.0 - FORMAT_PENALTY_PER_CHAR * _visible_chars(outside))


def tag_score(text: str) -> float:
    """Tag reward of one completion text: a quarter of 0.1 per tag that appears exactly once."""
    return TAG_WEIGHT * sum(0.25 for tag in TAGS if text.count(tag) == 1)


def format_reward(
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float]:
    """Paper's format reward, 0 to 0.1 per completion (TRL reward signature)."""
    return [format_score(completion_text(c)) for c in completions]


def tag_reward(
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float]:
    """Paper's tag-count reward, 0 to 0.1 per completion (TRL reward signature)."""
    return [tag_score(completion_text(c)) for c in completions]
