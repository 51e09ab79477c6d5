"""The synthetic arithmetic task: determinism, disjoint splits, distinctness, difficulty, correct solutions."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from pods.data.arith import (
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

STEP = re.compile(r"(\d+) ([+*-]) (\d+) = (\d+)\.")


def _check_solution(solution: str, answer: int) -> list[tuple[int, str, int, int]]:
    """Recompute every step of a worked solution; return the parsed steps."""
    steps = [(int(a), op, int(b), int(c)) for a, op, b, c in STEP.findall(solution)]
    assert steps, solution
    for a, op, b, c in steps:
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op], solution
    for (_, _, _, c), (a, _, _, _) in itertools.pairwise(steps):
        assert a == c, f"chain broken in {solution}"
    assert solution.endswith(f" #### {answer}") and steps[-1][3] == answer
    return steps


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_gold_solutions_recompute(difficulty: int) -> None:
    spec = spec_for_difficulty(difficulty)
    for problem in generate_problems(300, seed=difficulty, spec=spec):
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
