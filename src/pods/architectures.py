"""How a loaded model's rows may be computed: packed, with a shared prefill, or each row whole.

One place decides, per model, from evidence rather than from a list of flags (:func:`row_plan`):

- the attention implementation must take a custom 4D mask (eager, SDPA, FlexAttention);
- sliding windows are read from the config (``layer_types`` per layer, else ``sliding_window``) and put into
  the packed mask from position ids (a query sees the keys less than ``window`` positions back, as
  transformers' own mask does);
- a **self-check** on the real model, the first time it is planned: a few synthetic rows (longer than the
  window where it is at most :data:`CHECK_MAX_TOKENS`) computed packed and each row whole, and their prompts'
  last-token logits after a shared prefill and after a prefill per row. Where packed rows differ beyond float
  tolerance (a recurrent, convolution or linear-attention state runs from one packed segment into the next;
  an attention the mask does not reach), packing is off with one line naming the reason; likewise the
  shared prefill.

Every rank plans the same model at the same point and checks the same synthetic rows, so the self-check's
forwards are the same collectives everywhere (ZeRO-3 and FSDP gather parameters in each forward).
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import Tensor

from pods.model_info import (
    RowPlan,
    attention_free_types,
    base_model,
    cache_keyword,
    expand_prompt_cache,
    static_plan,
)
from pods.packing import model_inputs, pack

__all__ = ["CHECK_MAX_TOKENS", "VERIFIED_MODEL_TYPES", "packing_blocker", "row_plan", "synthetic_rows"]

# Architectures the suite builds (tests/test_architectures.py): packed = each row whole, or packing refused.
VERIFIED_MODEL_TYPES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_5_text",
        "qwen3_next",
        "mistral",
        "phi3",
        "starcoder2",
        "gemma2",
        "gemma3_text",
        "lfm2",
        "falcon_h1",
        "granitemoehybrid",
        "olmo2",
        "gpt_oss",
    }
)

# The self-check's synthetic rows stay this short; a longer window is not exercised by it (the suite's
# architecture zoo checks the window mechanism on windows of 12 tokens).
CHECK_MAX_TOKENS = 320
# Float rounding: a packed or shared-prefill result may differ from each row computed whole by this much in
# log-prob (float32; 1e-9 in float64), or by NOISE_FACTOR times what transformers' own padded batch differs by
# (mixed precision, 16-bit weights): a state or a window that leaks moves log-probs far more.
TOLERANCE = {torch.float64: 1e-9}
FLOAT_TOLERANCE = 1e-5
NOISE_FACTOR = 10.0


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_plan(model: torch.nn.Module) -> RowPlan:
    """How ``model``'s rows may be computed: decided once per model and attention implementation (the
    self-check runs on the first call), and said on stderr once where packing or the shared prefill is off."""
    base = base_model(model)
    implementation = getattr(getattr(base, "config", None), "_attn_implementation", None)
    known = _PLANS.get(base)
    if known is not None and known[0] == implementation:  # planned anew where the attention was changed
        return known[1]
    plan = _self_check(model, static_plan(base))
    _PLANS[base] = (implementation, plan)
    for what, reason in (("packing", plan.packing_blocker), ("shared prefill", plan.prefill_blocker)):
        if reason is not None:
            _say(f"{what} is off for {type(base).__name__}: {reason}")
    return plan


def packing_blocker(model: torch.nn.Module) -> str | None:
    """Why ``model``'s rows are not packed (a one-line reason), or None when they are."""
    return row_plan(model).packing_blocker


_SAID: set[str] = set()


def _say(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def _tolerance(model: torch.nn.Module, rows: tuple[Tensor, ...], whole: Tensor) -> float:
    """How far from each row computed whole float rounding alone may take a result: the dtype's floor, or
    :data:`NOISE_FACTOR` x the difference of the padded batch (exact up to rounding), whichever is larger."""
    noise = _max_difference(_padded_logprobs(model, rows), whole, rows[3])
    floor = TOLERANCE.get(next(model.parameters()).dtype, FLOAT_TOLERANCE)
    return max(floor, NOISE_FACTOR * noise)


def synthetic_rows(
    vocab_size: int, window: int | None, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two left-padded prompts with three right-padded completions each, random tokens from a fixed seed,
    long enough that a packed unit spans more than ``window`` positions (up to :data:`CHECK_MAX_TOKENS`)."""
    generator = torch.Generator().manual_seed(seed)
    span = min(window + 4, CHECK_MAX_TOKENS // 2) if window else 14
    prompt_lengths = [max(2, span // 3), max(2, span // 5)]
    completion_lengths = [[span, 3, span // 2], [span - 2, span // 3, 1]]
    width_p, width_c = max(prompt_lengths), max(max(c) for c in completion_lengths)
    rows = 3 * len(prompt_lengths)
    prompt_ids = torch.zeros(rows, width_p, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros(rows, width_c, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for p, (length, completions) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        prompt = torch.randint(0, vocab_size, (length,), generator=generator)
        for k, n in enumerate(completions):
            b = 3 * p + k
            prompt_ids[b, width_p - length :], prompt_mask[b, width_p - length :] = prompt, 1
            completion_ids[b, :n] = torch.randint(0, vocab_size, (n,), generator=generator)
            completion_mask[b, :n] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _vocab_size(model: torch.nn.Module) -> int:
    """The rows of the input embedding (under ZeRO-3 a parameter is empty outside a forward: its ``ds_shape``)."""
    weight = base_model(model).get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def _self_check(model: torch.nn.Module, plan: RowPlan) -> RowPlan:
    """``plan`` with packing and the shared prefill switched off where, on synthetic rows, they differ from
    each row computed whole (or raise inside the model)."""
    finite = [w for w in plan.windows.values() if w is not None]
    rows = synthetic_rows(_vocab_size(model), min(finite) if finite else None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                whole = _whole_row_logprobs(model, rows)
                tolerance = _tolerance(model, rows, whole)
            except Exception as error:  # the model fails on plain rows: nothing to compare with; say why
                reason = f"the self-check could not run the model ({_first_line(error)})"
                return RowPlan(plan.packing_blocker or reason, plan.prefill_blocker or reason, plan.windows)
            packing = plan.packing_blocker or _packing_difference(model, plan, rows, whole, tolerance)
            prefill = plan.prefill_blocker or _prefill_difference(model, rows, tolerance)
    finally:
        model.train(was_training)
    return RowPlan(packing, prefill, plan.windows)


def _state_hint(model: torch.nn.Module) -> str:
    kinds = attention_free_types(model)
    if kinds:
        return f"the state of its {', '.join(kinds)} layers runs from one packed segment into the next"
    return "the packed mask misses something the model does (a window or a state its config does not declare)"


def _packing_difference(
    model: torch.nn.Module, plan: RowPlan, rows: tuple[Tensor, ...], whole: Tensor, tolerance: float
) -> str | None:
    """Why packed rows do not give each row's log-probs computed whole (None when they do)."""
    try:
        logprobs = _packed_logprobs(model, rows, plan)
    except Exception as error:  # the model cannot run a packed row: each row whole, exact, said in one line
        return f"{type(base_model(model)).__name__} failed on a packed row ({_first_line(error)})"
    difference = _max_difference(logprobs, whole, rows[3])
    if difference > tolerance:
        return (
            f"packed log-probs differ from each row computed whole by {difference:.2g} "
            f"(tolerance {tolerance:g}): {_state_hint(model)}; each row is computed whole"
        )
    return None


def _prefill_difference(model: torch.nn.Module, rows: tuple[Tensor, ...], tolerance: float) -> str | None:
    """Why a prompt's cache computed once and repeated for its samples does not give the logits of a prefill
    per row (None when it does)."""
    prompt_ids, prompt_mask = rows[0], rows[1]
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    try:
        cache = expand_prompt_cache(model, ids, mask)
        if cache is None:
            return "no row of the check repeats its prompt"
        shared = model(
            input_ids=ids[:, -1:],
            attention_mask=mask,
            position_ids=positions[:, -1:],
            use_cache=True,
            **{cache_keyword(model): cache},
        ).logits[:, -1]
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[
            :, -1
        ]
    except Exception as error:  # a cache that cannot be repeated per sample: each row prefilled, exact
        return f"its cache cannot be repeated per sample ({_first_line(error)})"
    difference = float(
        (torch.log_softmax(shared.float(), -1) - torch.log_softmax(full.float(), -1)).abs().max()
    )
    if difference > tolerance:
        return (
            f"a prompt's cache repeated for its samples gives logits {difference:.2g} away from a prefill per "
            f"row (tolerance {tolerance:g}); each row is prefilled"
        )
    return None


# The check's own log-probs, plain (a full log-softmax of a few short rows): the training path
# (pods.loss) is tested against each row whole by the architecture zoo, not by this check.
def _log_probs_at(logits: Tensor, targets: Tensor) -> Tensor:
    return (
        torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None].to(logits.device))[..., 0].cpu()
    )


def _whole_row_logprobs(model: torch.nn.Module, rows: tuple[Tensor, ...]) -> Tensor:
    """Each row's completion log-probs from a forward of that row alone (no padding, nothing packed)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows
    device = next(model.parameters()).device
    out = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for b in range(prompt_ids.shape[0]):
        prompt = prompt_ids[b][prompt_mask[b].bool()]
        completion = completion_ids[b][completion_mask[b].bool()]
        ids = torch.cat([prompt, completion])[None].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
        out[b, : len(completion)] = _log_probs_at(logits, completion)
    return out


def _padded_logprobs(model: torch.nn.Module, rows: tuple[Tensor, ...]) -> Tensor:
    """The rows as transformers' padded batch: left-padded prompts, positions from the mask."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows
    device = next(model.parameters()).device
    mask = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
    logits = model(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1).to(device),
        attention_mask=mask,
        position_ids=(mask.cumsum(dim=1) - 1).clamp_min(0),
        use_cache=False,
    ).logits
    return _log_probs_at(logits[:, prompt_ids.shape[1] - 1 : -1], completion_ids)


def _packed_logprobs(model: torch.nn.Module, rows: tuple[Tensor, ...], plan: RowPlan) -> Tensor:
    """The rows shared-prefix packed (:func:`pods.packing.pack`) under ``plan``'s masks."""
    packed = pack(*rows, token_budget=10**9)
    logits = model(**model_inputs(model, packed, plan), use_cache=False).logits
    values = _log_probs_at(logits, packed.labels.clamp_min(0)).reshape(-1)[packed.label_index]
    batch, width = packed.shape
    return torch.zeros(batch * width).scatter(0, packed.label_dest, values).view(batch, width)


def _max_difference(logprobs: Tensor, whole: Tensor, mask: Tensor) -> float:
    return float((logprobs.float().cpu() - whole)[mask.bool()].abs().max())


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
