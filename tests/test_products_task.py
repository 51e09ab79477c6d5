"""The embedded tool task ``products``: its calculator, its problems and splits, its tokenizer and the
shipped tool-base model."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from pods.data import get_task, load_task
from pods.data.arith import format_prompt
from pods.data.products import (
    MAX_NEW_TOKENS,
    STOP,
    Problem,
    calculator,
    format_solution,
    generate_problems,
    solution_segments,
    supervised_pairs,
    tool_result,
)
from pods.embedded import EMBEDDED_MODELS, _batch, build_tokenizer, model_path


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347 * 589", "204383"),
        ("12 + 3 * 4 - 5", "19"),
        ("10 - 2 * 3", "4"),
        ("1 - 2 - 3", "-4"),
        ("2*3*4", "24"),
        (" 7 ", "7"),
        ("999 * 999 * 999 * 999 * 999 * 999", str(999**6)),
    ],
)
def test_calculator_evaluates_integer_chains(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1" * 65, "too long: 65 characters"),
        ("1 +", "ends with the operator '+'"),
        ("* 2", "expected an integer at token 1"),
        ("1 2", "expected an operator at token 2"),
        ("2 ** 3", "expected an integer at token 3"),
        ("6 / 2", "unexpected character '/' at position 2"),
        ("1.5 * 2", "unexpected character '.'"),
        ("(1 + 2)", "unexpected character '('"),
        ("__import__('os').system('true')", "unexpected character '_' at position 0"),
        ("1 + x", "unexpected character 'x'"),
        ("\u0663 * 2", "unexpected character"),  # a digit of another script is not an integer here
    ],
)
def test_calculator_refuses_anything_else_naming_the_problem(expression: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        calculator(expression)


def test_calculator_never_runs_code(monkeypatch) -> None:
    monkeypatch.setattr("builtins.eval", lambda *a, **k: pytest.fail("eval called"))
    monkeypatch.setattr("builtins.exec", lambda *a, **k: pytest.fail("exec called"))
    assert calculator("6 * 7") == "42"
    for code in ("__import__('os')", "open('x')", "lambda: 1", "1 if 1 else 2", "[1] * 3"):
        with pytest.raises(ValueError):
            calculator(code)


def test_calculator_has_a_schema_chat_templates_accept() -> None:
    from transformers.utils import get_json_schema

    function = get_json_schema(calculator)["function"]
    assert function["name"] == "calculator" and function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"


def test_problems_are_deterministic_distinct_and_the_splits_disjoint() -> None:
    train = generate_problems(3000, seed=0, split="train")
    test = generate_problems(500, seed=0, split="test")
    assert train == generate_problems(3000, seed=0, split="train")
    assert generate_problems(10, seed=1, split="test") != test[:10]
    assert not {p.question for p in train} & {p.question for p in test}
    assert len({p.question for p in train}) == 3000
    assert all(100 <= f <= 999 for p in train + test for f in (p.a, p.b))
    with pytest.raises(ValueError, match="split"):
        generate_problems(1, split="dev")


def test_task_rows_prompts_and_reward() -> None:
    task = get_task("products")
    assert task.prompt_style == "plain" and task.reward_funcs == ("accuracy",)
    assert task.tools == ("pods.data.products:calculator",) and task.max_new_tokens == MAX_NEW_TOKENS
    rows = load_task("products", "test", num_problems=50)
    assert rows["question"][0] == "What is 505 * 790 ?" and rows["answer"][0] == "398950"
    assert rows["prompt"][0] == "Question: What is 505 * 790 ?\nAnswer:"
    assert rows["solution"][0] == " <call>calculator(505 * 790)</call><result>398950</result> #### 398950"
    gold = task.accuracy_function()(rows["prompt"], rows["solution"], answer=rows["answer"])
    assert gold == [1.0] * 50
    guess = [format_solution(Problem(505, 790), calls_tool=False)]
    assert guess == [" 505 * 790 = 398950 #### 398950"]
    assert task.accuracy_function()(None, [" 505 * 790 = 398951 #### 398951"], answer=["398950"]) == [0.0]


def test_supervised_pairs_mix_tool_calls_and_guesses() -> None:
    pairs = supervised_pairs(2000, seed=0, tool_share=0.3)
    calls = [len(segments) == 3 for _, segments in pairs]
    assert 0.25 < sum(calls) / len(calls) < 0.35
    assert all(
        [flag for _, flag in segments] == [False, True, False]
        for (_, segments), c in zip(pairs, calls, strict=True)
        if c
    )
    with pytest.raises(ValueError, match="tool_share"):
        supervised_pairs(1, tool_share=1.5)


def test_tokenizer_covers_every_piece_and_tool_tokens_are_out_of_the_loss() -> None:
    tokenizer = build_tokenizer("products")
    problems = [*generate_problems(200, seed=0, split="train"), Problem(999, 999), Problem(100, 100)]
    for p in problems:
        prompt = format_prompt(p.question)
        for calls_tool in (True, False):
            segments = solution_segments(p, calls_tool=calls_tool)
            text = format_solution(p, calls_tool)
            ids = tokenizer(prompt + text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == prompt + text
            apart = tokenizer(prompt)[
                "input_ids"
            ]  # the engine tokenises prompt, turns and tool answers apart
            for text, _ in segments:
                apart += tokenizer(text, add_special_tokens=False)["input_ids"]
            assert apart == ids
    # the longest episode (6-digit product) fits the budget with its eos
    longest = tokenizer(format_solution(Problem(999, 999), True))["input_ids"]
    assert len(longest) + 1 <= MAX_NEW_TOKENS == EMBEDDED_MODELS["products"].max_new_tokens
    assert tokenizer.decode(tokenizer(STOP)["input_ids"]) == STOP
    # supervised labels: -100 over the prompt and the tool's <result>...</result>, the rest trained
    p = Problem(347, 589)
    _, _, labels = _batch(tokenizer, [(format_prompt(p.question), solution_segments(p, calls_tool=True))])
    trained = tokenizer.decode([i for i in labels[0].tolist() if i != -100], skip_special_tokens=True)
    assert trained == " <call>calculator(347 * 589)</call> #### 204383"
    assert tool_result(p.expression) == "<result>204383</result>"


def test_arith_tokenizers_are_unchanged() -> None:
    for task in ("arith", "arith-hard"):
        shipped = json.loads((model_path(task) / "tokenizer.json").read_text())["model"]["vocab"]
        assert build_tokenizer(task).get_vocab() == shipped
    assert build_tokenizer().get_vocab() == build_tokenizer("arith").get_vocab()
    with pytest.raises(ValueError, match="no embedded tokenizer for task 'gsm8k'"):
        build_tokenizer("gsm8k")


def test_shipped_tool_base_loads_and_round_trips_a_solution() -> None:
    from pods.models import resolve_model_path

    path = model_path("products")
    assert path.name == "tool-base" and resolve_model_path("embedded-products") == str(path)
    assert sum(f.stat().st_size for f in path.iterdir()) < 6_000_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) == len(build_tokenizer("products"))
    assert tokenizer.get_vocab() == build_tokenizer("products").get_vocab()
    text = format_prompt("What is 347 * 589 ?") + format_solution(Problem(347, 589), calls_tool=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    card = json.loads((path / "build_metrics.json").read_text())
    assert card["task"] == "products" and card["greedy"]["accuracy"] < 0.1
    assert 0.2 <= card["sampled_t1"]["tool_call_share"] <= 0.4 and card["sampled_t1"]["accuracy_tool"] > 0.9


def test_shipped_tool_base_guesses_greedily_and_is_right_when_it_samples_a_call() -> None:
    """Measured through the multi-turn engine: greedy guesses (wrong); sampled episodes that call the tool
    get its answer back and copy it."""
    import torch

    from pods.embedded import evaluate

    path = model_path("products")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    greedy = evaluate(model, tokenizer, task="products", num_problems=40)
    assert greedy["accuracy"] < 0.1 and greedy["tool_call_share"] < 0.1
    torch.manual_seed(0)
    sampled = evaluate(model, tokenizer, task="products", num_problems=100, temperature=1.0)
    assert 0.1 < sampled["tool_call_share"] < 0.5 and sampled["accuracy_tool"] > 0.9
    assert sampled["accuracy_guess"] < 0.1


def test_build_smoke(tmp_path) -> None:
    from pods.embedded import build_base_model

    metrics = build_base_model(
        tmp_path, task="products", steps=2, batch_size=4, eval_problems=4, progress=False
    )
    assert (
        metrics["tool_share"] == EMBEDDED_MODELS["products"].tool_share
        and "misconception_rates" not in metrics
    )
    assert metrics["greedy"]["num_problems"] == 4 and 0.0 <= metrics["greedy"]["tool_call_share"] <= 1.0
    assert AutoTokenizer.from_pretrained(tmp_path).get_vocab() == build_tokenizer("products").get_vocab()
    with pytest.raises(ValueError, match="no misconceptions"):
        build_base_model(tmp_path / "bad", task="products", misconception_rates={"gives": 0.5})
