"""The prompt-level group filter with bounded refill (DAPO's dynamic sampling), as pure functions.

A group whose n rewards are all equal gives every kept completion advantage 0: whichever m a rule keeps,
the prompt adds no policy gradient. With ``prompt_filter: nonzero_std`` a step drops such groups and
generates for more prompts, round after round, until each process holds P (``prompts_per_step``) groups
that pass, or ``max_num_gen_batches`` rounds have run (verl's name; the first round counts). The bound
matters: on a solved dataset an unbounded loop never ends. When it is hit, the step is filled up with the
first groups that did not pass: they train with advantage 0, exactly as they would without the filter,
and ``pods/filter/groups_unfilled`` counts them.

"Equal" is :func:`pods.advantages.zero_variance_groups`: equal up to a relative 1e-6, so that rounding in
a sum of reward functions never makes a group look informative. Unscorable completions (NaN) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pods.advantages import zero_variance_groups
from pods.config import PROMPT_FILTERS
from pods.rollout.base import Rollouts, concat_rollouts

__all__ = ["PROMPT_FILTERS", "Groups", "SampledGroups", "fill_groups", "passing_groups"]


def passing_groups(rewards: torch.Tensor, prompt_filter: str) -> torch.Tensor:
    """``BoolTensor[G]``: the groups of ``rewards[G, n]`` that ``prompt_filter`` keeps (all of them for ``none``;
    those whose rewards are not all equal for ``nonzero_std``)."""
    if prompt_filter == "none":
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    if prompt_filter == "nonzero_std":
        return ~zero_variance_groups(rewards)
    raise ValueError(f"unknown prompt_filter {prompt_filter!r}; choose one of {', '.join(PROMPT_FILTERS)}.")


def fill_groups(passed: torch.Tensor, wanted: int) -> torch.Tensor:
    """``LongTensor[wanted]``, ascending: the positions of the groups a step trains on, out of every group it
    generated (in generation order): the first ``wanted`` that passed, then, if fewer passed (the refill bound
    was hit), the first that did not."""
    if passed.ndim != 1 or passed.dtype != torch.bool:
        raise ValueError(
            f"passed must be a 1-D bool tensor, got {passed.dtype} of shape {tuple(passed.shape)}."
        )
    if not 0 <= wanted <= passed.numel():
        raise ValueError(f"cannot train on {wanted} groups out of {passed.numel()} generated.")
    positions = torch.arange(passed.numel(), device=passed.device)
    order = torch.cat([positions[passed], positions[~passed]])  # passing groups first, each part in order
    return order[:wanted].sort().values


@dataclass(frozen=True)
class Groups:
    """Whole groups of n rollouts, prompt-major: the completions, their summed rewards and each function's."""

    rollouts: Rollouts
    rewards: torch.Tensor  # [G, n]
    per_function: dict[str, torch.Tensor]  # name -> [G, n]

    @property
    def lengths(self) -> torch.Tensor:
        """``[G, n]`` completion tokens of each rollout."""
        return self.rollouts.completion_lengths.view(self.rewards.shape)


@dataclass
class SampledGroups:
    """Every group a step generated, round by round (a refill round appends), with what the filter said of it."""

    prompt_filter: str
    pad_id: int = 0
    ids: list[int] = field(default_factory=list)  # each group's prompt (its position in the training set)
    skipped: int = 0  # prompts skipped before generation (prompt_skip), over the rounds
    rounds: list[Groups] = field(default_factory=list)
    _passed: list[torch.Tensor] = field(default_factory=list)
    _all: Groups | None = None  # every round joined, kept until the next round

    def add(
        self, ids: list[int], rollouts: Rollouts, rewards: torch.Tensor, per_function: dict, skipped: int = 0
    ):
        """Record one round: ``ids[P]``, its rollouts and ``rewards[P, n]``."""
        self.ids.extend(ids)
        self.skipped += skipped
        self.rounds.append(Groups(rollouts, rewards, per_function))
        self._passed.append(passing_groups(rewards, self.prompt_filter))

    @property
    def passed(self) -> torch.Tensor:
        """``BoolTensor[G]`` over every group so far: which pass the filter."""
        return torch.cat(self._passed)

    @property
    def num_passed(self) -> int:
        return int(self.passed.sum())

    @property
    def rewards(self) -> torch.Tensor:
        """``[G, n]`` summed rewards of every group so far."""
        return torch.cat([part.rewards for part in self.rounds])

    @property
    def all(self) -> Groups:
        """Every group so far, as one batch (rollouts re-padded)."""
        if self._all is None or self._all.rewards.shape[0] != len(self.ids):
            names = self.rounds[0].per_function
            self._all = Groups(
                concat_rollouts([part.rollouts for part in self.rounds], self.pad_id),
                self.rewards,
                {name: torch.cat([part.per_function[name] for part in self.rounds]) for name in names},
            )
        return self._all

    def take(self, positions: torch.Tensor) -> Groups:
        """The groups at ``positions`` (ascending), in that order."""
        everything = self.all
        if positions.numel() == everything.rewards.shape[0]:  # every group (one round without a filter)
            return everything
        n = everything.rewards.shape[1]
        rows = (positions.unsqueeze(1) * n + torch.arange(n)).reshape(-1)
        return Groups(
            everything.rollouts.select(rows),
            everything.rewards[positions],
            {name: values[positions] for name, values in everything.per_function.items()},
        )
