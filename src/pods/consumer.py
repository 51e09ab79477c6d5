"""Stages 3-4 of a step (the groups it trains on, m of n in each, their advantages) and the step's row of
metrics: functions of the batch, the consumer's side of a step (the update is :mod:`pods.update`)."""

from __future__ import annotations

from typing import Any

import torch

from pods.advantages import Downsampled, difficulty_counts, downsample, nanstd, zero_variance_groups
from pods.distributed import gather, synced_max, synced_mean, synced_sum
from pods.metrics import StepTimer, peak_memory_mb, reward_metrics
from pods.producer import reward_components
from pods.prompt_filter import Groups, SampledGroups, fill_groups
from pods.rollout import Rollouts

__all__ = ["observe_for_auto", "select_kept", "stage_metrics", "step_metrics"]


def select_kept(
    config: Any, accelerator: Any, sampled: SampledGroups, m: int, generator: torch.Generator
) -> tuple[Groups, Downsampled]:
    """3-4. The groups the step trains on (those that passed the filter first; past the bound as
    ``prompt_filter_exhausted`` says, ``error`` excepted: the trainer checks it first), m (or a difficulty's k) of
    each, and their advantages."""
    cfg, acc = config, accelerator
    exhausted = cfg.prompt_filter_exhausted if cfg.prompt_filter != "none" else "pad"
    taken = fill_groups(sampled.passed, cfg.prompts_per_step, exhausted)
    groups = sampled.take(taken.positions, trained=taken.trained)
    counts = None
    if cfg.num_generations_kept_by_difficulty:  # GFPO: k per group from its mean reward's quartile
        means = gather(acc, groups.rewards.nanmean(dim=1))
        mine = slice(acc.process_index * len(taken.positions), (acc.process_index + 1) * len(taken.positions))
        counts = difficulty_counts(means.cpu(), cfg.num_generations_kept_by_difficulty)[mine]
    components = weights = None
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        components, weights = reward_components(cfg, groups.per_function)
    chosen = downsample(
        groups.ranked,
        m,
        cfg.selection_rule,
        scale=cfg.scale_rewards,
        eps=cfg.advantage_eps,
        generator=generator,
        gather=lambda values: gather(acc, values),
        lengths=groups.lengths,
        kept_counts=counts,
        keep_signal=cfg.prompt_filter != "none",
        components=components,
        weights=weights,
    )
    return groups, chosen


def step_metrics(
    accelerator: Any,
    state: Any,
    timer: StepTimer,
    rollouts: Rollouts,
    rewards: torch.Tensor,
    kept_rewards: torch.Tensor,
    per_function: dict[str, torch.Tensor],
    update: dict[str, float],
    trained_groups: torch.Tensor,
    *,
    epoch: float,
    learning_rate: float,
    accuracy_name: str,
) -> dict[str, Any]:
    """The step's row of metrics.jsonl: rewards of every group generated and of the kept rows of the groups
    trained on (``kept_rewards`` NaN where a position is not trained), lengths, timings, memory."""
    acc = accelerator
    everywhere = lambda t: gather(acc, t).cpu()  # noqa: E731 - equal shapes on every process
    all_rewards = everywhere(rewards)
    kept = everywhere(kept_rewards)[everywhere(trained_groups.to(acc.device)).bool()]
    lengths = everywhere(rollouts.completion_mask.sum(dim=1).double())
    truncated = everywhere(rollouts.truncated.double())
    step_seconds = synced_max(acc, timer.total)
    metrics: dict[str, Any] = {
        "step": state.step,
        "epoch": round(epoch, 4),  # every prompt drawn, refills included
        "train_seconds": state.train_seconds,  # unrounded: the schedules compare against this exact clock
        "num_generations": rewards.shape[1],
        **reward_metrics(all_rewards, kept),
        "skipped_steps": state.skipped_steps,
    }
    for name, values in per_function.items():
        values = everywhere(values)
        metrics[f"rewards/{name}/mean"] = values.nanmean().item()
        metrics[f"rewards/{name}/std"] = nanstd(values.reshape(1, -1), dim=1).item()
    metrics.update(
        {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
            "learning_rate": learning_rate,
            **{key: synced_mean(acc, value) for key, value in update.items()},
        }
    )
    if rollouts.tool_mask is not None:
        # multi-turn rollouts: the tokens the loss weighs, tool output left out
        metrics["completions/mean_sampled_length"] = (
            everywhere(rollouts.sampled_lengths.double()).mean().item()
        )
    if rollouts.episode_stats is not None:  # multi-turn rollouts: TRL's two tool metrics, and pods' own
        calls, errors, turns = everywhere(rollouts.episode_stats.double()).unbind(dim=1)
        metrics["tools/call_frequency"] = calls.mean().item()  # calls per rollout
        metrics["tools/failure_frequency"] = (errors.sum() / calls.sum()).item() if calls.sum() > 0 else 0.0
        metrics["tools/errors_per_rollout"] = errors.mean().item()
        metrics["tools/calling_share"] = (calls > 0).double().mean().item()  # rollouts with a call
        metrics["tools/mean_turns"] = turns.mean().item()
    if accuracy_name in per_function:
        metrics["accuracy"] = (
            (everywhere(torch.nan_to_num(per_function[accuracy_name])) > 0.5).double().mean().item()
        )
    for phase, seconds in timer.seconds.items():
        metrics[f"seconds_{phase}"] = round(synced_max(acc, seconds), 4)
    metrics["seconds_step"] = round(step_seconds, 4)
    metrics["timeline"] = [list(span) for span in timer.spans]  # when each phase ran (wall clock)
    metrics["tokens_per_second"] = round(lengths.sum().item() / max(step_seconds, 1e-9), 1)
    metrics["peak_memory_mb"] = round(peak_memory_mb(), 1)
    return metrics


def stage_metrics(
    config: Any,
    accelerator: Any,
    sampled: SampledGroups,
    groups: Groups,
    chosen: Downsampled,
    trained: torch.Tensor,
) -> dict[str, float]:
    """Rollouts generated (every round, every process) and groups trained with a signal, so that rollouts per
    useful group can be read from any run; with a ``prompt_filter`` its rounds, drops and shortfall; with a
    length rule under a filter, the groups whose signal a swap restored."""
    acc, cfg = accelerator, config
    kept = chosen.rewards.masked_fill(~trained, float("nan"))
    with_signal = int((groups.trained & ~zero_variance_groups(kept)).sum())
    first = len(sampled.rounds[0].rollouts)
    counts = [sampled.num_rollouts, with_signal, sampled.num_rollouts - first, chosen.signal_restored]
    generated, with_signal, extra, restored = synced_sum(acc, torch.tensor(counts)).tolist()
    metrics = {
        "pods/rollouts_generated": int(generated),
        "pods/groups_trained_with_signal": int(with_signal),
    }
    if cfg.prompt_filter == "none":
        return metrics
    wanted, passed = cfg.prompts_per_step, sampled.num_passed
    unfilled = max(wanted - passed, 0)  # slots without a group that passed (train_fewer: left out)
    failed = len(sampled.ids) - passed
    dropped, unfilled = synced_sum(acc, torch.tensor([failed - unfilled, unfilled])).tolist()
    share = sampled.pass_share.share
    return {
        **metrics,
        "pods/filter/num_gen_batches": len(sampled.rounds),
        "pods/filter/first_round_prompts": len(sampled.rounds[0].rewards),
        "pods/filter/groups_dropped": int(dropped),
        "pods/filter/extra_rollouts": int(extra),
        "pods/filter/groups_unfilled": int(unfilled),
        "pods/filter/pass_share": float("nan") if share is None else share,
        "pods/selection/signal_restored": int(restored),
    }


def observe_for_auto(
    auto: Any, accelerator: Any, step: int, batch: Any, timer: StepTimer, accuracy_name: str
) -> list[dict[str, Any]]:
    """``num_generations: auto``: record the step's successes per group (the accuracy reward above 0.5, else the
    summed reward above 0.5) and its timings, over every process, and re-decide n when due; the rows for
    num_generations.jsonl. With a rollout worker, generating is the worker's time and the trainer's waiting is
    neither."""
    everything = batch.sampled.all
    rewards, per_function = everything.rewards, everything.per_function
    phases = dict(timer.seconds)
    if batch.seconds:  # sampled by a rollout worker
        phases.pop("wait_for_rollouts", None)
        phases = {"generate": sum(batch.seconds.values()), "update": sum(phases.values())}
    scores = torch.nan_to_num(per_function.get(accuracy_name, rewards))
    successes = gather(accelerator, (scores > 0.5).sum(dim=1)).cpu().tolist()
    seconds = {phase: synced_max(accelerator, value) for phase, value in sorted(phases.items())}
    rows = [auto.observe(step, rewards.shape[1], successes, seconds)]
    decision = auto.decide(step)
    if decision is not None:
        rows.append({"kind": "decision", **decision.to_dict()})
    return rows
