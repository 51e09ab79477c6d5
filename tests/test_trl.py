"""PODS inside TRL's GRPOTrainer, on a tiny random Llama on CPU: selection, equality with GRPO at m = n,
the batch-arithmetic errors, two processes, the GSM8K example's configuration, the length-aware rules, and
the prompt filter with refill and GRESO's skipping inside TRL."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from pods.advantages import group_advantages, zero_variance_groups
from pods.architectures import packing_blocker
from pods.errors import PromptFilterExhausted
from pods.integrations.trl import (
    PROMPT_STAGES_STATE_FILE,
    PODSConfig,
    PODSTrainer,
    advantage_scale,
    check_batch_arithmetic,
    concat_batches,
    prompt_key,
    summed_rewards,
    take_rows,
)
from pods.prompt_filter import PassShare, fill_groups, next_round_size
from pods.selection import register_rule, select

REPO_ROOT = Path(__file__).resolve().parents[1]


def token_sum_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """A deterministic reward with spread inside each group: the token-id sum modulo 4."""
    return [float(sum(ids) % 4) for ids in completion_ids]


def lowest_rewards(rewards: torch.Tensor, m: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A user rule: the m lowest rewards of each group."""
    return rewards.argsort(dim=1, stable=True)[:, :m]


register_rule("test_lowest", lowest_rewards, overwrite=True)


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Question {i}: 3 + {i}"}]} for i in range(32)]
    )


def tiny_args(config_class: type, output_dir: Path, **overrides) -> GRPOConfig:
    """A CPU config for 2 quick steps: 8 completions per process and step, 8 new tokens at most."""
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_completion_length=8,
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
    )
    settings.update(overrides)
    return config_class(**settings)


# --- pure helpers ----------------------------------------------------------------------------------------


def test_batch_arithmetic_counts_kept_rows_and_explains_errors() -> None:
    assert check_batch_arithmetic(16, 4, num_generations=64, num_generations_kept=16) == 16
    assert check_batch_arithmetic(8, 1, num_generations=4, num_generations_kept=2, num_processes=2) == 4
    with pytest.raises(ValueError, match=r"not a multiple of n=4.*spread a prompt's group over 2 processes"):
        check_batch_arithmetic(6, 1, num_generations=4, num_generations_kept=2, num_processes=2)
    with pytest.raises(ValueError, match=r"\(2 x 2 / 4\) x 3 = 1 prompts x 3 = 3.*drop 1 kept"):
        check_batch_arithmetic(2, 2, num_generations=4, num_generations_kept=3)


def test_misconfigured_batch_fails_when_the_config_is_built(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"steps_per_generation=2 equal micro-batches.*per_device_train_batch_size=4"
    ):
        tiny_args(
            PODSConfig,
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_generations_kept=3,
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_generations_kept": 5}, r"between 2 and num_generations \(n=4\), got 5"),
        ({"num_generations_kept": 1}, r"m=1 gives no signal"),
        ({"selection_rule": "best"}, r"unknown selection_rule 'best'; known rules: max_variance"),
        ({"selection_rule": "all", "num_generations_kept": 2}, r"'all' keeps every completion"),
        ({"prompt_filter": "mean"}, r"unknown prompt_filter 'mean'; choose one of none, nonzero_std"),
        ({"prompt_skip": "always"}, r"unknown prompt_skip 'always'; choose one of none, greso"),
        ({"prompt_skip_mode": "drop"}, r"unknown prompt_skip_mode 'drop'; choose one of shrink, replace"),
        ({"prompt_filter_exhausted": "wait"}, r"unknown prompt_filter_exhausted 'wait'"),
        (
            {"max_num_gen_batches": -1},
            r"max_num_gen_batches must be an int of at least 1 .* or 0 for no bound",
        ),
        ({"prompt_skip_target": 1.5}, r"prompt_skip_target must be in \[0, 1\)"),
        ({"packing": True, "token_budget": 0}, r"token_budget must be at least 1"),
        ({"generation_batch_prompts": "auto"}, r"generation_batch_prompts: oversamples .* set prompt_filter"),
        (
            {"prompt_filter": "nonzero_std", "generation_batch_prompts": 1},
            r"generation_batch_prompts: must be null, auto, or a number of prompts of at least",
        ),
        (
            {"num_generations_kept": 2, "num_generations_kept_by_difficulty": [2, 3, 3, 3]},
            r"num_generations_kept_by_difficulty: must list 4 counts .* each from 2 to num_generations_kept \(2\)",
        ),
        (
            {"prompt_skip": "greso", "prompt_skip_solved_mean": 0.1, "prompt_skip_failed_mean": 0.2},
            r"failed_mean",
        ),
        (
            {"prompt_filter": "nonzero_std", "loss_type": "grpo"},
            r"prompt_filter_exhausted='train_fewer' leaves rows out .* loss_type='grpo' .* "
            r"or prompt_filter_exhausted='pad'",
        ),
        (
            {"prompt_skip": "greso", "loss_type": "bnpo"},
            r"prompt_skip_mode='shrink' leaves rows out .* or prompt_skip_mode='replace'",
        ),
    ],
)
def test_config_rejects_bad_pods_fields(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_args(PODSConfig, tmp_path, **overrides)


def test_config_defaults_to_plain_grpo_and_accepts_user_rules(tmp_path: Path) -> None:
    assert tiny_args(PODSConfig, tmp_path).kept_per_prompt == 4
    assert (
        tiny_args(PODSConfig, tmp_path, num_generations_kept=2, selection_rule="test_lowest").kept_per_prompt
        == 2
    )


def test_config_parses_from_the_command_line_with_trl_parser(tmp_path: Path) -> None:
    from trl import TrlParser

    flags = "--use_cpu True --num_generations 4 --per_device_train_batch_size 4 --num_generations_kept 2"
    flags = ["--output_dir", str(tmp_path), *flags.split(), "--selection_rule", "random"]
    (config,) = TrlParser(PODSConfig).parse_args_into_dataclasses(flags)
    assert (config.num_generations, config.kept_per_prompt, config.selection_rule) == (4, 2, "random")


def test_scale_mapping_and_summed_rewards() -> None:
    assert [advantage_scale(s) for s in ("group", "batch", "none", True, False)] == [
        "group",
        "batch",
        "none",
        "group",
        "none",
    ]
    with pytest.raises(ValueError, match="scale_rewards"):
        advantage_scale("std")
    per_func = torch.tensor([[1.0, float("nan")], [0.5, 2.0], [float("nan"), float("nan")]])
    summed = summed_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert summed[:2].tolist() == [1.0, 1.5] and summed[2].isnan()  # every function None: NaN, as in TRL


def test_take_rows_keeps_every_per_row_entry_and_refuses_unknown_shapes() -> None:
    rows = torch.tensor([1, 3, 4, 6])  # positions [1, 3] of group 0 and [0, 2] of group 1, n = 4
    batch = {
        "completion_ids": torch.arange(16).view(8, 2),
        "advantages": torch.arange(8.0),
        "num_images": list(range(8)),
        "num_items_in_batch": torch.tensor(16),
        "old_per_token_logps": None,
    }
    out = take_rows(batch, rows, num_rows=8)
    assert out["completion_ids"].tolist() == [[2, 3], [6, 7], [8, 9], [12, 13]]
    assert out["advantages"].tolist() == [1.0, 3.0, 4.0, 6.0]
    assert out["num_images"] == [1, 3, 4, 6]
    assert out["num_items_in_batch"].item() == 16 and out["old_per_token_logps"] is None
    with pytest.raises(ValueError, match=r"'mystery' \(size \(3,\)\).*not one entry per completion \(8\)"):
        take_rows({**batch, "mystery": torch.zeros(3)}, rows, num_rows=8)


# --- the trainer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale", "rule"),
    [("group", "max_variance"), ("batch", "max_variance"), ("group", "max_variance_shortest")],
)
def test_generation_batch_keeps_the_selected_rows_of_each_group(
    tiny_model_dir, prompts, tmp_path, scale, rule
) -> None:
    """One generation batch, checked row by row against an independent recomputation."""
    seen: list[list[int]] = []

    def recording_reward(completion_ids, **kwargs):
        seen.extend(completion_ids)
        return token_sum_reward(completion_ids)

    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        gradient_accumulation_steps=2,
        beta=0.04,
        scale_rewards=scale,
        selection_rule=rule,
    )
    trainer = PODSTrainer(str(tiny_model_dir), recording_reward, args, prompts)  # TRL's positional order
    inputs = next(iter(trainer.get_train_dataloader()))
    assert len(inputs) == 16  # 8 completions x 2 accumulation steps = 4 groups of n = 4

    trainer.model.train()
    batch = trainer._generate_and_score_completions(inputs)
    rewards = torch.tensor(token_sum_reward(seen)).view(4, 4)
    lengths = torch.tensor([len(ids) for ids in seen]).view(4, 4)
    expected = select(rewards, 2, rule, lengths=lengths)
    rows = (expected + 4 * torch.arange(4).unsqueeze(1)).flatten().tolist()
    completions = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
    ]
    assert completions == [seen[r] for r in rows]
    for key in ("prompt_ids", "prompt_mask", "completion_mask", "ref_per_token_logps", "advantages"):
        assert batch[key].shape[0] == 8, key
    kept_rewards = rewards.gather(1, expected)
    assert torch.equal(batch["advantages"], group_advantages(kept_rewards, scale=scale).view(-1))
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
    for group in range(4):  # each kept pair still belongs to one prompt, and it is the best pair there is
        assert torch.equal(batch["prompt_ids"][2 * group], batch["prompt_ids"][2 * group + 1])
        best = max(rewards[group, list(pair)].var().item() for pair in itertools.combinations(range(4), 2))
        assert kept_rewards[group].var().item() == pytest.approx(best)
    assert trainer._metrics["train"]["pods/reward_kept"] == [pytest.approx(kept_rewards.mean().item())]
    assert trainer._metrics["train"]["reward"] == [pytest.approx(rewards.mean().item())]  # TRL's own, all n
    logged = torch.tensor(list(trainer._logs["advantages"])).view(4, 4)  # completions table: NaN = dropped
    assert torch.equal(logged.isnan().logical_not().nonzero()[:, 1].view(4, 2), expected)

    trainer.model.eval()  # evaluation is TRL's, untouched: every completion comes back
    assert trainer._generate_and_score_completions(inputs)["completion_ids"].shape[0] == 16


def test_unscorable_completions_follow_trls_rule(tiny_model_dir, prompts, tmp_path) -> None:
    """A completion every reward function scores None: left out of the mean and std, advantage 0 (TRL)."""
    seen: list[list[int]] = []

    def sometimes_none(completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [None if sum(ids) % 3 == 0 else float(sum(ids) % 4) for ids in completion_ids]

    args = tiny_args(
        PODSConfig, tmp_path, num_generations_kept=3, per_device_train_batch_size=12, num_generations=6
    )
    trainer = PODSTrainer(str(tiny_model_dir), sometimes_none, args, prompts)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    rewards = torch.tensor([float("nan") if sum(ids) % 3 == 0 else float(sum(ids) % 4) for ids in seen]).view(
        -1, 6
    )
    assert rewards.isnan().any(), "the draw has no unscorable completion; change the reward"
    kept = torch.tensor(
        [
            seen.index(ids[mask.bool()].tolist())
            for ids, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
        ]
    )
    kept_rewards = rewards.flatten()[kept].view(-1, 3)
    advantages = batch["advantages"].view(-1, 3)
    for group, values in enumerate(kept_rewards):
        scored = values[~values.isnan()]
        assert advantages[group][values.isnan()].eq(0).all()
        if len(scored) > 1 and scored.std() > 0:
            expected = (scored - scored.mean()) / (scored.std() + 1e-4)
            torch.testing.assert_close(advantages[group][~values.isnan()], expected, rtol=1e-5, atol=1e-6)
    assert trainer._metrics["train"]["reward"] == [pytest.approx(rewards.nanmean().item())]


def numbered_prompts(size: int) -> Dataset:
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Question {i}: 3 + {i}"}], "number": i}
            for i in range(size)
        ]
    )


def half_constant_reward(completion_ids: list[list[int]], number: list[int], **kwargs) -> list[float]:
    """Even-numbered prompts always score 1 (all-equal groups); odd ones the token-id sum modulo 4."""
    return [1.0 if k % 2 == 0 else float(sum(ids) % 4) for ids, k in zip(completion_ids, number, strict=True)]


def recording_rewards():
    """A reward (half_constant_reward) that records every completion and prompt number it scores, and each call's
    number of groups of 4 (one call per generation round)."""
    seen: list[list[int]] = []
    numbers: list[int] = []
    calls: list[int] = []

    def recording(completion_ids, number, **kwargs):
        seen.extend(completion_ids)
        numbers.extend(number)
        calls.append(len(number) // 4)
        return half_constant_reward(completion_ids, number)

    return recording, seen, numbers, calls


def test_prompt_filter_rounds_are_sized_to_the_shortfall_in_trl(tiny_model_dir, tmp_path) -> None:
    """One generation batch with dynamic sampling: TRL generates again for more prompts while fewer than 4 groups
    have a spread, each refill sized to the shortfall (replayed with the pure functions), never repeating a prompt
    of the batch; the batch is the first 4 groups with a spread, m of each kept, checked row by row."""
    recording, seen, numbers, calls = recording_rewards()
    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        gradient_accumulation_steps=2,
        prompt_filter="nonzero_std",
        max_num_gen_batches=4,
    )
    trainer = PODSTrainer(str(tiny_model_dir), recording, args, numbered_prompts(32))
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    rewards = torch.tensor(half_constant_reward(seen, numbers)).view(-1, 4)  # every round's groups
    passed = ~zero_variance_groups(rewards)
    passed_so_far, drawn = 0, 0
    for index, size in enumerate(calls):
        assert size == next_round_size(
            rounds_run=index,
            wanted=4,
            missing=4 - passed_so_far,
            share=PassShare().plus(passed_so_far, drawn).share,
            prompt_filter="nonzero_std",
            max_num_gen_batches=4,
        )
        passed_so_far += int(passed[drawn : drawn + size].sum())
        drawn += size
    assert len(calls) > 1, "no group of the first round had all-equal rewards: the refill was not exercised"
    prompt_numbers = numbers[::4]
    assert len(set(prompt_numbers)) == len(prompt_numbers), "a refill repeated a prompt of the batch"
    taken = fill_groups(passed, 4, "train_fewer")
    assert bool(taken.trained.all()) and bool(passed[taken.positions].all())
    groups = taken.positions
    kept = select(rewards[groups], 2, "max_variance")
    rows = (groups.unsqueeze(1) * 4 + kept).flatten().tolist()
    completions = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
    ]
    assert completions == [seen[r] for r in rows]
    assert torch.equal(batch["advantages"], group_advantages(rewards[groups].gather(1, kept)).view(-1))
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()
    metrics = trainer._metrics["train"]
    assert metrics["pods/filter/num_gen_batches"] == [len(calls)]
    assert metrics["pods/filter/extra_rollouts"] == [(drawn - calls[0]) * 4]
    assert metrics["pods/rollouts_generated"] == [drawn * 4] and metrics[
        "pods/groups_trained_with_signal"
    ] == [4]
    assert metrics["pods/filter/groups_dropped"] == [int((~passed).sum())]
    assert metrics["pods/filter/groups_unfilled"] == [0]
    assert len(metrics["reward"]) == len(calls)  # TRL's own metrics, once per round (averaged when logged)
    # The completions table holds the last rows logged (TRL keeps one generation's 16): trained advantages or NaN.
    logged = torch.tensor(list(trainer._logs["advantages"])).view(4, 4)
    for group in range(4):
        position = drawn - 4 + group
        trained = (groups == position).nonzero()
        expected_kept = kept[trained.item()].tolist() if trained.numel() else []
        assert (~logged[group].isnan()).nonzero().flatten().tolist() == expected_kept


@pytest.mark.parametrize("exhausted", ["train_fewer", "pad", "error"])
def test_past_the_bound_trl_trains_fewer_pads_or_stops(tiny_model_dir, tmp_path, exhausted: str) -> None:
    """Every reward 1: no group passes. After max_num_gen_batches rounds, train_fewer gives every row a zero loss
    mask (nothing counts in num_items_in_batch), pad trains them at advantage 0, error raises verl's error."""

    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        prompt_filter="nonzero_std",
        max_num_gen_batches=2,
        prompt_filter_exhausted=exhausted,
    )
    trainer = PODSTrainer(str(tiny_model_dir), always_one, args, numbered_prompts(32))
    trainer.model.train()
    inputs = next(iter(trainer.get_train_dataloader()))
    if exhausted == "error":
        with pytest.raises(PromptFilterExhausted, match=r"only 0 of the 2 groups .* prompt_filter_exhausted"):
            trainer._generate_and_score_completions(inputs)
        return
    batch = trainer._generate_and_score_completions(inputs)
    assert batch["advantages"].abs().sum() == 0 and batch["completion_ids"].shape[0] == 4
    tokens = batch["completion_mask"].sum().item()
    assert (tokens == 0) == (exhausted == "train_fewer") and batch["num_items_in_batch"].item() == tokens
    assert trainer._metrics["train"]["pods/filter/groups_unfilled"] == [2]


def test_normalize_then_sum_ranks_and_trains_on_trls_gdpo_quantity(tiny_model_dir, tmp_path) -> None:
    """TRL's multi_objective_aggregation='normalize_then_sum' (GDPO): each reward function normalised within the
    group, then summed. PODS ranks on that quantity (max-variance on it, not on the plain sum), and trains the kept
    rows on the mode applied to the kept set: per function over the kept of the group, summed, then over the batch.
    The same run as TRL's test_train_normalize_then_sum_aggregation: training moves every parameter."""
    scored: list[tuple[float, float]] = []

    def long_completions(completions, **kwargs):
        values = [100.0 * len(str(c)) for c in completions]  # a large scale: it dominates the plain sum
        scored.extend((v, 0.0) for v in values)
        return values

    def unique_letters(completions, **kwargs):
        values = [float(len(set(str(c)))) for c in completions]
        for offset, value in enumerate(values, start=len(scored) - len(values)):
            scored[offset] = (scored[offset][0], value)
        return values

    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        per_device_train_batch_size=32,  # 8 groups
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 3.0],
    )
    trainer = PODSTrainer(str(tiny_model_dir), [long_completions, unique_letters], args, numbered_prompts(32))
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    parts = torch.tensor(scored, dtype=torch.float64).view(-1, 4, 2)  # [groups, n, functions]
    weights = torch.tensor([1.0, 3.0], dtype=torch.float64)

    def gdpo(values: torch.Tensor) -> torch.Tensor:  # written out here, independently of pods
        mean, std = values.mean(dim=1, keepdim=True), values.std(dim=1, keepdim=True)
        return ((values - mean) / (std + 1e-4) * weights).sum(dim=2)

    ranked = gdpo(parts)
    kept = select(ranked, 2, "max_variance")
    assert not torch.equal(kept, select(parts @ weights, 2, "max_variance")), "the sum ranks alike: no teeth"
    summed = gdpo(parts.gather(1, kept.unsqueeze(2).expand(-1, -1, 2)))
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert torch.allclose(batch["advantages"].double(), expected.view(-1), atol=1e-5)

    trainer = PODSTrainer(
        str(tiny_model_dir),
        [long_completions, unique_letters],
        tiny_args(
            PODSConfig,
            tmp_path / "train",
            num_generations_kept=2,
            multi_objective_aggregation="normalize_then_sum",
        ),
        numbered_prompts(32),
    )
    before = {name: p.clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(not torch.equal(p, trainer.model.get_parameter(name)) for name, p in before.items())


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_the_logged_reward_reflects_reward_weights(tiny_model_dir, tmp_path, aggregation: str) -> None:
    """TRL's test_reward_metric_reflects_reward_weights with the drop-in (m < n): rewards 1 and 0 weighted 0.7 and
    0.3 log a reward of 0.7, in both aggregation modes."""

    def constant_one(completions, **kwargs):
        return [1.0] * len(completions)

    def constant_zero(completions, **kwargs):
        return [0.0] * len(completions)

    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        reward_weights=[0.7, 0.3],
        multi_objective_aggregation=aggregation,
        learning_rate=0.1,
        logging_steps=10,  # as in TRL's test: the metrics reach the last log, the training summary
    )
    trainer = PODSTrainer(str(tiny_model_dir), [constant_one, constant_zero], args, numbered_prompts(32))
    trainer.train()
    assert abs(trainer.state.log_history[-1]["reward"] - 0.7) < 1e-5


def test_adaptive_k_in_trl_leaves_fillers_out_of_the_loss(tiny_model_dir, tmp_path) -> None:
    """num_generations_kept_by_difficulty: the easiest groups keep 2 of their 4 kept rows trained; the other rows
    of the group have a zero loss mask and advantage 0."""
    recording, seen, numbers, _ = recording_rewards()
    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations=4,
        num_generations_kept=4,
        per_device_train_batch_size=16,
        num_generations_kept_by_difficulty=[2, 2, 4, 4],
    )
    trainer = PODSTrainer(str(tiny_model_dir), recording, args, numbered_prompts(32))
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    rewards = torch.tensor(half_constant_reward(seen, numbers)).view(-1, 4)
    weighing = (batch["completion_mask"].sum(dim=1) > 0).view(-1, 4).sum(dim=1)
    means = rewards.mean(dim=1)
    assert weighing[means.argmin()] == 4
    assert bool((weighing[means > torch.quantile(means, 0.5)] == 2).all())
    assert batch["advantages"].view(-1, 4)[:, 2:][weighing == 2].abs().sum() == 0
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()


def test_join_of_trl_batches_repads_each_side_and_refuses_images() -> None:
    first = {
        "prompt_ids": torch.tensor([[5, 6]]),
        "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[7]]),
        "completion_mask": torch.tensor([[1]]),
        "advantages": torch.tensor([0.5]),
        "num_items_in_batch": torch.tensor(1),
        "old_per_token_logps": None,
        "num_images": [0],
    }
    second = {
        "prompt_ids": torch.tensor([[8]]),
        "prompt_mask": torch.tensor([[1]]),
        "completion_ids": torch.tensor([[9, 10, 11]]),
        "completion_mask": torch.tensor([[1, 1, 1]]),
        "advantages": torch.tensor([-0.5]),
        "num_items_in_batch": torch.tensor(3),
        "old_per_token_logps": None,
        "num_images": [0],
    }
    joined = concat_batches([first, second], pad_id=0)
    assert joined["prompt_ids"].tolist() == [[5, 6], [0, 8]] and joined["prompt_mask"].tolist() == [
        [1, 1],
        [0, 1],
    ]
    assert joined["completion_ids"].tolist() == [[7, 0, 0], [9, 10, 11]]
    assert joined["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert joined["advantages"].tolist() == [0.5, -0.5] and joined["num_items_in_batch"].item() == 4
    assert joined["old_per_token_logps"] is None and joined["num_images"] == [0, 0]
    with pytest.raises(ValueError, match=r"'pixel_values' over generation rounds; .* text prompts only"):
        concat_batches([{**first, "pixel_values": object()}, {**second, "pixel_values": object()}], pad_id=0)
    assert prompt_key({"prompt": [{"role": "user", "content": "a"}]}) == prompt_key(
        {"prompt": [{"content": "a", "role": "user"}], "other": 1}
    )


def test_greso_in_trl_skips_prompts_and_checkpoints_its_history(tiny_model_dir, tmp_path) -> None:
    """Six prompts, two per generation: GRESO skips prompts whose groups were all equal, its history goes into
    every checkpoint, and a resume from a checkpoint without it is refused."""
    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        prompt_skip="greso",
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
    )
    trainer = PODSTrainer(str(tiny_model_dir), half_constant_reward, args, numbered_prompts(6))
    trainer.train()
    logs = [log for log in trainer.state.log_history if "pods/skip/prompts_skipped" in log]
    assert len(logs) == 6 and sum(log["pods/skip/prompts_skipped"] for log in logs) > 0
    assert all(log["pods/skip/rollouts_saved"] == 4 * log["pods/skip/prompts_skipped"] for log in logs)
    # shrink: a skipped prompt is not generated for, so a step generates fewer rollouts than its 2 x 4
    assert all(log["pods/rollouts_generated"] == 8 - log["pods/skip/rollouts_saved"] for log in logs)
    assert [log["pods/epoch"] for log in logs] == pytest.approx([2 * (step + 1) / 6 for step in range(6)])
    saved = json.loads((tmp_path / "checkpoint-6" / PROMPT_STAGES_STATE_FILE).read_text())
    assert saved["prompt_history"] == trainer._pods_history.to_state() and saved["prompt_history"]["streaks"]
    assert (tmp_path / "checkpoint-3" / PROMPT_STAGES_STATE_FILE).is_file()
    fresh = PODSTrainer(str(tiny_model_dir), half_constant_reward, args, numbered_prompts(6))
    (tmp_path / "checkpoint-3" / PROMPT_STAGES_STATE_FILE).unlink()
    with pytest.raises(
        ValueError, match=r"pods_prompt_stages\.json is missing or holds no skip history: the checkpoint was"
    ):
        fresh.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_old_and_reference_logprobs_are_computed_on_the_kept_rows_only(
    tiny_model_dir, prompts, tmp_path, lora: bool
) -> None:
    """TRL computes them for all n before rewards exist; PODS computes them after selection, for the m kept,
    with the same values TRL's computation over all n gives those rows (LoRA: reference = adapter disabled)."""
    from peft import LoraConfig

    args = tiny_args(
        PODSConfig,
        tmp_path,
        num_generations_kept=2,
        gradient_accumulation_steps=2,
        num_iterations=2,  # generation every 4 micro-steps, accumulation over 2: TRL needs old log-probs
        beta=0.04,
        bf16=False,  # float32: packed and unpacked forwards agree to float rounding
    )
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False) if lora else None
    )
    trainer = PODSTrainer(str(tiny_model_dir), token_sum_reward, args, prompts, peft_config=peft_config)
    rows_seen = []
    compute = trainer._get_per_token_logps_and_entropies

    def counting(model, input_ids, *rest, **kwargs):
        result = compute(model, input_ids, *rest, **kwargs)
        if result[0] is not None:
            rows_seen.append(input_ids.shape[0])
        return result

    trainer._get_per_token_logps_and_entropies = counting
    trainer.model.train()
    inputs = next(iter(trainer.get_train_dataloader()))
    torch.manual_seed(5)
    kept_only = trainer._generate_and_score_completions(inputs)
    assert rows_seen == [8, 8]  # old, then reference: the 8 kept of 16 generated

    trainer._defer_logps = lambda inputs: False  # TRL's way: all 16 rows, then the kept 8 are taken
    torch.manual_seed(5)
    all_rows = trainer._generate_and_score_completions(inputs)
    assert rows_seen[2:] == [16, 16]
    assert torch.equal(kept_only["completion_ids"], all_rows["completion_ids"])
    mask = kept_only["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        torch.testing.assert_close(kept_only[key][mask], all_rows[key][mask], rtol=1e-5, atol=1e-6)
    if lora:  # a random adapter: the reference (adapter disabled) differs from the policy
        assert not torch.allclose(
            kept_only["old_per_token_logps"][mask], kept_only["ref_per_token_logps"][mask]
        )

    # packing=True: a packed forward (each prompt once for its kept rows) gives the same log-probs
    assert packing_blocker(trainer.model) is None
    trainer._defer_logps = lambda inputs: True
    trainer.args.packing = True
    torch.manual_seed(5)
    packed = trainer._generate_and_score_completions(inputs)
    assert rows_seen[4:] == []  # not TRL's forward
    assert torch.equal(packed["completion_ids"], kept_only["completion_ids"])
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        torch.testing.assert_close(packed[key][mask], kept_only[key][mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("rule", ["max_variance", "max_reward", "random", "test_lowest", "reward_per_token"])
def test_two_training_steps_per_rule(tiny_model_dir, prompts, tmp_path, rule: str) -> None:
    args = tiny_args(PODSConfig, tmp_path, num_generations_kept=2, selection_rule=rule)
    trainer = PODSTrainer(
        model=str(tiny_model_dir), reward_funcs=token_sum_reward, args=args, train_dataset=prompts
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    logs = [log for log in trainer.state.log_history if "pods/reward_kept" in log]
    assert len(logs) == 2
    for log in logs:
        assert torch.isfinite(torch.tensor(log["loss"]))
        kept, everything = log["pods/reward_kept"], log["reward"]
        if rule == "max_reward":
            assert kept >= everything
        if rule == "test_lowest":
            assert kept <= everything
        if rule == "max_variance":  # max-variance keeps a spread in every group that has one
            assert log["pods/frac_reward_zero_std_kept"] == log["frac_reward_zero_std"]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [False, True], ids=["plain", "filter+skip"])
def test_random_rule_draws_resume_exactly(tiny_model_dir, prompts, tmp_path, stages: bool) -> None:
    """After resuming from a checkpoint, the random rule keeps what an uninterrupted run keeps; with the prompt
    filter and GRESO, the refills and skips (the history comes from the checkpoint) are the same too."""
    extra = (
        {
            "prompt_filter": "nonzero_std",
            "prompt_skip": "greso",
            "max_num_gen_batches": 3,
            "generation_batch_prompts": "auto",
        }
        if stages
        else {}
    )
    dataset, reward = (numbered_prompts(6), half_constant_reward) if stages else (prompts, token_sum_reward)

    def run(folder, resume=None):
        args = tiny_args(
            PODSConfig,
            folder,
            num_generations_kept=2,
            selection_rule="random",
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            **extra,
        )
        trainer = PODSTrainer(str(tiny_model_dir), reward, args, dataset)
        trainer.train(resume_from_checkpoint=resume)
        logged = [
            {k: v for k, v in log.items() if k.startswith("pods/") or k == "reward"}
            for log in trainer.state.log_history
            if "pods/reward_kept" in log
        ]
        return trainer, logged

    whole, kept_whole = run(tmp_path / "whole")
    resumed, kept_resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert kept_resumed == kept_whole and len(kept_whole) == 4
    if stages:
        assert (
            sum(
                log["pods/filter/groups_dropped"] + log["pods/skip/prompts_skipped"] for log in kept_whole[2:]
            )
            > 0
        )
    for (name, a), b in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_m_equal_n_reproduces_grpo_exactly(tiny_model_dir, prompts, tmp_path) -> None:
    """Same seed, KL on and two accumulation steps: identical losses and identical weights."""
    common = dict(beta=0.04, gradient_accumulation_steps=2, max_steps=2)
    grpo = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=token_sum_reward,
        args=tiny_args(GRPOConfig, tmp_path / "grpo", **common),
        train_dataset=prompts,
    )
    grpo.train()
    pods = PODSTrainer(
        model=str(tiny_model_dir),
        reward_funcs=token_sum_reward,
        args=tiny_args(PODSConfig, tmp_path / "pods", selection_rule="all", num_generations_kept=4, **common),
        train_dataset=prompts,
    )
    pods.train()
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (grpo, pods)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert any(loss != 0.0 for loss in losses[0])  # the KL term makes the second loss non-trivial
    weights = grpo.model.state_dict(), pods.model.state_dict()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_trainer_needs_a_pods_config(tiny_model_dir, prompts, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"PODSTrainer needs args=PODSConfig"):
        PODSTrainer(
            model=str(tiny_model_dir),
            reward_funcs=token_sum_reward,
            args=tiny_args(GRPOConfig, tmp_path),
            train_dataset=prompts,
        )


@pytest.mark.slow
def test_two_processes_keep_groups_local(tiny_model_dir, tmp_path) -> None:
    """accelerate launch, 2 CPU processes (gloo). ``--cpu --num_processes 2`` starts ONE process in
    accelerate 1.16, so we launch through torchrun (``--multi_gpu``) with CUDA hidden. Three modes in one launch:
    plain, then with the prompt filter and GRESO (every process refills the same number of rounds and trains
    on its own groups), then a chunk of kept rows that weighs nothing on one process alone under FSDP2 (both
    still run its forward: each gathers parameters with the other)."""
    script = REPO_ROOT / "tests" / "scripts" / "trl_two_process.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
    result = subprocess.run(
        [*command, str(script), str(tiny_model_dir), str(tmp_path), "plain,stages,masked_chunk"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for mode, checks in (("plain", 2), ("stages", 2), ("masked_chunk", 1)):
        for rank in (0, 1):
            line = f"PODS-TWO-PROCESS-OK rank={rank} mode={mode} checks={checks}"
            assert line in result.stdout, result.stdout[-3000:]


# --- the example -----------------------------------------------------------------------------------------


def load_example():
    spec = importlib.util.spec_from_file_location("trl_gsm8k", REPO_ROOT / "examples" / "trl_gsm8k.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_gsm8k_example_builds_its_config_without_a_gpu(tmp_path) -> None:
    example = load_example()
    args = example.build_parser().parse_args(["--output-dir", str(tmp_path)])
    assert (args.model, args.n, args.m, args.rule) == ("Qwen/Qwen2.5-3B-Instruct", 64, 16, "max_variance")
    gpu = example.config_kwargs(args)  # what a GPU run gets; bf16 cannot be validated without a GPU
    assert gpu["bf16"] and gpu["use_vllm"] and gpu["vllm_mode"] == "colocate"
    assert (gpu["vllm_gpu_memory_utilization"], gpu["temperature"], gpu["beta"]) == (0.5, 0.9, 0.0)
    config = PODSConfig(**{**gpu, "bf16": False, "use_cpu": True})
    assert (config.num_generations, config.kept_per_prompt, config.selection_rule) == (64, 16, "max_variance")
    # one prompt per step: 64 generated on the process, 16 kept, 4 micro-batches of 4
    assert (config.per_device_train_batch_size, config.steps_per_generation) == (16, 4)
    grpo = example.build_config(
        example.build_parser().parse_args(["--n", "16", "--m", "16", "--rule", "all", "--cpu"])
    )
    assert (grpo.num_generations, grpo.kept_per_prompt, grpo.per_device_train_batch_size) == (16, 16, 4)
    assert example.build_peft_config(args).r == 64
    with pytest.raises(ValueError, match=r"--micro-batch 5 must divide .* 1 x 16 = 16"):
        example.build_config(example.build_parser().parse_args(["--micro-batch", "5", "--cpu"]))


def test_gsm8k_example_runs_one_step_on_cpu(tiny_model_dir, shared_data, tmp_path) -> None:
    """main() end to end on the tiny model and the local GSM8K copy, with our rewards and loader."""
    source = tmp_path / "gsm8k"  # the first 16 real training problems (filtering all 7473 takes seconds)
    source.mkdir()
    lines = (shared_data / "gsm8k" / "train.jsonl").read_text().splitlines(keepends=True)[:16]
    (source / "train.jsonl").write_text("".join(lines))
    flags = ["--model", str(tiny_model_dir), "--source", str(source), "--output-dir", str(tmp_path / "out")]
    flags += ["--cpu", "--n", "4", "--m", "2", "--micro-batch", "2", "--max-steps", "1", "--limit", "8"]
    load_example().main([*flags, "--max-completion-length", "8"])
    assert (tmp_path / "out" / "model.safetensors").is_file()
