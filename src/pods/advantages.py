"""Group-relative advantages over the rollouts kept in each group (GRPO's baseline, PODS's subset)."""

from __future__ import annotations

import torch

__all__ = ["SCALES", "group_advantages", "zero_variance_groups"]

SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Advantages ``A[G, m]`` of the kept rewards ``rewards[G, m]``, relative to their own group.

    ``A = (r - mean_group) / (std + eps)`` where std is the unbiased std of the group (``scale="group"``,
    the paper's choice), of the whole batch (``"batch"``), or 1 with no eps (``"none"``: mean-centring
    only, as in Dr. GRPO). A group whose rewards are all equal gets exactly zero advantages.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {', '.join(SCALES)}.")
    if not isinstance(rewards, torch.Tensor) or rewards.ndim != 2 or rewards.numel() == 0:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a non-empty 2-D tensor [groups, kept], got {shape}.")
    if eps < 0:
        raise ValueError(f"eps must be non-negative, got {eps}.")
    dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    values = rewards.to(torch.float64)
    centred = values - values.mean(dim=1, keepdim=True)
    if scale == "group":
        std = values.std(dim=1, keepdim=True) if values.shape[1] > 1 else torch.zeros_like(centred[:, :1])
        advantages = centred / (std + eps)
    elif scale == "batch":
        std = values.std() if values.numel() > 1 else values.new_zeros(())
        advantages = centred / (std + eps)
    else:
        advantages = centred
    advantages = advantages.masked_fill(zero_variance_groups(values).unsqueeze(1), 0.0)
    return advantages.to(dtype)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``BoolTensor[G]``: True where every reward of the group is equal (the group carries no signal)."""
    return rewards.amax(dim=1) == rewards.amin(dim=1)
