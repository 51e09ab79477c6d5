"""The embedded synthetic tasks: grade-school arithmetic word problems, generated on the fly.

Problems are chains of 1 to k steps (+, -, and at higher difficulty x2 / x3) worded in several ways,
with GSM8K-style worked solutions (`` 12 + 7 = 19. 19 - 5 = 14. #### 14``), so the same rewards and
evaluation apply. Some steps carry an optional misconception (:data:`MISREAD_AS`: "gives b to X" written
as an addition, "doubles" / "triples" as adding 2 / 3) used to build the supervised data of the shipped
base models: a model learns a plausible wrong procedure next to the right one, and RL has something to
select. Two tasks are registered (:mod:`pods.data`): ``arith`` (difficulty 1, one possible trap per
problem) and ``arith-hard`` (:data:`HARD_SPEC`: three steps, one to three traps per problem, so that
a sampled solution is rarely right: the sparse-reward regime).

Everything here is a pure function of its arguments; randomness comes from a ``random.Random`` seeded
per call. The train/test split is decided by a hash of the question text, so the splits are disjoint.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pods.data.task import Task

NAMES_SHE = ("Mia", "Ava", "Emma", "Lily", "Zoe", "Nora", "Ruby", "Lucy")
NAMES_HE = ("Sam", "Leo", "Max", "Ben", "Tom", "Jack", "Owen", "Noah")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "pencils", "cards", "shells")

OPENINGS = ("{name} has {a} {items}.", "{name} starts with {a} {items}.", "{name} owns {a} {items}.")
STEP_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{sub} buys {b} more {items}.",
        "{sub} finds {b} more {items}.",
        "{sub} gets {b} {items} from {other}.",
    ),
    "sub": (
        "{sub} loses {b} {items}.",
        "{sub} sells {b} of the {items}.",
        "{sub} uses {b} {items}.",
    ),
    "gives": ("{sub} gives {b} {items} to {other}.", "{sub} gives {b} of the {items} to {other}."),
    "double": ("{sub} doubles the {items}.", "Then the number of {items} doubles."),
    "triple": ("{sub} triples the {items}.", "Then the number of {items} triples."),
}
QUESTIONS = ("How many {items} does {name} have now?", "How many {items} does {name} have in the end?")
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
SYMBOL = {"add": "+", "sub": "-", "gives": "-", "double": "*", "triple": "*"}
FACTOR = {"double": 2, "triple": 3}
MISREAD_AS = {"gives": "add", "double": "add", "triple": "add"}
"""The misconceptions: the kind of step each of these kinds is wrongly written as (``gives 3`` as ``+ 3``,
``doubles`` as ``+ 2``, ``triples`` as ``+ 3``); the rest of the chain then follows the wrong value."""
TEST_PERCENT = 10  # share of the question space (by hash) that belongs to the test split
DEFAULT_SIZES = {"train": 20_000, "test": 1_000}


@dataclass(frozen=True)
class ArithSpec:
    """What problems look like: step count, value range, operations and the share with a "gives" step."""

    min_steps: int = 1
    max_steps: int = 2
    max_value: int = 20  # starting values and operands lie in [2, max_value)
    ops: tuple[str, ...] = ("add", "sub")
    gives_fraction: float = 0.6  # share of problems containing exactly one "gives b to X" step
    max_result: int = 999  # any intermediate value above this is rejected

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.max_value < 4:
            raise ValueError(f"max_value must be at least 4, got {self.max_value}")
        unknown = set(self.ops) - {"add", "sub", "double", "triple"}
        if unknown or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of add, sub, double, triple; got {self.ops}")
        if not 0.0 <= self.gives_fraction <= 1.0:
            raise ValueError(f"gives_fraction must lie in [0, 1], got {self.gives_fraction}")


def spec_for_difficulty(difficulty: int = 1, **overrides: Any) -> ArithSpec:
    """The spec of a difficulty level: 1 = values < 20, 1-2 steps of +/- (the embedded default);
    each level adds a step and widens the values; level 2 and up also doubles and triples."""
    if not isinstance(difficulty, int) or not 1 <= difficulty <= 5:
        raise ValueError(f"difficulty must be an integer from 1 to 5, got {difficulty!r}")
    ops = ("add", "sub") if difficulty == 1 else ("add", "sub", "double", "triple")
    max_value = (20, 50, 100, 100, 100)[difficulty - 1]
    return ArithSpec(max_steps=difficulty + 1, max_value=max_value, ops=ops, **overrides)


HARD_SPEC = ArithSpec(
    min_steps=3,
    max_steps=3,
    max_value=20,
    ops=("add", "sub", "double", "triple"),
    gives_fraction=1.0,
    max_result=99,
)
"""The ``arith-hard`` task: three steps on values below 100 (operands below 20), one "gives" step in
every problem and, among the other two, doublings and triplings; every number fits in two digits, so
the arithmetic stays easy for a 1M-parameter model and the difficulty lies in the traps (:data:`MISREAD_AS`)."""


@dataclass(frozen=True)
class Step:
    """One operation: kind (add, sub, gives, double, triple), its operand, and the true values around it."""

    kind: str
    operand: int
    before: int
    after: int


@dataclass(frozen=True)
class Problem:
    """A word problem with its true answer and the steps of its solution."""

    question: str
    answer: int
    steps: tuple[Step, ...] = field(repr=False)

    @property
    def has_gives(self) -> bool:
        """Whether the problem contains the "gives b to X" step that the misconception targets."""
        return any(step.kind == "gives" for step in self.steps)

    @property
    def traps(self) -> int:
        """How many of its steps have a misconception (:data:`MISREAD_AS`)."""
        return sum(step.kind in MISREAD_AS for step in self.steps)


def _apply(kind: str, value: int, operand: int) -> int:
    if kind == "add":
        return value + operand
    if kind in ("sub", "gives"):
        return value - operand
    return value * operand


def generate_problem(rng: random.Random, spec: ArithSpec = ArithSpec()) -> Problem:
    """Draw one problem from ``spec`` using ``rng`` (rejection-samples chains that go below 0 or too high)."""
    while True:
        n_steps = rng.randint(spec.min_steps, spec.max_steps)
        gives_at = rng.randrange(n_steps) if rng.random() < spec.gives_fraction else -1
        value = rng.randrange(2, spec.max_value)
        steps: list[Step] = []
        for i in range(n_steps):
            kind = "gives" if i == gives_at else rng.choice(spec.ops)
            if kind in ("sub", "gives"):
                if value < 2:
                    break
                operand = rng.randint(2, min(value, spec.max_value - 1))
            elif kind == "add":
                operand = rng.randrange(2, spec.max_value)
            else:
                operand = FACTOR[kind]
            after = _apply(kind, value, operand)
            if after > spec.max_result:
                break
            steps.append(Step(kind, operand, value, after))
            value = after
        else:
            return Problem(_question(rng, steps), value, tuple(steps))


def _question(rng: random.Random, steps: list[Step]) -> str:
    female = rng.random() < 0.5
    names = NAMES_SHE if female else NAMES_HE
    name = rng.choice(names)
    others = [n for n in NAMES_SHE + NAMES_HE if n != name]
    items = rng.choice(ITEMS)
    parts = [rng.choice(OPENINGS).format(name=name, a=steps[0].before, items=items)]
    for i, step in enumerate(steps):
        sub = ("She" if female else "He") if i == 0 else f"Then {name}"
        template = rng.choice(STEP_TEMPLATES[step.kind])
        parts.append(template.format(sub=sub, b=step.operand, items=items, other=rng.choice(others)))
    parts.append(rng.choice(QUESTIONS).format(items=items, name=name))
    return " ".join(parts)


def format_solution(problem: Problem, *, misconceived: bool | Collection[int] = False) -> str:
    """The worked solution ``" a + b = c. c - d = e. #### e"``. ``misconceived`` (``True`` for every step
    that has a misconception, or the indices of the steps) writes those steps as :data:`MISREAD_AS` says,
    and the rest of the chain follows from the wrong value."""
    wrong = range(len(problem.steps)) if misconceived is True else misconceived or ()
    value = problem.steps[0].before
    lines = []
    for i, step in enumerate(problem.steps):
        kind = MISREAD_AS.get(step.kind, step.kind) if i in wrong else step.kind
        after = _apply(kind, value, step.operand)
        lines.append(f"{value} {SYMBOL[kind]} {step.operand} = {after}.")
        value = after
    return " " + " ".join(lines) + f" #### {value}"


def format_prompt(question: str) -> str:
    """The plain-text prompt the shipped base model was trained on (its completion starts with a space)."""
    return PROMPT_TEMPLATE.format(question=question)


def split_of(question: str) -> str:
    """``"test"`` for the ~10% of questions whose hash falls in the test bucket, else ``"train"``."""
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "little") % 100 < TEST_PERCENT else "train"


def generate_problems(
    num_problems: int, *, seed: int = 0, spec: ArithSpec = ArithSpec(), split: str | None = None
) -> list[Problem]:
    """``num_problems`` distinct problems, deterministic by ``seed``, all from ``split`` when given."""
    return list(iter_problems(num_problems, seed=seed, spec=spec, split=split))


def iter_problems(
    num_problems: int, *, seed: int = 0, spec: ArithSpec = ArithSpec(), split: str | None = None
) -> Iterator[Problem]:
    """:func:`generate_problems` one at a time (arguments checked at the call): the first k of them are the same
    for any ``num_problems >= k``, so a reader that needs only k rows stops there."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    if num_problems < 0:
        raise ValueError(f"num_problems must be >= 0, got {num_problems}")
    return _problems(num_problems, seed, spec, split)


def _problems(num_problems: int, seed: int, spec: ArithSpec, split: str | None) -> Iterator[Problem]:
    rng = random.Random(f"arith-{seed}-{split}")
    seen: set[str] = set()
    attempts, max_attempts = 0, 50 * num_problems + 1000
    while len(seen) < num_problems:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"could only find {len(seen)} distinct problems of {num_problems} for {spec}; "
                "ask for fewer or raise the difficulty"
            )
        problem = generate_problem(rng, spec)
        if problem.question in seen or (split is not None and split_of(problem.question) != split):
            continue
        seen.add(problem.question)
        yield problem


def supervised_pairs(
    num_problems: int,
    *,
    seed: int = 0,
    spec: ArithSpec = ArithSpec(),
    misconception_rate: float | Mapping[str, float] = 0.6,
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from the train split for supervised pre-training. Each step of a kind
    in ``misconception_rate`` (a rate per kind of :data:`MISREAD_AS`; a number is the rate of "gives"
    steps) is written with its misconception with that probability, independently; the rest correctly."""
    rates = (
        {"gives": misconception_rate} if isinstance(misconception_rate, int | float) else misconception_rate
    )
    for kind, rate in rates.items():
        if kind not in MISREAD_AS or not 0.0 <= rate <= 1.0:
            raise ValueError(
                f"misconception rates must be kinds of {sorted(MISREAD_AS)} with rates in [0, 1], got {kind}: {rate}"
            )
    rng = random.Random(f"arith-sft-{seed}")
    pairs = []
    for problem in generate_problems(num_problems, seed=seed, spec=spec, split="train"):
        wrong = [
            i
            for i, step in enumerate(problem.steps)
            if step.kind in rates and rng.random() < rates[step.kind]
        ]
        pairs.append((format_prompt(problem.question), format_solution(problem, misconceived=wrong)))
    return pairs


def read_arith(
    split: str = "train", *, seed: int = 0, num_problems: int | None = None, difficulty: int | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of the ``arith`` task, generated as they are read: question, answer (str), solution (gold, GSM8K
    form) and has_gives (whether the misconception step occurs). ``num_problems`` defaults to 20,000 (train) /
    1,000 (test)."""
    return _rows(split, spec_for_difficulty(1 if difficulty is None else difficulty), seed, num_problems)


def read_arith_hard(
    split: str = "train", *, seed: int = 0, num_problems: int | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of the ``arith-hard`` task (:data:`HARD_SPEC`), with the columns of :func:`read_arith` plus
    traps (how many steps have a misconception)."""
    return _rows(split, HARD_SPEC, seed, num_problems)


def _rows(split: str, spec: ArithSpec, seed: int, num_problems: int | None) -> Iterator[dict[str, Any]]:
    if split not in DEFAULT_SIZES:
        raise ValueError(f"split must be 'train' or 'test' for the arith tasks, got {split!r}")
    count = num_problems if num_problems is not None else DEFAULT_SIZES[split]
    problems = iter_problems(count, seed=seed, spec=spec, split=split)
    return (
        {
            "question": problem.question,
            "answer": str(problem.answer),
            "solution": format_solution(problem),
            "has_gives": problem.has_gives,
            "traps": problem.traps,
        }
        for problem in problems
    )


def load_arith(split: str = "train", **options: Any):
    """The task as a ``datasets.Dataset`` (see :meth:`pods.data.task.Task.load` for the options).

    ``prompt_style="plain"`` (the default) gives the text the shipped base model was trained on;
    ``"chat"`` and ``"raw"`` build the paper's prompts with :func:`pods.prompts.make_prompt`.
    """
    return ARITH_TASK.load(split, **options)


# The embedded models were trained on "Question: ...\nAnswer:" and write 20-odd (arith-hard: 30-odd) tokens.
_PLAIN = {"reward_funcs": ("accuracy",), "prompt_style": "plain", "plain_template": PROMPT_TEMPLATE}
ARITH_TASK = Task("arith", read_arith, **_PLAIN, max_new_tokens=32)
ARITH_HARD_TASK = Task("arith-hard", read_arith_hard, **_PLAIN, max_new_tokens=40)
