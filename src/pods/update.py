"""The policy update of one step: gradient steps on the kept rows, as a function of the model, the optimizer
and the kept batch (testable without a trainer).

The rows are split into micro-batches of ``micro_batch_size``, accumulated into one optimizer step per pass,
``num_iterations`` passes; packed (``packing``), a micro-batch runs as forwards of at most ``token_budget``
tokens, each backpropagated before the next, so that memory is bounded by the budget. With several processes each
micro-batch runs as many forwards on every process (:func:`padding_logprobs`). Old and reference
log-probs come from evaluation-mode forwards (no dropout); the sampler's log-probs, when the engine reports
them (vLLM), are compared with the old ones: truncated importance weights correct the sampler/trainer
mismatch, and the mismatch is logged. Tool and environment output in a completion (``Rollouts.tool_mask``
0) is context the rows attend to, never a token the loss, the KL or the importance weights weigh. A NaN/inf
loss or gradient norm skips the optimizer step (:class:`NonFiniteGuard`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pods.checkpoint import TrainerState
from pods.config import TrainConfig
from pods.distributed import (
    gradients_kept_local,
    step_was_applied,
    synced_any,
    synced_counts,
    synced_max,
    synced_sum,
)
from pods.errors import NonFiniteError
from pods.loss import (
    Forward,
    forward_logprobs,
    mean_abs_difference,
    plan_forwards,
    planned_logprobs,
    policy_loss,
    truncated_importance_weights,
)
from pods.rollout import Rollouts

# Loss statistics averaged over tokens (metric name -> field of the loss output).
LOSS_STATISTICS = {
    "kl": "kl",
    "clip_ratio/low_mean": "clip_low_fraction",
    "clip_ratio/high_mean": "clip_high_fraction",
    "clip_ratio/region_mean": "clip_fraction",
}


@dataclass
class NonFiniteGuard:
    """A NaN/inf loss or gradient norm on any process skips the optimizer step (weights, optimizer and
    scheduler unchanged); ``limit`` skips in a row end the run. Counts live in the checkpointed state."""

    state: TrainerState
    limit: int
    checkpoint_root: Path

    def allows_step(self, accelerator: Any, finite: bool) -> bool:
        """Whether to take this optimizer step; a collective with several processes (call on every rank)."""
        finite = not synced_any(accelerator, not finite)
        state = self.state
        if finite:
            state.consecutive_skips = 0
            return True
        state.skipped_steps += 1
        state.consecutive_skips += 1
        if state.consecutive_skips >= self.limit:
            raise NonFiniteError(
                f"{self.limit} optimizer steps in a row had a non-finite (NaN or infinite) loss or gradient "
                f"norm, at training step {state.step + 1}; they were skipped, so the weights are those of the "
                f"last good step and the checkpoints in {self.checkpoint_root} are intact. Lower learning_rate "
                "or max_grad_norm, or train in float32 (mixed_precision: no); max_consecutive_skips sets this limit"
            )
        return False


@contextlib.contextmanager
def reference_policy(accelerator: Any, model: torch.nn.Module, reference: torch.nn.Module | None):
    """The KL reference: ``reference`` (a frozen copy, full fine-tuning) or the base with the LoRA adapter
    disabled (no second copy)."""
    if reference is not None:
        yield reference
    else:
        unwrapped = accelerator.unwrap_model(model)
        with unwrapped.disable_adapter():
            yield unwrapped


def policy_update(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batch: Rollouts,
    advantages: torch.Tensor,
    config: TrainConfig,
    guard: NonFiniteGuard,
    reference: torch.nn.Module | None = None,
    trained: torch.Tensor | None = None,
) -> dict[str, float]:
    """Gradient steps on the kept rows ``batch`` with their ``advantages`` [rows]: micro-batches accumulated,
    ``num_iterations`` passes; returns the step's loss metrics (averaged over every process).

    ``trained[rows]`` (default: all) marks the rows the loss weighs; the others (groups a step trains without:
    ``train_fewer``, fillers of an adaptive k) are left out, except as many as keep every one of the
    ``gradient_accumulation_steps`` micro-batches non-empty, and those weigh nothing (no tokens in the loss).
    Fewer rows make smaller micro-batches, never fewer: accelerate, DeepSpeed and FSDP count them. With no
    trained row on any process there is nothing to learn: no optimizer or scheduler step, as for a skipped
    non-finite step."""
    cfg, acc = config, accelerator
    device = acc.device
    num_parts = acc.gradient_accumulation_steps
    if trained is None:
        trained = torch.ones(len(batch), dtype=torch.bool)
    if not synced_any(acc, bool(trained.any())):
        return {"loss": 0.0, **dict.fromkeys(LOSS_STATISTICS, 0.0), "grad_norm": 0.0}
    order = training_rows(trained.cpu(), num_parts)
    weighs = trained.cpu()[order] & first_occurrences(order)
    batch = batch.select(order) if order.numel() != len(batch) or not bool(weighs.all()) else batch
    advantages = advantages.cpu()[order].to(device=device, dtype=torch.float32)
    prompt_ids, prompt_mask = batch.prompt_ids.to(device), batch.prompt_mask.to(device)
    completion_ids = batch.completion_ids.to(device)
    weighing = weighs.unsqueeze(1).to(batch.completion_mask)
    # The rows attend to every completion token, tool output included (context the model read): the forwards
    # are planned on ``attention``. The loss, its token counts, the KL, the importance weights and the
    # sampler mismatch weigh only the tokens the model sampled (``mask``, the batch's loss mask).
    attention = (batch.completion_mask * weighing).to(device)
    mask = (batch.loss_mask * weighing).to(device)
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    # dapo divides by the tokens of the whole batch across processes, grpo and dr_grpo by its sequences; DDP
    # averages gradients, so both are counted per process.
    total_tokens = synced_sum(acc, mask.sum().double()) / acc.num_processes
    total_sequences = float(synced_sum(acc, weighs.sum().double()) / acc.num_processes)

    rows = (prompt_ids, prompt_mask, completion_ids, attention)
    parts = split_evenly(completion_ids.shape[0], num_parts)
    # Each micro-batch's forwards (packed: forwards of at most token_budget tokens), planned once for every
    # pass and for the old and reference log-probs (the reference shares the policy's architecture).
    plans = {
        part.start: plan_forwards(
            model, *[t[part] for t in rows], packing=cfg.packing, token_budget=cfg.token_budget
        )
        for part in parts
    }
    # Under DeepSpeed ZeRO-3 and FSDP every forward gathers parameters, under ZeRO-2 and FSDP every backward
    # reduces gradients, with all processes at once: each micro-batch runs as many forwards on every process
    # as on the one whose rows plan the most, the others filling in with padding forwards that weigh nothing.
    counts = synced_counts(acc, [len(plan) for plan in plans.values()])
    agreed = dict(zip(plans, counts, strict=True))

    def logprobs_of(net: torch.nn.Module, part: slice, **truncation: Any) -> torch.Tensor:
        part_rows = [t[part] for t in rows]
        plan = plans[part.start]
        logprobs = planned_logprobs(net, plan, *part_rows, temperature=temperature, **truncation)
        for _ in range(agreed[part.start] - len(plan)):
            padding_logprobs(net, *part_rows)
        return logprobs

    sampling_logprobs = batch.sampling_logprobs
    correct = cfg.vllm_importance_sampling_correction and sampling_logprobs is not None
    # Old and reference log-probs: always in evaluation mode (no dropout), at every step. The first pass
    # is on-policy (ratio exactly 1, as with num_iterations = 1); later passes use the old log-probs. With a
    # sampler's log-probs the old ones are the "before" side of the importance weights: from the train-mode
    # forward, dropout noise would enter the weights.
    old_logprobs = ref_logprobs = sampled_view = None
    model.eval()
    if cfg.num_iterations > 1 or sampling_logprobs is not None:
        with torch.no_grad():
            old_logprobs = torch.cat([logprobs_of(model, part) for part in parts])
    if sampling_logprobs is not None and cfg.temperature > 0 and (cfg.top_k > 0 or cfg.top_p < 1):
        # The sampler reports log-probs of the top-k / top-p truncated, renormalised distribution: the
        # mismatch diagnostic compares them with the trainer's under the same truncation, so that it shows
        # engine drift (stale weights) rather than the truncated mass. The weights stay TRL's (<= ~1).
        with torch.no_grad():
            sampled_view = torch.cat(
                [logprobs_of(model, part, top_k=cfg.top_k, top_p=cfg.top_p) for part in parts]
            )
    if cfg.beta > 0:
        # Under the policy's mixed precision: accelerate autocasts the prepared policy, not this copy.
        with torch.no_grad(), acc.autocast(), reference_policy(acc, model, reference) as frozen:
            ref_logprobs = torch.cat([logprobs_of(frozen, part) for part in parts])

    model.train()
    loss = 0.0
    # Token-weighted sums of the statistics, and the token count: averages over tokens (all micro-batches,
    # passes and processes), so they do not depend on micro_batch_size.
    sums = torch.zeros(len(LOSS_STATISTICS) + 1, dtype=torch.float64)
    grad_norms, finite, mismatch = [], True, []
    sampler_weights: dict[int, torch.Tensor] = {}  # per micro-batch, from the first pass
    for iteration in range(cfg.num_iterations):
        for part in parts:
            # accelerate syncs gradients (DDP / DeepSpeed / FSDP) and lets the optimizer step only on
            # the last micro-batch of each pass; it divides the loss by the number of micro-batches,
            # which our loss already accounts for (each part is its share of the batch loss).
            with acc.accumulate(model):
                if sampling_logprobs is not None and part.start not in sampler_weights:
                    # first pass: the trainer's log-probs before this update against the sampler's
                    sampler_weights[part.start] = truncated_importance_weights(
                        old_logprobs[part],
                        sampling_logprobs[part],
                        mask[part],
                        cfg.vllm_importance_sampling_cap,
                    )
                    comparable = old_logprobs if sampled_view is None else sampled_view
                    if bool(mask[part].any()):  # a micro-batch of padding rows has no tokens to compare
                        mismatch.append(
                            mean_abs_difference(comparable[part], sampling_logprobs[part], mask[part])
                        )
                # Packed, a micro-batch runs as forwards of at most token_budget tokens, each backpropagated
                # before the next (activations bounded by the budget); gradients sync after the last one, which
                # may be a padding forward (as many forwards on every process: see ``agreed``).
                part_rows = [t[part] for t in rows]
                forwards = plans[part.start]
                for index in range(agreed[part.start]):
                    last = index == agreed[part.start] - 1
                    with contextlib.nullcontext() if last else gradients_kept_local(acc, model):
                        if index >= len(forwards):
                            nothing = padding_logprobs(model, *part_rows).sum() * 0.0  # zero gradients
                            finite = finite and math.isfinite(nothing.item())
                            acc.backward(nothing)
                            continue
                        forward = forwards[index]
                        logprobs = forward_logprobs(model, forward, *part_rows, temperature=temperature)
                        out = policy_loss(
                            logprobs,
                            advantages[part],
                            mask[part] * forward.rows.to(device).unsqueeze(1),
                            old_logprobs=None if iteration == 0 else old_logprobs[part],
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[part],
                            importance_weights=sampler_weights.get(part.start) if correct else None,
                            epsilon=cfg.epsilon,
                            epsilon_high=cfg.epsilon_high,
                            beta=cfg.beta,
                            loss_type=cfg.loss_type,
                            total_sequences=total_sequences,
                            total_tokens=float(total_tokens),
                            max_completion_length=cfg.max_completion_length,
                            micro_batch_mask=mask[part],
                        )
                        # The loss is checked before backward: under DeepSpeed the optimizer steps inside it.
                        finite = finite and math.isfinite(out.loss.item())
                        acc.backward(out.loss * acc.gradient_accumulation_steps)
                    loss += out.loss.item() / cfg.num_iterations
                    tokens = out.num_tokens.item()
                    sums += torch.tensor(
                        [getattr(out, field).item() * tokens for field in LOSS_STATISTICS.values()] + [tokens]
                    )
                if acc.sync_gradients:
                    grad_norm = float(acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                    grad_norms.append(grad_norm)
                    # DeepSpeed has already stepped, or skipped a step with NaN/inf gradients itself (see
                    # pods.distributed.deepspeed_guards_non_finite_steps); its optimizer.step() is a no-op.
                    applied = step_was_applied(model)
                    # fp16: the GradScaler skips overflowing steps itself and lowers its scale.
                    usable = acc.scaler is not None or guard.allows_step(
                        acc, finite and applied and math.isfinite(grad_norm)
                    )
                    if usable:
                        optimizer.step()
                        scheduler.step()
                    finite = True
                optimizer.zero_grad(set_to_none=True)  # accelerate clears only after a sync
    sums = synced_sum(acc, sums.to(device)).cpu()
    means = {name: float(sums[i] / max(float(sums[-1]), 1.0)) for i, name in enumerate(LOSS_STATISTICS)}
    # TRL's names: how far the sampler's log-probs are from the trainer's, over all processes
    if mismatch:
        ratios = [
            (sampler_weights[part.start].sum() / mask[part].sum().clamp_min(1)).item()
            for part in parts
            if part.start in sampler_weights and bool(mask[part].any())
        ]
        totals = torch.tensor([sum(mismatch), len(mismatch), sum(ratios), len(ratios)], dtype=torch.float64)
        totals = synced_sum(acc, totals.to(device)).cpu()
        means["sampling/sampling_logp_difference/mean"] = float(totals[0] / totals[1])
        means["sampling/importance_sampling_ratio/mean"] = float(totals[2] / totals[3])
        weights = [
            w[mask[part].bool()] for part in parts if (w := sampler_weights.get(part.start)) is not None
        ]
        weights = torch.cat([w.flatten().float().cpu() for w in weights]) if weights else torch.ones(1)
        low, high = -synced_max(acc, -float(weights.min())), synced_max(acc, float(weights.max()))
        means["sampling/importance_sampling_ratio/min"] = low
        means["sampling/importance_sampling_ratio/max"] = high
    return {"loss": loss, **means, "grad_norm": sum(grad_norms) / len(grad_norms)}


def padding_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Log-probs ``[1, 1]`` of the first row's first completion token, one short forward through the whole model:
    a padding forward that keeps this process's collectives (parameter gathers, and with gradients the
    backward's reductions) in step with a process that runs more forwards; callers weigh it by zero."""
    completion = completion_ids[:1, :1] if completion_ids.shape[1] else prompt_ids[:1, -1:]
    whole = Forward(torch.ones(1, dtype=torch.bool), None)
    return forward_logprobs(
        model, whole, prompt_ids[:1], prompt_mask[:1], completion, torch.ones_like(completion)
    )


def training_rows(trained: torch.Tensor, num_parts: int) -> torch.Tensor:
    """``LongTensor``: the rows to run, in order: every trained row, then untrained ones (repeated if need be)
    until there is at least one row per micro-batch."""
    rows = trained.nonzero().flatten()
    missing = num_parts - rows.numel()
    if missing > 0:
        others = (~trained).nonzero().flatten()
        pool = others if others.numel() else torch.arange(trained.numel())
        rows = torch.cat([rows, pool.repeat(-(-missing // pool.numel()))[:missing]]).sort().values
    return rows


def first_occurrences(order: torch.Tensor) -> torch.Tensor:
    """``BoolTensor``: True at the first occurrence of each value of ``order`` (a repeated filler row weighs nothing)."""
    seen: set[int] = set()
    first = []
    for value in order.tolist():
        first.append(value not in seen)
        seen.add(value)
    return torch.tensor(first, dtype=torch.bool)


def split_evenly(rows: int, num_parts: int) -> list[slice]:
    """``num_parts`` contiguous slices of ``rows`` rows, sizes differing by at most one (none empty if rows allow)."""
    size, extra = divmod(rows, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + size + (part < extra))
    return [slice(start, end) for start, end in itertools.pairwise(bounds) if end > start]
