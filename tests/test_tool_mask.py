"""The tool mask (groundwork for multi-turn rollouts, issue 44): tool and environment output inside a completion is
context the model attends to, but no loss, KL, importance weight or gradient reaches it; the mask travels with the
rows through selection, joined rounds and a checkpoint's batches in flight."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import pods.update
from pods.checkpoint import TrainerState
from pods.config import TrainConfig
from pods.loss import completion_logprobs
from pods.producer import ProducedBatch, ProducerState
from pods.prompt_filter import SampledGroups
from pods.rollout.base import Rollouts, concat_rollouts
from pods.rollout_worker import load_in_flight, save_in_flight
from pods.update import NonFiniteGuard, policy_update

PROMPTS, N, WIDTH = 2, 2, 8
# per row: the completion's length and the [start, end) of its tool output
LAYOUT = [(8, (2, 5)), (6, (1, 3)), (7, (3, 6)), (5, (0, 0))]


def tool_batch(vocab: int, sampling: bool = False) -> Rollouts:
    """Two prompts x two completions of distinct random tokens, three of them with a span of tool output."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (PROMPTS, 4), generator=generator)
    completion_ids = torch.randint(3, vocab, (PROMPTS * N, WIDTH), generator=generator)
    completion_mask = torch.zeros_like(completion_ids)
    tool_mask = torch.ones_like(completion_ids)
    for row, (length, (start, end)) in enumerate(LAYOUT):
        completion_mask[row, :length] = 1
        tool_mask[row, start:end] = 0
    completion_ids = completion_ids * completion_mask  # pad id 0
    noise = torch.randn(completion_ids.shape, generator=generator)
    return Rollouts(
        prompt_ids=prompts.repeat_interleave(N, dim=0),
        prompt_mask=torch.ones(PROMPTS * N, 4, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        texts=[""] * (PROMPTS * N),
        truncated=torch.zeros(PROMPTS * N, dtype=torch.bool),
        num_prompts=PROMPTS,
        num_generations=N,
        sampling_logprobs=(-3.0 + 0.1 * noise) * completion_mask if sampling else None,
        tool_mask=tool_mask,
    )


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).float()


def run_update(model, batch: Rollouts, advantages: torch.Tensor, micro_batches: int, **settings):
    """One policy_update with plain SGD (no gradient clipping) on a copy of ``model``; returns the copy."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro_batches)
    config = TrainConfig(
        num_generations=N, num_generations_kept=N, prompts_per_step=PROMPTS, micro_batch_size=4 // micro_batches,
        max_grad_norm=1e9, max_completion_length=WIDTH, **settings,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    reference = copy.deepcopy(model).eval() if settings.get("beta") else None
    guard = NonFiniteGuard(TrainerState(), 3, Path("unused"))
    policy_update(accelerator, model, optimizer, scheduler, batch, advantages, config, guard, reference)
    return model


@pytest.mark.parametrize("packing", [True, False])
def test_no_tool_output_token_gets_a_gradient(
    tiny_model_dir: Path, packing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every training forward's per-token log-probs are hooked: over two passes with a KL and the sampler's
    importance weights, in two micro-batches (packed: several forwards each), the gradient at every tool-output
    position is exactly 0.0 and at every sampled position it is not."""
    model = load(tiny_model_dir)
    batch = tool_batch(model.config.vocab_size, sampling=True)
    seen: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (batch rows, scored rows, gradient)
    original = pods.update.forward_logprobs

    def hooked(net, forward, prompt_ids, prompt_mask, completion_ids, completion_mask, **scoring):
        logprobs = original(net, forward, prompt_ids, prompt_mask, completion_ids, completion_mask, **scoring)
        rows = [
            next(i for i in range(len(batch)) if torch.equal(batch.completion_ids[i], row.cpu()))
            for row in completion_ids
        ]
        logprobs.register_hook(lambda grad: seen.append((rows, forward.rows.clone(), grad.detach().cpu())))
        return logprobs

    monkeypatch.setattr(pods.update, "forward_logprobs", hooked)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    settings = {"packing": packing, "token_budget": 16, "beta": 0.1, "num_iterations": 2}
    run_update(model, batch, advantages, micro_batches=2, temperature=0.9, **settings)

    assert len(seen) >= 4 and (not packing or len(seen) > 4)  # two passes of two micro-batches
    sampled_grad = torch.zeros(len(batch), WIDTH)
    for rows, scored, grad in seen:
        tool = batch.completion_mask[rows].bool() & ~batch.tool_mask[rows].bool()
        assert bool((grad[tool] == 0.0).all()), grad[tool]
        sampled_grad[rows] += grad.abs() * scored.unsqueeze(1) * batch.loss_mask[rows]
    assert bool((sampled_grad[batch.loss_mask.bool()] > 0).all()), sampled_grad
    assert int((batch.loss_mask == 0).sum()) > int((batch.completion_mask == 0).sum())  # there is tool output


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_update_is_the_loss_over_sampled_tokens_by_hand(tiny_model_dir: Path, loss_type: str) -> None:
    """One SGD step of policy_update (packed, KL included) lands on the weights of a step on a loss written by
    hand: log-probs with tool output in the context, surrogate and k3 KL over sampled tokens only (grpo: each
    sequence's mean over its sampled tokens). Without the tool mask the step differs."""
    model = load(tiny_model_dir)
    batch = tool_batch(model.config.vocab_size)
    advantages, beta, temperature, lr = torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1, 0.9, 0.1
    settings = {"loss_type": loss_type, "beta": beta, "temperature": temperature}
    updated = run_update(model, batch, advantages, micro_batches=1, **settings)

    by_hand = copy.deepcopy(model)
    rows = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    logprobs = completion_logprobs(by_hand, *rows, temperature=temperature, packing=False)
    with torch.no_grad():
        reference = completion_logprobs(model, *rows, temperature=temperature, packing=False)
    sampled = batch.completion_mask * batch.tool_mask
    delta = reference - logprobs
    per_token = -advantages.unsqueeze(1) * torch.exp(logprobs - logprobs.detach()) + beta * (
        torch.exp(delta) - delta - 1
    )
    per_token = per_token * sampled
    if loss_type == "grpo":
        loss = (per_token.sum(dim=1) / sampled.sum(dim=1)).mean()
    else:
        loss = per_token.sum() / sampled.sum()
    loss.backward()
    with torch.no_grad():
        for parameter in by_hand.parameters():
            parameter -= lr * parameter.grad

    for (name, a), b in zip(updated.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    batch.tool_mask = None
    untouched = run_update(model, batch, advantages, micro_batches=1, **settings)
    assert any(
        not torch.allclose(a, b) for a, b in zip(updated.parameters(), untouched.parameters(), strict=True)
    )


def test_the_tool_mask_is_checked_and_kept_through_selection_rounds_and_a_checkpoint(tmp_path: Path) -> None:
    """Validated like the sampler's log-probs; select trims it with the rows, joining rounds counts a round
    without one as all sampled, and a checkpoint's batch in flight reads back with the same mask."""
    batch = tool_batch(50)
    fields = {name: getattr(batch, name) for name in batch.__dataclass_fields__}
    with pytest.raises(ValueError, match="tool_mask"):
        Rollouts(**{**fields, "tool_mask": batch.tool_mask[:, :-1]})
    with pytest.raises(ValueError, match="tool_mask"):
        Rollouts(**{**fields, "tool_mask": batch.tool_mask * 2})

    kept = batch.select([2, 3])  # the second group's completions, of 7 and 5 tokens: trimmed to 7 columns
    assert torch.equal(kept.tool_mask, batch.tool_mask[2:, :7])
    assert kept.sampled_lengths.tolist() == [4, 5] and kept.completion_lengths.tolist() == [7, 5]

    plain = Rollouts(**{**fields, "tool_mask": None}).select([0, 1])
    joined = concat_rollouts([kept, plain])
    assert torch.equal(joined.tool_mask[:2, :7], kept.tool_mask) and bool(
        (joined.tool_mask[:2, 7:] == 0).all()
    )
    assert torch.equal(joined.tool_mask[2:], torch.ones(2, WIDTH, dtype=torch.long))
    assert concat_rollouts([plain, plain]).tool_mask is None

    sampled = SampledGroups("none")
    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.2]], dtype=torch.float64)
    sampled.add([0, 1], batch, rewards, {"accuracy": rewards})
    sampled.add([2], plain, rewards[:1], {"accuracy": rewards[:1]})
    state = ProducerState(3, [1.0], {"exploration_solved": 0.5, "exploration_failed": 0.5, "streaks": []})
    save_in_flight(tmp_path, [ProducedBatch(4, 3, N, sampled, state, {}, {}, 0.0)])
    (loaded,) = load_in_flight(tmp_path)
    assert torch.equal(loaded.sampled.rounds[0].rollouts.tool_mask, batch.tool_mask)
    assert loaded.sampled.rounds[1].rollouts.tool_mask is None
    taken = loaded.sampled.take(torch.tensor([1, 2]))  # the second group of round one and round two's
    assert torch.equal(taken.rollouts.tool_mask[:2], batch.tool_mask[2:])
    assert bool((taken.rollouts.tool_mask[2:] == 1).all())
