"""The architecture zoo: on tiny random models of every architecture users train (sliding windows, per-layer
windows, attention sinks, MoE, linear attention, convolutions, Mamba), packed log-probs and gradients equal
each row computed whole, or packing is refused with its line; HF generation with a shared prefill samples
the same completions as a prefill per row, or prefills each row; one training step runs on each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pods.architectures import VERIFIED_MODEL_TYPES, _self_check, row_plan
from pods.loss import completion_logprobs, plan_forwards
from pods.model_info import RowPlan
from pods.rollout.base import SamplingParams
from pods.rollout.hf import HFGenerateEngine
from pods.testing import ZOO_CONFIGS, build_tiny_tokenizer, build_zoo_model, save_zoo_model

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

# Architectures whose every layer is attention under a mask: their rows must pack (a window included).
PACKS = {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "starcoder2", "gemma2", "gemma3_text"}
PACKS |= {"olmo2", "gpt_oss"}
# Recurrent state beside attention: linear attention, short convolutions, Mamba.
HYBRID = {"qwen3_5_text", "qwen3_next", "lfm2", "falcon_h1", "granitemoehybrid"}
WINDOWED = {"qwen2", "mistral", "phi3", "starcoder2", "gemma2", "gemma3_text", "gpt_oss"}


def test_the_zoo_is_the_verified_set() -> None:
    assert set(ZOO_CONFIGS) == VERIFIED_MODEL_TYPES == PACKS | HYBRID
    for model_type in WINDOWED:  # rows below reach past each window
        windows = row_plan(build_zoo_model(model_type)).windows.values()
        assert 12 in windows, model_type


def zoo_rows(vocab_size: int = 64) -> tuple[torch.Tensor, ...]:
    """2 prompts (9 and 5 tokens, left-padded) x 3 completions (up to 20 tokens): units of ~45 positions."""
    generator = torch.Generator().manual_seed(1)
    prompt_lengths, completion_lengths = [9, 5], [[14, 3, 20], [18, 11, 2]]
    prompt_ids = torch.zeros(6, 9, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros(6, 20, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for p in range(2):
        prompt = torch.randint(3, vocab_size, (prompt_lengths[p],), generator=generator)
        for k, n in enumerate(completion_lengths[p]):
            b = 3 * p + k
            prompt_ids[b, 9 - len(prompt) :], prompt_mask[b, 9 - len(prompt) :] = prompt, 1
            completion_ids[b, :n] = torch.randint(3, vocab_size, (n,), generator=generator)
            completion_mask[b, :n] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def whole_row_logprobs(model: torch.nn.Module, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Each row alone: no padding, nothing packed (the reference every path must match)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows
    out = torch.zeros(completion_ids.shape)
    for b in range(prompt_ids.shape[0]):
        prompt, completion = (
            prompt_ids[b][prompt_mask[b].bool()],
            completion_ids[b][completion_mask[b].bool()],
        )
        logits = model(input_ids=torch.cat([prompt, completion])[None], use_cache=False).logits
        logprobs = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
        out[b, : len(completion)] = logprobs.gather(-1, completion[:, None])[:, 0]
    return out


def weighted_gradients(model: torch.nn.Module, rows: tuple[torch.Tensor, ...], packing: bool) -> list:
    model.zero_grad()
    weights = torch.linspace(-1.0, 1.5, rows[2].numel()).view(rows[2].shape) * rows[3]
    logprobs = completion_logprobs(model, *rows, packing=packing, token_budget=10**6)
    (logprobs * weights).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("model_type", sorted(ZOO_CONFIGS))
def test_packed_logprobs_and_gradients_equal_each_row_whole(model_type: str, capfd, monkeypatch) -> None:
    monkeypatch.setattr("pods.architectures._SAID", set())  # each line is said once per process
    model = build_zoo_model(model_type)
    rows = zoo_rows()
    mask = rows[3].bool()
    plan = row_plan(model)
    with torch.no_grad():
        whole = whole_row_logprobs(model, rows)
        padded = completion_logprobs(model, *rows, packing=False)
        packed = completion_logprobs(model, *rows, packing=True, token_budget=10**6)
    assert (padded - whole)[mask].abs().max() <= 1e-5
    assert (packed - whole)[mask].abs().max() <= 1e-5
    forwards = plan_forwards(model, *rows, packing=True, token_budget=10**6)
    if model_type in PACKS:
        assert plan.packing_blocker is None
        assert forwards[0].packed is not None and forwards[0].packed.input_ids.shape[1] > 12
        unpacked, packed_grads = weighted_gradients(model, rows, False), weighted_gradients(model, rows, True)
        for a, b in zip(unpacked, packed_grads, strict=True):
            assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-7
    else:  # refused, with its line (printed once per model)
        assert forwards[0].packed is None
        assert "each row is computed whole" in plan.packing_blocker
        line = f"packing is off for {type(model).__name__}: {plan.packing_blocker}"
        assert capfd.readouterr().err.count(line) == 1


HIDDEN = [("mistral", torch.float32), ("gemma2", torch.float32), ("lfm2", torch.float32)]
HIDDEN += [("qwen3_5_text", torch.float32), ("mistral", torch.bfloat16), ("gpt_oss", torch.bfloat16)]


@pytest.mark.parametrize("model_type, dtype", HIDDEN)
def test_the_self_check_refuses_what_the_config_hides(model_type: str, dtype: torch.dtype) -> None:
    """A window or a recurrent layer the config does not declare is caught by the self-check's rows: packing
    off, with the measured difference in its line; in bfloat16 too, where rounding alone does not refuse."""
    model = build_zoo_model(model_type).to(dtype)
    if dtype != torch.float32:
        assert row_plan(model).packing_blocker is None  # the declared window: rounding within tolerance
    checked = _self_check(model, RowPlan(windows={"": None}))
    assert checked.packing_blocker is not None
    assert (
        "differ from each row computed whole" in checked.packing_blocker
        or "failed" in checked.packing_blocker
    )


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("model_type", sorted(ZOO_CONFIGS))
def test_shared_prefill_samples_what_a_prefill_per_row_samples(model_type: str, tokenizer) -> None:
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "eos_token_id": None}
    model = build_zoo_model(model_type, len(tokenizer), special_tokens=special)
    assert row_plan(model).prefill_blocker is None  # every zoo architecture shares its prompt's cache
    prompts = ["Tom has 12 apples and buys 7", "abc"]  # the longer one reaches past the window of 12
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    completions = []
    for share in (True, False):
        engine = HFGenerateEngine(model, tokenizer, share_prefix=share)
        torch.manual_seed(3)
        completions.append(engine.generate(prompts, 3, sampling).completion_ids)
    assert completions[0].shape[1] > 8
    assert torch.equal(completions[0], completions[1])


@pytest.mark.parametrize("model_type", sorted(ZOO_CONFIGS))
def test_one_training_step_with_hf_generate(model_type: str, tmp_path: Path) -> None:
    from tiny_run import TINY_SETTINGS, count_of_a, tiny_dataset

    from pods.config import TrainConfig
    from pods.trainer import PODSTrainer

    folder = save_zoo_model(tmp_path / "model", model_type)
    settings = {**TINY_SETTINGS, "max_steps": 1, "max_completion_length": 12}
    config = TrainConfig.from_dict({"model": str(folder), "output_dir": str(tmp_path / "run"), **settings})
    trainer = PODSTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset(8))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.train()
    assert result.steps == 1
    changed = [not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)]
    assert any(changed)


@pytest.mark.parametrize("model_type", sorted(PACKS))
def test_the_trl_drop_in_packs_each_architecture_exactly(model_type: str) -> None:
    """The drop-in's packed old/reference log-probs (TRL's fused LM head over packed rows, the windows in
    the mask) equal each row computed whole."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    from pods.integrations.trl import fused_packed_logps

    model = build_zoo_model(model_type)
    add_fused_lm_head(model)
    rows = zoo_rows()
    with torch.no_grad():
        packed = fused_packed_logps(model, list(rows), token_budget=10**6)
        whole = whole_row_logprobs(model, rows)
    assert (packed - whole)[rows[3].bool()].abs().max() <= 1e-5
