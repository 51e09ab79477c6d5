"""Asynchronous rollouts (``async_generation``) on the tiny model: the schedule of weight versions, the cores,
the batches a checkpoint holds; a real rollout worker process that samples the next step during the update,
reproducibly, with the behaviour log-probs the importance weights need; exact resume; a killed worker and a
stopped trainer leave no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pods.checkpoint import checkpoint_dir, list_checkpoints
from pods.config import TrainConfig
from pods.errors import ConfigError, RewardFunctionError
from pods.metrics import TIMING_KEYS, read_jsonl
from pods.producer import ProducedBatch, ProducerState
from pods.prompt_filter import SampledGroups
from pods.rollout import Rollouts
from pods.rollout_worker import fresh_in_flight, load_in_flight, sampler_version, save_in_flight, split_cores

SCRIPT = Path(__file__).parent / "scripts" / "tiny_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from tiny_run import TINY_SETTINGS, RecordingTrainer, count_of_a, tiny_dataset  # noqa: E402

ASYNC = {"async_generation": True, "rollout_worker_threads": 1, "torch_threads": 1}


def tiny_config(model_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig.from_dict(
        {"model": str(model_dir), "output_dir": str(output_dir), **TINY_SETTINGS, **ASYNC, **overrides}
    )


def tiny_trainer(model_dir: Path, output_dir: Path, reward=count_of_a, **overrides) -> RecordingTrainer:
    """The recording trainer on the tiny model and data, asynchronous, rewarding ``reward``."""
    return RecordingTrainer(
        tiny_config(model_dir, output_dir, **overrides), reward_funcs=[reward], train_dataset=tiny_dataset()
    )


def learning_rows(path: Path) -> list[dict]:
    skip = set(TIMING_KEYS) | {"seconds_wait_for_rollouts"}
    return [
        {k: v for k, v in row.items() if k not in skip and not k.startswith("pods/async/worker")}
        for row in read_jsonl(path)
    ]


def test_the_schedule_samples_each_step_with_weights_at_most_max_staleness_old() -> None:
    assert [sampler_version(t, 1, 1) for t in range(5)] == [0, 0, 1, 2, 3]
    assert [sampler_version(t, 2, 1) for t in range(5)] == [0, 0, 0, 1, 2]
    assert [sampler_version(t, 2, 2) for t in range(7)] == [0, 0, 0, 2, 2, 4, 4]  # new weights every 2 steps
    assert [sampler_version(t, 1, 1, first=6) for t in range(6, 9)] == [6, 6, 7]  # resumed at step 6
    for s in (1, 2, 3):
        for k in range(1, s + 1):
            for t in range(40):
                v = sampler_version(t, s, k)
                assert v % k == 0 and 0 <= t - v <= s and v <= max(t - 1, 0)


def test_the_worker_and_the_trainer_get_their_own_cores() -> None:
    assert split_cores([0, 1], None) == ([0], [1])
    assert split_cores([0, 1, 2, 3, 4, 5, 6, 7], None) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split_cores([0, 1, 2, 3], 3) == ([0], [1, 2, 3])
    assert split_cores([0, 1, 2, 3], 9) == ([0], [1, 2, 3])  # the trainer keeps one
    assert split_cores([5], None) == ([5], [5])  # one core: shared


def batch(step: int, version: int) -> ProducedBatch:
    ids = torch.tensor([[5, 6], [5, 6]])
    rollouts = Rollouts(
        prompt_ids=ids,
        prompt_mask=torch.ones_like(ids),
        completion_ids=torch.tensor([[7, 0], [8, 9]]),
        completion_mask=torch.tensor([[1, 0], [1, 1]]),
        texts=["a", "bc"],
        truncated=torch.tensor([False, True]),
        num_prompts=1,
        num_generations=2,
        sampling_logprobs=torch.tensor([[-0.5, 0.0], [-1.0, -2.0]]),
    )
    sampled = SampledGroups("nonzero_std")
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    sampled.add([3], rollouts, rewards, {"accuracy": rewards}, skipped=1, drawn=2)
    state = ProducerState(
        17, [1.0, 2.0], {"exploration_solved": 0.5, "exploration_failed": 0.5, "streaks": []}
    )
    return ProducedBatch(
        step, version, 2, sampled, state, {"pods/skip/prompts_skipped": 1}, {"generate": 0.5}, 0.1
    )


def test_batches_in_flight_survive_a_checkpoint_without_pickled_code(tmp_path: Path) -> None:
    saved = [batch(6, 5), batch(7, 6)]
    save_in_flight(tmp_path, saved)
    loaded = load_in_flight(tmp_path)
    assert [(b.step, b.version) for b in loaded] == [(6, 5), (7, 6)]
    original, copy = saved[1], loaded[1]
    assert copy.state_after == original.state_after and copy.skip_metrics == original.skip_metrics
    assert copy.sampled.ids == [3] and copy.sampled.passed.tolist() == [True] and copy.sampled.skipped == 1
    assert copy.sampled.all.rollouts.texts == ["a", "bc"]
    assert torch.equal(
        copy.sampled.all.rollouts.sampling_logprobs, original.sampled.all.rollouts.sampling_logprobs
    )
    assert load_in_flight(tmp_path / "nothing") == []
    # a resume keeps the consecutive batches from its step whose staleness is within the bound
    assert [b.step for b in fresh_in_flight(loaded, 6, 1)] == [6, 7]
    assert [b.step for b in fresh_in_flight([batch(6, 4), batch(7, 6)], 6, 1)] == []  # 6 is 2 steps old
    assert fresh_in_flight(loaded, 5, 2) == []  # not the resumed step's


def test_an_async_run_overlaps_sampling_and_reproduces_itself(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every batch is sampled by the weights of the step before (staleness 1; the first two by the initial ones),
    in a worker process with its own pid, with the behaviour log-probs the importance weights use; the first step
    is the sync run's first step exactly; two runs with the same seed are identical, the second with its weights
    sent over a gloo process group instead of shared memory."""
    runs = []
    for name, backend in (("a", "shared_memory"), ("b", "gloo")):
        trainer = tiny_trainer(
            tiny_model_dir, tmp_path / name, max_steps=4, save_final=False, weight_sync_backend=backend
        )
        trainer.train()
        runs.append(learning_rows(tmp_path / name / "metrics.jsonl"))
        assert trainer.rollouts is None  # the worker is gone after train()
    assert runs[0] == runs[1]
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [row["pods/async/staleness_max"] for row in rows] == [0, 1, 1, 1]
    assert all(row["sampling/importance_sampling_ratio/mean"] > 0 for row in rows)
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # the same weights sampled and trained
    assert all(row["seconds_generate"] > 0 and "seconds_wait_for_rollouts" in row for row in rows)

    sync = tiny_trainer(
        tiny_model_dir, tmp_path / "sync", max_steps=2, save_final=False, async_generation=False
    )
    sync.train()
    # the timeline of both: the worker's phases in its own lane, every span inside the plotted window
    from pods.cli import main

    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "sync"), "--timeline", "1,2"]) == 0
    assert (tmp_path / "a" / "timeline.png").stat().st_size > 10_000
    worker = [span for row in rows for span in row["pods/async/worker_timeline"]]
    assert {span[0] for span in worker} >= {"generate", "score"} and all(
        end >= start for _, start, end in worker
    )
    assert main(["plot", str(tmp_path / "a"), "--timeline", "x"]) == 2
    first = read_jsonl(tmp_path / "sync" / "metrics.jsonl")[0]
    # (the worker packs a group's n rows, the trainer its kept ones: the same log-probs to float rounding)
    for key in ("reward", "pods/reward_kept", "completions/mean_length", "loss"):
        assert rows[0][key] == pytest.approx(first[key], rel=1e-6, abs=1e-6), key


def test_an_async_run_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The checkpoint after step 2 holds the batch of step 3, sampled by step 2's weights; resumed from it (a copy
    of the run folder without the later checkpoints) to step 5, the run is the uninterrupted one's, weights and
    metrics."""
    import shutil

    settings = {"max_steps": 5, "save_every_steps": 2, "save_total_limit": 3}
    straight = tiny_trainer(tiny_model_dir, tmp_path / "straight", **settings)
    straight.train()
    checkpoint = checkpoint_dir(tmp_path / "straight" / "checkpoints", 2)
    assert [(b.step, b.version) for b in load_in_flight(checkpoint)] == [(2, 1)]
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    for step in (4, 5):
        shutil.rmtree(checkpoint_dir(tmp_path / "resumed" / "checkpoints", step))
    resumed = tiny_trainer(tiny_model_dir, tmp_path / "resumed", **settings, resume_from="auto")
    resumed.train()
    assert len(resumed.updates) == 3  # steps 3 to 5 only
    a, b = (
        {n: p.detach() for n, p in t.accelerator.unwrap_model(t.model).named_parameters()}
        for t in (straight, resumed)
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert learning_rows(tmp_path / "straight" / "metrics.jsonl") == learning_rows(
        tmp_path / "resumed" / "metrics.jsonl"
    )


def test_the_worker_samples_under_the_trainers_mixed_precision(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With mixed_precision bf16 the worker's HF forwards run under the same autocast as the trainer's prepared
    model: the first step's behaviour log-probs are the trainer's to rounding (3e-4 apart in float32)."""
    trainer = tiny_trainer(tiny_model_dir, tmp_path, max_steps=1, save_final=False, mixed_precision="bf16")
    trainer.train()
    [row] = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["sampling/sampling_logp_difference/mean"] < 2e-5


def test_a_resume_with_a_smaller_max_staleness_samples_the_too_old_batches_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint of a max_staleness 2 run holds the batches of steps 2 (weights 0) and 3 (weights 1); resumed
    with max_staleness 1, step 2's batch would be 2 steps old: both are sampled again, and counted."""
    first = tiny_trainer(tiny_model_dir, tmp_path, max_steps=2, save_every_steps=2, max_staleness=2)
    first.train()
    [checkpoint] = list_checkpoints(tmp_path / "checkpoints")
    assert [(b.step, b.version) for b in load_in_flight(checkpoint)] == [(2, 0), (3, 1)]
    resumed = tiny_trainer(tiny_model_dir, tmp_path, max_steps=4, max_staleness=1, resume_from="auto")
    resumed.train()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row["pods/async/batches_sampled_again"] for row in rows[2:]] == [2, 0]
    # sampled again by the checkpoint's weights (those of step 2): 0 steps old for step 2, 1 for step 3
    assert [row["pods/async/staleness_max"] for row in rows[2:]] == [0, 1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_reward_function_failing_in_the_worker_ends_the_run_with_its_error_and_a_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tiny_run import always_fails

    trainer = tiny_trainer(tiny_model_dir, tmp_path, max_steps=4, reward=always_fails)
    with pytest.raises(RewardFunctionError, match="this reward always fails") as error:
        trainer.train()
    assert "is saved in" in str(error.value) and "resume_from: auto" in str(error.value)
    assert list_checkpoints(tmp_path / "checkpoints") == [checkpoint_dir(tmp_path / "checkpoints", 0)]


def test_reward_functions_that_cannot_reach_the_worker_are_named(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = RecordingTrainer(
        tiny_config(tiny_model_dir, tmp_path),
        reward_funcs=[lambda prompts, completions, **kw: [0.0]],
        train_dataset=tiny_dataset(),
    )
    with pytest.raises(
        ConfigError, match=r"reward function '.*<lambda>' cannot be sent to the rollout worker"
    ):
        trainer.train()


def test_auto_n_reaches_the_worker_with_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """num_generations: auto with a rollout worker: a decision after step t travels with the weights of step t,
    so the batch sampled by them has the new n: one step later than without a worker (max_staleness 1), and the
    decisions model generation as overlapping the update."""
    trainer = tiny_trainer(
        tiny_model_dir,
        tmp_path,
        max_steps=6,
        num_generations="auto",
        num_generations_every=2,
        save_final=False,
    )
    trainer.train()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["num_generations"] for row in rows[:5]] == [4, 4, 4, 8, 8]  # decided after 2: from the 4th
    decisions = [r for r in read_jsonl(tmp_path / "num_generations.jsonl") if r["kind"] == "decision"]
    assert "generation overlapping the update" in decisions[-1]["reason"]
    after_four = next(d for d in decisions if d["step"] == 4)
    assert rows[5]["num_generations"] == after_four["num_generations"]  # decided after 4: the 6th step's


def test_timeline_panels_name_runs_that_share_a_folder_name() -> None:
    """A sweep's runs are all called seedK: the timeline's panels then name the arm too."""
    from pods.plotting import _run_label

    runs = [Path("x/pods8/seed0"), Path("x/pods8_async/seed0"), Path("x/other")]
    assert [_run_label(path, runs) for path in runs] == ["pods8/seed0", "pods8_async/seed0", "other"]


@pytest.mark.slow
def test_two_trainer_processes_each_with_a_worker_resume_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """accelerate launch, 2 CPU processes, each with its own rollout worker; the workers agree on the prompt
    filter's rounds through their own gloo group. The checkpoint at step 2 holds each process's batch in flight;
    resumed from it, the run trains what the uninterrupted one trains, on both processes."""
    import shutil

    from test_trainer import two_process_launch

    settings = {
        **ASYNC,
        "max_steps": 3,
        "save_every_steps": 2,
        "prompt_filter": "nonzero_std",
        "max_num_gen_batches": 2,
    }
    straight = tmp_path / "straight"
    command, env = two_process_launch(tiny_model_dir, straight, settings)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = checkpoint_dir(straight / "checkpoints", 2)
    assert [(b.step, b.version) for b in load_in_flight(checkpoint, 0)] == [(2, 1)]
    assert [(b.step, b.version) for b in load_in_flight(checkpoint, 1)] == [(2, 1)]
    rows = read_jsonl(straight / "metrics.jsonl")
    assert [row["pods/async/staleness_max"] for row in rows] == [0, 1, 1]
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # each worker had its trainer's weights
    updates = [json.loads((straight / f"record-rank{r}.json").read_text())["updates"] for r in (0, 1)]
    assert updates[0][0]["texts"] != updates[1][0]["texts"]  # each process's own prompts

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(checkpoint_dir(resumed / "checkpoints", 3))
    command, env = two_process_launch(tiny_model_dir, resumed, {**settings, "resume_from": "auto"})
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        a, b = (torch.load(folder / f"weights-rank{rank}.pt") for folder in (straight, resumed))
        assert all(torch.equal(a[k], b[k]) for k in a), rank
    assert learning_rows(straight / "metrics.jsonl") == learning_rows(resumed / "metrics.jsonl")


@pytest.mark.slow
def test_a_killed_worker_of_one_trainer_process_ends_both_with_its_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Process 1's worker is SIGKILLed while it generates (fault point worker_generating, on rank 1 only), with
    the prompt filter on, so that process 0's worker waits for it in their group: both processes stop at the same
    step with a checkpoint, process 1's worker named on both, and none waits for another; nothing is left."""
    from test_trainer import two_process_launch

    settings = {**ASYNC, "max_steps": 4, "prompt_filter": "nonzero_std", "max_num_gen_batches": 2}
    command, env = two_process_launch(tiny_model_dir, tmp_path, settings)
    env.update(PODS_FAULT="worker_generating", PODS_FAULT_RANK="1", PODS_TEST_TAG=str(tmp_path))
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0 and time.monotonic() - started < 120
    # process 1's worker died; process 0's, waiting for it in their group, failed there (not a hang)
    killed = "process 1: RolloutWorkerError: the rollout worker (pid "
    assert "rollout workers failed: " in result.stderr and killed in result.stderr, result.stderr[-3000:]
    assert "died with exit code -9 (SIGKILL)" in result.stderr and "process 0: " in result.stderr
    assert "resume_from: auto" in result.stderr
    assert list_checkpoints(tmp_path / "checkpoints") == [checkpoint_dir(tmp_path / "checkpoints", 0)]
    from test_rollout_faults import tagged

    assert not tagged(str(tmp_path))


def test_async_with_several_processes_refuses_what_cannot_work() -> None:
    from types import SimpleNamespace

    from pods.rollout_worker import require_async_with_several_processes

    def accelerator(kind: str = "MULTI_GPU", zero_stage: int | None = None):
        plugin = (
            None
            if zero_stage is None
            else SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": zero_stage}})
        )
        return SimpleNamespace(
            state=SimpleNamespace(deepspeed_plugin=plugin), distributed_type=SimpleNamespace(value=kind)
        )

    config = TrainConfig.from_dict({"async_generation": True})
    require_async_with_several_processes(accelerator(), config)  # DDP: each process holds the whole weights
    require_async_with_several_processes(accelerator("DEEPSPEED", 2), config)
    for sharded in (accelerator("DEEPSPEED", 3), accelerator("FSDP")):
        with pytest.raises(ConfigError, match="use DDP or ZeRO-1/2"):
            require_async_with_several_processes(sharded, config)
    unbounded = TrainConfig.from_dict({"prompt_filter": "nonzero_std", "max_num_gen_batches": 0})
    with pytest.raises(ConfigError, match="set max_num_gen_batches to 1 or more"):
        require_async_with_several_processes(accelerator(), unbounded)
