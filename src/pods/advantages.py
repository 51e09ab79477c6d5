"""Group-relative advantages over the rollouts kept in each group (GRPO's baseline, PODS's subset), and
:func:`downsample`, the one step both trainers share: select m of n per group (or k per group by difficulty),
gather the kept rewards, compute their advantages and return the kept row indices.

With several reward functions the rules rank one quantity per completion, the one the advantages use
(:func:`aggregate_rewards`, TRL's ``multi_objective_aggregation``): the weighted sum (``sum_then_normalize``)
or the sum of each function's group-normalised rewards (``normalize_then_sum``, GDPO)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pods.selection import Rule, select

__all__ = [
    "EQUAL_REWARDS_RTOL",
    "SCALES",
    "Downsampled",
    "aggregate_rewards",
    "difficulty_counts",
    "downsample",
    "group_advantages",
    "nanstd",
    "restore_signal",
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


def aggregate_rewards(
    components: torch.Tensor, weights: torch.Tensor, mode: str = "sum_then_normalize", eps: float = 1e-4
) -> torch.Tensor:
    """One reward per completion from ``components[G, k, F]`` (each reward function's, NaN where it does not
    apply): the weighted sum (``sum_then_normalize``), or the weighted sum of each function's rewards normalised
    within the group, ``(r - mean) / (std + eps)`` (``normalize_then_sum``, TRL's GDPO mode). NaN where every
    function returned None (unscorable)."""
    values = components.to(torch.float64)
    if mode == "normalize_then_sum":
        mean = values.nanmean(dim=1, keepdim=True)
        std = nanstd(values, dim=1) if values.shape[1] > 1 else torch.zeros_like(mean)
        values = (values - mean) / (std + eps)
    elif mode != "sum_then_normalize":
        raise ValueError(
            f"unknown multi_objective_aggregation {mode!r}; choose sum_then_normalize or normalize_then_sum."
        )
    total = (values * weights.to(values).view(1, 1, -1)).nansum(dim=2)
    return total.masked_fill(components.isnan().all(dim=2), float("nan"))


def difficulty_counts(mean_rewards: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """GFPO's adaptive difficulty: ``LongTensor[G]``, how many rollouts each group keeps, from its mean reward's
    quartile among ``mean_rewards[G]`` (every process's groups of the step): ``counts[0]`` for the easiest
    quarter (mean above the third quartile), ..., ``counts[3]`` for the hardest (at or below the first).
    Groups with equal means share a quartile; NaN means (unscorable) count as the hardest."""
    means = torch.nan_to_num(mean_rewards.to(torch.float64), nan=float("-inf"))
    finite = means[means.isfinite()]
    if finite.numel() == 0:
        return torch.full_like(means, counts[-1], dtype=torch.long)
    quartiles = torch.quantile(finite, torch.tensor([0.75, 0.5, 0.25], dtype=torch.float64))
    harder = (means.unsqueeze(1) <= quartiles.unsqueeze(0)).sum(dim=1)  # quartiles at or above: 0 easiest
    return torch.tensor(counts, dtype=torch.long)[harder]


def restore_signal(
    rewards: torch.Tensor, kept: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Where a group's rewards have a spread but its kept ones (``kept[G, k]``, positions where ``valid``) are all
    equal, swap one kept rollout for one with another reward: the longest kept (else the last) for the shortest
    (else the first) of the others. Returns the new ``kept`` (ascending valid positions) and the groups changed."""
    values = rewards.to(torch.float64)
    kept_values = values.gather(1, kept).masked_fill(~valid, float("nan"))
    flat = ~zero_variance_groups(values) & zero_variance_groups(kept_values) & (valid.sum(dim=1) >= 2)
    kept = kept.clone()
    for group in flat.nonzero().flatten().tolist():
        slots = valid[group].nonzero().flatten()
        common = kept_values[group, slots[0]]
        others = ((values[group] - common).abs() > EQUAL_REWARDS_RTOL * values[group].abs().amax()).nonzero()
        others = others.flatten()
        others = others[~torch.isin(others, kept[group, slots])]
        if lengths is None:
            add, drop = others[0], slots[-1]
        else:
            add = others[lengths[group, others].argsort(stable=True)[0]]
            drop = slots[lengths[group, kept[group, slots]].argsort(descending=True, stable=True)[0]]
        filler = (kept[group] == add) & ~valid[group]  # the rollout added was a filler: swap the two
        kept[group, filler] = kept[group, drop]
        kept[group, drop] = add
        kept[group, slots] = kept[group, slots].sort().values
    return kept, int(flat.sum())


@dataclass(frozen=True)
class Downsampled:
    """What :func:`downsample` keeps of a ``[G, n]`` batch of rollouts."""

    kept: torch.Tensor  # [G, m] positions kept within each group, ascending among the trained
    rows: torch.Tensor  # [G * m] flat indices of the kept rollouts (group g occupies rows g*n .. g*n + n - 1)
    rewards: torch.Tensor  # [G, m] the kept rewards (NaN where every reward function returned None)
    advantages: torch.Tensor  # [G, m] their group-relative advantages (0 where not trained)
    trained: torch.Tensor  # [G, m] bool: the kept positions the loss weighs (False: filler, k < m)
    signal_restored: int = 0  # groups where a rule's kept rollouts had no spread and one was swapped


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
    kept_counts: torch.Tensor | None = None,
    keep_signal: bool = False,
    components: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> Downsampled:
    """Select m of the n rollouts of each group, then compute the kept rollouts' advantages.

    ``rewards[G, n]`` is what the rule ranks and the advantages use; it may hold NaN for unscorable
    completions (TRL's rule for "every reward function returned None"): the rule sees them at their group's
    mean reward (the value that adds the least spread, so ``max_variance`` prefers scorable ones), and the
    advantages leave them out (advantage 0). With ``scale="batch"`` the std is taken over ``gather(kept
    rewards)``: pass a function that collects every process's kept rewards when each process holds only its own
    groups. ``lengths[G, n]`` (completion tokens) reaches the rules that use it (:func:`pods.selection.uses_lengths`).

    ``kept_counts[G]`` (each at most m) keeps that many in each group, the rule applied with that count; the
    remaining m - k positions of the group are filler (``trained`` False, advantage 0). ``keep_signal`` swaps one
    kept rollout where a group has a spread but its kept ones have none (:func:`restore_signal`): for groups the
    prompt filter passed because they carry a signal. ``components[G, n, F]`` with ``weights[F]`` selects
    ``normalize_then_sum``: the kept rows' advantages are each function's rewards normalised over the kept of
    the group, summed, then normalised over every kept row of the batch (TRL's GDPO mode; ``scale`` unused).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}.")
    values = rewards.to(torch.float64)
    unscorable = values.isnan()
    for_rule = values
    if bool(unscorable.any()):
        fill = torch.nan_to_num(values.nanmean(dim=1, keepdim=True), nan=0.0).expand_as(values)
        for_rule = torch.where(unscorable, fill, values)
    num_groups, n = values.shape
    trained = torch.ones(num_groups, m, dtype=torch.bool, device=values.device)
    if kept_counts is None:
        kept = select(for_rule, m, rule, generator=generator, lengths=lengths)
    else:
        kept, trained = _select_counts(for_rule, m, kept_counts, rule, generator, lengths)
    restored = 0
    if keep_signal:
        kept, restored = restore_signal(for_rule, kept, trained, lengths)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    kept_rewards = values.gather(1, kept)
    scored = kept_rewards.masked_fill(~trained, float("nan"))  # fillers weigh nothing in the advantages
    if components is None:
        batch_rewards = gather(scored) if scale == "batch" and gather is not None else None
        advantages = group_advantages(scored, scale, eps, batch_rewards=batch_rewards)
    else:
        kept_parts = components.to(torch.float64).gather(
            1, kept.unsqueeze(2).expand(-1, -1, components.shape[2])
        )
        kept_parts = kept_parts.masked_fill(~trained.unsqueeze(2), float("nan"))
        summed = aggregate_rewards(kept_parts, weights, "normalize_then_sum", eps)
        everything = gather(summed) if gather is not None else summed
        spread = nanstd(everything.reshape(1, -1), dim=1)
        advantages = torch.nan_to_num((summed - everything.nanmean()) / (spread + eps), nan=0.0)
    advantages = advantages.masked_fill(~trained, 0.0).to(out_dtype)
    rows = (kept + n * torch.arange(num_groups, device=kept.device).unsqueeze(1)).reshape(-1)
    return Downsampled(kept, rows, kept_rewards.to(out_dtype), advantages, trained, restored)


def _select_counts(
    rewards: torch.Tensor,
    m: int,
    counts: torch.Tensor,
    rule: str | Rule,
    generator: torch.Generator | None,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kept[G, m]`` and ``trained[G, m]`` when group g keeps ``counts[g]``: the rule's choice with that count
    first, then the lowest positions not chosen as filler."""
    num_groups, n = rewards.shape
    kept = torch.empty(num_groups, m, dtype=torch.long, device=rewards.device)
    trained = torch.zeros(num_groups, m, dtype=torch.bool, device=rewards.device)
    for count in sorted(set(counts.tolist())):
        if not 1 <= count <= m:
            raise ValueError(f"a group cannot keep {count} of its rollouts: counts must be in 1..m = {m}.")
        groups = (counts == count).nonzero().flatten()
        chosen = select(
            rewards[groups],
            count,
            rule,
            generator=generator,
            lengths=None if lengths is None else lengths[groups],
        )
        unused = torch.ones(groups.numel(), n, dtype=torch.bool, device=rewards.device)
        unused.scatter_(1, chosen, False)
        filler = (
            torch.arange(n, device=rewards.device).expand(groups.numel(), n)[unused].view(groups.numel(), -1)
        )
        kept[groups] = torch.cat([chosen, filler[:, : m - count]], dim=1)
        trained[groups, :count] = True
    return kept, trained
