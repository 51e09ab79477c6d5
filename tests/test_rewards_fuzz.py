"""Fuzzing the reward functions: no exception and a bounded time per completion on any input
(binary junk, 1 MB strings, deeply nested braces, unicode, malformed conversational completions)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pods.rewards import accuracy_reward, format_reward, math_accuracy_reward, tag_reward
from pods.rewards.symbolic import MATH_VERIFY_TIMEOUT_S

# Stated bounds per completion (see the reward modules' docstrings). The cheap rewards are timed in CPU
# seconds of this process (time.process_time), which other processes on a busy machine cannot inflate.
# Measured on the shared 2-core machine at load average 5.4 (the full suite running beside it), over 5
# repeats of every 1 MB input: worst 3.6 ms of CPU (24.8 ms of wall clock), so the 0.5 s bound has a
# margin of 137x (20x even on the wall clock). The math reward runs in a worker process under a
# wall-clock timeout, so it is timed on the wall clock.
CHEAP_BOUND_S = 0.5
MATH_BOUND_S = MATH_VERIFY_TIMEOUT_S + 1.0

CHEAP_REWARDS = [accuracy_reward, format_reward, tag_reward]

MB = 1_000_000
HUGE_TEXTS = {
    "digits": "9" * MB,
    "open_braces": "{" * MB,
    "close_braces": "}" * MB,
    "nested_boxed": "\\boxed{" + "{" * (MB // 2) + "}" * (MB // 2),
    "many_boxed": "\\boxed{" * (MB // 7),
    "many_answer_tags": "<answer>" * (MB // 8),
    "many_hashes": "####" * (MB // 4),
    "thousands": "1," * (MB // 2),
    "minus_signs": "-" * MB,
    "fractions": "\\frac{1}{" * (MB // 9),
    "binary": os.urandom(MB).decode("latin-1"),
    "lone_surrogates": "\udc80" * MB,
    "repeated_format": "<think>1</think><answer>\\boxed{{2}}</answer>#### 3 " * (MB // 45),
    "huge_number_answer": "<answer>" + "7" * MB + "</answer>",
}

FRAGMENTS = [
    "<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "####",
    "$", "\\$", "1,000", "-", "\u2212", "\\frac{", "\\dfrac", "/", ".", "%", "^", "\\sqrt", "\\left(",
    "\\right)", "7", "0", "18", "1e308", "\n", " ", "\x00", "\ufeff", "\U0001f600", "\u0663", "x =",
]  # fmt: skip

texts = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(codec=None, exclude_categories=())),
    st.binary().map(lambda b: b.decode("latin-1")),
    st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join),
)
completions = st.one_of(
    texts,
    st.binary(),
    texts.map(lambda t: [{"role": "assistant", "content": t}]),
    st.lists(
        st.dictionaries(st.sampled_from(["role", "content"]), st.one_of(texts, st.none(), st.integers()))
    ),
    st.none(),
    st.integers(),
)
golds = st.one_of(
    st.sampled_from(["18", "-3", "1000", "\\frac{1}{2}", "\\pi", "(1, 2)"]), st.text(max_size=20)
)


def _timed(fn: Any, completion: Any, gold: str, clock: Any = time.process_time) -> tuple[list[float], float]:
    start = clock()
    scores = fn(["prompt"], [completion], None, answer=[gold])
    return scores, clock() - start


def _check(scores: list[float], seconds: float, bound: float, top: float) -> None:
    assert len(scores) == 1 and isinstance(scores[0], float)
    assert 0.0 <= scores[0] <= top
    assert seconds < bound, f"{seconds:.3f} s is over the stated bound of {bound} s"


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=completions, gold=golds)
def test_cheap_rewards_never_raise_and_stay_fast(completion: Any, gold: str) -> None:
    for fn in CHEAP_REWARDS:
        scores, seconds = _timed(fn, completion, gold)
        _check(scores, seconds, CHEAP_BOUND_S, 1.0)


@pytest.mark.parametrize("name", sorted(HUGE_TEXTS))
def test_cheap_rewards_on_megabyte_inputs(name: str) -> None:
    for fn in CHEAP_REWARDS:
        scores, seconds = _timed(fn, HUGE_TEXTS[name], "7")
        _check(scores, seconds, CHEAP_BOUND_S, 1.0)


@pytest.fixture(scope="module")
def math_worker_started() -> None:
    pytest.importorskip("math_verify")
    assert math_accuracy_reward(None, ["\\boxed{1}"], answer=["2"]) == [0.0]  # start the child untimed


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=completions, gold=golds)
def test_math_reward_never_raises_and_respects_its_time_bound(
    math_worker_started: None, completion: Any, gold: str
) -> None:
    scores, seconds = _timed(math_accuracy_reward, completion, gold, clock=time.perf_counter)
    _check(scores, seconds, MATH_BOUND_S, 1.0)


def test_math_reward_on_megabyte_inputs(math_worker_started: None) -> None:
    for name, text in HUGE_TEXTS.items():
        gold = "7" if name != "huge_number_answer" else "8"
        scores, seconds = _timed(math_accuracy_reward, text, gold, clock=time.perf_counter)
        _check(scores, seconds, MATH_BOUND_S, 1.0)
