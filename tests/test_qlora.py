"""QLoRA (a 4-bit bitsandbytes base + LoRA) on this CPU: bitsandbytes >= 0.48 has CPU kernels. The policy
loads, trains, and the vLLM engine (``vllm-cpu``) samples exactly what the HF QLoRA model does, before and
after an update; ``pods train`` runs it end to end with ``rollout_engine: auto`` choosing vLLM."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
import torch

from pods.config import TrainConfig
from pods.models import load_policy
from pods.rollout import HFGenerateEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from tiny_run import TINY_SETTINGS, count_of_a, tiny_dataset

bitsandbytes = pytest.importorskip("bitsandbytes")

VLLM_CPU = sys.platform == "linux" and platform.machine() == "x86_64"
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
PROMPTS = [
    "Tom has 5 apples. He gives 2 to Ann.",
    "A box holds 7 pens. Sam buys 3 more.",
    "Mia has 12 cards. She loses 4 of them.",
]


@pytest.fixture(scope="module")
def tiny_vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model with head size 32 (vLLM's CPU attention has kernels for it) and width 64
    (a multiple of bitsandbytes' 64-value quantization blocks)."""
    from pods.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qlora-model"), hidden_size=64, num_heads=2)


def qlora_policy(model_dir: Path, dtype: str = "float32"):
    config = TrainConfig(
        model=str(model_dir), load_in_4bit=True, lora_r=8, lora_alpha=16, dtype=dtype, max_steps=1
    )
    return load_policy(config)


def train_lora(model, tokenizer, steps: int = 3, lr: float = 3e-2) -> None:
    """A few real AdamW steps on the trainable (LoRA) weights, on a supervised loss."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    batch = tokenizer([p + " 1 + 1 = 2" for p in PROMPTS], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.train()
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def test_a_4bit_lora_policy_loads_on_the_cpu_and_its_engine_dtype_is_the_compute_dtype(
    tiny_vllm_model_dir: Path,
) -> None:
    from pods.rollout.vllm import engine_dtype

    policy = qlora_policy(tiny_vllm_model_dir)
    layer = policy.model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, bitsandbytes.nn.Linear4bit)
    assert type(layer.base_layer.weight).__name__ == "Params4bit"
    assert policy.is_lora and all("lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)
    # k-bit preparation upcasts the embeddings (the first parameter) to float32; the engine computes in
    # the 4-bit layers' compute dtype, which follows the run's dtype
    bf16 = qlora_policy(tiny_vllm_model_dir, dtype="bfloat16").model
    assert next(bf16.parameters()).dtype == torch.float32
    assert engine_dtype(bf16) == torch.bfloat16
    assert engine_dtype(policy.model) == torch.float32


def test_a_4bit_layer_computes_its_no_grad_eval_forward_as_its_training_forward(
    tiny_vllm_model_dir: Path,
) -> None:
    """On a CPU with AVX512-BF16 bitsandbytes would repack the weight and compute eval-mode no-grad forwards
    in bfloat16 (~0.4% off per weight): the trainer's "before" log-probs and HF generate would then differ
    from the training forward. pods keeps one precision (on other CPUs this holds either way)."""
    from pods.rollout.vllm import _dequantized

    layer = (
        qlora_policy(tiny_vllm_model_dir).model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    )
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    layer.train()
    training = layer(x.clone().requires_grad_(True)).detach()
    layer.eval()
    with torch.no_grad():
        inference = layer(x)
    assert torch.equal(inference, training)
    assert torch.equal(inference, x @ _dequantized(layer).T)  # and it is what the engine is given


@pytest.mark.skipif(not VLLM_CPU, reason="vllm-cpu is built for x86-64 Linux only")
def test_vllm_samples_exactly_the_qlora_policy_before_and_after_an_update(tiny_vllm_model_dir: Path) -> None:
    from pods.rollout.vllm import VLLMEngine

    policy = qlora_policy(tiny_vllm_model_dir)
    model, tokenizer = policy.model, policy.tokenizer
    model.eval()
    engine = VLLMEngine(model, tokenizer, kv_cache_gb=0.05)
    try:
        # the engine was built unquantized: the 4-bit settings are not in the config it loaded
        assert "quantization_config" not in json.loads((Path(engine._folder) / "config.json").read_text())
        before = engine.generate(PROMPTS, 1, GREEDY)
        expected_before = HFGenerateEngine(model, tokenizer).generate(PROMPTS, 1, GREEDY)
        assert before.texts == expected_before.texts
        assert torch.equal(before.completion_ids, expected_before.completion_ids)

        train_lora(model, tokenizer)
        expected = HFGenerateEngine(model, tokenizer).generate(PROMPTS, 1, GREEDY)
        assert expected.texts != before.texts  # the update changed the policy's completions
        engine.sync_weights(model)
        after = engine.generate(PROMPTS, 1, GREEDY)
        assert after.texts == expected.texts
        assert torch.equal(after.completion_ids, expected.completion_ids)
        # the adapter was folded in for the push only: the 4-bit base is untouched and unmerged
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert not layer.merged and type(layer.base_layer.weight).__name__ == "Params4bit"
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_CPU, reason="vllm-cpu is built for x86-64 Linux only")
def test_pods_train_qlora_picks_vllm_and_logs_a_small_sampler_mismatch(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    import yaml

    from pods.metrics import read_jsonl
    from pods.trainer import PODSTrainer

    settings = {
        **TINY_SETTINGS,
        "rollout_engine": "auto",
        "vllm_cpu_kv_cache_gb": 0.05,
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "learning_rate": 3e-2,
        "save_final": False,
    }
    config = TrainConfig.from_dict(
        {"model": str(tiny_vllm_model_dir), "output_dir": str(tmp_path), **settings}
    )
    trainer = PODSTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset())
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout_engine"] == "vllm"
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [1, 2]
    # vLLM samples dequantize(W) + LoRA delta: the trainer's 4-bit forward gives the same log-probs
    assert all(0 <= row["sampling/sampling_logp_difference/mean"] < 1e-3 for row in metrics)
    assert metrics[-1]["grad_norm"] > 0
