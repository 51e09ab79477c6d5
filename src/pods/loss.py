"""The GRPO/PODS policy loss and the log-probs it needs.

- :func:`selected_token_logprobs`: ``log p(token)`` from logits, chunk by chunk, never holding a full
  ``[B, L, V]`` log-softmax (with a 151k vocabulary that tensor would dominate memory).
- :func:`completion_logprobs`: log-probs of completion tokens under a causal LM (prompt + completion in
  one forward, positions from the attention mask, only the logits that are needed; or shared-prefix packed,
  each prompt once); optionally under the top-k / top-p truncated, renormalised distribution a sampler
  draws from (no gradient). :func:`plan_forwards` + :func:`forward_logprobs` are the same, forward by
  forward (the update backpropagates each before the next).
- :func:`policy_loss`: the clipped surrogate, an optional k3 KL penalty and the token aggregation modes,
  written so that summing the losses of micro-batches gives exactly the loss of the whole batch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pods.architectures import row_plan
from pods.model_info import RowPlan, accepts_logits_to_keep
from pods.packing import (
    DEFAULT_TOKEN_BUDGET,
    Packing,
    attention_path,
    forward_slices,
    hidden_size,
    model_inputs,
    pack,
    packable,
)

__all__ = [
    "LOSS_TYPES",
    "Forward",
    "LossOutput",
    "completion_logprobs",
    "forward_logprobs",
    "mean_abs_difference",
    "plan_forwards",
    "planned_logprobs",
    "policy_loss",
    "selected_token_logprobs",
    "truncated_importance_weights",
]

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")

# Default chunk: about 2**23 logits (32 MiB per float32 scratch buffer), i.e. 55 tokens of a 151k vocabulary,
# 262 tokens of a 32k one, everything at once for a tiny test vocabulary.
CHUNK_ELEMENTS = 2**23


def _chunks(batch: int, length: int, chunk_size: int):
    """Yield (row slice, column slice) blocks of about ``chunk_size`` tokens covering a [batch, length] grid."""
    rows_per_chunk = max(1, chunk_size // max(length, 1))
    cols_per_chunk = length if rows_per_chunk > 1 else chunk_size
    for r in range(0, batch, rows_per_chunk):
        for c in range(0, length, max(cols_per_chunk, 1)):
            yield slice(r, r + rows_per_chunk), slice(c, c + cols_per_chunk)


class _SelectedLogProbs(torch.autograd.Function):
    """log_softmax(logits / T).gather(token) with a chunked forward and a chunked, recomputing backward.

    Autograd would save a float32 log-softmax of every chunk for the backward pass (as much memory as a
    full one); here only the logits (alive anyway) are kept, and the backward recomputes each chunk's
    softmax. The fused log_softmax / softmax kernels on cache-sized chunks are also the fastest way here.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, token_ids: Tensor, temperature: float, chunk_size: int) -> Tensor:
        batch, length, _ = logits.shape
        out = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
        for rows, cols in _chunks(batch, length, chunk_size):
            out[rows, cols] = _chunk_logprobs(logits[rows, cols], token_ids[rows, cols], temperature)
        ctx.save_for_backward(logits, token_ids)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, token_ids = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        batch, length, _ = logits.shape
        for rows, cols in _chunks(batch, length, ctx.chunk_size):
            grad_logits[rows, cols] = _chunk_grad(
                logits[rows, cols], token_ids[rows, cols], grad_out[rows, cols], ctx.temperature
            )
        return grad_logits, None, None, None


# One chunk at a time, in functions so that a chunk's scratch buffers are freed before the next one.
def _scaled(logits: Tensor, temperature: float) -> Tensor:
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def _chunk_logprobs(logits: Tensor, token_ids: Tensor, temperature: float) -> Tensor:
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def _chunk_grad(logits: Tensor, token_ids: Tensor, grad_out: Tensor, temperature: float) -> Tensor:
    # d/dx [log_softmax(x)_t] = onehot(t) - softmax(x); then the chain rule through x = logits / T.
    g = grad_out.float().unsqueeze(-1)
    grad = torch.softmax(_scaled(logits, temperature), dim=-1).mul_(-g)
    grad.scatter_add_(-1, token_ids.unsqueeze(-1), g)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)


def _chunk_truncated_logprobs(
    logits: Tensor, token_ids: Tensor, temperature: float, top_k: int, top_p: float
) -> Tensor:
    """log-probs under softmax(logits / T) restricted to its top-k, then to its top-p nucleus, renormalised
    (vLLM's rule: drop the least likely tokens while their total stays within 1 - top_p). A token outside
    the kept set gets its untruncated log-prob (finite, so a mismatch shows as a gap, not as infinity)."""
    scaled = _scaled(logits, temperature)
    full = torch.log_softmax(scaled, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = scaled.sort(dim=-1)
        dropped = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1] = False  # the most likely token always stays
        scaled = scaled.scatter(-1, order, ascending.masked_fill(dropped, float("-inf")))
    truncated = torch.log_softmax(scaled, dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(torch.isfinite(truncated), truncated, full)


def selected_token_logprobs(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """``log softmax(logits / temperature)`` at ``token_ids``: ``[B, L, V], [B, L] -> [B, L]`` in float32.

    Computed in chunks of about ``chunk_size`` tokens (default: ``CHUNK_ELEMENTS // V``), so neither the
    forward nor the backward pass materialises a full ``[B, L, V]`` log-softmax: peak scratch memory is a
    few chunks.
    """
    if logits.ndim != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, L, V] and token_ids [B, L]; got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}."
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}.")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (tokens per chunk) or None, got {chunk_size}.")
    return _SelectedLogProbs.apply(logits, token_ids.long(), float(temperature), int(chunk_size))


def _last_used_column(mask: Tensor) -> int:
    """Index of the last column where some row of ``mask`` is nonzero (-1 when there is none)."""
    columns = mask.any(dim=0).nonzero()
    return int(columns.max()) if columns.numel() else -1


@dataclass(frozen=True)
class Forward:
    """One forward pass over a micro-batch: the rows whose completions it scores (``rows`` [B] bool) and,
    when packed, their packed rows (None: the padded rows as they are, all of them)."""

    rows: Tensor
    packed: Packing | None


def _check_rows(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> None:
    if prompt_ids.ndim != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_ids and prompt_mask must both be [B, Lp]; got {tuple(prompt_ids.shape)} and "
            f"{tuple(prompt_mask.shape)}."
        )
    if completion_ids.ndim != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion_ids and completion_mask must both be [B, Lc]; got {tuple(completion_ids.shape)} "
            f"and {tuple(completion_mask.shape)}."
        )
    if completion_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(
            f"prompt and completion batch sizes differ: {prompt_ids.shape[0]} vs {completion_ids.shape[0]}."
        )
    if prompt_ids.shape[0] and int(prompt_mask.sum(dim=1).min()) == 0:
        raise ValueError("every row needs at least one prompt token: it predicts the first completion token.")


def plan_forwards(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    packing: bool = True,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
) -> list[Forward]:
    """The forward passes that score these rows: one over the padded rows, or (``packing``, where the model's
    attention takes the mask: :func:`pods.architectures.row_plan`) shared-prefix packed rows, each prompt
    once, in forwards of at most ``token_budget`` tokens (:func:`pods.packing.forward_slices`)."""
    _check_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    everything = Forward(torch.ones(prompt_ids.shape[0], dtype=torch.bool), None)
    if not packing:
        return [everything]
    # decided (and self-checked) on every rank at the same point, whatever its rows: the check's forwards
    # are collectives under ZeRO-3 / FSDP
    plan = row_plan(model)
    if plan.packing_blocker is not None or completion_ids.shape[1] == 0:
        return [everything]
    if not _packs(model, prompt_mask, completion_mask):
        return [everything]
    rows = (prompt_ids.cpu(), prompt_mask.cpu(), completion_ids.cpu(), completion_mask.cpu())
    packed = pack(*rows, token_budget, hidden_size(model))
    return [Forward(piece.rows_scored(), piece) for piece in forward_slices(packed, token_budget)]


def forward_logprobs(
    model: torch.nn.Module,
    forward: Forward,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tensor:
    """Log-probs ``[B, Lc]`` (float32) of the completion tokens ``forward`` scores (0 at every other position
    when packed; finite but meaningless at masked positions unpacked). See :func:`completion_logprobs`."""
    device = next(model.parameters()).device
    batch, num_completion = completion_ids.shape
    if batch == 0 or num_completion == 0:
        return torch.zeros(batch, num_completion, dtype=torch.float32, device=device)
    if top_k > 0 or top_p < 1.0:
        if torch.is_grad_enabled():
            raise ValueError(
                "top-k / top-p truncated log-probs have no gradient; compute them under no_grad."
            )
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}.")
    scoring = {"temperature": temperature, "chunk_size": chunk_size, "top_k": top_k, "top_p": top_p}
    if forward.packed is not None:
        return _packed_logprobs(model, forward.packed, scoring, row_plan(model))
    use_logits_to_keep = accepts_logits_to_keep(model)

    # Trim columns that are padding in every row: leading prompt padding and trailing completion padding
    # (pure speed-up: positions come from the mask).
    first = int(prompt_mask.any(dim=0).long().argmax())
    width = max(1, _last_used_column(completion_mask) + 1)
    ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :width]], dim=1).to(device)
    mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :width]], dim=1).long().to(device)
    position_ids = (mask.cumsum(dim=1) - 1).clamp_min(0)
    keep = {"logits_to_keep": width + 1} if use_logits_to_keep else {}
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False, **keep
    ).logits
    # The logit at position t predicts token t + 1: the last width + 1 logits minus the final one.
    logits = logits[:, -(width + 1) : -1]
    logprobs = _token_logprobs(logits, completion_ids[:, :width].to(device), **scoring)
    return torch.nn.functional.pad(logprobs, (0, num_completion - width))


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    packing: bool = True,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
) -> Tensor:
    """Log-probs ``[B, Lc]`` (float32) of ``completion_ids`` under ``model`` given left-padded prompts.

    With ``top_k > 0`` or ``top_p < 1`` they are the log-probs under the truncated, renormalised
    distribution a top-k / top-p sampler draws from (what vLLM reports as its processed log-probs); only
    without gradients.

    Positions come from the attention mask, so a left-padded row scores exactly as it would unpadded.
    Inputs may live on the CPU (as :class:`pods.rollout.Rollouts` does): they are moved to the model's
    device, and the result is on that device. Callers split a batch into micro-batches themselves.
    Gradients flow unless the caller wraps this in ``torch.no_grad()`` (as it should for old/ref
    log-probs). Values at masked completion positions are finite but meaningless (0 past the longest
    completion of a micro-batch; 0 everywhere they are masked when packed).

    With ``packing`` (where the model's attention takes a custom mask: :func:`pods.architectures.row_plan`)
    rows with the same prompt forward it once, in forwards of at most ``token_budget`` tokens: the same
    log-probs, each prompt computed once. (With gradients, all forwards' activations are held until the
    caller's backward: :func:`pods.update.policy_update` backpropagates forward by forward instead.)
    """
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    forwards = plan_forwards(model, *rows, packing=packing, token_budget=token_budget)
    return planned_logprobs(
        model, forwards, *rows, temperature=temperature, chunk_size=chunk_size, top_k=top_k, top_p=top_p
    )


def planned_logprobs(
    model: torch.nn.Module,
    forwards: list[Forward],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    **scoring: Any,
) -> Tensor:
    """:func:`completion_logprobs` over forwards already planned (:func:`plan_forwards`): a caller scoring
    the same rows several times (old, reference, training log-probs) packs them once."""
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    parts = [forward_logprobs(model, forward, *rows, **scoring) for forward in forwards]
    # packed forwards score disjoint tokens and leave 0 everywhere else
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)


def _token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float, chunk_size: int | None, top_k: int, top_p: float
) -> Tensor:
    """``[R, K, V], [R, K] -> [R, K]``: full log-probs (chunked, with gradient), or under top-k / top-p."""
    if top_k <= 0 and top_p >= 1.0:
        return selected_token_logprobs(logits, targets, temperature, chunk_size)
    batch, width = targets.shape
    step = max(1, (chunk_size or CHUNK_ELEMENTS // max(logits.shape[-1], 1)) // max(width, 1))
    return torch.cat(
        [
            _chunk_truncated_logprobs(logits[r : r + step], targets[r : r + step], temperature, top_k, top_p)
            for r in range(0, batch, step)
        ]
    )


_REPORTED: set[str] = set()


def _packs(model: torch.nn.Module, prompt_mask: Tensor, completion_mask: Tensor) -> bool:
    """Whether this batch of a packing model runs packed: the padding is the usual one, and there is a
    completion token to score. On a GPU, say once which attention runs it."""
    if not (bool(completion_mask.any()) and packable(prompt_mask.cpu(), completion_mask.cpu())):
        return False
    path = attention_path(model)
    if path not in _REPORTED and next(model.parameters()).device.type == "cuda":
        _REPORTED.add(path)
        print(f"packing: {path}", file=sys.stderr)
    return True


def _packed_logprobs(model: torch.nn.Module, packed: Packing, scoring: dict, plan: RowPlan) -> Tensor:
    """:func:`forward_logprobs` over shared-prefix packed rows (:mod:`pods.packing`): each prompt once."""
    device = next(model.parameters()).device
    length = packed.input_ids.shape[1]
    # Logits only from the first labelled column on (transformers keeps a suffix of the row).
    keep = length - packed.first_column
    extra = {"logits_to_keep": keep} if accepts_logits_to_keep(model) else {}
    logits = model(**model_inputs(model, packed, plan), use_cache=False, **extra).logits
    if logits.shape[1] != keep:  # a model without logits_to_keep (a no-op slice would copy in backward)
        logits = logits[:, -keep:]
    offset = length - keep  # packed column c is logits column c - offset
    targets = packed.labels[:, offset:].clamp_min(0).to(device)  # 0 where nothing is predicted: dropped below
    logprobs = _token_logprobs(logits, targets, **scoring).reshape(-1)
    index = packed.label_index.to(device)
    values = logprobs[(index // length) * keep + index % length - offset]
    batch, width = packed.shape
    flat = torch.zeros(batch * width, dtype=values.dtype, device=device)
    return flat.scatter(0, packed.label_dest.to(device), values).view(batch, width)


@dataclass
class LossOutput:
    """A micro-batch's loss (its share of the batch loss) and detached per-token statistics of it."""

    loss: Tensor  # scalar, differentiable
    kl: Tensor  # mean k3 KL to the reference over masked tokens (0 without a reference)
    clip_fraction: Tensor  # fraction of masked tokens where the clip bound is active (zero gradient)
    clip_low_fraction: Tensor  # ... where it is the lower bound (ratio < 1 - epsilon, negative advantage)
    clip_high_fraction: (
        Tensor  # ... where it is the upper bound (ratio > 1 + epsilon_high, positive advantage)
    )
    ratio_mean: Tensor  # mean importance ratio over masked tokens
    num_tokens: Tensor  # masked tokens in this micro-batch (weights for averaging the statistics above)


def _check_same_shape(name: str, tensor: Tensor | None, shape: torch.Size) -> None:
    if tensor is not None and tensor.shape != shape:
        raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(tensor.shape)}.")


def policy_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    importance_weights: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: str = "grpo",
    total_sequences: int | Tensor,
    total_tokens: int | Tensor,
    max_completion_length: int,
    micro_batch_mask: Tensor | None = None,
) -> LossOutput:
    """Clipped GRPO surrogate (+ ``beta`` x k3 KL) of one micro-batch, scaled as its share of the batch loss.

    ``logprobs``, ``mask`` and the optional old/ref log-probs are ``[B, L]``; ``advantages`` is ``[B]``
    (one per sequence) or ``[B, L]``. ``total_sequences`` and ``total_tokens`` (masked tokens) count the
    whole optimisation batch, so that the micro-batch losses add up to the batch loss:

    - ``"grpo"``: sum over sequences of the sequence's token mean, / ``total_sequences``;
    - ``"bnpo"`` (TRL's): this micro-batch's token mean, weighted by its share of the sequences, so the
      batch loss is the mean over (equal-sized) micro-batches of their own token means (where ``mask``
      covers one forward's rows of a micro-batch, ``micro_batch_mask`` is the whole micro-batch's mask, which
      sets the mean and the share);
    - ``"dapo"``: token sum / ``total_tokens`` (the caller sets its scope: all processes, as DAPO does);
    - ``"dr_grpo"``: token sum / (``total_sequences`` x ``max_completion_length``).

    ``old_logprobs=None`` means on-policy: ratio 1 with gradients flowing through ``logprobs``.
    ``importance_weights`` (``[B, L]``, no gradient) multiplies each token's surrogate term, not the KL:
    the correction for a sampler whose probabilities differ from the trainer's
    (:func:`truncated_importance_weights`).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}.")
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, L], got shape {tuple(logprobs.shape)}.")
    _check_same_shape("mask", mask, logprobs.shape)
    _check_same_shape("old_logprobs", old_logprobs, logprobs.shape)
    _check_same_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    _check_same_shape("importance_weights", importance_weights, logprobs.shape)
    _check_same_shape("micro_batch_mask", micro_batch_mask, logprobs.shape)
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)
    batch, length = logprobs.shape
    if advantages.ndim != 2 or advantages.shape[0] != batch or advantages.shape[1] not in (1, length):
        raise ValueError(
            f"advantages must be [B] or [B, L] with B, L = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}."
        )
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon} and {epsilon_high}.")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}.")
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta = {beta} > 0 needs ref_logprobs (log-probs under the reference model).")
    if total_sequences <= 0:
        raise ValueError(f"total_sequences must be > 0, got {total_sequences}.")
    if loss_type == "dapo" and total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0 for loss_type {loss_type!r}, got {total_tokens}.")
    if loss_type == "dr_grpo" and max_completion_length <= 0:
        raise ValueError(f"max_completion_length must be > 0 for dr_grpo, got {max_completion_length}.")

    # Everything joins logprobs' device (rollout masks live on the CPU). Masked positions are zeroed
    # first, so that -inf/NaN there cannot leak into values or gradients.
    device = logprobs.device
    mask = mask.to(device).bool()
    logprobs = logprobs.float().masked_fill(~mask, 0.0)
    advantages = advantages.to(device=device, dtype=torch.float32)
    if old_logprobs is None:
        old = logprobs.detach()
    else:
        old = old_logprobs.to(device).float().masked_fill(~mask, 0.0)

    ratio = torch.exp(logprobs - old)
    clipped_ratio = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)
    unclipped_term, clipped_term = ratio * advantages, clipped_ratio * advantages
    per_token = -torch.minimum(unclipped_term, clipped_term)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach().to(device).float().masked_fill(~mask, 0.0)
    if ref_logprobs is not None:
        delta = ref_logprobs.to(device).float().masked_fill(~mask, 0.0) - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        if beta > 0:
            per_token = per_token + beta * k3
    per_token = per_token * mask

    if loss_type == "grpo":
        token_counts = mask.sum(dim=1).clamp_min(1)
        loss = (per_token.sum(dim=1) / token_counts).sum() / total_sequences
    elif loss_type == "bnpo":
        whole = mask if micro_batch_mask is None else micro_batch_mask.to(device).bool()
        sequences = whole.any(dim=1).sum()  # a padding row (no tokens) is no sequence
        loss = per_token.sum() / whole.sum().clamp_min(1) * (sequences / total_sequences)
    elif loss_type == "dapo":
        loss = per_token.sum() / total_tokens
    else:
        loss = per_token.sum() / (total_sequences * max_completion_length)

    with torch.no_grad():
        num_tokens = mask.sum()
        denom = num_tokens.clamp_min(1)
        clip_active = (clipped_term < unclipped_term) & mask  # min picked the clipped value: no gradient
        clip_low = clip_active & (ratio < 1.0 - epsilon)
        kl = (k3 * mask).sum() / denom if ref_logprobs is not None else logprobs.new_zeros(())
        return LossOutput(
            loss=loss,
            kl=kl.detach(),
            clip_fraction=clip_active.sum() / denom,
            clip_low_fraction=clip_low.sum() / denom,
            clip_high_fraction=(clip_active & ~clip_low).sum() / denom,
            ratio_mean=(ratio * mask).sum() / denom,
            num_tokens=num_tokens,
        )


def truncated_importance_weights(
    trainer_logprobs: Tensor, sampling_logprobs: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Per-token ``min(exp(logp_trainer - logp_sampler), cap)``, 0 on padding (TRL's "token_truncate").

    A sampler such as vLLM computes slightly different probabilities than the trained model (other
    kernels, other precision): the surrogate's gradient is only unbiased for tokens drawn from the
    trainer's policy, so each token is reweighted by the ratio of the two, truncated to bound the variance.
    With top-p < 1 or top-k > 0 the sampler's log-probs are those of the truncated, renormalised
    distribution, so against the trainer's full distribution the weights are at most about 1 (the kept
    mass), as in TRL.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}.")
    _check_same_shape("sampling_logprobs", sampling_logprobs, trainer_logprobs.shape)
    _check_same_shape("mask", mask, trainer_logprobs.shape)
    mask = mask.to(trainer_logprobs.device).bool()
    delta = (
        trainer_logprobs.detach().float() - sampling_logprobs.to(trainer_logprobs.device).float()
    ).masked_fill(~mask, 0.0)
    return torch.exp(delta).clamp(max=cap).masked_fill(~mask, 0.0)


def mean_abs_difference(logprobs: Tensor, other: Tensor, mask: Tensor) -> float:
    """Mean ``|logprobs - other|`` over masked tokens: the sampler/trainer mismatch logged each step."""
    mask = mask.to(logprobs.device).bool()
    difference = (logprobs.detach().float() - other.to(logprobs.device).float()).abs().masked_fill(~mask, 0.0)
    return float(difference.sum() / mask.sum().clamp_min(1))
