"""MATH accuracy through Hugging Face ``math-verify`` (the optional extra ``pods[math]``).

math-verify parses LaTeX into sympy and compares symbolically. It is run in a child process
(:class:`pods.rewards.timeouts.WorkerProcess`) so that its time limit holds on any thread and in any
worker process: a completion gets at most ``MATH_VERIFY_TIMEOUT_S`` seconds (default 5), after which
it scores 0.0 and the child is replaced. Starting the child (about 1 to 2 s, once per process and
after a kill) is bounded separately by the worker's start-up limit. A fast path first tries the
numeric/textual comparison of :func:`pods.rewards.answers_match`, which needs no child at all.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from typing import Any

from pods.errors import ConfigError
from pods.rewards.extract import answer_block, answer_views, completion_text
from pods.rewards.numeric import answers_match, gold_column
from pods.rewards.timeouts import WorkerProcess, WorkerTimeout

__all__ = [
    "MATH_VERIFY_TIMEOUT_S",
    "math_accuracy_reward",
    "math_answers_match",
    "require_math_verify",
    "verify_with_math_verify",
]

MATH_VERIFY_TIMEOUT_S = 5.0
# Only the end of a long completion is sent to math-verify (the final answer is there).
TAIL_CHARS = 4_000
BLOCK_CHARS = 2_000

_worker: WorkerProcess | None = None
_worker_lock = threading.Lock()


class MissingDependencyError(ConfigError, ImportError):
    """An optional dependency the configuration needs is not installed; the message says how to install it."""


def require_math_verify() -> None:
    """Raise an error (a ConfigError and an ImportError) that says how to install math-verify when missing."""
    if importlib.util.find_spec("math_verify") is None:
        raise MissingDependencyError(
            "math_accuracy_reward needs the optional dependency math-verify: pip install 'pods[math]' "
            "(or use accuracy_reward, which needs nothing extra, for numeric answers)."
        )


def math_answers_match(text: str, gold: str, timeout: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """True when the completion ``text`` states ``gold`` (LaTeX): first by the fast numeric/textual
    comparison, then by math-verify. Never raises, except ImportError when math-verify is missing."""
    if any(answers_match(view, gold) for view in answer_views(text)):
        return True
    return verify_with_math_verify(text, gold, timeout)


def verify_with_math_verify(text: str, gold: str, timeout: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """math-verify alone, in the child process: the ``<answer>`` block or the end of ``text`` against
    ``gold``; False past ``timeout`` seconds. Never raises, except ImportError when it is missing."""
    global _worker
    require_math_verify()
    candidates = [text[-TAIL_CHARS:]]
    block = answer_block(text)
    if block:
        block = block[-BLOCK_CHARS:]
        # math-verify finds LaTeX inside $...$ or \boxed{}; a bare block gets the dollars it needs.
        candidates.insert(0, block if "$" in block or "\\boxed" in block else f"${block}$")
    with _worker_lock:
        if _worker is None:
            _worker = WorkerProcess("pods.rewards._math_worker")
    try:
        reply = _worker.call({"gold": str(gold)[-BLOCK_CHARS:], "candidates": candidates}, timeout=timeout)
    except (WorkerTimeout, RuntimeError, ValueError):
        return False
    return bool(reply.get("match", False))


def math_accuracy_reward(
    prompts: Sequence[Any] | None,
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None = None,
    *,
    answer: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float]:
    """1.0 when the completion's final answer is mathematically equal to the gold ``answer`` (LaTeX),
    checked by math-verify with a hard time limit per completion, else 0.0 (TRL reward signature)."""
    require_math_verify()
    golds = gold_column(answer, len(completions), "math_accuracy_reward")
    return [
        1.0 if math_answers_match(completion_text(c), gold) else 0.0
        for c, gold in zip(completions, golds, strict=True)
    ]
