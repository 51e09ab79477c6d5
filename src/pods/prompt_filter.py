"""The prompt-level group filter with rounds sized to need (DAPO's dynamic sampling), as pure functions.

A group whose n rewards are all equal gives every kept completion advantage 0: whichever m a rule keeps,
the prompt adds no policy gradient. With ``prompt_filter: nonzero_std`` a step drops such groups and generates
for more prompts until each process holds P (``prompts_per_step``) groups that pass, or
``max_num_gen_batches`` rounds have run (verl's name; the first round counts; 0 = no bound).

Rounds are sized to what is missing, from the running share of groups that pass (:class:`PassShare`):
the first round generates for ``generation_batch_prompts`` prompts (P, a fixed number, or ``auto``:
P / share), a refill round for ``missing / share x 1.25`` (GRESO's margin), each rounded up to what the
engine batches well and at most :data:`MAX_ROUND_FACTOR` x P. When the bound is hit with fewer than P groups
that pass, ``prompt_filter_exhausted`` says what the step does: ``train_fewer`` (the groups that passed only),
``pad`` (fill up with groups that did not pass: advantage 0, as without the filter) or ``error`` (verl's).

"Equal" is :func:`pods.advantages.zero_variance_groups`: equal up to a relative 1e-6, so that rounding in
a sum of reward functions never makes a group look informative. Unscorable completions (NaN) are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pods.advantages import zero_variance_groups
from pods.config import PROMPT_FILTER_EXHAUSTED, PROMPT_FILTERS
from pods.errors import PromptFilterExhausted
from pods.rollout.base import Rollouts, concat_rollouts

__all__ = [
    "MAX_ROUND_FACTOR",
    "PROMPT_FILTERS",
    "PROMPT_FILTER_EXHAUSTED",
    "REFILL_MARGIN",
    "Groups",
    "PassShare",
    "SampledGroups",
    "TrainedGroups",
    "exhausted_message",
    "fill_groups",
    "first_round_prompts",
    "next_round_size",
    "passing_groups",
    "refill_prompts",
    "round_up",
    "rounds_left",
]

REFILL_MARGIN = 1.25  # GRESO's: a refill round asks for a quarter more than the share predicts
MAX_ROUND_FACTOR = 8  # a round generates for at most this many times P prompts per process
PASS_SHARE_DECAY = 0.5  # the running share weighs the previous steps' counts by this factor per step


def passing_groups(rewards: torch.Tensor, prompt_filter: str) -> torch.Tensor:
    """``BoolTensor[G]``: the groups of ``rewards[G, n]`` that ``prompt_filter`` keeps (all of them for ``none``;
    those whose rewards are not all equal for ``nonzero_std``)."""
    if prompt_filter == "none":
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    if prompt_filter == "nonzero_std":
        return ~zero_variance_groups(rewards)
    raise ValueError(f"unknown prompt_filter {prompt_filter!r}; choose one of {', '.join(PROMPT_FILTERS)}.")


# ------------------------------------------------------------------------------------------ round sizes


@dataclass(frozen=True)
class PassShare:
    """The running share of groups that pass: counts of earlier steps decay by half per step, so the estimate
    follows a policy that changes. JSON-able through :meth:`to_state` (trainer state, for exact resume)."""

    passed: float = 0.0
    drawn: float = (
        0.0  # prompts the round sizes counted (candidates drawn with GRESO's shrink, else generated)
    )

    @property
    def share(self) -> float | None:
        """(passed + 1) / (drawn + 2), Laplace's rule, so that a few groups that all failed do not make the next
        round as large as a round may be; None before anything was drawn."""
        return (self.passed + 1) / (self.drawn + 2) if self.drawn > 0 else None

    def plus(self, passed: int, drawn: int) -> PassShare:
        """This step's counts added to the decayed history (the estimate within a step and at its end)."""
        return PassShare(self.passed * PASS_SHARE_DECAY + passed, self.drawn * PASS_SHARE_DECAY + drawn)

    def to_state(self) -> list[float]:
        return [self.passed, self.drawn]

    @classmethod
    def from_state(cls, state: list[float] | None) -> PassShare:
        return cls() if state is None else cls(float(state[0]), float(state[1]))


def round_up(prompts: int, multiple: int) -> int:
    """``prompts`` rounded up to a multiple of ``multiple`` (what the engine batches well)."""
    return -(-prompts // multiple) * multiple


def _sized(wanted: float, share: float | None, multiple: int, cap: int) -> int:
    share = 1.0 if share is None else share  # nothing measured yet: no oversampling
    prompts = math.ceil(wanted / share - 1e-9)
    return max(1, min(round_up(prompts, multiple), cap))


def first_round_prompts(
    wanted: int, setting: int | str | None, share: float | None, *, multiple: int = 1
) -> int:
    """Prompts of a step's first round per process: ``wanted`` (P) for ``None``, the number given, or for
    ``"auto"`` P / share (no margin: a shortfall is refilled, a surplus dropped), at least P and at most
    :data:`MAX_ROUND_FACTOR` x P."""
    if setting is None:
        return wanted
    if setting != "auto":
        return int(setting)
    return max(wanted, _sized(wanted, share, multiple, MAX_ROUND_FACTOR * wanted))


def refill_prompts(missing: int, wanted: int, share: float | None, *, multiple: int = 1) -> int:
    """Prompts of a refill round per process when ``missing`` groups that pass are still missing (the most any
    process misses): ``missing / share x`` :data:`REFILL_MARGIN`, at least 1, at most MAX_ROUND_FACTOR x P."""
    return _sized(missing * REFILL_MARGIN, share, multiple, MAX_ROUND_FACTOR * wanted)


def rounds_left(rounds_run: int, max_num_gen_batches: int) -> bool:
    """Whether the bound allows another round (``max_num_gen_batches`` 0: no bound)."""
    return max_num_gen_batches == 0 or rounds_run < max_num_gen_batches


def next_round_size(
    *,
    rounds_run: int,
    wanted: int,
    missing: int,
    share: float | None,
    prompt_filter: str,
    max_num_gen_batches: int,
    generation_batch_prompts: int | str | None = None,
    multiple: int = 1,
) -> int:
    """Prompts per process of a step's next round, 0 when the step has what it needs: the first round always; a
    refill while some process still misses groups that pass (``missing``, the most any process misses) and the
    bound allows one."""
    if rounds_run == 0:
        return first_round_prompts(wanted, generation_batch_prompts, share, multiple=multiple)
    if prompt_filter == "none" or missing <= 0 or not rounds_left(rounds_run, max_num_gen_batches):
        return 0
    return refill_prompts(missing, wanted, share, multiple=multiple)


# ------------------------------------------------------------------------------------------ the groups trained


@dataclass(frozen=True)
class TrainedGroups:
    """The groups a step trains on, out of every group it generated: ``positions[G]`` ascending, and which of
    them carry weight in the loss (``trained[G]``; the others only keep shapes fixed and weigh nothing)."""

    positions: torch.Tensor
    trained: torch.Tensor


def fill_groups(passed: torch.Tensor, wanted: int, exhausted: str = "pad") -> TrainedGroups:
    """The first ``wanted`` groups that passed, in generation order. With fewer (the bound was hit), the first
    that did not pass fill up the step: trained on (``pad``) or weighing nothing (``train_fewer``); ``error``
    raises :class:`~pods.errors.PromptFilterExhausted`. With fewer groups than ``wanted`` in all (GRESO's
    shrink mode without a filter), every group is taken."""
    if passed.ndim != 1 or passed.dtype != torch.bool:
        raise ValueError(
            f"passed must be a 1-D bool tensor, got {passed.dtype} of shape {tuple(passed.shape)}."
        )
    if exhausted not in PROMPT_FILTER_EXHAUSTED:
        raise ValueError(
            f"unknown prompt_filter_exhausted {exhausted!r}; choose one of {', '.join(PROMPT_FILTER_EXHAUSTED)}."
        )
    if wanted < 1 or passed.numel() == 0:
        raise ValueError(f"cannot train on {wanted} groups out of {passed.numel()} generated.")
    positions = torch.arange(passed.numel(), device=passed.device)
    order = torch.cat([positions[passed], positions[~passed]])[:wanted]  # passing groups first, in order
    num_passed = int(passed.sum())
    if num_passed < order.numel() and exhausted == "error":
        raise PromptFilterExhausted(exhausted_message(num_passed, wanted))
    trained = torch.ones(order.numel(), dtype=torch.bool, device=passed.device)
    if exhausted == "train_fewer":
        trained = passed[order]
    ascending = order.sort()
    return TrainedGroups(ascending.values, trained[ascending.indices])


def exhausted_message(num_passed: int, wanted: int) -> str:
    """``prompt_filter_exhausted: error``'s message (verl's behaviour), naming the fixes."""
    return (
        f"prompt_filter_exhausted: error: only {num_passed} of the {wanted} groups a step trains on had rewards "
        "that were not all equal after its last generation round (max_num_gen_batches): the policy solves (or "
        "fails) nearly every prompt. Raise max_num_gen_batches (0: no bound), use a harder (or easier) dataset, "
        "or set prompt_filter_exhausted: train_fewer or pad"
    )


# ------------------------------------------------------------------------------------------ a step's rounds


@dataclass(frozen=True)
class Groups:
    """Whole groups of n rollouts, prompt-major: the completions, their summed rewards (weighted) and each
    function's; what the rules rank (``ranked``, None: the summed rewards), what the prompt-level stages read
    (``signal``, None: ``ranked``), and which groups weigh in the loss (``trained``, None: all)."""

    rollouts: Rollouts
    rewards: torch.Tensor  # [G, n]
    per_function: dict[str, torch.Tensor]  # name -> [G, n]
    ranked_rewards: torch.Tensor | None = None  # [G, n]
    signal: torch.Tensor | None = None  # [G, n]
    trained_groups: torch.Tensor | None = None  # [G] bool

    @property
    def lengths(self) -> torch.Tensor:
        """``[G, n]`` completion tokens of each rollout."""
        return self.rollouts.completion_lengths.view(self.rewards.shape)

    @property
    def ranked(self) -> torch.Tensor:
        """``[G, n]`` the reward the rules rank and the advantages use."""
        return self.rewards if self.ranked_rewards is None else self.ranked_rewards

    @property
    def filter_rewards(self) -> torch.Tensor:
        """``[G, n]`` the reward the prompt filter and GRESO read."""
        return self.ranked if self.signal is None else self.signal

    @property
    def trained(self) -> torch.Tensor:
        """``BoolTensor[G]``: the groups that weigh in the loss."""
        if self.trained_groups is None:
            return torch.ones(self.rewards.shape[0], dtype=torch.bool)
        return self.trained_groups

    def take(self, positions: torch.Tensor, trained: torch.Tensor | None = None) -> Groups:
        """The groups at ``positions``, in that order (``trained[len(positions)]``: which weigh in the loss)."""
        n = self.rewards.shape[1]
        whole = positions.numel() == self.rewards.shape[0] and bool(
            (positions.cpu() == torch.arange(positions.numel())).all()
        )  # every group in order (one round without a filter)
        rows = (positions.unsqueeze(1) * n + torch.arange(n)).reshape(-1)
        pick = (
            (lambda values: values)
            if whole
            else (lambda values: None if values is None else values[positions])
        )
        return Groups(
            self.rollouts if whole else self.rollouts.select(rows),
            pick(self.rewards),
            {name: pick(values) for name, values in self.per_function.items()},
            pick(self.ranked_rewards),
            pick(self.signal),
            trained,
        )


@dataclass
class SampledGroups:
    """Every group a step generated, round by round (a refill round appends), with what the filter said of it;
    and where the step left the prompt stream (``cursor``) and the running share that passes."""

    prompt_filter: str
    pad_id: int = 0
    ids: list[int] = field(default_factory=list)  # each group's prompt (its position in the training set)
    skipped: int = 0  # prompts skipped before generation and not generated (prompt_skip), over the rounds
    drawn: int = 0  # prompts the round sizes counted, over the rounds (for the running pass share)
    rounds: list[Groups] = field(default_factory=list)
    cursor: int = 0  # prompts drawn per process from the stream, this step's draws included
    pass_share: PassShare = field(default_factory=PassShare)
    _passed: list[torch.Tensor] = field(default_factory=list)
    _all: Groups | None = None  # every round joined, kept until the next round

    def add(
        self,
        ids: list[int],
        rollouts: Rollouts,
        rewards: torch.Tensor,
        per_function: dict,
        *,
        ranked: torch.Tensor | None = None,
        signal: torch.Tensor | None = None,
        skipped: int = 0,
        drawn: int | None = None,
    ) -> None:
        """Record one round: ``ids[P]``, its rollouts, ``rewards[P, n]``, and what is ranked and filtered on."""
        self.ids.extend(ids)
        self.skipped += skipped
        self.drawn += len(ids) if drawn is None else drawn
        round_groups = Groups(rollouts, rewards, per_function, ranked, signal)
        self.rounds.append(round_groups)
        self._passed.append(passing_groups(round_groups.filter_rewards, self.prompt_filter))

    @property
    def passed(self) -> torch.Tensor:
        """``BoolTensor[G]`` over every group so far: which pass the filter."""
        return torch.cat(self._passed)

    @property
    def num_passed(self) -> int:
        return int(self.passed.sum()) if self._passed else 0

    @property
    def num_rollouts(self) -> int:
        """Completions generated over the rounds (this process)."""
        return sum(len(part.rollouts) for part in self.rounds)

    @property
    def rewards(self) -> torch.Tensor:
        """``[G, n]`` summed rewards of every group so far."""
        return torch.cat([part.rewards for part in self.rounds])

    @property
    def filter_rewards(self) -> torch.Tensor:
        """``[G, n]`` the reward the prompt stages read, of every group so far."""
        return torch.cat([part.filter_rewards for part in self.rounds])

    @property
    def all(self) -> Groups:
        """Every group so far, as one batch (rollouts re-padded)."""
        if self._all is None or self._all.rewards.shape[0] != len(self.ids):
            first = self.rounds[0]
            joined = lambda name: torch.cat([getattr(part, name) for part in self.rounds])  # noqa: E731
            self._all = Groups(
                concat_rollouts([part.rollouts for part in self.rounds], self.pad_id),
                self.rewards,
                {
                    name: torch.cat([part.per_function[name] for part in self.rounds])
                    for name in first.per_function
                },
                None if first.ranked_rewards is None else joined("ranked_rewards"),
                None if first.signal is None else joined("signal"),
            )
        return self._all

    def take(self, positions: torch.Tensor, trained: torch.Tensor | None = None) -> Groups:
        """The groups at ``positions`` (ascending), in that order, and which of them weigh in the loss."""
        return self.all.take(positions, trained)
