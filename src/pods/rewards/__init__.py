"""Verifiable rewards in TRL's reward-function signature ``f(prompts, completions, completion_ids=None,
**columns) -> list[float]``; the gold answer arrives as the ``answer`` column.

- ``accuracy_reward``: numeric answer match (GSM8K and the synthetic task), 1.0 or 0.0.
- ``math_accuracy_reward``: symbolic match through math-verify (``pip install 'pods[math]'``).
- ``format_reward``, ``tag_reward``: the paper's format bonuses (0 to 0.1 each).

No reward function raises on any completion text or executes it; see each module for its time bound.
"""

from __future__ import annotations

from collections.abc import Callable

from pods.rewards.extract import answer_views, completion_text, extract_answer, find_boxed
from pods.rewards.format import format_reward, tag_reward
from pods.rewards.numeric import accuracy_reward, answers_match, parse_number
from pods.rewards.symbolic import math_accuracy_reward, math_answers_match

__all__ = [
    "REWARD_FUNCTIONS",
    "accuracy_reward",
    "answer_views",
    "answers_match",
    "completion_text",
    "extract_answer",
    "find_boxed",
    "format_reward",
    "get_reward_functions",
    "math_accuracy_reward",
    "math_answers_match",
    "parse_number",
    "tag_reward",
]

RewardFunction = Callable[..., list[float]]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "accuracy": accuracy_reward,
    "math_accuracy": math_accuracy_reward,
    "format": format_reward,
    "tag": tag_reward,
}


def get_reward_functions(names: list[str] | tuple[str, ...]) -> list[RewardFunction]:
    """Look reward functions up by name (``accuracy``, ``math_accuracy``, ``format``, ``tag``, or any
    name added to ``REWARD_FUNCTIONS``)."""
    if isinstance(names, str):
        raise ValueError(f"get_reward_functions takes a list of names, e.g. [{names!r}], not a string.")
    unknown = [n for n in names if n not in REWARD_FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}; known: {sorted(REWARD_FUNCTIONS)}.")
    functions = [REWARD_FUNCTIONS[n] for n in names]
    if math_accuracy_reward in functions:
        from pods.rewards.symbolic import require_math_verify

        require_math_verify()
    return functions
