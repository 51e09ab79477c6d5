"""Down-sampling rules: choose m of the n rollouts of each group (prompt) to train on.

Every rule maps a reward matrix ``rewards[G, n]`` (G groups, n rollouts each) and a count ``m`` to
``indices[G, m]``: for each group, m distinct positions into that group's row. Groups never mix: a
rule sees all groups at once only so that it can work on them in one vectorised pass. A rule that
declares a keyword parameter ``lengths`` also receives the completions' token counts ``[G, n]``
(the length-aware rules below); other rules are called exactly as before.

Built-in rules return each row's indices in ascending order:

- ``max_variance`` (the PODS rule): the m rewards with the largest (sample) variance, exactly. After
  sorting, some optimal subset is "the t highest plus the m - t lowest" for a t in 0..m, so one sort,
  prefix sums of r and r^2 and m + 1 constant-time evaluations find it: O(n log n) per group.
  Ties are broken deterministically: among equally good splits the one with the fewest highest
  rewards wins, and among equal rewards the sort is stable (earlier rollouts come first in the
  ascending order). So a group whose rewards are all equal keeps its first m rollouts.
- ``max_reward``: the m highest rewards (ties go to earlier rollouts).
- ``random``: m distinct rollouts uniformly at random, reproducible with a ``torch.Generator``.
- ``all``: every rollout (m must equal n): plain GRPO.
- ``shortest`` (GFPO's shortest-k): the m shortest completions (ties go to earlier rollouts).
- ``reward_per_token`` (GFPO's token efficiency): the m highest reward / length ratios (length counted
  as at least 1 token; a negative reward counts as reward x length, so a long wrong answer ranks below a
  short one; ties go to earlier rollouts).
- ``max_variance_shortest``: a max-variance subset, and among all max-variance subsets one with the
  fewest tokens in total, exactly. Every max-variance subset keeps the same multiset of reward values
  as one of the tied "t highest + m - t lowest" splits, so for each tied split it keeps, within each
  reward value, the shortest completions, and takes the split with the fewest tokens (ties: the
  fewest highest, as ``max_variance``; then earlier rollouts).

Users add rules with :func:`register_rule`; their output is validated before it is used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Rule",
    "available_rules",
    "get_rule",
    "register_rule",
    "select",
    "subset_variance",
    "uses_lengths",
]

Rule = Callable[..., torch.Tensor]
"""A rule: ``fn(rewards[G, n] float64, m, generator) -> indices[G, m]`` (integer tensor); a rule that
declares a keyword parameter ``lengths`` is called as ``fn(rewards, m, generator, lengths=lengths)``
with the completion lengths in tokens (float64 ``[G, n]``)."""

# Relative tolerance under which two candidate splits count as equally good (absorbs rounding).
_TIE_RTOL = 1e-10


def max_variance(rewards: torch.Tensor, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exact max-variance subset of size m per row, in O(n log n) per row, vectorised over rows."""
    num_groups, n = rewards.shape
    ascending, order = torch.sort(_centred(rewards), dim=1, stable=True)
    best_top = _best_splits(_split_spreads(ascending, m)).int().argmax(dim=1, keepdim=True)  # fewest highest

    # Kept position j of the ascending order is j for the m - t lowest, else n - m + j.
    positions = torch.arange(m, device=rewards.device).expand(num_groups, m)
    sorted_positions = torch.where(positions < m - best_top, positions, positions + (n - m))
    return order.gather(1, sorted_positions)


def max_variance_shortest(
    rewards: torch.Tensor,
    m: int,
    generator: torch.Generator | None = None,
    *,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """A max-variance subset of size m per row with the fewest tokens among all max-variance subsets, exactly."""
    if m == 1:  # every single rollout has variance 0: the shortest one
        return shortest(rewards, m, generator, lengths=lengths)
    num_groups, n = rewards.shape
    # Ascending rewards, equal rewards by ascending length, then by position (two stable sorts).
    by_length = torch.sort(lengths, dim=1, stable=True).indices
    by_reward = torch.sort(rewards.gather(1, by_length), dim=1, stable=True).indices
    order = by_length.gather(1, by_reward)
    values = rewards.gather(1, order)
    is_best = _best_splits(_split_spreads(_centred(values), m))  # [G, m + 1]; centring keeps the order

    # For each split t, its sorted positions [m + 1, m]; then, within each run of equal rewards, the same
    # number of positions taken from the start of the run (its shortest completions): same values, same variance.
    t = torch.arange(m + 1, device=rewards.device).unsqueeze(1)
    j = torch.arange(m, device=rewards.device).unsqueeze(0)
    positions = torch.where(j < m - t, j, j + (n - m)).expand(num_groups, m + 1, m)
    starts_run = torch.ones_like(values, dtype=torch.bool)
    starts_run[:, 1:] = values[:, 1:] != values[:, :-1]
    run_start = (torch.arange(n, device=rewards.device) * starts_run).cummax(dim=1).values  # [G, n]
    kept_run = run_start.unsqueeze(1).expand(num_groups, m + 1, n).gather(2, positions)  # [G, m + 1, m]
    first_in_run = torch.ones_like(kept_run, dtype=torch.bool)
    first_in_run[..., 1:] = kept_run[..., 1:] != kept_run[..., :-1]
    first_j = (j * first_in_run).cummax(dim=2).values  # index among the kept of the run's first one
    run_prefix = kept_run + (j - first_j)

    sorted_lengths = lengths.gather(1, order).unsqueeze(1).expand(num_groups, m + 1, n)
    tokens = sorted_lengths.gather(2, run_prefix).sum(dim=2)  # [G, m + 1]
    tokens = tokens.masked_fill(~is_best, float("inf"))
    best = tokens.argmin(dim=1)  # the first (fewest highest) among the shortest best splits
    chosen = run_prefix[torch.arange(num_groups, device=rewards.device), best]
    return order.gather(1, chosen)


def _centred(rewards: torch.Tensor) -> torch.Tensor:
    """Each row brought to [-1, 1], centred (so that large offsets such as 1e6 + noise do not cancel in
    E[r^2] - E[r]^2), then its deviations scaled to [-1, 1]: squares neither overflow (rewards above
    ~1e154) nor underflow (spreads below ~1e-154). Scaling a row does not change its best subset, and the
    map is increasing, so it keeps the rewards' order."""
    centred = rewards / _row_scale(rewards)
    centred = centred - centred.mean(dim=1, keepdim=True)
    return centred / _row_scale(centred)


def _split_spreads(ascending: torch.Tensor, m: int) -> torch.Tensor:
    """``[G, m + 1]``: (m - 1) x the sample variance of "the t highest plus the m - t lowest" for t = 0..m,
    from each row's ascending values, with prefix sums of r and r^2 (O(1) per split)."""
    num_groups, n = ascending.shape
    zeros = ascending.new_zeros(num_groups, 1)
    prefix = torch.cat([zeros, ascending.cumsum(dim=1)], dim=1)  # prefix[:, i] = sum of i lowest
    prefix_sq = torch.cat([zeros, (ascending * ascending).cumsum(dim=1)], dim=1)
    num_top = torch.arange(m + 1, device=ascending.device)  # t = how many of the highest to keep
    num_low = m - num_top
    total, total_sq = prefix[:, n : n + 1], prefix_sq[:, n : n + 1]
    sums = prefix[:, num_low] + total - prefix[:, n - num_top]
    sums_sq = prefix_sq[:, num_low] + total_sq - prefix_sq[:, n - num_top]
    return sums_sq - sums * sums / m


def _best_splits(spread: torch.Tensor) -> torch.Tensor:
    """``BoolTensor[G, m + 1]``: the splits whose spread is the row's largest (within rounding)."""
    best = spread.max(dim=1, keepdim=True).values
    return spread >= best - _TIE_RTOL * best.abs().clamp_min(1e-300)


def _row_scale(values: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude, or 1 for an all-zero row: ``[G, 1]``."""
    scale = values.abs().amax(dim=1, keepdim=True)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def max_reward(rewards: torch.Tensor, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The m highest rewards per row; among equal rewards, earlier rollouts first."""
    descending = torch.sort(rewards, dim=1, descending=True, stable=True).indices
    return descending[:, :m]


def random_subset(rewards: torch.Tensor, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """m distinct rollouts per row, uniformly at random (reproducible with ``generator``)."""
    num_groups, n = rewards.shape
    device = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(num_groups, n, generator=generator, device=device)
    return keys.argsort(dim=1)[:, :m].to(rewards.device)


def shortest(
    rewards: torch.Tensor, m: int, generator: torch.Generator | None = None, *, lengths: torch.Tensor
) -> torch.Tensor:
    """GFPO's shortest-k: the m shortest completions per row; among equal lengths, earlier rollouts first."""
    return torch.sort(lengths, dim=1, stable=True).indices[:, :m]


def reward_per_token(
    rewards: torch.Tensor, m: int, generator: torch.Generator | None = None, *, lengths: torch.Tensor
) -> torch.Tensor:
    """GFPO's token efficiency: the m highest reward / length per row (length at least 1); a negative reward counts
    as reward x length, so that among wrong answers a long one ranks below a short one; ties to earlier rollouts."""
    tokens = lengths.clamp_min(1.0)
    efficiency = torch.where(rewards >= 0, rewards / tokens, rewards * tokens)
    return torch.sort(efficiency, dim=1, descending=True, stable=True).indices[:, :m]


def keep_all(rewards: torch.Tensor, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Every rollout: no down-sampling (GRPO). Requires m == n."""
    num_groups, n = rewards.shape
    if m != n:
        raise ValueError(f"rule 'all' keeps every rollout, so m must equal n; got m={m}, n={n}.")
    return torch.arange(n, device=rewards.device).expand(num_groups, n).clone()


_BUILTIN_RULES: dict[str, Rule] = {
    "max_variance": max_variance,
    "max_reward": max_reward,
    "random": random_subset,
    "all": keep_all,
    "shortest": shortest,
    "reward_per_token": reward_per_token,
    "max_variance_shortest": max_variance_shortest,
}
_RULES: dict[str, Rule] = dict(_BUILTIN_RULES)


def register_rule(name: str, fn: Rule, *, overwrite: bool = False) -> None:
    """Make ``fn`` available as ``select(..., rule=name)`` (and by name in configs and the CLI).

    ``fn(rewards, m, generator)`` receives float64 rewards ``[G, n]`` on the caller's device and must
    return an integer tensor ``[G, m]`` of distinct positions per row; this is checked on every call. Give
    ``fn`` a keyword parameter ``lengths`` to also receive the completion lengths (float64 ``[G, n]``).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a rule name must be a non-empty string, got {name!r}.")
    if not callable(fn):
        raise ValueError(
            f"rule {name!r} must be callable as fn(rewards, m, generator), got {type(fn).__name__}."
        )
    if name in _BUILTIN_RULES:
        raise ValueError(f"{name!r} is a built-in rule and cannot be replaced; register under another name.")
    if name in _RULES and not overwrite:
        raise ValueError(f"a rule named {name!r} is already registered; pass overwrite=True to replace it.")
    _RULES[name] = fn


def available_rules() -> list[str]:
    """Names of every rule :func:`select` accepts, built-in ones first."""
    return list(_RULES)


def uses_lengths(rule: str | Rule) -> bool:
    """Whether ``rule`` (a name or a callable) takes the completion lengths: it has a parameter ``lengths``."""
    fn = rule if callable(rule) else get_rule(rule)
    try:
        return "lengths" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature (some builtins): the old protocol
        return False


def get_rule(name: str) -> Rule:
    """The rule registered under ``name``, or a ``ValueError`` listing the known names."""
    if name not in _RULES:
        raise ValueError(f"unknown selection rule {name!r}; known rules: {', '.join(available_rules())}.")
    return _RULES[name]


def select(
    rewards: torch.Tensor | Sequence[Sequence[float]] | Sequence[float],
    m: int,
    rule: str | Rule = "max_variance",
    *,
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | Sequence[Sequence[float]] | Sequence[float] | None = None,
) -> torch.Tensor:
    """Indices of the m rollouts to keep in each group, as a ``LongTensor[G, m]`` (ascending per row).

    ``rewards`` is ``[G, n]`` (a tensor or a list of lists), or ``[n]`` for one group, in which case
    the result is ``[m]``. ``rule`` is a registered name or a callable with the :data:`Rule` signature.
    ``lengths`` (completion tokens, the same shape as ``rewards``) is required by the rules that use it
    (:func:`uses_lengths`) and ignored by the others. The objective is always computed in float64,
    whatever the input's dtype; the result lives on the input's device.
    """
    matrix, single_group = _as_reward_matrix(rewards)
    num_groups, n = matrix.shape
    if isinstance(m, bool) or not isinstance(m, int):
        raise ValueError(f"m (rollouts kept per group) must be an int, got {type(m).__name__} {m!r}.")
    if m < 1:
        raise ValueError(f"m (rollouts kept per group) must be at least 1, got {m}.")
    if m > n:
        raise ValueError(f"cannot keep m={m} rollouts from groups of n={n}: m must be at most n.")

    fn = rule if callable(rule) else get_rule(rule)
    name = getattr(fn, "__name__", repr(fn)) if callable(rule) else rule
    if uses_lengths(fn):
        indices = fn(matrix, m, generator, lengths=_as_lengths(lengths, matrix, single_group, name))
    else:
        indices = fn(matrix, m, generator)
    if fn not in _BUILTIN_RULES.values():
        indices = _validate_indices(indices, num_groups, n, m, name)
    indices = indices.to(device=matrix.device, dtype=torch.long).sort(dim=1).values
    return indices[0] if single_group else indices


def subset_variance(rewards: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Sample (unbiased) variance of each row's selected rewards, in float64: ``[G]``."""
    chosen = rewards.to(torch.float64).gather(-1, indices)
    return chosen.var(dim=-1, unbiased=True) if chosen.shape[-1] > 1 else chosen.new_zeros(chosen.shape[:-1])


def _as_reward_matrix(rewards: object) -> tuple[torch.Tensor, bool]:
    """Validate ``rewards`` and return it as float64 ``[G, n]``, plus whether it was one group."""
    if not isinstance(rewards, torch.Tensor):
        try:
            rewards = torch.as_tensor(rewards, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                "rewards must be a tensor or a (list of) equal-length lists of numbers; "
                f"could not convert it: {error}"
            ) from None
    if rewards.is_complex():
        raise ValueError("rewards must be real numbers, got a complex tensor.")
    if rewards.ndim not in (1, 2):
        raise ValueError(
            f"rewards must be 2-D [groups, rollouts] (or 1-D for one group), got shape {tuple(rewards.shape)}."
        )
    single_group = rewards.ndim == 1
    matrix = rewards.unsqueeze(0) if single_group else rewards
    if matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(
            f"rewards is empty (shape {tuple(rewards.shape)}): need at least one group of one rollout."
        )
    matrix = matrix.to(torch.float64)
    finite = torch.isfinite(matrix)
    if not bool(finite.all()):
        group, position = (~finite).nonzero()[0].tolist()
        raise ValueError(
            f"rewards must be finite; group {group}, rollout {position} is {matrix[group, position].item()}. "
            "Check the reward functions (a failed score should be 0.0, not NaN or inf)."
        )
    return matrix, single_group


def _as_lengths(lengths: object, rewards: torch.Tensor, single_group: bool, name: str) -> torch.Tensor:
    """Validate completion lengths for a length-aware rule: float64 ``[G, n]``, finite and non-negative."""
    if lengths is None:
        raise ValueError(
            f"rule {name!r} ranks completions by length: pass lengths (completion tokens, shaped like rewards)."
        )
    try:
        values = torch.as_tensor(lengths, dtype=torch.float64, device=rewards.device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"lengths must be a tensor or (lists of) numbers: {error}") from None
    if single_group and values.ndim == 1:
        values = values.unsqueeze(0)
    if values.shape != rewards.shape:
        raise ValueError(
            f"lengths has shape {tuple(values.shape)}, but rewards has {tuple(rewards.shape)}: one length per rollout."
        )
    if not bool((torch.isfinite(values) & (values >= 0)).all()):
        raise ValueError("lengths must be finite, non-negative token counts.")
    return values


def _validate_indices(indices: object, num_groups: int, n: int, m: int, name: str) -> torch.Tensor:
    """Check a user rule's output: integer ``[G, m]``, each in [0, n), distinct within a row."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(
            f"rule {name!r} must return a torch.Tensor of indices, got {type(indices).__name__}."
        )
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"rule {name!r} must return an integer tensor, got dtype {indices.dtype}.")
    if tuple(indices.shape) != (num_groups, m):
        raise ValueError(
            f"rule {name!r} returned shape {tuple(indices.shape)}; expected (groups, m) = ({num_groups}, {m})."
        )
    if bool(((indices < 0) | (indices >= n)).any()):
        raise ValueError(
            f"rule {name!r} returned an index outside [0, {n}); indices must point into each row."
        )
    if m > 1:
        ordered = indices.sort(dim=1).values
        duplicated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(duplicated.any()):
            group = int(duplicated.nonzero()[0])
            raise ValueError(
                f"rule {name!r} chose the same rollout twice in group {group}: {indices[group].tolist()}."
            )
    return indices
