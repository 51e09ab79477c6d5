"""pods.rollout: the HF generate engine on a tiny real model, and Rollouts.select."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from pods.rollout import HFGenerateEngine, RolloutEngine, Rollouts, SamplingParams

PROMPTS = ["Question: Tom has 12 apples. Answer:", "abc"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(
        tiny_model_dir
    )


def _check_layout(r: Rollouts, tokenizer, prompts: list[str], n: int, max_new_tokens: int, eos_ids) -> None:
    """Everything the Rollouts contract promises, checked row by row."""
    rows = len(prompts) * n
    pad = tokenizer.pad_token_id
    assert (r.num_prompts, r.num_generations, len(r)) == (len(prompts), n, rows)
    encoded = [tokenizer.encode(p) for p in prompts]
    assert r.prompt_ids.shape == (rows, max(map(len, encoded)))
    lengths = r.completion_lengths
    assert r.completion_ids.shape == (rows, int(lengths.max())) and int(lengths.max()) <= max_new_tokens
    for row in range(rows):
        tokens = encoded[row // n]
        width = r.prompt_ids.shape[1]
        assert r.prompt_ids[row, width - len(tokens) :].tolist() == tokens  # left-padded copy of its prompt
        assert r.prompt_mask[row].tolist() == [0] * (width - len(tokens)) + [1] * len(tokens)
        assert (r.prompt_ids[row, : width - len(tokens)] == pad).all()
        length = int(lengths[row])
        assert length >= 1
        assert r.completion_mask[row].tolist() == [1] * length + [0] * (r.completion_ids.shape[1] - length)
        assert (r.completion_ids[row, length:] == pad).all()
        real = r.completion_ids[row, :length].tolist()
        ends_with_eos = real[-1] in eos_ids
        assert not any(t in eos_ids for t in real[:-1])  # nothing after the first EOS is kept
        assert bool(r.truncated[row]) == (length == max_new_tokens and not ends_with_eos)


def test_shapes_masks_and_chunking(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, generation_batch_size=4)  # 6 rows -> chunks of 4 and 2
    assert isinstance(engine, RolloutEngine)
    torch.manual_seed(0)
    r = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=10, temperature=1.0))
    _check_layout(r, tokenizer, PROMPTS, 3, 10, engine.eos_token_ids)
    expected_texts = [
        tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for ids, mask in zip(r.completion_ids, r.completion_mask, strict=True)
    ]
    assert r.texts == expected_texts
    assert model.training is False


def test_eos_ids_from_the_generation_config_end_completions(tiny):
    model, tokenizer = tiny
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    reference = HFGenerateEngine(model, tokenizer).generate(PROMPTS, 1, greedy)
    # the random tiny model never says EOS in 12 greedy tokens: both rows hit max_new_tokens
    assert reference.truncated.tolist() == [True, True] and reference.completion_lengths.tolist() == [12, 12]
    row = reference.completion_ids[0].tolist()
    stop_token = row[3]
    first = row.index(stop_token)

    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop_token]
    try:
        engine = HFGenerateEngine(model, tokenizer, generation_batch_size=1)  # chunks of different widths
        r = engine.generate(PROMPTS, 2, greedy)
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert stop_token in engine.eos_token_ids and tokenizer.eos_token_id in engine.eos_token_ids
    _check_layout(r, tokenizer, PROMPTS, 2, 12, engine.eos_token_ids)
    assert r.completion_lengths[:2].tolist() == [first + 1] * 2
    assert r.completion_ids[0, : first + 1].tolist() == row[: first + 1]
    assert not r.truncated[:2].any()


def _first_stop(tokenizer, tokens: list[int], stop: str) -> int | None:
    """Fewest tokens whose decoded text contains ``stop`` (the completion-only rule), or None."""
    for t in range(1, len(tokens) + 1):
        if stop in tokenizer.decode(tokens[:t], skip_special_tokens=True):
            return t
    return None


@pytest.fixture(scope="module")
def embedded():
    """The shipped arithmetic model: a word-level tokenizer, whose vocabulary HF's StopStringCriteria could not
    read (its "abcdef" prefix is <unk> there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pods.data.arith import format_prompt, generate_problems
    from pods.embedded import default_model_path

    prompts = [format_prompt(problem.question) for problem in generate_problems(2, seed=0)]
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), prompts


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_stop_strings_cut_mask_and_text_on_the_completion_only(which, request):
    if which == "tiny":
        (model, tokenizer), prompts = request.getfixturevalue("tiny"), PROMPTS
    else:
        model, tokenizer, prompts = request.getfixturevalue("embedded")
    engine = HFGenerateEngine(model, tokenizer)
    free = engine.generate(prompts, 1, SamplingParams(max_new_tokens=12, temperature=0))
    text = free.texts[0]
    assert len(text) >= 6 and text[:6].isascii(), (
        f"pick another prompt: greedy text {text!r} is unusable here"
    )
    # a stop string inside the completion, and one that straddles the prompt/completion boundary
    stops = (text[2:5], prompts[0][-1] + text[0])
    for stop in stops:
        r = engine.generate(
            prompts, 1, SamplingParams(max_new_tokens=12, temperature=0, stop_strings=(stop,))
        )
        tokens = free.completion_ids[0, : int(free.completion_lengths[0])].tolist()
        expected_length = _first_stop(tokenizer, tokens, stop)
        if expected_length is None:  # the straddling string never occurs inside the completion itself
            assert r.texts[0] == text and bool(r.truncated[0]) == bool(free.truncated[0])
        else:
            assert int(r.completion_lengths[0]) == expected_length
            assert r.texts[0] == text[: text.find(stop) + len(stop)]
            assert not r.truncated[0]
    never = engine.generate(
        prompts, 1, SamplingParams(max_new_tokens=12, temperature=0, stop_strings=("@@@@",))
    )
    assert never.texts == free.texts and torch.equal(never.completion_ids, free.completion_ids)


def test_same_seed_gives_the_same_rollouts(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, generation_batch_size=3)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(engine.generate(PROMPTS, 4, sampling))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids) and runs[0].texts == runs[1].texts
    assert not torch.equal(runs[0].completion_ids, runs[2].completion_ids)


def test_greedy_top_k_1_and_model_defaults(tiny):
    model, tokenizer = tiny
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    one = HFGenerateEngine(model, tokenizer, generation_batch_size=1).generate(PROMPTS, 3, greedy)
    many = HFGenerateEngine(model, tokenizer, generation_batch_size=64).generate(PROMPTS, 3, greedy)
    assert torch.equal(one.completion_ids, many.completion_ids)  # padding does not change the result
    assert len(set(one.texts[:3])) == 1 and len(set(one.texts[3:])) == 1
    # top_k = 1 sampling is greedy: the sampling settings reach generate
    top1 = HFGenerateEngine(model, tokenizer).generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, top_k=1))
    assert torch.equal(top1.completion_ids, one.completion_ids)
    # the model's own generation defaults (here a huge repetition penalty) must not bias rollouts
    model.generation_config.repetition_penalty = 50.0
    try:
        biased = HFGenerateEngine(model, tokenizer).generate(PROMPTS, 3, greedy)
    finally:
        model.generation_config.repetition_penalty = None
    assert torch.equal(biased.completion_ids, one.completion_ids)


def test_lora_model_generates_and_training_mode_is_restored(tiny):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    peft_model.train()
    engine = HFGenerateEngine(peft_model, tokenizer)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    r = engine.generate(PROMPTS, 2, greedy)
    assert peft_model.training
    _check_layout(r, tokenizer, PROMPTS, 2, 8, engine.eos_token_ids)
    with peft_model.disable_adapter():  # the base model, as the reference of a LoRA run
        base = engine.generate(PROMPTS, 2, greedy)
    assert torch.equal(
        base.completion_ids, HFGenerateEngine(model, tokenizer).generate(PROMPTS, 2, greedy).completion_ids
    )


def test_bad_input_is_rejected_with_a_clear_message(tiny):
    model, tokenizer = tiny
    engine = HFGenerateEngine(model, tokenizer, max_prompt_length=4)
    with pytest.raises(ValueError, match="max_prompt_length=4"):
        engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate([], 2, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="num_generations"):
        engine.generate(["abc"], 0, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="stop_strings"):
        SamplingParams(stop_strings="</answer>")
    assert SamplingParams(stop_strings=["</answer>"]).stop_strings == ("</answer>",)  # hashable, frozen
    with pytest.raises(ValueError, match="generation_batch_size"):
        HFGenerateEngine(model, tokenizer, generation_batch_size=0)


def test_select_keeps_rows_and_shrinks_padding(tiny):
    model, tokenizer = tiny
    torch.manual_seed(1)
    r = HFGenerateEngine(model, tokenizer).generate(
        PROMPTS, 4, SamplingParams(max_new_tokens=10, temperature=1.0)
    )
    rows = torch.tensor([1, 3, 4, 6])  # PODS: m = 2 kept from each of the 2 groups
    kept = r.select(rows)
    assert (kept.num_prompts, kept.num_generations) == (2, 2)
    assert kept.texts == [r.texts[i] for i in rows]
    assert torch.equal(kept.truncated, r.truncated[rows])
    width = int(r.completion_lengths[rows].max())
    assert torch.equal(kept.completion_ids, r.completion_ids[rows, :width])
    assert torch.equal(kept.completion_mask, r.completion_mask[rows, :width])
    assert torch.equal(kept.prompt_ids, r.prompt_ids[rows])

    short = r.select([5, 7])  # only the short prompt: its left padding goes
    assert short.prompt_mask.all() and short.prompt_ids[0].tolist() == tokenizer.encode(PROMPTS[1])
    assert (short.num_prompts, short.num_generations) == (1, 2)
    assert (r.select([0, 1, 4]).num_prompts, r.select([0, 1, 4]).num_generations) == (3, 1)  # uneven: flat
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        r.select([8])
    with pytest.raises(ValueError, match="boolean mask"):
        r.select(torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="inconsistent Rollouts"):
        Rollouts(**{**vars(r), "texts": r.texts[:-1]})


def test_native_stderr_filter_drops_only_the_matching_lines_error_or_not(capfd) -> None:
    """What C++ writes to file descriptor 2 (os.write is the same system call) passes except the matching
    lines, also when the block fails; afterwards stderr is the real one again."""
    from pods.rollout.native_stderr import native_stderr_without

    notice = b"[W1203 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation\n"
    with native_stderr_without(r"NUMA binding: Using MEMBIND"):
        os.write(2, notice + b"a real error\n")
    with (
        pytest.raises(RuntimeError, match="engine failed"),
        native_stderr_without(r"NUMA binding: Using MEMBIND"),
    ):
        os.write(2, b"why it failed\n" + notice)
        raise RuntimeError("engine failed")
    os.write(2, notice)
    assert capfd.readouterr().err == "a real error\nwhy it failed\n" + notice.decode()
