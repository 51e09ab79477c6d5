"""The policy update on rows that weigh nothing (groups trained without, fillers of an adaptive k): it equals the
update on the weighing rows alone, for every loss type, keeps the micro-batch count, and with nothing to learn
takes no step at all."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pods.checkpoint import TrainerState
from pods.config import TrainConfig
from pods.rollout import HFGenerateEngine, SamplingParams
from pods.update import NonFiniteGuard, policy_update, split_evenly, training_rows


def test_training_rows_keep_every_trained_row_and_one_per_micro_batch() -> None:
    trained = torch.tensor([False, True, False, True])
    assert training_rows(trained, 1).tolist() == [1, 3]
    assert training_rows(trained, 3).tolist() == [0, 1, 3]  # one untrained row fills the third micro-batch
    assert training_rows(torch.zeros(2, dtype=torch.bool), 3).tolist() == [0, 0, 1]  # repeated if need be
    assert [(s.start, s.stop) for s in split_evenly(7, 3)] == [(0, 3), (3, 5), (5, 7)]
    assert [(s.start, s.stop) for s in split_evenly(64, 1)] == [(0, 64)]


def rollouts(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = HFGenerateEngine(model, tokenizer)
    batch = engine.generate(["say a", "say b"], 2, SamplingParams(max_new_tokens=6, temperature=1.0))
    return model, batch


def update(model, batch, advantages, trained, micro_batches: int, loss_type: str, beta: float):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro_batches)
    config = TrainConfig(
        num_generations=2, num_generations_kept=2, prompts_per_step=2, micro_batch_size=4 // micro_batches,
        loss_type=loss_type, beta=beta, learning_rate=1e-2, max_completion_length=6,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    reference = copy.deepcopy(model) if beta else None
    guard = NonFiniteGuard(TrainerState(), 3, Path("unused"))
    metrics = policy_update(
        accelerator, model, optimizer, scheduler, batch, advantages, config, guard, reference, trained=trained
    )
    return model, optimizer, metrics


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_rows_that_weigh_nothing_leave_the_update_as_if_absent(tiny_model_dir: Path, loss_type: str) -> None:
    """Four rows, the last three trained without, over two micro-batches (one of them padding only): the weights
    after the update are those of the update on the first row alone, in one micro-batch."""
    model, batch = rollouts(tiny_model_dir)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trained = torch.tensor([True, False, False, False])
    weighed, _, metrics = update(model, batch, advantages, trained, 2, loss_type, beta=0.1)
    alone, _, _ = update(model, batch.select([0]), advantages[:1], None, 1, loss_type, beta=0.1)
    everything, _, _ = update(model, batch, advantages, None, 2, loss_type, beta=0.1)
    for (name, a), b in zip(weighed.named_parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    assert any(
        not torch.equal(a, c) for a, c in zip(weighed.parameters(), everything.parameters(), strict=True)
    )
    assert metrics["grad_norm"] > 0


def test_nothing_to_learn_takes_no_step(tiny_model_dir: Path) -> None:
    """No row weighs on any process: no forward, no optimizer step (Adam's moments stay empty), the weights stay."""
    model, batch = rollouts(tiny_model_dir)
    after, optimizer, metrics = update(
        model, batch, torch.ones(4), torch.zeros(4, dtype=torch.bool), 1, "grpo", beta=0.0
    )
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), after.parameters(), strict=True))
    assert not optimizer.state and metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
