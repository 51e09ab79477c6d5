"""Group-relative advantages over the rollouts kept in each group (GRPO's baseline, PODS's subset), and
:func:`downsample`, the one step both trainers share: select m of n per group, gather the kept rewards,
compute their advantages and return the kept row indices."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pods.selection import Rule, select

__all__ = [
    "EQUAL_REWARDS_RTOL",
    "SCALES",
    "Downsampled",
    "downsample",
    "group_advantages",
    "nanstd",
    "zero_variance_groups",
]

SCALES = ("group", "batch", "none")

# Rewards of a group that differ by less than this fraction of the group's largest magnitude count as equal:
# a float32 sum of reward functions (TRL's) or 0.1 + 0.2 against 0.3 must not turn a group "informative".
EQUAL_REWARDS_RTOL = 1e-6


def group_advantages(
    rewards: torch.Tensor,
    scale: str = "group",
    eps: float = 1e-4,
    *,
    batch_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``A[G, m]`` of the kept rewards ``rewards[G, m]``, relative to their own group.

    ``A = (r - mean_group) / (std + eps)`` where std is the unbiased std of the group (``scale="group"``,
    the paper's choice), of the whole batch (``"batch"``: ``batch_rewards`` when given, e.g. every
    process's kept rewards, else ``rewards``), or 1 with no eps (``"none"``: mean-centring only, as in
    Dr. GRPO). A group whose rewards are all equal gets exactly zero advantages. A NaN reward (a completion
    every reward function scored ``None``) is left out of the mean and std and gets advantage 0, as in TRL.
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
    centred = values - values.nanmean(dim=1, keepdim=True)
    if scale == "group":
        advantages = centred / (nanstd(values, dim=1) + eps)
    elif scale == "batch":
        everything = values if batch_rewards is None else batch_rewards.to(values)
        advantages = centred / (nanstd(everything.reshape(1, -1), dim=1) + eps)
    else:
        advantages = centred
    advantages = advantages.masked_fill(zero_variance_groups(values).unsqueeze(1), 0.0)
    return torch.nan_to_num(advantages, nan=0.0).to(dtype)


def nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std over the non-NaN entries along ``dim`` (kept as a size-1 dim); 0 with fewer than two."""
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    squares = (values - values.nanmean(dim=dim, keepdim=True)).pow(2).nansum(dim=dim, keepdim=True)
    return torch.where(count > 1, squares / (count - 1).clamp_min(1), torch.zeros_like(squares)).sqrt()


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``BoolTensor[G]``: True where every (non-NaN) reward of the group is equal: no signal. Equal up to
    rounding: the spread is at most :data:`EQUAL_REWARDS_RTOL` times the group's largest magnitude."""
    values = rewards.to(torch.float64)
    filled = torch.where(values.isnan(), values.nanmean(dim=1, keepdim=True), values)
    spread = filled.amax(dim=1) - filled.amin(dim=1)
    return (spread <= EQUAL_REWARDS_RTOL * filled.abs().amax(dim=1)) | filled.isnan().all(dim=1)


@dataclass(frozen=True)
class Downsampled:
    """What :func:`downsample` keeps of a ``[G, n]`` batch of rollouts."""

    kept: torch.Tensor  # [G, m] positions kept within each group, ascending
    rows: torch.Tensor  # [G * m] flat indices of the kept rollouts (group g occupies rows g*n .. g*n + n - 1)
    rewards: torch.Tensor  # [G, m] the kept rewards (NaN where every reward function returned None)
    advantages: torch.Tensor  # [G, m] their group-relative advantages


def downsample(
    rewards: torch.Tensor,
    m: int,
    rule: str | Rule = "max_variance",
    *,
    scale: str = "group",
    eps: float = 1e-4,
    generator: torch.Generator | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lengths: torch.Tensor | None = None,
) -> Downsampled:
    """Select m of the n rollouts of each group, then compute the kept rollouts' advantages.

    ``rewards[G, n]`` may hold NaN for unscorable completions (TRL's rule for "every reward function
    returned None"): the rule sees them at their group's mean reward (the value that adds the least spread, so
    ``max_variance`` prefers scorable ones), and the advantages leave them out (advantage 0). With
    ``scale="batch"`` the std is taken over ``gather(kept rewards)``: pass a function that collects every
    process's kept rewards when each process holds only its own groups. ``lengths[G, n]`` (completion tokens)
    reaches the rules that use it (:func:`pods.selection.uses_lengths`).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}.")
    values = rewards.to(torch.float64)
    unscorable = values.isnan()
    for_rule = values
    if bool(unscorable.any()):
        fill = torch.nan_to_num(values.nanmean(dim=1, keepdim=True), nan=0.0).expand_as(values)
        for_rule = torch.where(unscorable, fill, values)
    kept = select(for_rule, m, rule, generator=generator, lengths=lengths)
    kept_rewards = values.gather(1, kept).to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    batch_rewards = gather(kept_rewards) if scale == "batch" and gather is not None else None
    advantages = group_advantages(kept_rewards, scale, eps, batch_rewards=batch_rewards)
    n = values.shape[1]
    rows = (kept + n * torch.arange(values.shape[0], device=kept.device).unsqueeze(1)).reshape(-1)
    return Downsampled(kept=kept, rows=rows, rewards=kept_rewards, advantages=advantages)
