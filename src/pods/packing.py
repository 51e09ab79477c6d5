"""Shared-prefix packing: the rows of a group forward their prompt once.

Rows that share a prompt (the kept completions of a group) become one packed sequence: the prompt once, then
each completion, every completion attending to the prompt and to its own earlier tokens only, its position
ids continuing from the prompt (each completion carries its own copy of the prompt's last token, so that
each position predicts one token: see :class:`Packing`). Such units are laid into packed rows without
padding between them; a group longer than ``token_budget`` tokens splits into several units, each with its
own copy of the prompt.

- :func:`pack`: padded rows -> a :class:`Packing` (pure: token ids and indices, no model);
- :func:`forward_slices`: a packing's rows in slices of at most ``token_budget`` tokens, one forward each (the
  update backpropagates each before the next: its activations are bounded by the budget, not the batch);
- :func:`attention_mask`: its ``[R, 1, T, T]`` boolean mask (True: may attend), with a sliding window where
  the model has one (on position ids);
- :func:`model_mask`: that mask in the form the model's attention takes (bool, additive, FlexAttention's; one
  per layer type where windows differ);
- whether a model's rows are packed at all is decided with the shared prefill in
  :func:`pods.architectures.row_plan`, by a self-check on the real model.

Per-token log-probs go back to the ``[rows, completion_len]`` layout the losses use through the indices
of :class:`Packing` (:func:`pods.loss.completion_logprobs` does it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pods.model_info import RowPlan, base_model

__all__ = [
    "DEFAULT_TOKEN_BUDGET",
    "Packing",
    "attention_mask",
    "attention_path",
    "dense_cost",
    "flex_block_mask",
    "forward_slices",
    "hidden_size",
    "model_inputs",
    "model_mask",
    "pack",
    "packable",
]

DEFAULT_TOKEN_BUDGET = 2048


@dataclass(frozen=True)
class Packing:
    """Packed rows and where each completion token of the padded layout is predicted in them.

    A unit is its prompt but the last token, then each completion preceded by its own copy of that last
    token (at the same position): every position then predicts one token, its ``labels`` entry, so that
    log-probs are a plain next-token gather (and TRL's fused head, which takes one label per position, works).
    The copy costs one token per completion; it sees exactly what the prompt's last token sees.
    """

    input_ids: Tensor  # [R, T] packed tokens, 0 on padding
    position_ids: Tensor  # [R, T] position within the prompt + completion each token belongs to
    block_ids: Tensor  # [R, T] which unit (prompt copy) of the row a token belongs to, -1 on padding
    segment_ids: Tensor  # [R, T] 0 for a shared prompt token, k for the unit's k-th completion, -1 padding
    labels: Tensor  # [R, T] the completion token a position predicts, -100 where none
    label_index: Tensor  # [N] flat packed index (r * T + t) of each labelled position
    label_dest: Tensor  # [N] flat padded index (b * Lc + j) of the completion token it predicts
    first_column: int  # leftmost labelled column (logits are needed from there on)
    shape: tuple[int, int]  # (B, Lc): the padded completion layout

    @property
    def num_tokens(self) -> int:
        """Completion tokens scored."""
        return self.label_index.numel()

    def rows_scored(self) -> Tensor:
        """``[B]`` bool: the padded rows whose completion tokens these packed rows score."""
        batch, width = self.shape
        scored = torch.zeros(batch, dtype=torch.bool)
        scored[self.label_dest // width] = True
        return scored

    def slice_rows(self, start: int, stop: int) -> Packing:
        """Packed rows ``start:stop`` as a packing of their own (the same padded layout)."""
        length = self.input_ids.shape[1]
        inside = (self.label_index >= start * length) & (self.label_index < stop * length)
        index = self.label_index[inside] - start * length
        return Packing(
            input_ids=self.input_ids[start:stop],
            position_ids=self.position_ids[start:stop],
            block_ids=self.block_ids[start:stop],
            segment_ids=self.segment_ids[start:stop],
            labels=self.labels[start:stop],
            label_index=index,
            label_dest=self.label_dest[inside],
            first_column=int((index % length).min()),
            shape=self.shape,
        )


def _is_prefix_mask(mask: Tensor) -> bool:
    """Whether every row of ``mask`` is ones then zeros (a right-padded completion)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all()) if mask.shape[1] > 1 else True


def packable(prompt_mask: Tensor, completion_mask: Tensor) -> bool:
    """Whether the padded rows can be packed exactly: left-padded prompts, right-padded completions."""
    return _is_prefix_mask(prompt_mask.flip(1)) and _is_prefix_mask(completion_mask)


def dense_cost(tokens: int, hidden_size: int | None) -> float:
    """Work of a forward over one row of ``tokens`` tokens, in token-layers of the linear layers: each token
    costs about 12 h^2 multiply-adds there and, under a dense mask, 2 h T in attention (all T keys computed,
    visible or not), so a row costs ``T (1 + T / 6h)``. Without ``hidden_size``: the linear part only."""
    return tokens * (1.0 + tokens / (6.0 * hidden_size)) if hidden_size else float(tokens)


def _units(
    prompts: list[list[int]], rows: list[int], lengths: list[int], token_budget: int, hidden_size: int | None
):
    """Split each prompt's rows into units of at most ``token_budget`` tokens (prompt included, and one
    token per completion); a unit holds at least one completion, so a single prompt + completion longer than
    the budget stands alone. With ``hidden_size`` a completion also starts a unit of its own where joining
    costs more than it saves (:func:`dense_cost`): a short prompt shared by long completions saves little,
    while one long packed row costs attention over all of it, so no unit costs more than its rows unpacked."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in rows:
        groups.setdefault(tuple(prompts[b]), []).append(b)
    units = []
    for prompt, members in groups.items():
        unit: list[int] = []
        size = len(prompt) - 1
        for b in members:
            grown = size + lengths[b] + 1
            alone = len(prompt) + lengths[b]  # the completion's own row, unpacked
            worth = dense_cost(grown, hidden_size) <= dense_cost(size, hidden_size) + dense_cost(
                alone, hidden_size
            )
            if unit and (grown > token_budget or not worth):
                units.append((list(prompt), unit))
                unit, size = [], len(prompt) - 1
            unit.append(b)
            size += lengths[b] + 1
        units.append((list(prompt), unit))
    return units


def _first_fit(sizes: list[int]) -> list[list[int]]:
    """First-fit decreasing into rows as long as the longest unit: no row is longer than the batch needs,
    so filling a row's tail with small units adds no padding and no longer attention span."""
    capacity = max(sizes)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for r, room in enumerate(free):
            if sizes[i] <= room:
                rows[r].append(i)
                free[r] -= sizes[i]
                break
        else:
            rows.append([i])
            free.append(capacity - sizes[i])
    return rows


def pack(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    hidden_size: int | None = None,
) -> Packing:
    """Pack left-padded prompts and right-padded completions ``[B, L]`` (CPU tensors) into shared-prefix rows.

    Rows with the same prompt tokens share one copy of it; rows without completion tokens are left out.
    With the model's ``hidden_size``, completions share a row only where that costs less than apart (see
    :func:`_units`). Needs at least one completion token and :func:`packable` masks.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}.")
    batch, width = completion_ids.shape
    lengths = completion_mask.sum(dim=1).tolist()
    rows = [b for b in range(batch) if lengths[b] > 0]
    if not rows:
        raise ValueError("nothing to pack: no row has a completion token.")
    prompts = [prompt_ids[b][prompt_mask[b].bool()].tolist() for b in range(batch)]
    if any(not prompts[b] for b in rows):
        raise ValueError("every row needs at least one prompt token: it predicts the first completion token.")
    completions = completion_ids.tolist()
    units = _units(prompts, rows, lengths, token_budget, hidden_size)
    sizes = [len(prompt) - 1 + sum(lengths[b] + 1 for b in members) for prompt, members in units]
    layout = _first_fit(sizes)
    length = max(sum(sizes[i] for i in row) for row in layout)

    shape = (len(layout), length)
    input_ids = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    block_ids = torch.full(shape, -1, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    label_index, label_dest, starts = [], [], []
    for r, row in enumerate(layout):
        column = 0
        for block, i in enumerate(row):
            prompt, members = units[i]
            shared = len(prompt) - 1  # the last prompt token goes in front of each completion
            span = slice(column, column + shared)
            input_ids[r, span] = torch.tensor(prompt[:-1], dtype=torch.long)
            position_ids[r, span] = torch.arange(shared)
            block_ids[r, span] = block
            segment_ids[r, span] = 0
            column += shared
            starts.append(column)
            for k, b in enumerate(members, start=1):
                n = lengths[b]
                tokens = torch.tensor([prompt[-1], *completions[b][:n]])
                span = slice(column, column + n + 1)
                input_ids[r, span] = tokens
                position_ids[r, span] = torch.arange(shared, shared + n + 1)
                block_ids[r, span] = block
                segment_ids[r, span] = k
                labels[r, column : column + n] = tokens[1:]
                label_index.append(torch.arange(column, column + n) + r * length)
                label_dest.append(torch.arange(n) + b * width)
                column += n + 1
    return Packing(
        input_ids=input_ids,
        position_ids=position_ids,
        block_ids=block_ids,
        segment_ids=segment_ids,
        labels=labels,
        label_index=torch.cat(label_index),
        label_dest=torch.cat(label_dest),
        first_column=min(starts),
        shape=(batch, width),
    )


def forward_slices(packed: Packing, token_budget: int = DEFAULT_TOKEN_BUDGET) -> list[Packing]:
    """``packed``'s rows in consecutive slices of at most ``token_budget`` tokens each (padding counted; a
    row longer than the budget, a single prompt + completion that is, goes alone). Each slice scores whole
    completions, so a loss over one slice's rows is that slice's exact share of the batch loss."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}.")
    rows, length = packed.input_ids.shape
    per_slice = max(1, token_budget // length)
    if per_slice >= rows:
        return [packed]
    return [packed.slice_rows(start, min(start + per_slice, rows)) for start in range(0, rows, per_slice)]


def attention_mask(
    block_ids: Tensor, segment_ids: Tensor, position_ids: Tensor | None = None, window: int | None = None
) -> Tensor:
    """``[R, 1, T, T]`` bool, True where query t may attend to key s: s <= t in the same unit, s is a prompt
    token or in t's own completion, and (with a sliding ``window``) s is less than ``window`` positions before
    t (transformers' rule, on the position ids: the same keys as in the row computed whole). A padding
    position attends to the padding before it (never an empty row, which would give NaN)."""
    length = block_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=block_ids.device).tril()
    same_unit = block_ids[:, :, None] == block_ids[:, None, :]
    visible = (segment_ids[:, None, :] == 0) | (segment_ids[:, :, None] == segment_ids[:, None, :])
    allowed = causal & same_unit & visible
    if window is not None:
        if position_ids is None:
            raise ValueError("a sliding window needs the position ids of the packed rows.")
        allowed &= position_ids[:, :, None] - position_ids[:, None, :] < window
    return allowed.unsqueeze(1)


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation transformers runs ``model`` with (None for a model without a config)."""
    config = getattr(base_model(model), "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def hidden_size(model: torch.nn.Module) -> int | None:
    """The model's hidden size, for :func:`pack`'s cost rule (None where the config has none)."""
    config = getattr(base_model(model), "config", None)
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) and size > 0 else None


def model_mask(model: torch.nn.Module, packed: Packing, plan: RowPlan) -> Any:
    """The packed rows' mask in the form ``model``'s attention takes: a block mask for FlexAttention (it
    skips the blocks no query sees), bool for SDPA, additive float for eager attention; one per layer type
    (a dict, as transformers builds for itself) where layer types see different windows."""
    device = next(model.parameters()).device
    ids = [t.to(device) for t in (packed.block_ids, packed.segment_ids, packed.position_ids)]
    masks = {kind: _mask_for(model, *ids, window) for kind, window in plan.windows.items()}
    return masks if plan.per_layer_masks else masks[""]


def model_inputs(model: torch.nn.Module, packed: Packing, plan: RowPlan) -> dict[str, Any]:
    """The keyword arguments of ``model``'s forward over packed rows: tokens, mask and position ids, on its device."""
    device = next(model.parameters()).device
    return {
        "input_ids": packed.input_ids.to(device),
        "attention_mask": model_mask(model, packed, plan),
        "position_ids": packed.position_ids.to(device),
    }


def _mask_for(
    model: torch.nn.Module, block_ids: Tensor, segment_ids: Tensor, position_ids: Tensor, window: int | None
) -> Any:
    implementation = attention_implementation(model)
    if implementation == "flex_attention":
        return flex_block_mask(block_ids, segment_ids, position_ids, window)
    allowed = attention_mask(block_ids, segment_ids, position_ids, window)
    if implementation == "sdpa":
        return allowed
    dtype = base_model(model).get_input_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def flex_block_mask(
    block_ids: Tensor, segment_ids: Tensor, position_ids: Tensor | None = None, window: int | None = None
) -> Any:
    """:func:`attention_mask` as a FlexAttention ``BlockMask`` (built from the ids, never as a dense T x T)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        same_unit = block_ids[b, q] == block_ids[b, k]
        visible = (segment_ids[b, k] == 0) | (segment_ids[b, q] == segment_ids[b, k])
        return (k <= q) & same_unit & visible

    def windowed(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return allowed(b, h, q, k) & (position_ids[b, q] - position_ids[b, k] < window)

    rows, length = block_ids.shape
    rule = allowed if window is None else windowed
    return create_block_mask(rule, B=rows, H=None, Q_LEN=length, KV_LEN=length, device=block_ids.device)


def attention_path(model: torch.nn.Module) -> str:
    """How packed rows run on ``model``, in words (what the run says once)."""
    implementation = attention_implementation(model)
    return {
        "flex_attention": "FlexAttention with a block mask (only the blocks a query sees are computed)",
        "sdpa": "SDPA with a boolean 4D mask (on a GPU its memory-efficient kernel; flash kernels take no mask)",
        "eager": "eager attention with an additive 4D mask",
    }.get(implementation, f"{implementation} (unpacked)")
