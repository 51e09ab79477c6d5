"""The prompt-level stages wired into ``pods train``'s loop, on a tiny real model: rounds sized to what is missing,
the three endings past the refill bound, no bound, GRESO's skipping that shrinks rounds (or replaces), the epoch
counting every prompt drawn, the filter's own reward, the length rules and adaptive k under the filter, and several
reward functions normalised then summed (GDPO)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from pods.advantages import zero_variance_groups
from pods.checkpoint import STATE_FILE, list_checkpoints
from pods.config import TrainConfig
from pods.errors import ConfigError, PromptFilterExhausted
from pods.interrupts import TrainingStopped
from pods.metrics import read_jsonl
from pods.prompt_filter import PassShare, fill_groups, next_round_size
from pods.prompt_skip import (
    FAILED,
    SOLVED,
    GresoSettings,
    PromptHistory,
    adapt_exploration,
    group_outcomes,
    record_outcomes,
    round_prompts,
)
from pods.selection import select

SCRIPT = Path(__file__).parent / "scripts" / "tiny_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from tiny_run import TINY_SETTINGS, RecordingTrainer, half_constant, tiny_dataset  # noqa: E402


def tiny_config(model_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig.from_dict(
        {"model": str(model_dir), "output_dir": str(output_dir), **TINY_SETTINGS, **overrides}
    )


def scored_by_step(trainer: RecordingTrainer) -> list[list[dict]]:
    """The scoring rounds of each step, in order."""
    steps = [[] for _ in trainer.updates]
    for record in trainer.scored:
        steps[record["step"]].append(record)
    return steps


def question_index(question: str) -> int:
    return int(question.split(":")[0].split()[1])


def always_one(prompts, completions, **columns):
    return [1.0] * len(completions)


def trainable(trainer: RecordingTrainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def step_rewards(rounds: list[dict]) -> torch.Tensor:
    return torch.cat([torch.tensor(r["rewards"], dtype=torch.float64) for r in rounds])


def test_rounds_are_sized_to_what_is_missing_and_the_step_trains_on_the_groups_that_pass(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Half the prompts always give all-equal rewards. The first round of the first step is P (nothing measured),
    later ones P / the running share (auto); a refill asks for the shortfall / share x 1.25, so for fewer than P
    prompts where one group is missing (before, every refill was a whole round of P). Replaying the pure
    functions over the recorded rewards predicts every round's size; the update trains on the first P groups that
    passed; the logged counts are those of the rounds."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=6,
        prompts_per_step=8,
        micro_batch_size=4,
        prompt_filter="nonzero_std",
        generation_batch_prompts="auto",
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[half_constant], train_dataset=tiny_dataset())
    trainer.train()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    n, m, wanted = config.num_generations, config.num_generations_kept, config.prompts_per_step
    share, cursor, small_refills = PassShare(), 0, 0
    for rounds, update, row in zip(scored_by_step(trainer), trainer.updates, rows, strict=True):
        rewards, passed_so_far, drawn = [], 0, 0
        for index, scored in enumerate(rounds):
            expected = next_round_size(
                rounds_run=index,
                wanted=wanted,
                missing=wanted - passed_so_far,
                share=share.plus(passed_so_far, drawn).share,
                prompt_filter="nonzero_std",
                max_num_gen_batches=4,
                generation_batch_prompts="auto",
            )
            assert len(scored["questions"]) == expected
            small_refills += index > 0 and expected < wanted
            drawn += expected
            rewards.append(torch.tensor(scored["rewards"], dtype=torch.float64))
            passed_so_far += int((~zero_variance_groups(rewards[-1])).sum())
        assert passed_so_far >= wanted or len(rounds) == 4, "a step stopped short of P before the bound"
        share = share.plus(passed_so_far, drawn)
        cursor += drawn
        everything = torch.cat(rewards)
        passed = ~zero_variance_groups(everything)
        taken = fill_groups(passed, wanted, "train_fewer")
        texts = [text for r in rounds for text in r["texts"]]
        for slot, group in enumerate(taken.positions.tolist()):  # m of each chosen group, in order
            kept = update["texts"][slot * m : (slot + 1) * m]
            assert all(text in texts[group * n : (group + 1) * n] for text in kept)
            assert update["trained"][slot * m : (slot + 1) * m] == [bool(taken.trained[slot])] * m
        assert row["pods/rollouts_generated"] == len(texts) == everything.numel()
        assert row["pods/filter/num_gen_batches"] == len(rounds)
        assert row["pods/filter/first_round_prompts"] == len(rounds[0]["questions"])
        assert row["pods/filter/extra_rollouts"] == len(texts) - len(rounds[0]["texts"])
        assert row["pods/filter/pass_share"] == pytest.approx(share.share)
        assert row["epoch"] == pytest.approx(round(cursor / 64, 4))  # refill draws count
        kept_groups = torch.tensor(update["advantages"]).view(-1, m)
        assert row["pods/groups_trained_with_signal"] == int((kept_groups != 0).any(dim=1).sum())
    assert small_refills > 0, "no refill smaller than P: rounds were not sized to the shortfall"
    assert max(row["pods/filter/first_round_prompts"] for row in rows) > wanted, "auto never oversampled"


@pytest.mark.parametrize("exhausted", ["train_fewer", "pad", "error"])
def test_past_the_bound_a_step_trains_fewer_pads_or_stops(
    tiny_model_dir: Path, tmp_path: Path, exhausted: str
) -> None:
    """Every reward 1, so no group can pass. Each step stops after max_num_gen_batches rounds, then: train_fewer
    trains on nothing (no row weighs, no optimizer step), pad trains on the first P groups at advantage 0 (every
    row weighs), error stops with verl's error, naming the fix, after saving the last completed step."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=2,
        prompt_filter="nonzero_std",
        max_num_gen_batches=3,
        prompt_filter_exhausted=exhausted,
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[always_one], train_dataset=tiny_dataset())
    before = trainable(trainer)
    if exhausted == "error":
        with pytest.raises(
            PromptFilterExhausted, match=r"max_num_gen_batches.*prompt_filter_exhausted"
        ) as error:
            trainer.train()
        assert "step-0000000" in str(error.value)
        assert [folder.name for folder in list_checkpoints(tmp_path / "checkpoints")] == ["step-0000000"]
        assert trainer.updates == [] and len(trainer.scored) == 3
        return
    assert trainer.train().steps == 2
    after = trainable(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [len(rounds) for rounds in scored_by_step(trainer)] == [3, 3]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for rounds, update, row in zip(scored_by_step(trainer), trainer.updates, rows, strict=True):
        assert all(advantage == 0 for advantage in update["advantages"])
        assert update["trained"] == [exhausted == "pad"] * len(update["trained"])
        assert (row["pods/filter/groups_unfilled"], row["pods/groups_trained_with_signal"]) == (2, 0)
        assert row["pods/rollouts_generated"] == sum(len(r["texts"]) for r in rounds)
        sizes = [len(r["questions"]) for r in rounds]
        assert sizes[0] == 2 and sizes[1] <= sizes[2] <= 8 * 2  # the share falls: refills grow, up to 8 P
    assert len(trainer.scored[1]["questions"]) < len(trainer.scored[2]["questions"])


def test_no_bound_refills_until_every_process_has_its_groups(tiny_model_dir: Path, tmp_path: Path) -> None:
    """max_num_gen_batches: 0 is verl's "no bound": a step generates until it has P groups that pass, however many
    rounds that takes (on the tiny model, odd questions of half_constant pass only now and then)."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=3,
        prompts_per_step=4,
        prompt_filter="nonzero_std",
        max_num_gen_batches=0,
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[half_constant], train_dataset=tiny_dataset())
    trainer.train()
    for rounds, update in zip(scored_by_step(trainer), trainer.updates, strict=True):
        assert int((~zero_variance_groups(step_rewards(rounds))).sum()) >= 4
        assert all(update["trained"])
    assert max(len(rounds) for rounds in scored_by_step(trainer)) > 1


def test_a_stop_request_ends_an_unbounded_filters_rounds(tiny_model_dir: Path, tmp_path: Path) -> None:
    """On a solved dataset an unbounded filter never fills a step; SIGTERM during its rounds still stops the run,
    with a checkpoint of the last completed step (the abandoned step is redone on resume)."""
    calls = []

    def solved_then_signal(prompts, completions, **columns):
        calls.append(len(completions))
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return [1.0] * len(completions)

    config = tiny_config(
        tiny_model_dir, tmp_path, max_steps=2, prompt_filter="nonzero_std", max_num_gen_batches=0
    )
    trainer = RecordingTrainer(config, reward_funcs=[solved_then_signal], train_dataset=tiny_dataset())
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert stopped.value.step == 0 and trainer.updates == []
    assert len(calls) in (5, 6)  # the round in flight when the signal came, then the check
    assert (stopped.value.checkpoint / STATE_FILE).is_file()


def replay_greso(trainer: RecordingTrainer, config: TrainConfig, mode: str) -> None:
    """Replaying GRESO's pure functions over every scored group (record each, adapt past the first epoch) predicts
    which prompts each step generated for and skipped, what it saved, the rates and the checkpointed history."""
    settings = GresoSettings()
    history = PromptHistory.start(settings)
    rows = read_jsonl(Path(config.output_dir) / "metrics.jsonl")
    cursor, wanted, n = 0, config.prompts_per_step, config.num_generations
    for step, (rounds, update, row) in enumerate(
        zip(scored_by_step(trainer), trainer.updates, rows, strict=True)
    ):
        (scored,) = rounds  # no filter: one round
        start = cursor

        def draw(count: int) -> list[int]:
            nonlocal cursor
            cursor += count
            return trainer.prompts.draw(cursor - count, count)

        expected = round_prompts(
            draw,
            wanted,
            settings=settings,
            history=history,
            generator=trainer.producer.skip_generator(step, 0),
            mode=mode,
        )
        assert [question_index(q) for q in scored["questions"]] == expected.ids
        assert row["pods/skip/prompts_skipped"] == expected.skipped
        assert row["pods/skip/rollouts_saved"] == (expected.skipped * n if mode == "shrink" else 0)
        assert row["pods/rollouts_generated"] == len(expected.ids) * n
        assert len(update["texts"]) == len(expected.ids) * config.num_generations_kept  # shrink: fewer groups
        assert row["epoch"] == pytest.approx(round(cursor / len(trainer.train_rows), 4))
        outcomes = group_outcomes(torch.tensor(scored["rewards"], dtype=torch.float64)).tolist()
        history = record_outcomes(history, expected.ids, outcomes)
        if start / len(trainer.train_rows) >= 1:
            history = adapt_exploration(history, outcomes, settings)
        assert row["pods/skip/exploration_solved"] == history.exploration[SOLVED]
        assert row["pods/skip/exploration_failed"] == history.exploration[FAILED]
    assert sum(row["pods/skip/prompts_skipped"] for row in rows) > 0, "nothing was skipped: no teeth"
    assert rows[0]["pods/skip/exploration_solved"] == 0.5
    assert any(row["pods/skip/exploration_solved"] != 0.5 for row in rows), "the rates never moved"
    saved = json.loads(
        (list_checkpoints(Path(config.output_dir) / "checkpoints")[-1] / STATE_FILE).read_text()
    )
    assert PromptHistory.from_state(saved["prompt_history"], settings) == history
    assert saved["prompts_drawn"] == cursor


def test_greso_shrink_generates_for_the_prompts_it_keeps_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Six prompts, each back every three steps. In shrink mode (the default) a skipped prompt is not generated
    for: steps generate and train on fewer groups, and rollouts_saved counts the rollouts not generated."""
    config = tiny_config(tiny_model_dir, tmp_path, max_steps=9, prompt_skip="greso", save_every_steps=9)
    trainer = RecordingTrainer(config, reward_funcs=[half_constant], train_dataset=tiny_dataset(6))
    trainer.train()
    replay_greso(trainer, config, "shrink")
    assert min(len(r["questions"]) for r in trainer.scored) < config.prompts_per_step, "no step shrank"


def test_greso_replace_keeps_the_step_at_p_prompts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """In replace mode a skipped prompt is replaced by further candidates: every step generates for P prompts,
    and no rollout counts as saved."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=9,
        prompt_skip="greso",
        prompt_skip_mode="replace",
        save_every_steps=9,
    )
    trainer = RecordingTrainer(config, reward_funcs=[half_constant], train_dataset=tiny_dataset(6))
    trainer.train()
    replay_greso(trainer, config, "replace")
    assert {len(r["questions"]) for r in trainer.scored} == {config.prompts_per_step}


def test_the_filter_reads_the_reward_it_is_told_to(tiny_model_dir: Path, tmp_path: Path) -> None:
    """prompt_filter_reward names one reward function (verl's filter_groups.metric): a group passes when that
    function's rewards have a spread, whatever the others add. A constant bonus that differs per completion would
    make every group pass on the total; on the accuracy-like function alone, the all-equal groups are dropped."""

    def accuracy(prompts, completions, answer, **columns):
        return [1.0 if int(a) % 2 == 0 else 0.0 for a in answer]  # all-equal in every group

    def length_bonus(prompts, completions, **columns):
        return [0.01 * len(text) for text in completions]

    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=2,
        prompt_filter="nonzero_std",
        prompt_filter_reward="accuracy",
        max_num_gen_batches=2,
        prompt_filter_exhausted="pad",
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[accuracy, length_bonus], train_dataset=tiny_dataset())
    trainer.train()
    for rounds, row in zip(scored_by_step(trainer), read_jsonl(tmp_path / "metrics.jsonl"), strict=True):
        assert len(rounds) == 2 and row["pods/filter/groups_unfilled"] == 2  # none passed on accuracy
        assert bool((~zero_variance_groups(step_rewards(rounds))).any()), "the total had a spread: no teeth"
    with pytest.raises(
        ConfigError, match="prompt_filter_reward: 'acc' is not one of this run's reward functions"
    ):
        RecordingTrainer(
            tiny_config(
                tiny_model_dir, tmp_path / "bad", prompt_filter="nonzero_std", prompt_filter_reward="acc"
            ),
            reward_funcs=[accuracy, length_bonus],
            train_dataset=tiny_dataset(),
        )


def test_a_length_rule_under_the_filter_keeps_a_signal(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With the filter every trained group has a spread; shortest keeps the m shortest, which may all score
    alike. Under the filter one of them is swapped for another reward, so the group still trains with a signal."""

    def longer_is_better(prompts, completions, **columns):
        return [1.0 if len(text) > 12 else 0.0 for text in completions]

    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=4,
        num_generations=8,
        selection_rule="shortest",
        prompt_filter="nonzero_std",
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[longer_is_better], train_dataset=tiny_dataset())
    trainer.train()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    m = config.num_generations_kept
    for update, row in zip(trainer.updates, rows, strict=True):
        groups = torch.tensor(update["advantages"]).view(-1, m)
        trained = torch.tensor(update["trained"]).view(-1, m).all(dim=1)
        assert bool((groups[trained] != 0).any(dim=1).all()), "a trained group lost its signal"
        assert row["pods/groups_trained_with_signal"] == int(trained.sum())
    assert sum(row["pods/selection/signal_restored"] for row in rows) > 0, "no swap was needed: no teeth"


def test_adaptive_k_keeps_fewer_of_easy_groups(tiny_model_dir: Path, tmp_path: Path) -> None:
    """num_generations_kept_by_difficulty (GFPO): groups in the easiest quartile of mean reward keep 2 of their
    rollouts, the hardest keep m = 4; the rest of a group's m rows are fillers that weigh nothing."""
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=3,
        num_generations=8,
        num_generations_kept=4,
        micro_batch_size=8,
        prompts_per_step=4,
        num_generations_kept_by_difficulty=[2, 2, 4, 4],
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[half_constant], train_dataset=tiny_dataset())
    trainer.train()
    for rounds, update in zip(scored_by_step(trainer), trainer.updates, strict=True):
        means = step_rewards(rounds).mean(dim=1)
        weighs = torch.tensor(update["trained"]).view(-1, 4).sum(dim=1)
        easiest = means >= torch.quantile(means, 0.75)
        assert set(weighs[means.argsort()[:1]].tolist()) == {4}  # the hardest group keeps m
        assert bool((weighs[easiest & (means > torch.quantile(means, 0.5))] == 2).all())
        assert set(weighs.tolist()) <= {2, 4}
    assert any(2 in torch.tensor(u["trained"]).view(-1, 4).sum(dim=1).tolist() for u in trainer.updates)


def test_normalize_then_sum_ranks_on_the_gdpo_quantity_and_logs_the_weighted_reward(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """multi_objective_aggregation: normalize_then_sum (TRL's GDPO mode) in pods train: the rule keeps the
    max-variance m of each group by the sum of the functions' group-normalised rewards (not by the weighted sum, which
    the large-scale function dominates), while the logged reward stays the weighted sum."""
    scored: list[list[float]] = []

    def long_text(prompts, completions, **columns):
        values = [100.0 * len(text) for text in completions]
        scored.append(values)
        return values

    def has_a(prompts, completions, **columns):
        values = [float("a" in text) for text in completions]
        scored[-1] = list(zip(scored[-1], values, strict=True))
        return values

    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=3,
        num_generations=8,
        prompts_per_step=4,
        micro_batch_size=8,
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 2.0],
        save_final=False,
    )
    trainer = RecordingTrainer(config, reward_funcs=[long_text, has_a], train_dataset=tiny_dataset())
    trainer.train()
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    differs = 0
    for step, (values, update) in enumerate(zip(scored, trainer.updates, strict=True)):
        parts = torch.tensor(values, dtype=torch.float64).view(4, 8, 2)
        z = (parts - parts.mean(dim=1, keepdim=True)) / (parts.std(dim=1, keepdim=True) + 1e-4)
        ranked = (z * weights).sum(dim=2)
        kept = select(ranked, 2, "max_variance")
        texts = trainer.scored[step]["texts"]
        assert update["texts"] == [texts[g * 8 + k] for g in range(4) for k in kept[g].tolist()]
        differs += not torch.equal(kept, select(parts @ weights, 2, "max_variance"))
        row = read_jsonl(tmp_path / "metrics.jsonl")[step]
        assert row["reward"] == pytest.approx((parts @ weights).mean().item())
    assert differs > 0, "the weighted sum kept the same rows: no teeth"
