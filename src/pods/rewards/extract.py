"""Answer extraction: the views of a completion under which the paper accepts an answer.

Every function here is linear in the length of the text (plain ``str.find``/``rfind`` scans and
regular expressions without nested quantifiers), so arbitrarily long or hostile text cannot make
them slow, and none of them raises on any ``str`` input.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "answer_block",
    "answer_views",
    "completion_text",
    "extract_answer",
    "find_boxed",
    "hash_answer",
    "last_number",
]

# Only the tail of a completion is searched for the "last number" view: the answer is at the end, and a
# cap keeps the Python-level work bounded for megabyte-long junk.
LAST_NUMBER_WINDOW = 10_000
# A boxed answer longer than this is not an answer; the cap bounds the brace-matching loop.
BOXED_MAX_CHARS = 10_000
# A text this short is also compared as a whole (the paper's "whole text" view).
WHOLE_TEXT_MAX_CHARS = 200

# A number: optional sign, digits with optional thousands separators, optional decimals, optional
# "/denominator"; or a LaTeX \frac{a}{b}. Not preceded by a letter, digit or dot ("x2", "1.2.3").
NUMBER_PATTERN = re.compile(
    r"(?P<frac>[-\u2212]?\\[dt]?frac\s*\{\s*(?P<fn>[-\u2212]?\d+(?:\.\d+)?)\s*\}\s*\{\s*(?P<fd>\d+(?:\.\d+)?)\s*\}"
    r"|[-\u2212]?\\[dt]?frac(?P<fn1>\d)(?P<fd1>\d))"
    r"|(?<![\w.])(?P<num>[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-\u2212]?\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+)(?![\d.]))?"
)


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or a TRL conversational completion (list of messages).

    Anything else (None, bytes, numbers, malformed messages) is turned into text without raising.
    """
    try:
        if isinstance(completion, str):
            return completion
        if isinstance(completion, bytes | bytearray):
            return bytes(completion).decode("utf-8", errors="replace")
        if isinstance(completion, dict):  # a message, or a content part {"type": "text", "text": ...}
            return completion_text(completion.get("content", completion.get("text", "")))
        if isinstance(completion, list | tuple):
            # A conversation: the assistant's messages, in order (usually exactly one).
            parts = [
                m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
            ]
            return "\n".join(completion_text(m) for m in parts)
        if completion is None:
            return ""
        return str(completion)
    except Exception:  # a hostile __str__ or similar: treat as empty text
        return ""


def find_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    end = len(text)
    for _ in range(8):  # look back over at most a few unbalanced candidates
        start = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if start < 0:
            return None
        i = start + (6 if text.startswith("\\boxed", start) else 5)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, min(len(text), i + BOXED_MAX_CHARS)):
                c = text[j]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
        elif start + 6 < len(text) and text.startswith("\\boxed ", start):
            token = text[start + 7 :].split(maxsplit=1)
            if token:
                return token[0].rstrip(".$")
        end = start
    return None


def answer_block(text: str) -> str | None:
    """Content of the last ``<answer> ... </answer>`` block; an unclosed last block runs to the end."""
    open_at = text.rfind("<answer>")
    if open_at < 0:
        return None
    close_at = text.find("</answer>", open_at)
    content = text[open_at + len("<answer>") : close_at if close_at >= 0 else len(text)]
    return content.strip()


def hash_answer(text: str) -> str | None:
    """What follows the last ``####`` on its line (GSM8K's final-answer marker), else None."""
    at = text.rfind("####")
    if at < 0:
        return None
    line = text[at + 4 :].split("\n", 1)[0].strip()
    return line or None


def last_number(text: str) -> str | None:
    """The last number in the text (searched in its last ``LAST_NUMBER_WINDOW`` characters), else None."""
    window = text[-LAST_NUMBER_WINDOW:]
    found = None
    for found in NUMBER_PATTERN.finditer(window):  # noqa: B007 (we want the last match)
        pass
    return found.group(0) if found is not None else None


def answer_views(text: str) -> list[str]:
    """Candidate answers, most explicit first: ``<answer>`` block, ``####`` line, ``\\boxed{}``, last
    number, and the whole text when it is short."""
    views = [answer_block(text), hash_answer(text), find_boxed(text), last_number(text)]
    if len(text) <= WHOLE_TEXT_MAX_CHARS:
        views.append(text.strip())
    return [v for v in views if v]


def extract_answer(text: str) -> str | None:
    """The model's final answer: the first of the views above that is present, else None."""
    views = answer_views(completion_text(text))
    return views[0] if views else None
