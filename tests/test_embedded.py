"""The embedded default: word-level tokenizer, the shipped base model, and the build that makes it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pods.data.arith import format_prompt, format_solution, generate_problems, spec_for_difficulty
from pods.embedded import build_base_model, build_tokenizer, default_model_path, evaluate


def _task_texts(per_level: int = 300) -> list[str]:
    texts = []
    for level in range(1, 6):
        for p in generate_problems(per_level, seed=level, spec=spec_for_difficulty(level)):
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


def test_build_base_model_smoke(tmp_path) -> None:
    metrics = build_base_model(tmp_path, steps=3, batch_size=8, eval_problems=8, progress=False)
    greedy = metrics["greedy"]
    assert metrics["steps"] == 3 and greedy["num_problems"] == 8
    assert greedy["accuracy"] * 8 == pytest.approx(round(greedy["accuracy"] * 8))  # a count of 8 problems
    assert metrics["final_loss"] > 0 and metrics["parameters"] > 500_000
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.generation_config.eos_token_id == AutoTokenizer.from_pretrained(tmp_path).eos_token_id
    with pytest.raises(ValueError, match="steps"):
        build_base_model(tmp_path / "bad", steps=0)
