"""The evaluation schedule: at the training times ``eval_at_seconds`` and at every multiple of
``eval_every_seconds``, each right after the first step that reaches it, also across a resume."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pods.config import ConfigError, TrainConfig
from pods.evaluation import next_evaluation_seconds
from pods.metrics import read_jsonl
from pods.trainer import PODSTrainer

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from tiny_run import TINY_SETTINGS, count_of_a, tiny_dataset


def test_next_evaluation_is_the_earliest_scheduled_time_beyond_the_last() -> None:
    at, every = [5.0, 10.0, 20.0], 30.0
    assert next_evaluation_seconds(None, every, at) == 5.0  # nothing evaluated yet
    assert next_evaluation_seconds(0.0, every, at) == 5.0  # after the evaluation at the start
    assert next_evaluation_seconds(5.3, every, at) == 10.0  # evaluations land a little after their time
    assert next_evaluation_seconds(12.0, every, at) == 20.0
    assert next_evaluation_seconds(20.4, every, at) == 30.0  # then every 30 s: 30, 60, 90, ...
    assert next_evaluation_seconds(31.0, every, at) == 60.0  # not 61: the grid does not drift
    assert next_evaluation_seconds(60.0, every, at) == 90.0
    assert next_evaluation_seconds(25.0, None, at) is None  # no periodic evaluations: the list only
    assert next_evaluation_seconds(3.0, None, []) is None
    assert next_evaluation_seconds(0.9, 0.3, []) == pytest.approx(1.2)  # 0.9 / 0.3 is 3.0000000000000004


def test_the_schedule_is_checked_and_kept_sorted() -> None:
    assert TrainConfig().eval_at_seconds == [5.0, 10.0, 20.0]  # the embedded default shows the climb
    assert TrainConfig(eval_at_seconds=[20, 5, 5]).eval_at_seconds == [5.0, 20.0]
    assert TrainConfig.from_dict({"eval_at_seconds": None}).eval_at_seconds == []
    for bad in ([0], [-5], ["soon"], [True]):
        with pytest.raises(ConfigError, match=r"eval_at_seconds: must be a list of positive training times"):
            TrainConfig.from_dict({"eval_at_seconds": bad})
    with pytest.raises(ConfigError, match=r"eval_at_seconds must be a list \(\[a, b\]\) or null, got '5,10'"):
        TrainConfig.from_dict({"eval_at_seconds": "5,10"})
    with pytest.raises(ConfigError, match="eval_every_seconds: must be positive"):
        TrainConfig(eval_every_seconds=0)


def expected_evaluation_steps(
    metrics: list[dict], at: list[float], every: float, forced: set[int]
) -> list[int]:
    """The steps after which the schedule evaluates, replayed from each step's logged training time (the
    trainer's own clock, unrounded, so a step ending a hair past a due time replays on the same side): the
    start, the first step reaching each due time, and the ``forced`` ones (the end of each part of the run)."""
    steps, last = [0], 0.0
    for row in metrics:
        due = next_evaluation_seconds(last, every, at)
        if row["step"] in forced or (due is not None and row["train_seconds"] >= due):
            steps.append(row["step"])
            last = row["train_seconds"]
    return steps


@pytest.mark.slow
def test_evaluations_happen_at_the_scheduled_training_times_also_after_a_resume(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    at, every = [0.2, 0.5], 1.0

    def slow_count_of_a(prompts: list[str], completions: list[str], **columns) -> list[float]:
        """The reward, taking at least 0.05 s a step: 14 steps then span the whole schedule on any machine
        (at ~0.035 s a step, this VM's tiny steps alone ended before the periodic time)."""
        time.sleep(0.05)
        return count_of_a(prompts, completions, **columns)

    def trainer(max_steps: int, **overrides) -> PODSTrainer:
        settings = {
            **TINY_SETTINGS, "model": str(tiny_model_dir), "output_dir": str(tmp_path), "max_steps": max_steps,
            "eval_at_start": True, "eval_at_seconds": at, "eval_every_seconds": every, **overrides,
        }  # fmt: skip
        return PODSTrainer(
            TrainConfig.from_dict(settings),
            reward_funcs=[slow_count_of_a],
            train_dataset=tiny_dataset(),
            eval_dataset=tiny_dataset(4),
        )

    trainer(6, save_final=True).train()  # ends with an evaluation and a checkpoint at step 6
    trainer(14, resume_from="auto").train()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    evaluations = read_jsonl(tmp_path / "eval.jsonl")
    assert [row["step"] for row in metrics] == list(range(1, 15))
    assert [row["step"] for row in evaluations] == expected_evaluation_steps(metrics, at, every, {6, 14})
    scheduled = [row for row in evaluations if row["step"] not in (0, 6, 14)]
    assert len(scheduled) >= 2, evaluations  # the schedule itself was exercised, before and after the resume
    assert any(row["step"] < 6 for row in scheduled) and any(row["step"] > 6 for row in scheduled)
