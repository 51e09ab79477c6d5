"""Stages 0-2 of a step, the producer: draw the round's prompts from the stream (GRESO skipping some), generate
n completions of each, score them; with a prompt filter, more rounds sized to what is missing. It runs in the
trainer's process (``pods train``) or alone in the rollout worker (``async_generation``), the same code.

What the producer carries from step to step is :class:`ProducerState` (the stream's cursor, the filter's pass
share, GRESO's history): plain data, checkpointed with the trainer's state, so that a resumed run draws,
skips and sizes its rounds exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pods.advantages import aggregate_rewards
from pods.agents.episodes import sample_rollouts
from pods.config import TrainConfig
from pods.data.stream import PromptStream
from pods.distributed import gather, synced_max, synced_sum
from pods.metrics import StepTimer
from pods.prompt_filter import PassShare, SampledGroups, next_round_size
from pods.prompt_skip import (
    PromptHistory,
    adapt_exploration,
    greso_settings,
    group_outcomes,
    record_outcomes,
    round_prompts,
)
from pods.rollout import Rollouts, SamplingParams
from pods.scoring import RewardFunction, reward_columns, score_completions

__all__ = ["OneProcess", "ProducedBatch", "Producer", "ProducerState", "score_batch", "seed_step"]

Score = Callable[
    [list[dict[str, Any]], Rollouts, list[Any] | None], tuple[torch.Tensor, dict[str, torch.Tensor]]
]  # (rows, rollouts, each rollout's environment or None) -> rewards [prompts, n], each function's


@dataclass
class ProducerState:
    """Where the producer stands: prompts drawn per process (the stream's cursor), the filter's running pass share
    (:meth:`PassShare.to_state`) and GRESO's history (:meth:`PromptHistory.to_state`). JSON-able."""

    prompts_drawn: int = 0
    pass_share: list[float] | None = None
    prompt_history: dict[str, Any] | None = None

    @classmethod
    def of(cls, state: Any, prompts_per_step: int) -> ProducerState:
        """The producer's part of a :class:`~pods.checkpoint.TrainerState` (a run checkpointed before the cursor
        existed drew step x P prompts)."""
        drawn = state.prompts_drawn if state.prompts_drawn is not None else state.step * prompts_per_step
        return cls(drawn, state.pass_share, state.prompt_history)

    def into(self, state: Any) -> None:
        """Write this into a :class:`~pods.checkpoint.TrainerState`."""
        state.prompts_drawn, state.pass_share, state.prompt_history = (
            self.prompts_drawn,
            self.pass_share,
            self.prompt_history,
        )


@dataclass
class ProducedBatch:
    """One step's output of stages 0-2, as the trainer consumes it: the groups, the weights version that sampled
    them (the trainer's own step without a rollout worker), and the producer's state after them."""

    step: int  # the trainer step it is for (0-based)
    version: int  # the weights version (optimizer steps applied) that sampled it
    num_generations: int
    sampled: SampledGroups
    state_after: ProducerState
    skip_metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(
        default_factory=dict
    )  # a rollout worker's phases: select, generate, score
    idle_seconds: float = 0.0  # how long a rollout worker waited for the weights before this batch
    spans: list[tuple[str, float, float]] = field(
        default_factory=list
    )  # a rollout worker's phases, wall-clock


@dataclass(frozen=True)
class OneProcess:
    """What the producer reads of an accelerator, for a producer alone in its process (the rollout worker)."""

    num_processes: int = 1
    process_index: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def seed_step(seed: int, step: int, process: int) -> None:
    """Reseed torch per step (and process): sampling after a resume, or in the rollout worker, matches an
    uninterrupted run in one process exactly."""
    torch.manual_seed((seed * 1_000_003 + step) * 64 + process)


def score_batch(
    reward_funcs: list[RewardFunction],
    config: TrainConfig,
    batch: list[dict[str, Any]],
    rollouts: Rollouts,
    environments: list[Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """2. One weighted, summed reward per completion ``[prompts, n]``, and each function's; with environments,
    every function also gets ``environments`` (one per completion, as TRL passes them)."""
    n = rollouts.num_generations
    columns = reward_columns(batch, n)
    if environments is not None:
        columns["environments"] = environments
    prompts = [row["prompt"] for row in batch for _ in range(n)]
    completion_ids = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(rollouts.completion_ids, rollouts.completion_mask, strict=True)
    ]
    total, per_function = score_completions(
        reward_funcs,
        config.reward_weights,
        prompts,
        rollouts.texts,
        completion_ids,
        columns,
        timeout=config.reward_timeout,
        conversations=rollouts.messages,
    )
    shape = (len(batch), n)
    return total.view(shape), {name: values.view(shape) for name, values in per_function.items()}


def reward_components(
    config: TrainConfig, per_function: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, n, F]`` each reward function's rewards, and their ``[F]`` weights."""
    weights = config.reward_weights or [1.0] * len(per_function)
    return torch.stack(list(per_function.values()), dim=2), torch.tensor(weights, dtype=torch.float64)


class Producer:
    """Stages 0-2 for one process: :meth:`sample` a step's groups from a :class:`ProducerState`, then
    :meth:`advance` the state past them (GRESO's history, the cursor, the pass share)."""

    def __init__(
        self,
        config: TrainConfig,
        engine: Any,
        tokenizer: Any,
        rows: list[dict[str, Any]],
        *,
        score: Score | None = None,
        reward_funcs: list[RewardFunction] | None = None,
        accelerator: Any = None,
    ) -> None:
        self.config, self.engine, self.tokenizer, self.rows = config, engine, tokenizer, rows
        self.accelerator = accelerator or OneProcess()
        self.score = score or (
            lambda batch, rollouts, environments=None: score_batch(
                reward_funcs or [], config, batch, rollouts, environments
            )
        )
        acc = self.accelerator
        self.prompts = PromptStream(rows, config.seed, acc.process_index, acc.num_processes)
        self.greso = greso_settings(config)
        self.sampling = SamplingParams(
            max_new_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            stop_strings=tuple(config.stop_strings),
        )

    def sample(
        self,
        state: ProducerState,
        step: int,
        n: int,
        timer: StepTimer,
        *,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> SampledGroups | None:
        """A step's groups: rounds of prompts drawn from the stream (GRESO skipping some), n completions each,
        scored. One round without a prompt filter; with one, rounds sized to what is missing until every process
        has P groups that pass or ``max_num_gen_batches`` rounds ran. Every process runs the same rounds of the
        same size (engines and reward gathering may need all of them). ``state`` is not changed (see
        :meth:`advance`). None when ``should_stop`` ends an unbounded filter's rounds."""
        cfg, acc = self.config, self.accelerator
        wanted = cfg.prompts_per_step
        sampled = SampledGroups(cfg.prompt_filter, pad_id=self.tokenizer.pad_token_id or 0)
        sampled.cursor = state.prompts_drawn
        start = PassShare.from_state(state.pass_share)
        history = PromptHistory.from_state(state.prompt_history, self.greso) if self.greso else None
        most = (lambda value: int(synced_max(acc, value))) if acc.num_processes > 1 else (lambda value: value)

        def draw(count: int) -> list[int]:
            ids = self.prompts.draw(sampled.cursor, count)
            sampled.cursor += count
            return ids

        while True:
            passed, drawn = synced_sum(acc, torch.tensor([sampled.num_passed, sampled.drawn])).tolist()
            sampled.pass_share = start.plus(int(passed), int(drawn))
            size = next_round_size(
                rounds_run=len(sampled.rounds),
                wanted=wanted,
                missing=most(wanted - sampled.num_passed),
                share=sampled.pass_share.share,
                prompt_filter=cfg.prompt_filter,
                max_num_gen_batches=cfg.max_num_gen_batches,
                generation_batch_prompts=cfg.generation_batch_prompts,
                multiple=self.engine.round_multiple(n),
            )
            if size == 0:
                return sampled
            if cfg.max_num_gen_batches == 0 and sampled.rounds:
                if (
                    should_stop is not None and should_stop()
                ):  # no bound: a stop must be able to end the rounds
                    return None
                if progress is not None and len(sampled.rounds) % 8 == 0:
                    progress(
                        f"step {step + 1}: {len(sampled.rounds)} generation rounds so far, {sampled.num_passed} "
                        f"of {wanted} groups with a spread (max_num_gen_batches: 0, no bound)"
                    )
            with timer("select"):  # 0. the round's prompts, skipping those predicted to give no signal
                prompts = round_prompts(
                    draw,
                    size,
                    settings=self.greso,
                    history=history,
                    generator=self.skip_generator(step, len(sampled.rounds)),
                    mode=cfg.prompt_skip_mode,
                    most=most,
                )
            batch = [self.rows[index] for index in prompts.ids]
            with timer("generate"):  # 1. n completions per prompt (episodes, with tools)
                episodes = sample_rollouts(self.engine, batch, n, self.sampling, self.tokenizer, most=most)
                rollouts = episodes.rollouts
            with timer("score"):  # 2. one reward per completion: [prompts, n]
                rewards, per_function = self.score(batch, rollouts, episodes.environments)
                ranked, signal = self.ranked_and_signal(rewards, per_function)
            sampled.add(
                prompts.ids,
                rollouts,
                rewards,
                per_function,
                ranked=ranked,
                signal=signal,
                skipped=prompts.skipped,
                drawn=size,
            )

    def advance(self, state: ProducerState, sampled: SampledGroups) -> tuple[ProducerState, dict[str, float]]:
        """The state after a step's groups: the cursor and pass share they reached, and with GRESO every process's
        outcomes added to the history (rates adapted past the first epoch); and GRESO's metrics."""
        after = ProducerState(sampled.cursor, sampled.pass_share.to_state(), state.prompt_history)
        if self.greso is None:
            return after, {}
        acc = self.accelerator
        outcomes = gather(acc, group_outcomes(sampled.filter_rewards, self.greso)).tolist()
        ids = gather(acc, torch.tensor(sampled.ids, dtype=torch.long)).tolist()
        history = record_outcomes(PromptHistory.from_state(state.prompt_history, self.greso), ids, outcomes)
        if self.prompts.epoch(state.prompts_drawn) >= 1:  # as GRESO: past the first epoch
            history = adapt_exploration(history, outcomes, self.greso)
        after.prompt_history = history.to_state()
        skipped = int(synced_sum(acc, torch.tensor(sampled.skipped)))
        shrinks = (
            self.config.prompt_skip_mode == "shrink"
        )  # replace mode generates another prompt for each skip
        return after, {
            "pods/skip/prompts_skipped": skipped,
            "pods/skip/rollouts_saved": skipped * sampled.rounds[0].rewards.shape[1] if shrinks else 0,
            "pods/skip/exploration_solved": after.prompt_history["exploration_solved"],
            "pods/skip/exploration_failed": after.prompt_history["exploration_failed"],
        }

    def ranked_and_signal(
        self, rewards: torch.Tensor, per_function: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What the rules rank and the advantages use (None: the weighted sum; with ``normalize_then_sum`` the sum
        of each function's group-normalised rewards), and what the prompt stages read (None: the same; else the
        ``prompt_filter_reward`` function's rewards)."""
        cfg = self.config
        ranked = None
        if cfg.multi_objective_aggregation == "normalize_then_sum":
            components, weights = reward_components(cfg, per_function)
            ranked = aggregate_rewards(components, weights, "normalize_then_sum", cfg.advantage_eps)
        signal = None if cfg.prompt_filter_reward == "total" else per_function[cfg.prompt_filter_reward]
        return ranked, signal

    def skip_generator(self, step: int, round_index: int) -> torch.Generator:
        """GRESO's draws for one round of one step on this process (no state to checkpoint)."""
        process = self.accelerator.process_index
        return torch.Generator().manual_seed(
            ((self.config.seed * 1_000_003 + step) * 64 + process) * 1_009 + round_index
        )
