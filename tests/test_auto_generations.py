"""``num_generations: auto``: the decision model on synthetic timings and rewards, and the trainer choosing
n as it runs on the tiny model (n changes between steps; decisions logged; exact resume of the state)."""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import pytest

from pods.auto_generations import (
    AutoGenerations,
    choose_num_generations,
    expected_signal,
    fit_beta_binomial,
    fit_step_cost,
    fit_success_rates,
    informative_fraction,
    kept_variance,
)
from pods.config import ConfigError, TrainConfig
from pods.metrics import read_jsonl
from pods.trainer import PODSTrainer

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from tiny_run import TINY_SETTINGS, count_of_a, tiny_dataset


def groups(n: int, count: int = 320, seed: int = 0) -> tuple[list[int], list[int]]:
    """Successes of ``count`` groups of n: half the prompts are solved 90% of the time, half 30%."""
    rng = random.Random(seed)
    successes = [sum(rng.random() < (0.9 if i % 2 else 0.3) for _ in range(n)) for i in range(count)]
    return successes, [n] * count


def decide(
    generate_seconds: dict[int, float],
    other_seconds: float,
    rule: str = "max_variance",
    overlapped: bool = False,
) -> int:
    successes, trials = groups(8)
    return choose_num_generations(
        step=10, m=4, low=4, high=64, rule=rule, successes=successes, trials=trials,
        generate_seconds=generate_seconds, other_seconds=other_seconds, overlapped=overlapped,
    ).num_generations  # fmt: skip


def test_with_a_rollout_worker_n_grows_until_generating_fills_the_update() -> None:
    """Generating overlaps the update: rollouts that fit in its time cost nothing. With 0.05 s per rollout per
    prompt and a 0.6-s update, every n up to 12 costs one update; n past 12 costs more. Run one after the other
    (the sum), the same costs pick a smaller n."""
    overlapped = decide({4: 0.2, 16: 0.8}, other_seconds=0.6, overlapped=True)
    summed = decide({4: 0.2, 16: 0.8}, other_seconds=0.6)
    assert overlapped >= 12 > summed
    assert decide({4: 0.2, 16: 0.8}, other_seconds=3.0, overlapped=True) >= 56  # a long update hides many


def test_cheap_generation_picks_a_large_n() -> None:
    # A GPU-like profile: 16 prompts x n rollouts cost little more than a fixed 0.3 s; the update 1 s.
    assert decide({8: 0.30, 16: 0.32}, other_seconds=1.0) >= 32


def test_generation_as_costly_as_the_update_picks_n_near_m() -> None:
    # One more rollout per prompt costs what training one more row costs (16 prompts, m = 4: 0.01 s each).
    assert decide({8: 1.28, 16: 2.56}, other_seconds=0.64) <= 8
    # The CPU's measured split for the embedded default (0.32 s at n=4, 0.94 s at n=16, update 0.42 s).
    assert decide({4: 0.32, 16: 0.94}, other_seconds=0.42) <= 8


def test_random_selection_gains_nothing_from_more_rollouts() -> None:
    assert decide({8: 0.30, 16: 0.32}, other_seconds=1.0, rule="random") == 4


def test_kept_variance_per_rule() -> None:
    # m = 4 kept of n = 16 with c successes; 1.0 is an even split (2 of 4).
    assert kept_variance(8, 16, 4, "max_variance") == 1.0
    assert kept_variance(1, 16, 4, "max_variance") == pytest.approx(0.75)  # 1 of 4: 3/12 over 4/12
    assert kept_variance(0, 16, 4, "max_variance") == 0.0
    assert kept_variance(8, 16, 4, "max_reward") == 0.0  # the top 4 are all successes
    assert kept_variance(3, 16, 4, "max_reward") == pytest.approx(0.75)
    # random: the mean over every subset of 4 of a group of 7 with 3 successes, enumerated
    group = [1] * 3 + [0] * 4
    subsets = list(itertools.combinations(group, 4))
    variances = [sum(s) * (4 - sum(s)) / 12 / (4 / 12) for s in subsets]
    assert kept_variance(3, 7, 4, "random") == pytest.approx(sum(variances) / len(subsets))


def test_informative_fraction_and_signal_grow_with_n() -> None:
    for n in (2, 4, 16):  # p ~ Uniform: E[p^n] = 1 / (n + 1)
        assert informative_fraction(n, 1.0, 1.0) == pytest.approx(1 - 2 / (n + 1))
    signals = [expected_signal(n, 4, 0.5, 2.0, "max_variance") for n in (4, 8, 16, 32)]
    assert signals == sorted(signals) and signals[-1] > 1.5 * signals[0]


def test_beta_binomial_fit_recovers_the_success_rates() -> None:
    rng = random.Random(1)
    rates = [rng.betavariate(2.0, 6.0) for _ in range(2000)]  # mean 0.25
    successes = [sum(rng.random() < p for _ in range(8)) for p in rates]
    alpha, beta = fit_beta_binomial(successes, [8] * len(successes))
    assert alpha / (alpha + beta) == pytest.approx(0.25, abs=0.02)
    assert 4 < alpha + beta < 16  # concentration 8, loosely


def test_step_cost_fit() -> None:
    assert fit_step_cost({4: 0.5 + 0.1 * 4, 16: 0.5 + 0.1 * 16}, other_seconds=1.0) == pytest.approx(
        (1.5, 0.1)
    )
    assert fit_step_cost({8: 0.8}, other_seconds=1.0) == pytest.approx((1.0, 0.1))  # one point: no overhead


def test_no_success_or_no_failure_decides_by_the_rare_outcome_not_by_a_grid_corner() -> None:
    """No group with a success: the beta-binomial likelihood has no maximum, so the rate is taken at its 95%
    upper bound. A rare success is what every extra rollout buys (max_variance and max_reward keep it), so n
    goes up to where the bound says successes would stop being rare; random keeps it with chance m / n."""
    fails, all_pass, trials = [0] * 80, [8] * 80, [8] * 80

    def choice(successes: list[int], rule: str) -> int:
        return choose_num_generations(
            step=10, m=4, low=4, high=64, rule=rule, successes=successes, trials=trials,
            generate_seconds={8: 1.28, 16: 2.56}, other_seconds=1.0,
        ).num_generations  # fmt: skip

    alpha, beta, note = fit_success_rates(fails, trials)
    assert alpha / (alpha + beta) == pytest.approx(1 - 0.05 ** (1 / 640)) and "upper bound" in note
    assert choice(fails, "max_variance") >= 56 and choice(fails, "max_reward") >= 56  # was 7 and 4
    assert choice(fails, "random") == 4
    alpha, beta, note = fit_success_rates(all_pass, trials)
    assert alpha / (alpha + beta) == pytest.approx(0.05 ** (1 / 640)) and "lower bound" in note
    assert choice(all_pass, "max_variance") >= 56  # one failure among many successes: kept with 3 successes
    assert choice(all_pass, "max_reward") == 4  # max_reward keeps the top m: only n = m keeps the failure
    assert fit_success_rates([0, 3], [8, 8])[2] == "beta-binomial fit"


def test_the_fixed_cost_of_a_step_includes_the_weight_sync() -> None:
    """Every phase that does not grow with n is fixed cost: leaving vLLM's weight push out of it made a
    bigger n look relatively dearer than it is."""
    auto = AutoGenerations(m=4, low=4, high=64, rule="max_variance", every=1)
    row = auto.observe(
        1, 8, [3, 5], {"generate": 1.0, "score": 0.1, "select": 0.1, "update": 2.0, "sync": 3.0}
    )
    assert row["seconds_generate"] == pytest.approx(1.2) and row["seconds_other"] == pytest.approx(5.0)
    # a GPU-like profile with a 3-s push of a large model's weights: the choice moves up with the fixed cost
    assert decide({8: 0.6, 16: 1.2}, other_seconds=5.0) > decide({8: 0.6, 16: 1.2}, other_seconds=2.0)


def test_a_log_with_a_step_written_twice_is_replayed_once() -> None:
    def observation(step: int, n: int) -> dict:
        return {"step": step, "kind": "observation", "num_generations": n, "successes": [1, 2],
                "seconds_generate": 1.0, "seconds_other": 1.0}  # fmt: skip

    earlier_attempt = [observation(1, 4), observation(2, 4)]
    this_run = [observation(1, 8), observation(2, 8), {"step": 2, "kind": "decision", "num_generations": 6}]
    auto = AutoGenerations(m=4, low=4, high=64, rule="max_variance", every=2)
    auto.restore(earlier_attempt + this_run)
    assert [(row["step"], row["num_generations"]) for row in auto.observations] == [(1, 8), (2, 8)]
    assert auto.current == 6


def test_auto_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="models the rules"):
        TrainConfig(num_generations="auto", selection_rule="all")
    with pytest.raises(ConfigError, match="num_generations_min: must be at least m"):
        TrainConfig(num_generations="auto", num_generations_min=2)
    with pytest.raises(ConfigError, match="only with num_generations: auto"):
        TrainConfig(num_generations=8, num_generations_max=32)
    assert TrainConfig(
        num_generations="auto", num_generations_kept=2, micro_batch_size=2
    ).generation_bounds == (2, 32)


def auto_trainer(model_dir: Path, output_dir: Path, **overrides) -> PODSTrainer:
    settings = {
        "model": str(model_dir), "output_dir": str(output_dir), **TINY_SETTINGS,
        "num_generations": "auto", "num_generations_max": 8, "num_generations_every": 2, **overrides,
    }  # fmt: skip
    return PODSTrainer(
        TrainConfig.from_dict(settings), reward_funcs=[count_of_a], train_dataset=tiny_dataset()
    )


@pytest.mark.slow
def test_trainer_chooses_n_as_it_runs_and_resumes_its_state(tiny_model_dir: Path, tmp_path: Path) -> None:
    # m = 2: explores n = 4 (steps 1-2) and n = 8 (steps 3-4), then decides from the measurements.
    auto_trainer(tiny_model_dir, tmp_path, max_steps=5, save_final=True).train()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["num_generations"] for row in metrics[:4]] == [4, 4, 8, 8]
    log = read_jsonl(tmp_path / "num_generations.jsonl")
    decisions = [row for row in log if row["kind"] == "decision"]
    assert [row["step"] for row in decisions] == [0, 2, 4]
    assert [row["num_generations"] for row in decisions[:2]] == [4, 8]
    chosen = decisions[-1]
    assert (
        chosen["reason"].startswith("most expected signal per second") and 2 <= chosen["num_generations"] <= 8
    )
    assert set(chosen["measured_generate_seconds"]) == {"4", "8"} and chosen["groups"] == 8  # 4 steps x 2
    assert metrics[4]["num_generations"] == chosen["num_generations"]
    observations = [row for row in log if row["kind"] == "observation"]
    assert [len(row["successes"]) for row in observations] == [2] * 5

    auto_trainer(tiny_model_dir, tmp_path, max_steps=6, resume_from="auto").train()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[5]["num_generations"] == chosen["num_generations"]  # the restored decision holds
    last = [row for row in read_jsonl(tmp_path / "num_generations.jsonl") if row["kind"] == "decision"][-1]
    assert last["step"] == 6 and last["groups"] == 12  # 6 steps of observations: the earlier 5 were restored
    assert json.loads(json.dumps(last))["predicted"]  # the decision's inputs and predictions are logged


@pytest.mark.slow
def test_a_fresh_start_under_resume_from_auto_drops_an_earlier_attempts_log(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """resume_from: auto in a folder without checkpoints starts afresh: the observations of an attempt that
    stopped before its first checkpoint must not stay in the log, or a later resume replays them too."""
    auto_trainer(tiny_model_dir, tmp_path, max_steps=3, resume_from="auto", save_final=False).train()
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    auto_trainer(tiny_model_dir, tmp_path, max_steps=4, resume_from="auto", save_final=True).train()
    steps = [
        row["step"] for row in read_jsonl(tmp_path / "num_generations.jsonl") if row["kind"] == "observation"
    ]
    assert steps == [1, 2, 3, 4]
    auto_trainer(tiny_model_dir, tmp_path, max_steps=6, resume_from="auto").train()
    decisions = [row for row in read_jsonl(tmp_path / "num_generations.jsonl") if row["kind"] == "decision"]
    assert decisions[-1]["step"] == 6 and decisions[-1]["groups"] == 12  # 6 steps x 2 prompts, each once
