"""Numeric answer equivalence and the GSM8K-style accuracy reward.

Numbers are compared exactly as rationals (``fractions.Fraction``), so ``18.00`` = ``18``,
``0.5`` = ``1/2`` = ``\\frac{1}{2}``, and ``1,000`` = ``1000``; ``$``, ``%`` and units around the
number are ignored. Time per completion is linear in its length and bounded by the extraction caps
in :mod:`pods.rewards.extract` (measured: well under 50 ms for a 1 MB completion on one CPU core).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from pods.rewards.extract import NUMBER_PATTERN, answer_views, completion_text

__all__ = ["accuracy_reward", "answers_match", "gold_column", "normalize_text", "parse_number"]

# Longer digit strings are not answers (and would make int() slow or raise on CPython's digit limit).
MAX_DIGITS = 100
# Longer predicted strings are cut to their last characters before being parsed.
MAX_ANSWER_CHARS = 2_000

_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\\displaystyle|\$|\s+")


def _to_fraction(number: str) -> Fraction | None:
    if len(number) > MAX_DIGITS:
        return None
    try:
        return Fraction(number.replace(",", "").replace("\u2212", "-"))
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str) -> Fraction | None:
    """The value of the last number in ``text`` (integers, decimals, ``a/b``, ``\\frac{a}{b}``,
    thousands separators, signs), or None when there is none."""
    text = text[-MAX_ANSWER_CHARS:].replace("{,}", ",")
    match = None
    for match in NUMBER_PATTERN.finditer(text):  # noqa: B007 (we want the last match)
        pass
    if match is None:
        return None
    if match.group("frac") is not None:
        numerator = match.group("fn") or match.group("fn1")
        denominator = match.group("fd") or match.group("fd1")
        value, den = _to_fraction(numerator), _to_fraction(denominator)
        sign = -1 if match.group(0).lstrip()[0] in "-\u2212" else 1
        if value is None or not den:
            return None
        return sign * value / den
    value = _to_fraction(match.group("num"))
    if value is None:
        return None
    if match.group("den") is not None:
        den = _to_fraction(match.group("den"))
        if not den:
            return None
        value /= den
    return value


def normalize_text(text: str) -> str:
    """A canonical string form for non-numeric answers: no spaces, ``$`` or sizing commands."""
    text = text[-MAX_ANSWER_CHARS:]
    text = _LATEX_NOISE.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    return text.rstrip(".")


def answers_match(predicted: str | None, gold: str) -> bool:
    """True when ``predicted`` equals ``gold``: numerically when gold is a number, else as
    normalised text. Never raises."""
    try:
        if predicted is None or not isinstance(predicted, str):
            return False
        gold = str(gold)
        gold_value = parse_number(gold)
        if gold_value is not None and NUMBER_PATTERN.sub("", normalize_text(gold)).strip("\\%") == "":
            return parse_number(predicted) == gold_value
        return normalize_text(predicted) == normalize_text(gold) != ""
    except Exception:  # defensive: a reward must never raise on model text
        return False


def gold_column(answer: Any, count: int, reward_name: str) -> list[str]:
    """Validate the ``answer`` column a reward function receives: one gold answer per completion."""
    if answer is None:
        raise ValueError(
            f"{reward_name} needs the gold answers as the 'answer' column (keyword argument answer=[...]); "
            "load the data with pods.data.load_task or add an 'answer' column to your dataset."
        )
    if isinstance(answer, str) or len(answer) != count:
        raise ValueError(
            f"{reward_name}: 'answer' must be a list with one gold answer per completion "
            f"({count} completions), got {type(answer).__name__} of length {len(answer)}."
        )
    return [str(a) for a in answer]


def accuracy_reward(
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None = None,
    *,
    answer: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float]:
    """1.0 when any view of the completion (``<answer>`` block, ``####`` line, ``\\boxed{}``, last
    number, whole text) equals the gold ``answer`` numerically, else 0.0 (TRL reward signature)."""
    golds = gold_column(answer, len(completions), "accuracy_reward")
    rewards = []
    for completion, gold in zip(completions, golds, strict=True):
        views = answer_views(completion_text(completion))
        rewards.append(1.0 if any(answers_match(view, gold) for view in views) else 0.0)
    return rewards
