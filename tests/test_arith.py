"""The synthetic arithmetic tasks: determinism, disjoint splits, distinctness, difficulty, correct solutions,
the misconceptions, and the arith-hard task's spec."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from pods.data import load_task
from pods.data.arith import (
    HARD_SPEC,
    SYMBOL,
    ArithSpec,
    format_prompt,
    format_solution,
    generate_problem,
    generate_problems,
    load_arith,
    spec_for_difficulty,
    split_of,
    supervised_pairs,
)

STEP = re.compile(r"(-?\d+) ([+*-]) (\d+) = (-?\d+)\.")  # misconceived chains can go below 0


def _check_chain(solution: str) -> list[tuple[int, str, int, int]]:
    """Recompute every step of a worked solution and check that each starts from the last; return the steps."""
    steps = [(int(a), op, int(b), int(c)) for a, op, b, c in STEP.findall(solution)]
    assert steps, solution
    for a, op, b, c in steps:
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op], solution
    for (_, _, _, c), (a, _, _, _) in itertools.pairwise(steps):
        assert a == c, f"chain broken in {solution}"
    assert solution.endswith(f" #### {steps[-1][3]}")
    return steps


def _check_solution(solution: str, answer: int) -> list[tuple[int, str, int, int]]:
    """Recompute every step of a worked solution and check its answer; return the parsed steps."""
    steps = _check_chain(solution)
    assert steps[-1][3] == answer, solution
    return steps


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5, "hard"])
def test_gold_solutions_recompute(difficulty: int | str) -> None:
    spec = HARD_SPEC if difficulty == "hard" else spec_for_difficulty(difficulty)
    for problem in generate_problems(300, seed=0 if difficulty == "hard" else difficulty, spec=spec):
        steps = _check_solution(format_solution(problem), problem.answer)
        assert spec.min_steps <= len(steps) <= spec.max_steps
        assert all(c >= 0 for *_, c in steps)
        assert steps[0][0] < spec.max_value and str(steps[0][0]) in problem.question


def test_deterministic_by_seed_and_seeds_differ() -> None:
    a = generate_problems(200, seed=3, split="train")
    assert a == generate_problems(200, seed=3, split="train")
    assert [p.question for p in a] != [p.question for p in generate_problems(200, seed=4, split="train")]
    rng1, rng2 = random.Random(7), random.Random(7)
    assert generate_problem(rng1) == generate_problem(rng2)


def test_splits_disjoint_and_distinct() -> None:
    train = {p.question for p in generate_problems(5000, seed=0, split="train")}
    test = {p.question for p in generate_problems(500, seed=0, split="test")}
    assert len(train) == 5000 and len(test) == 500
    assert not train & test
    assert all(split_of(q) == "test" for q in test)
    # the hash decides: a train question is never in any test set, whatever its seed
    other_test = {p.question for p in generate_problems(500, seed=1, split="test")}
    assert not train & other_test


def test_difficulty_knob_widens_values_and_steps() -> None:
    easy = generate_problems(500, seed=0, spec=spec_for_difficulty(1))
    hard = generate_problems(500, seed=0, spec=spec_for_difficulty(4))
    assert max(len(p.steps) for p in easy) == 2 and max(len(p.steps) for p in hard) == 5
    assert max(p.steps[0].before for p in easy) < 20 < max(p.steps[0].before for p in hard)
    assert {s.kind for p in easy for s in p.steps} == {"add", "sub", "gives"}
    assert {"double", "triple"} <= {s.kind for p in hard for s in p.steps}
    with pytest.raises(ValueError, match="difficulty"):
        spec_for_difficulty(0)
    with pytest.raises(ValueError, match="ops"):
        ArithSpec(ops=("divide",))


def test_gives_fraction_and_misconception() -> None:
    problems = generate_problems(2000, seed=0, spec=ArithSpec(gives_fraction=0.6))
    share = sum(p.has_gives for p in problems) / len(problems)
    assert 0.55 < share < 0.65
    assert not any(p.has_gives for p in generate_problems(300, spec=ArithSpec(gives_fraction=0.0)))
    for problem in problems[:300]:
        wrong = format_solution(problem, misconceived=True)
        if problem.has_gives:
            assert " + " in wrong and not wrong.endswith(f"#### {problem.answer}")
        else:
            assert wrong == format_solution(problem)
    pairs = supervised_pairs(1000, seed=0, misconception_rate=0.6)
    truth = generate_problems(1000, seed=0, split="train")
    assert [format_prompt(p.question) for p in truth] == [prompt for prompt, _ in pairs]
    wrong = [not c.endswith(f"#### {p.answer}") for p, (_, c) in zip(truth, pairs, strict=True)]
    assert not any(w for w, p in zip(wrong, truth, strict=True) if not p.has_gives)
    wrong_share = sum(wrong) / sum(p.has_gives for p in truth)
    assert 0.53 < wrong_share < 0.67
    assert all(p.startswith("Question: ") and p.endswith("\nAnswer:") and c.startswith(" ") for p, c in pairs)


def test_load_arith_columns_and_errors() -> None:
    ds = load_arith("test", limit=50)
    assert len(ds) == 50
    assert set(ds.column_names) >= {"question", "answer", "solution", "prompt"}
    row = ds[0]
    assert row["prompt"] == format_prompt(row["question"])
    assert row["solution"].endswith(f"#### {row['answer']}")
    assert load_arith("test", limit=50)["question"] == ds["question"]
    assert not set(load_arith("train", num_problems=2000)["question"]) & set(load_arith("test")["question"])
    with pytest.raises(ValueError, match="split"):
        load_arith("validation")
    with pytest.raises(ValueError, match="unknown prompt style 'fancy'"):
        load_arith("test", prompt_style="fancy")
    with pytest.raises(ValueError, match="generated"):
        load_arith("test", source="data/arith.jsonl")
    with pytest.raises(ValueError, match=r"does not accept option\(s\) \['bogus'\]"):
        load_arith("test", bogus=1)
    with pytest.raises(ValueError, match="tokenizer"):
        load_arith("test", max_prompt_tokens=10)


def test_gold_solutions_score_one_with_accuracy_reward() -> None:
    rewards = pytest.importorskip("pods.rewards", reason="pods.rewards not committed yet")
    ds = load_arith("test", num_problems=300, difficulty=3)
    prompts, solutions, answers = ds["prompt"], ds["solution"], ds["answer"]
    assert rewards.accuracy_reward(prompts, solutions, answer=answers) == [1.0] * len(ds)
    shifted = [str(int(a) + 1) for a in answers]
    assert rewards.accuracy_reward(prompts, solutions, answer=shifted) == [0.0] * len(ds)


def test_load_arith_other_prompt_styles_and_length_filter() -> None:
    from pods.embedded import build_tokenizer

    chat = load_arith("test", prompt_style="chat", limit=5)
    assert chat[0]["prompt"][-1] == {"role": "user", "content": chat[0]["question"]}
    assert load_arith("test", prompt_style="raw", limit=5)["prompt"] == chat["question"]
    tokenizer = build_tokenizer()
    full = load_arith("test", num_problems=300)
    short = load_arith("test", num_problems=300, tokenizer=tokenizer, max_prompt_tokens=30, limit=40)
    lengths = [len(tokenizer(p)["input_ids"]) for p in full["prompt"]]
    expected = [q for q, n in zip(full["question"], lengths, strict=True) if n <= 30][:40]
    assert short["question"] == expected and 0 < len(expected) < 300


def test_hard_spec_has_one_to_three_traps_in_three_small_steps() -> None:
    problems = generate_problems(2000, seed=0, spec=HARD_SPEC, split="train")
    assert all(len(p.steps) == 3 and sum(s.kind == "gives" for s in p.steps) == 1 for p in problems)
    assert all(s.after < 100 and s.operand < 20 for p in problems for s in p.steps)
    traps = [p.traps for p in problems]
    assert traps == [1 + sum(s.kind in ("double", "triple") for s in p.steps) for p in problems]
    shares = {k: traps.count(k) / len(traps) for k in (1, 2, 3)}
    assert all(0.15 < share < 0.6 for share in shares.values()), shares  # all three counts are common
    assert {s.kind for p in problems for s in p.steps} == {"add", "sub", "gives", "double", "triple"}


def test_hard_task_is_registered_deterministic_and_its_splits_disjoint() -> None:
    test = load_task("arith-hard", "test", num_problems=300)
    assert test["question"] == load_task("arith-hard", "test", num_problems=300)["question"]
    assert test["question"] != load_task("arith-hard", "test", num_problems=300, seed=1)["question"]
    train = load_task("arith-hard", "train", num_problems=3000)
    assert len(set(train["question"])) == 3000 and not set(train["question"]) & set(test["question"])
    assert all(split_of(q) == "test" for q in test["question"])
    assert test[0]["prompt"] == format_prompt(test[0]["question"]) and min(test["traps"]) >= 1
    # a different task from arith: no question in common
    assert not set(test["question"]) & set(load_arith("test", num_problems=1000)["question"])
    with pytest.raises(ValueError, match="difficulty"):
        load_task("arith-hard", "test", difficulty=2)


def test_each_misconception_is_its_own_wrong_procedure() -> None:
    problems = [p for p in generate_problems(500, seed=0, spec=HARD_SPEC) if p.traps == 3]
    misread_operand = {"gives": None, "double": 2, "triple": 3}
    for problem in problems[:50]:
        for i, step in enumerate(problem.steps):
            solution = format_solution(problem, misconceived=[i])
            steps = _check_chain(solution)  # still a consistent chain of right sums
            assert [op for _, op, _, _ in steps] == [
                "+" if j == i else SYMBOL[s.kind] for j, s in enumerate(problem.steps)
            ]
            assert steps[i][2] == (misread_operand[step.kind] or step.operand)
            if steps[i][3] != step.after:  # 2 doubled is 2 + 2: the only case where the trap changes nothing
                assert not solution.endswith(f"#### {problem.answer}"), solution
        assert format_solution(problem, misconceived=True) == format_solution(problem, misconceived=[0, 1, 2])
        assert format_solution(problem, misconceived=[]) == format_solution(problem)


def test_supervised_pairs_misconceive_each_kind_at_its_rate() -> None:
    rates = {"gives": 0.8, "double": 0.5, "triple": 0.2}
    pairs = supervised_pairs(2000, seed=0, spec=HARD_SPEC, misconception_rate=rates)
    truth = generate_problems(2000, seed=0, spec=HARD_SPEC, split="train")
    wrong: dict[str, list[bool]] = {kind: [] for kind in rates}
    for problem, (_, completion) in zip(truth, pairs, strict=True):
        ops = [op for _, op, _, _ in _check_chain(completion)]
        for step, op in zip(problem.steps, ops, strict=True):
            if step.kind in rates:
                wrong[step.kind].append(op != SYMBOL[step.kind])
            else:
                assert op == SYMBOL[step.kind]
    for kind, rate in rates.items():
        assert abs(sum(wrong[kind]) / len(wrong[kind]) - rate) < 0.05, kind
    # a number is the rate of "gives" steps: the same draws as the mapping that names only "gives"
    assert supervised_pairs(300, seed=1, misconception_rate=0.6) == supervised_pairs(
        300, seed=1, misconception_rate={"gives": 0.6}
    )
    with pytest.raises(ValueError, match="misconception rates"):
        supervised_pairs(10, misconception_rate={"sub": 0.5})
    with pytest.raises(ValueError, match="misconception rates"):
        supervised_pairs(10, misconception_rate=1.5)
