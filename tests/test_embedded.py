"""The embedded models: word-level tokenizer, the shipped base models, and the build that makes them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pods.data.arith import HARD_SPEC, format_prompt, format_solution, generate_problems, spec_for_difficulty
from pods.embedded import (
    build_base_model,
    build_tokenizer,
    default_model_path,
    evaluate,
    generate_answers,
    informative_share,
    model_path,
    sample_successes,
)


def _task_texts(per_level: int = 300) -> list[str]:
    texts = []
    for spec in [*map(spec_for_difficulty, range(1, 6)), HARD_SPEC]:
        for p in generate_problems(per_level, seed=0, spec=spec):
            texts += [format_prompt(p.question), format_solution(p), format_solution(p, misconceived=True)]
            texts.append(format_prompt(p.question) + format_solution(p))
    return texts


def _assert_round_trip(tokenizer, texts: list[str]) -> None:
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text
        assert tokenizer.decode(ids) == text


def test_tokenizer_round_trip_one_token_per_digit() -> None:
    tokenizer = build_tokenizer()
    _assert_round_trip(tokenizer, _task_texts())
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(" 12 + 7 = 19. #### 19")["input_ids"])
    assert tokens == [" 1", "2", " +", " 7", " =", " 1", "9", ".", " ####", " 1", "9"]
    assert tokenizer.padding_side == "left" and tokenizer.eos_token and tokenizer.pad_token
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # prompt and completion tokenise the same apart as together (RL tokenises them separately)
    prompt, completion = format_prompt("Mia has 3 coins."), " 3 + 4 = 7. #### 7"
    joined = tokenizer(prompt + completion)["input_ids"]
    assert joined == tokenizer(prompt)["input_ids"] + tokenizer(completion)["input_ids"]
    assert tokenizer("Zebra")["input_ids"] == [tokenizer.unk_token_id]


def test_saved_tokenizer_round_trips_through_auto_tokenizer(tmp_path) -> None:
    build_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    _assert_round_trip(loaded, _task_texts(40))


def test_shipped_model_loads_offline_and_answers() -> None:
    path = default_model_path()
    assert sum(f.stat().st_size for f in path.iterdir()) < 10_000_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.padding_side == "left"
    _assert_round_trip(tokenizer, _task_texts(40))
    prompts = [format_prompt("Mia has 12 apples. She buys 7 more apples. How many apples does Mia have now?")]
    batch = tokenizer(prompts * 2, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=32, do_sample=False)
    text = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text == " 12 + 7 = 19. #### 19"


def test_shipped_model_has_the_designed_headroom() -> None:
    """Greedy decoding solves most problems without a "gives" step and few with one (the misconception)."""
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    metrics = evaluate(model, AutoTokenizer.from_pretrained(path), num_problems=150)
    assert metrics["accuracy_other"] > 0.6 and metrics["accuracy_gives"] < 0.2
    card = json.loads((path / "build_metrics.json").read_text())
    assert 0.2 <= card["greedy"]["accuracy"] <= 0.5 and card["greedy"]["num_problems"] >= 500


@pytest.mark.parametrize("task", ["arith", "arith-hard"])
def test_build_base_model_smoke(task: str, tmp_path: Path) -> None:
    metrics = build_base_model(tmp_path, task=task, steps=3, batch_size=8, eval_problems=8, progress=False)
    greedy = metrics["greedy"]
    assert metrics["steps"] == 3 and greedy["num_problems"] == 8 and metrics["task"] == task
    assert set(greedy["accuracy_by_traps"]) <= ({"0", "1"} if task == "arith" else {"1", "2", "3"})
    assert greedy["accuracy"] * 8 == pytest.approx(round(greedy["accuracy"] * 8))  # a count of 8 problems
    assert metrics["final_loss"] > 0 and metrics["parameters"] > 500_000
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.generation_config.eos_token_id == AutoTokenizer.from_pretrained(tmp_path).eos_token_id
    with pytest.raises(ValueError, match="steps"):
        build_base_model(tmp_path / "bad", task=task, steps=0)
    with pytest.raises(ValueError, match="no embedded recipe for task 'gsm8k'"):
        build_base_model(tmp_path / "bad", task="gsm8k")


def test_embedded_names_resolve_to_the_shipped_models() -> None:
    from pods.config import ConfigError
    from pods.models import resolve_model_path

    assert resolve_model_path("embedded") == resolve_model_path("embedded-arith") == str(default_model_path())
    hard = Path(resolve_model_path("embedded-arith-hard"))
    assert hard == model_path("arith-hard") != default_model_path() and hard.name == "arith-hard-base"
    with pytest.raises(ConfigError, match=r"'embedded-nope' is not a shipped model.*embedded-arith-hard"):
        resolve_model_path("embedded-nope")


def test_informative_share_is_the_exact_subset_average() -> None:
    samples = 8
    for successes in ([0, 0, 8], [1, 2, 3, 4, 5, 6, 7], [3]):
        for group_size in (1, 2, 4, 8):
            brute = []  # every group of group_size drawn without replacement from each problem's samples
            for k in successes:
                flags = [True] * k + [False] * (samples - k)
                groups = list(itertools.combinations(flags, group_size))
                brute.append(sum(any(g) and not all(g) for g in groups) / len(groups))
            expected = sum(brute) / len(brute)
            assert informative_share(successes, samples, group_size) == pytest.approx(expected)
    assert informative_share([0, 32], 32, 4) == 0.0 and informative_share([1], 2, 2) == 1.0
    with pytest.raises(ValueError, match="group_size"):
        informative_share([1], 4, 5)


@pytest.mark.slow
def test_hard_model_is_small_and_leaves_room_to_climb() -> None:
    """arith-hard-base: greedy follows the traps (nearly all wrong, but by the designed wrong procedure),
    and a sample is right now and then (RL has a rare signal to find)."""
    path = model_path("arith-hard")
    assert sum(f.stat().st_size for f in path.iterdir()) < 5_000_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    problems = generate_problems(120, seed=0, spec=HARD_SPEC, split="test")
    greedy = generate_answers(
        model, tokenizer, [format_prompt(p.question) for p in problems], max_new_tokens=40
    )
    right = sum(g.endswith(f"#### {p.answer}") for g, p in zip(greedy, problems, strict=True)) / len(problems)
    all_traps = [g == format_solution(p, misconceived=True) for g, p in zip(greedy, problems, strict=True)]
    assert right <= 0.15 and sum(all_traps) / len(problems) >= 0.6
    torch.manual_seed(0)
    successes = sample_successes(model, tokenizer, task="arith-hard", num_problems=30, samples=16)
    assert 0.01 <= sum(successes) / (30 * 16) <= 0.2
    card = json.loads((path / "build_metrics.json").read_text())
    assert card["task"] == "arith-hard" and card["greedy"]["accuracy"] <= 0.15
    assert card["sample_successes"]["informative_n4"] < card["sample_successes"]["informative_n16"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["embedded-hard", "compare-embedded-hard"])
def test_hard_presets_train_a_step_on_their_shipped_model(preset: str, tmp_path: Path) -> None:
    from pods.cli import load_train_config
    from pods.trainer import PODSTrainer

    overrides = {"max_steps": 1, "max_time": "null", "eval_at_start": "false", "eval_every_seconds": "null"}
    overrides |= {"eval_at_seconds": "null", "rollout_engine": "hf", "train_limit": 64, "save_final": "false"}
    overrides |= {"save_every_seconds": "null", "progress": "false", "output_dir": str(tmp_path)}
    config = load_train_config(preset, [f"--{key}={value}" for key, value in overrides.items()])
    assert (config.model, config.task) == ("embedded-arith-hard", "arith-hard")
    assert PODSTrainer(config).train().steps == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(row for row in rows if row.get("step") == 1 and "reward" in row)
    assert 0.0 <= step["reward"] <= 0.5  # rare successes: the sparse regime, on the real model
