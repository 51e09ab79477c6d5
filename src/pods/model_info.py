"""What a loaded transformers model is, read from the model and its config: its base under wrappers, the
keywords its forward takes, the attention windows of its layer types (and what they rule out), and its prompt
cache repeated per sample. :func:`pods.architectures.row_plan` decides from these, with a self-check."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "RowPlan",
    "accepts_logits_to_keep",
    "attention_free_types",
    "base_model",
    "cache_keyword",
    "expand_prompt_cache",
    "static_plan",
]

# Attention implementations that apply a custom 4D mask exactly (flash-attention kernels take only
# causal or block-diagonal masks).
MASKED_ATTENTION = ("eager", "sdpa", "flex_attention")
# Layer types (transformers' ``config.layer_types``) that are attention and how far back they see.
FULL_ATTENTION = ("full_attention", "attention")
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RowPlan:
    """How rows of one model may be computed. ``windows`` maps each attention layer type to how many positions
    back its queries see (None: all); a single entry keyed ``""`` applies to every layer."""

    packing_blocker: str | None = None  # why rows are not packed (None: they are)
    prefill_blocker: str | None = None  # why HF generation prefills each row (None: a prompt once)
    windows: dict[str, int | None] = field(default_factory=lambda: {"": None})

    @property
    def per_layer_masks(self) -> bool:
        """Whether the model takes a mask per layer type (a dict keyed by ``config.layer_types``)."""
        return "" not in self.windows


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP/FSDP/DeepSpeed (``.module``) and peft wrappers."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward and ``generate`` take a cache by: ``cache`` from transformers 5.2x on,
    ``past_key_values`` before (deprecated since, removed in 5.40 for forward and 6.0 for generate)."""
    forward = inspect.signature(base_model(model).forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward, under DDP/FSDP/DeepSpeed (``.module``) and peft wrappers, takes
    ``logits_to_keep``."""
    return "logits_to_keep" in inspect.signature(base_model(model).forward).parameters


def static_plan(base: torch.nn.Module) -> RowPlan:
    """What the config alone decides: the attention implementation and the windows."""
    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None) if config is not None else None
    if implementation is None:
        reason = f"{type(base).__name__} is not a transformers model with an attention implementation"
        return RowPlan(reason, reason)
    blocker = None
    if implementation not in MASKED_ATTENTION:
        blocker = (
            f"attention implementation {implementation!r} takes no custom attention mask; "
            f"load the model with one of {', '.join(MASKED_ATTENTION)}"
        )
    windows, window_blocker = _windows(config)
    return RowPlan(blocker or window_blocker, None, windows)


def _windows(config: Any) -> tuple[dict[str, int | None], str | None]:
    """Per attention layer type, how many positions back a query sees; or why rows cannot be packed."""
    sliding = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        windows: dict[str, int | None] = {}
        stateful = []
        for kind in dict.fromkeys(layer_types):
            if kind in FULL_ATTENTION:
                windows[kind] = None
            elif kind == SLIDING_ATTENTION:
                if not isinstance(sliding, int) or sliding < 1:
                    return {"": None}, f"its sliding-attention layers have no sliding_window ({sliding!r})"
                windows[kind] = sliding
            else:  # linear attention, convolutions, Mamba (a state no mask reaches), chunked attention
                stateful.append(kind)
        if stateful:
            return {"": None}, (
                f"its {', '.join(stateful)} layers are not attention under a packed row's mask: a state would "
                "run from one packed segment into the next; each row is computed whole"
            )
        return windows, None
    if isinstance(sliding, int) and getattr(config, "use_sliding_window", True) is not False:
        return {"": sliding}, None
    return {"": None}, None


def attention_free_types(model: torch.nn.Module) -> list[str]:
    config = getattr(base_model(model), "config", None)
    kinds = dict.fromkeys(getattr(config, "layer_types", None) or ())
    return [kind for kind in kinds if kind not in FULL_ATTENTION and kind != SLIDING_ATTENTION]


def expand_prompt_cache(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    """A prompt cache shared by its samples (:func:`pods.rollout.hf.shared_prefill` without its checks): every distinct row's prompt but its last token
    forwarded once, its cache repeated for the rows that share it (None where no row repeats)."""
    unique, inverse = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
    if unique.shape[0] == ids.shape[0]:
        return None
    from transformers import DynamicCache

    width = ids.shape[1]
    prefix_ids, prefix_mask = unique[:, : width - 1], unique[:, width : 2 * width - 1]
    positions = (prefix_mask.long().cumsum(dim=1) - 1).masked_fill(prefix_mask == 0, 1)  # as generate does
    cache = DynamicCache(config=getattr(model, "config", None))
    model(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=positions,
        use_cache=True,
        **{cache_keyword(model): cache},
        **({"logits_to_keep": 1} if accepts_logits_to_keep(model) else {}),  # only the cache is wanted
    )
    cache.reorder_cache(inverse)  # rows may repeat: beam search's reordering, every layer kind's own
    return cache
