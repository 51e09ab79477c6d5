"""The embedded tool task ``products``: products of two 3-digit numbers, which a calculator tool solves.

A ~1M-parameter model cannot multiply 3-digit numbers in its head, but it can learn to call a tool
and copy its answer. A solution either calls the tool or guesses::

     <call>calculator(347 * 589)</call><result>204383</result> #### 204383    (the tool's part: <result>...</result>)
     347 * 589 = 204383 #### 204383                                           (a guess, written as if computed)

The model's turn ends at :data:`STOP` (``</call>``); the engine then appends the tool's answer
(:data:`RESULT_TEMPLATE`) as tokens the model did not choose, and the model writes the final answer.
The supervised data of the shipped base model (``tool-base``) call the tool in only part of the
solutions, so greedy decoding guesses (and is wrong) while sampling sometimes calls the tool (and is
then right): RL with a correctness reward has the tool-calling share to raise.

Everything here is a pure function of its arguments; randomness comes from a ``random.Random`` seeded
per call. The train/test split is decided by a hash of the question text (as in :mod:`pods.data.arith`),
so the splits are disjoint.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pods.data.arith import PROMPT_TEMPLATE, format_prompt, split_of
from pods.data.task import Task

LOW, HIGH = 100, 999  # both factors are drawn uniformly from [LOW, HIGH]
QUESTION_TEMPLATE = "What is {a} * {b} ?"
CALL_TEMPLATE = " <call>calculator({expression})</call>"
RESULT_TEMPLATE = "<result>{result}</result>"
GUESS_TEMPLATE = " {expression} = {answer}"
ANSWER_TEMPLATE = " #### {answer}"
STOP = "</call>"
"""The stop string that ends the model's turn when it calls the tool; the engine then runs the call."""
TEMPLATES = (
    PROMPT_TEMPLATE,
    QUESTION_TEMPLATE,
    CALL_TEMPLATE,
    RESULT_TEMPLATE,
    GUESS_TEMPLATE,
    ANSWER_TEMPLATE,
)
"""Every fixed text of the task's prompts and solutions (fields in braces), for its tokenizer."""
OPERATORS = ("+", "-", "*")
MAX_EXPRESSION_CHARS = 64
DEFAULT_SIZES = {"train": 20_000, "test": 1_000}
MAX_NEW_TOKENS = 40
"""Completion budget: the longest tool-calling solution is 37 tokens with the tool's 13 (6-digit product),
plus eos (tests/test_products_task.py counts them)."""

_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*])|(\S))")


@dataclass(frozen=True)
class Problem:
    """Two factors; the question, the expression the tool is called with and the answer follow from them."""

    a: int
    b: int

    @property
    def expression(self) -> str:
        """``"a * b"``: the calculator's argument, and the left side of a guess."""
        return f"{self.a} * {self.b}"

    @property
    def question(self) -> str:
        return QUESTION_TEMPLATE.format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a * self.b


def calculator(expression: str) -> str:
    """Evaluates an integer expression such as "347 * 589" or "12 + 3 * 4 - 5".

    Only non-negative integers joined by +, - and * are accepted, with * binding tighter; the text is
    parsed, never executed.

    Args:
        expression: Integers joined by the operators +, - or * (at most 64 characters).

    Returns:
        The value of the expression, as a decimal integer.

    Raises:
        ValueError: If the expression is empty, too long, or anything but integers and operators.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"the expression is too long: {len(expression)} characters, at most {MAX_EXPRESSION_CHARS}"
        )
    tokens = _tokens(expression)
    if not tokens:
        raise ValueError("the expression is empty: give integers joined by +, - or *")
    return str(_value(tokens))


def _tokens(expression: str) -> list[str]:
    """The expression's integers and operators, in order; ValueError at the first other character."""
    tokens = []
    for match in _TOKEN.finditer(expression):
        number, operator, other = match.groups()
        if other is not None:
            raise ValueError(
                f"unexpected character {other!r} at position {match.start(3)}: only integers and +, - or * are allowed"
            )
        tokens.append(number or operator)
    return tokens


def _value(tokens: list[str]) -> int:
    """The value of ``number (operator number)*``, products first; ValueError on any other order."""
    for i, token in enumerate(tokens):
        expected_number = i % 2 == 0
        if expected_number == (token in OPERATORS):
            want = "an integer" if expected_number else "an operator"
            raise ValueError(f"expected {want} at token {i + 1} of the expression, got {token!r}")
    if len(tokens) % 2 == 0:
        raise ValueError(
            f"the expression ends with the operator {tokens[-1]!r}: expected an integer after it"
        )
    total, term = 0, int(tokens[0])
    for operator, number in zip(tokens[1::2], tokens[2::2], strict=True):
        if operator == "*":
            term *= int(number)
        else:
            total, term = total + term, int(number) if operator == "+" else -int(number)
    return total + term


def tool_result(expression: str) -> str:
    """The text the engine appends after a call: ``<result>VALUE</result>``."""
    return RESULT_TEMPLATE.format(result=calculator(expression))


def solution_segments(problem: Problem, *, calls_tool: bool) -> tuple[tuple[str, bool], ...]:
    """The solution as (text, written by the tool) pieces: the call, the tool's result and the answer, or
    a guess and the answer (the true product, written as if computed in the head)."""
    answer = ANSWER_TEMPLATE.format(answer=problem.answer)
    if not calls_tool:
        return (
            (GUESS_TEMPLATE.format(expression=problem.expression, answer=problem.answer) + answer, False),
        )
    call = CALL_TEMPLATE.format(expression=problem.expression)
    return (call, False), (tool_result(problem.expression), True), (answer, False)


def format_solution(problem: Problem, calls_tool: bool) -> str:
    """The worked solution as one text (:func:`solution_segments` joined)."""
    return "".join(text for text, _ in solution_segments(problem, calls_tool=calls_tool))


def generate_problems(num_problems: int, *, seed: int = 0, split: str | None = None) -> list[Problem]:
    """``num_problems`` distinct problems, deterministic by ``seed``, all from ``split`` when given."""
    return list(iter_problems(num_problems, seed=seed, split=split))


def iter_problems(num_problems: int, *, seed: int = 0, split: str | None = None) -> Iterator[Problem]:
    """:func:`generate_problems` one at a time (arguments checked at the call); the first k are the same
    for any ``num_problems >= k``."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    return _problems(num_problems, seed, split)


def _problems(num_problems: int, seed: int, split: str | None) -> Iterator[Problem]:
    rng = random.Random(f"products-{seed}-{split}")
    seen: set[str] = set()
    while len(seen) < num_problems:  # the question space (810,000; ~81,000 in test) dwarfs any request
        problem = Problem(rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))
        if problem.question in seen or (split is not None and split_of(problem.question) != split):
            continue
        seen.add(problem.question)
        yield problem


def supervised_pairs(
    num_problems: int, *, seed: int = 0, tool_share: float = 0.3
) -> list[tuple[str, tuple[tuple[str, bool], ...]]]:
    """(prompt, solution segments) pairs from the train split for supervised pre-training: each solution
    calls the tool with probability ``tool_share``, independently, and guesses otherwise."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must lie in [0, 1], got {tool_share}")
    rng = random.Random(f"products-sft-{seed}")
    return [
        (format_prompt(p.question), solution_segments(p, calls_tool=rng.random() < tool_share))
        for p in generate_problems(num_problems, seed=seed, split="train")
    ]


def read_products(
    split: str = "train", *, seed: int = 0, num_problems: int | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of the ``products`` task, generated as they are read: question, answer (str) and solution (the
    tool-calling one, tool result included). ``num_problems`` defaults to 20,000 (train) / 1,000 (test)."""
    if split not in DEFAULT_SIZES:
        raise ValueError(f"split must be 'train' or 'test' for the products task, got {split!r}")
    count = num_problems if num_problems is not None else DEFAULT_SIZES[split]
    return (
        {"question": p.question, "answer": str(p.answer), "solution": format_solution(p, calls_tool=True)}
        for p in iter_problems(count, seed=seed, split=split)
    )


PRODUCTS_TASK = Task(
    "products",
    read_products,
    reward_funcs=("accuracy",),
    prompt_style="plain",
    plain_template=PROMPT_TEMPLATE,
    max_new_tokens=MAX_NEW_TOKENS,
    tools=("pods.data.products:calculator",),
)
