"""The PODS trainer on a tiny real model: every rule and loss type, LoRA and full fine-tuning, learning,
and two processes under ``accelerate launch`` (exact resume after crashes and signals: test_reliability.py);
the prompt filter with bounded refill and GRESO's skipping, wired into the loop, resumed exactly."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pods.advantages import zero_variance_groups
from pods.checkpoint import list_checkpoints
from pods.config import ConfigError, TrainConfig
from pods.metrics import TIMING_KEYS, read_jsonl
from pods.prompt_filter import fill_groups
from pods.trainer import PODSTrainer

SCRIPT = Path(__file__).parent / "scripts" / "tiny_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from tiny_run import (  # noqa: E402
    TINY_SETTINGS,
    RecordingTrainer,
    count_of_a,
    low_token_ids,
    tiny_dataset,
)


def tiny_config(model_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig.from_dict(
        {"model": str(model_dir), "output_dir": str(output_dir), **TINY_SETTINGS, **overrides}
    )


def run_tiny(model_dir: Path, output_dir: Path, **overrides):
    trainer = PODSTrainer(
        tiny_config(model_dir, output_dir, **overrides),
        reward_funcs=[count_of_a],
        train_dataset=tiny_dataset(),
    )
    return trainer, trainer.train()


def trainable_snapshot(trainer: PODSTrainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "overrides",
    [
        {"selection_rule": "max_variance"},
        {"selection_rule": "max_reward"},
        {"selection_rule": "random"},
        {"selection_rule": "all", "num_generations_kept": 4, "micro_batch_size": 4},
        {"loss_type": "bnpo"},
        {"loss_type": "dapo"},
        {"loss_type": "dr_grpo", "scale_rewards": "none"},
        {"lora_r": 4, "lora_alpha": 8, "report_to": ["tensorboard"]},
        {"lora_r": 4, "beta": 0.1},
        {
            "beta": 0.1,
            "num_iterations": 2,
            "micro_batch_size": 1,
            "lr_scheduler_type": "cosine",
            "warmup_ratio": 0.5,
        },
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_a_few_real_steps(tiny_model_dir: Path, tmp_path: Path, overrides: dict) -> None:
    trainer = PODSTrainer(
        tiny_config(tiny_model_dir, tmp_path, **overrides),
        reward_funcs=[count_of_a],
        train_dataset=tiny_dataset(),
    )
    before = trainable_snapshot(trainer)
    result = trainer.train()
    after = trainable_snapshot(trainer)
    assert result.steps == 2
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter moved"
    if "lora_r" in overrides:
        assert all("lora_" in name for name in before)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "pods/reward_kept",
        "rewards/count_of_a/mean",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "grad_norm",
        "kl",
        "loss",
    ):
        assert key in rows[-1] and rows[-1][key] is not None
    if overrides.get("selection_rule", "max_variance") == "max_variance":
        assert all(row["pods/group_reward_std_kept"] >= row["pods/group_reward_std"] - 1e-9 for row in rows)
    if overrides.get("beta"):
        assert rows[-1]["kl"] > 0
    assert (tmp_path / "config.yaml").is_file()
    if overrides.get("report_to"):
        assert list(tmp_path.glob("pods/events.out.tfevents.*")), sorted(p.name for p in tmp_path.rglob("*"))
    checkpoint = list_checkpoints(tmp_path / "checkpoints")[-1]
    assert (checkpoint / "model").is_dir()


def test_kl_and_clip_metrics_do_not_depend_on_micro_batch_size(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Averaged over tokens, not micro-batches: completions of unequal length make the two differ."""
    logged = []
    for micro in (1, 4):
        run_tiny(
            tiny_model_dir,
            tmp_path / f"micro{micro}",
            max_steps=1,
            micro_batch_size=micro,
            num_iterations=2,  # the second pass has moved: KL > 0 and some ratios clip
            beta=0.1,
            epsilon=0.02,
            learning_rate=3e-2,
            stop_strings=["a", "e"],  # completions of 1 to 8 tokens
            save_final=False,
        )
        logged.append(read_jsonl(tmp_path / f"micro{micro}" / "metrics.jsonl")[0])
    assert logged[0]["completions/min_length"] < logged[0]["completions/max_length"]
    for key in ("kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"):
        assert logged[0][key] == pytest.approx(logged[1][key], rel=1e-5, abs=1e-9), key
    assert logged[0]["kl"] > 0 and logged[0]["clip_ratio/region_mean"] > 0


def test_old_and_reference_logprobs_are_computed_in_eval_mode_at_every_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With LoRA dropout, train-mode old log-probs would be noisy; every no-grad forward must be eval mode."""
    trainer = PODSTrainer(
        tiny_config(
            tiny_model_dir, tmp_path, max_steps=3, num_iterations=2, beta=0.1, lora_r=4, lora_dropout=0.5
        ),
        reward_funcs=[count_of_a],
        train_dataset=tiny_dataset(),
    )
    modes = []  # training flag of every forward pass that builds no graph (generation, old and ref log-probs)
    base = trainer.accelerator.unwrap_model(trainer.model).get_base_model()
    base.register_forward_pre_hook(
        lambda module, args: None if torch.is_grad_enabled() else modes.append(module.training)
    )
    trainer.train()
    assert len(modes) > 3 * 8 and not any(modes), modes


def test_full_fine_tuning_kl_reference_runs_under_the_same_mixed_precision(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """At the first step the policy is the reference: under bf16 autocast for both, the KL is exactly 0."""
    run_tiny(tiny_model_dir, tmp_path, max_steps=1, beta=0.1, mixed_precision="bf16", save_final=False)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["kl"] == 0.0


def test_unscorable_completions_follow_trls_rule(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every reward function None: NaN, out of the reward statistics and the baseline (was counted as 0)."""
    given: list = []

    def one_or_none(prompts, completions, completion_ids=None, **columns):
        given.extend(None if len(ids) % 2 == 0 else 1.0 for ids in completion_ids)
        return given[-len(completion_ids) :]

    config = tiny_config(tiny_model_dir, tmp_path, max_steps=1, stop_strings=["a", "e"], save_final=False)
    PODSTrainer(config, reward_funcs=[one_or_none], train_dataset=tiny_dataset()).train()
    assert None in given and 1.0 in given
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert row["reward"] == 1.0 and row["rewards/one_or_none/mean"] == 1.0
    assert row["pods/reward_kept"] == 1.0


def test_mean_reward_rises(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(
        tiny_model_dir,
        tmp_path,
        max_steps=20,
        num_generations=8,
        num_generations_kept=4,
        prompts_per_step=4,
        micro_batch_size=16,
        learning_rate=1e-2,
        save_final=False,
    )
    PODSTrainer(config, reward_funcs=[low_token_ids], train_dataset=tiny_dataset()).train()
    rewards = [row["reward"] for row in read_jsonl(tmp_path / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, rewards


def run_script(
    model_dir: Path, output: Path, settings: dict, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(model_dir), str(output), json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def learning_metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in read_jsonl(path)]


FILTER_AND_SKIP = {
    "prompt_filter": "nonzero_std",
    "prompt_skip": "greso",
    "max_num_gen_batches": 3,
    "generation_batch_prompts": "auto",
}
HALF_CONSTANT = {
    "TINY_RUN_REWARD": "half_constant",
    "TINY_RUN_DATASET_SIZE": "6",
}  # zero-variance groups, revisits


@pytest.mark.slow
def test_a_4bit_lora_run_resumes_exactly_from_adapter_only_checkpoints(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """QLoRA (bitsandbytes' CPU backend): checkpoints hold the adapter (plus optimizer, scheduler, RNG), the
    base is named and hashed in the manifest; a run killed mid-save and resumed ends as a straight run."""
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file

    settings = {"max_steps": 4, "save_every_steps": 2, "load_in_4bit": True, "lora_r": 4, "lora_alpha": 8}
    straight = run_script(tiny_model_dir, tmp_path / "straight", settings)
    assert straight.returncode == 0, straight.stderr[-3000:]
    crashed = run_script(tiny_model_dir, tmp_path / "resumed", settings, env={"PODS_CRASH_DURING_SAVE": "4"})
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    [checkpoint] = list_checkpoints(tmp_path / "resumed" / "checkpoints")
    saved = load_file(checkpoint / "model.safetensors")
    assert saved and all("lora_" in name for name in saved)  # no 4-bit base weights, no quantization state
    base = json.loads((checkpoint / "manifest.json").read_text())["base_model"]
    assert base["name"] == str(tiny_model_dir) and len(base["sha256"]) == 64

    resumed = run_script(tiny_model_dir, tmp_path / "resumed", {**settings, "resume_from": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "straight" / "weights-rank0.pt")
    b = torch.load(tmp_path / "resumed" / "weights-rank0.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert learning_metrics(tmp_path / "straight" / "metrics.jsonl") == learning_metrics(
        tmp_path / "resumed" / "metrics.jsonl"
    )

    # the adapter onto another base (same architecture, other weights): refused, naming both
    from pods.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "other-base", seed=1)
    with pytest.raises(ConfigError, match="trained on the base"):
        run_tiny(other, tmp_path / "other", **{**settings, "max_steps": 6, "resume_from": str(checkpoint)})


@pytest.mark.slow
def test_resume_after_a_crash_with_filter_and_skipping_is_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The plain case is test_reliability.py's fault-injection test; here the refill rounds and GRESO's
    history must come back exactly from the checkpoint."""
    extra, env = FILTER_AND_SKIP, HALF_CONSTANT
    settings = {
        "max_steps": 4,
        "save_every_steps": 2,
        "selection_rule": "random",
        "num_iterations": 2,
        **extra,
    }
    straight = run_script(tiny_model_dir, tmp_path / "straight", settings, env)
    assert straight.returncode == 0, straight.stderr

    # Crash half-way through writing the step-4 checkpoint: metrics for steps 3-4 were already logged.
    crashed = run_script(
        tiny_model_dir, tmp_path / "resumed", settings, env={**env, "PODS_CRASH_DURING_SAVE": "4"}
    )
    assert crashed.returncode == 17, crashed.stderr
    assert [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == ["step-0000002"]
    assert len(read_jsonl(tmp_path / "resumed" / "metrics.jsonl")) == 4

    resumed = run_script(tiny_model_dir, tmp_path / "resumed", {**settings, "resume_from": "auto"}, env)
    assert resumed.returncode == 0, resumed.stderr
    assert not list((tmp_path / "resumed" / "checkpoints").glob(".partial-*"))

    a = torch.load(tmp_path / "straight" / "weights-rank0.pt")
    b = torch.load(tmp_path / "resumed" / "weights-rank0.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    straight_rows = learning_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed_rows = learning_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [row["step"] for row in resumed_rows] == [1, 2, 3, 4]
    assert straight_rows == resumed_rows
    # the resumed half ran on the checkpointed history: skips and refills happened after step 2
    late = straight_rows[2:]
    assert sum(row["pods/skip/prompts_skipped"] for row in late) > 0, late
    assert sum(row["pods/filter/groups_dropped"] for row in late) > 0, late
    straight_record, resumed_record = (
        json.loads((tmp_path / name / "record-rank0.json").read_text())["scored"]
        for name in ("straight", "resumed")
    )  # the resumed process scored steps 3-4 only: the same prompts, rounds, completions and rewards
    strip = lambda scored: [{k: v for k, v in r.items() if k != "step"} for r in scored]  # noqa: E731
    assert strip(resumed_record) == strip([r for r in straight_record if r["step"] >= 2])


def two_process_launch(model_dir: Path, output: Path, settings: dict) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run tiny_run.py as 2 CPU processes under ``accelerate launch``."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",  # with ACCELERATE_USE_CPU: torchrun over 2 CPU processes, gloo backend
        "--num_processes",
        "2",
        "--main_process_port",
        "0",  # a free port: launches in parallel test workers must not share one
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(SCRIPT),
        str(model_dir),
        str(output),
        json.dumps(settings),
    ]
    # A clean launch environment: earlier in-process tests (accelerate, TRL) leave ACCELERATE_* and
    # rank variables in os.environ that would change what the launcher does.
    launcher_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k not in launcher_keys}
    env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return command, env


@pytest.mark.slow
def test_a_deepspeed_zero2_step_uses_our_batch_shape_and_clipping(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """accelerate + DeepSpeed ZeRO-2 on the CPU, with no DataLoader to prepare: the step takes its micro-batch,
    accumulation and clip from our config (the launcher's clip of 1000 must not win over max_grad_norm)."""
    pytest.importorskip("deepspeed")
    settings = {"max_steps": 2, "max_grad_norm": 0.001, "micro_batch_size": 1}
    command, env = two_process_launch(tiny_model_dir, tmp_path / "zero2", settings)
    at = command.index("--multi_gpu")
    command[at : at + 3] = [
        "--use_deepspeed",
        "--zero_stage",
        "2",
        "--gradient_clipping",
        "1000",
        "--num_processes",
        "1",
    ]
    env.pop("ACCELERATE_USE_CPU")  # DeepSpeed picks its CPU accelerator itself (no GPU visible)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "distributed: DEEPSPEED" in result.stdout
    plain, _ = run_tiny(tiny_model_dir, tmp_path / "plain", **settings)  # in this process, without DeepSpeed
    zero2 = torch.load(tmp_path / "zero2" / "weights-rank0.pt")
    reference = plain.accelerator.unwrap_model(plain.model).state_dict()
    for key, value in reference.items():
        torch.testing.assert_close(zero2[key], value, rtol=1e-4, atol=1e-6, msg=key)


def deepspeed_launch(model_dir: Path, output: Path, settings: dict, stage: int = 2):
    """The command and environment that run tiny_run.py in one CPU process under DeepSpeed ZeRO-``stage``."""
    command, env = two_process_launch(model_dir, output, settings)
    at = command.index("--multi_gpu")
    command[at : at + 3] = ["--use_deepspeed", "--zero_stage", str(stage), "--num_processes", "1"]
    env.pop("ACCELERATE_USE_CPU")  # DeepSpeed picks its CPU accelerator itself (no GPU visible)
    return command, env


@pytest.mark.slow
def test_a_non_finite_step_under_deepspeed_zero2_is_skipped(tiny_model_dir: Path, tmp_path: Path) -> None:
    """DeepSpeed steps inside backward: a NaN loss (injected into the 3rd training forward, step 2 of 2)
    must leave the weights at step 1's, counted as a skipped step, with the scheduler not advanced."""
    pytest.importorskip("deepspeed")
    settings = {"max_steps": 2, "lr_scheduler_type": "linear"}
    command, env = deepspeed_launch(tiny_model_dir, tmp_path / "zero2", settings)
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**env, "TINY_RUN_NAN_FORWARDS": "3"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "distributed: DEEPSPEED" in result.stdout
    # the reference: one plain step in this process, without DeepSpeed
    one_step, _ = run_tiny(tiny_model_dir, tmp_path / "plain", **{**settings, "max_steps": 1})
    guarded = torch.load(tmp_path / "zero2" / "weights-rank0.pt")
    reference = one_step.accelerator.unwrap_model(one_step.model).state_dict()
    for key, value in reference.items():
        torch.testing.assert_close(guarded[key], value, rtol=1e-4, atol=1e-6, msg=key)
    rows = read_jsonl(tmp_path / "zero2" / "metrics.jsonl")
    assert [row["skipped_steps"] for row in rows] == [0, 1]
    assert rows[0]["learning_rate"] == rows[1]["learning_rate"]  # the schedule did not move either


@pytest.mark.slow
def test_under_deepspeed_zero3_the_exported_model_holds_the_full_trained_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """ZeRO-3 partitions every parameter (each process holds an empty local shard): the checkpoint's model/
    folder is written from the gathered weights, equal to a plain run's after the same steps. token_budget 1
    runs each packed completion as a forward of its own: DeepSpeed must step once per micro-batch group,
    after the last of them (the first forwards are no accumulation boundary)."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    settings = {"max_steps": 2, "token_budget": 1}
    command, env = deepspeed_launch(tiny_model_dir, tmp_path / "zero3", settings, stage=3)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    plain, _ = run_tiny(tiny_model_dir, tmp_path / "plain", **settings)  # in this process, without DeepSpeed
    exported = load_file(
        next((tmp_path / "zero3" / "checkpoints").glob("step-*")) / "model" / "model.safetensors"
    )
    reference = plain.accelerator.unwrap_model(plain.model).state_dict()
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(reference[k], initial[k]) for k in initial)  # the steps moved the weights
    for key in initial:
        torch.testing.assert_close(exported[key], reference[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_two_processes_keep_identical_parameters(tiny_model_dir: Path, tmp_path: Path) -> None:
    """DDP over gloo; token_budget 1 runs each packed completion as a forward of its own, the first ones
    under no_sync: the gradients must still be averaged over both processes once per micro-batch."""
    settings = {"max_steps": 2, "scale_rewards": "batch", "token_budget": 1}
    command, env = two_process_launch(tiny_model_dir, tmp_path, settings)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MULTI_CPU" in result.stdout
    lines = sorted(line.split(" ", 4) for line in result.stdout.splitlines() if line.startswith("RESULT"))
    assert [line[1] for line in lines] == ["0", "1"]
    assert lines[0][2] == lines[1][2] == "2"
    assert lines[0][4] != lines[1][4], "both processes trained on the same prompts"
    rank0 = torch.load(tmp_path / "weights-rank0.pt")
    rank1 = torch.load(tmp_path / "weights-rank1.pt")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]

    # scale_rewards: batch takes the std over every process's kept rewards, as TRL does.
    records = [json.loads((tmp_path / f"record-rank{rank}.json").read_text()) for rank in (0, 1)]
    m = TINY_SETTINGS["num_generations_kept"]
    for step in range(2):
        kept = [
            torch.tensor(count_of_a(None, r["updates"][step]["texts"]), dtype=torch.float64) for r in records
        ]
        std = torch.cat(kept).std()
        assert torch.cat(kept).view(-1, m).std(dim=1).max() > 0, "no spread to scale"
        for rank in (0, 1):
            rewards = kept[rank].view(-1, m)
            expected = (rewards - rewards.mean(dim=1, keepdim=True)) / (std + 1e-4)
            expected = expected.masked_fill((rewards.amax(1) == rewards.amin(1)).unsqueeze(1), 0.0)
            actual = torch.tensor(records[rank]["updates"][step]["advantages"], dtype=torch.float64)
            torch.testing.assert_close(actual, expected.flatten(), rtol=1e-5, atol=1e-6)


def test_updates_use_exactly_the_rows_the_rule_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The update sees the max-variance m of each group's n, in order, with their advantages."""
    config = tiny_config(tiny_model_dir, tmp_path, max_steps=2, save_final=False)
    trainer = RecordingTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset())
    trainer.train()
    n, m = config.num_generations, config.num_generations_kept
    for scored, update in zip(trainer.scored, trainer.updates, strict=True):
        rewards = torch.tensor(scored["rewards"], dtype=torch.float64)  # [prompts, n]
        for group, row in enumerate(rewards):
            texts = scored["texts"][group * n : (group + 1) * n]
            positions: list[int] = []  # where this group's kept texts sit among its n (a text may repeat)
            for text in update["texts"][group * m : (group + 1) * m]:
                assert text in texts, f"group {group} trained on a completion of another group"
                positions.append(next(i for i, t in enumerate(texts) if t == text and i not in positions))
            best = max(row[list(c)].var().item() for c in itertools.combinations(range(n), m))
            kept = row[positions]
            assert kept.var().item() == pytest.approx(best), (group, positions)
            expected = (
                (kept - kept.mean()) / (kept.std() + 1e-4) if kept.std() > 0 else torch.zeros_like(kept)
            )
            actual = torch.tensor(update["advantages"][group * m : (group + 1) * m], dtype=torch.float64)
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert len(set(update["texts"])) > 1


def test_half_precision_full_fine_tuning_outside_deepspeed_is_refused_naming_the_fixes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # why: an AdamW step of the paper's lr does not move a bfloat16 weight of 1.0 at all
    weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    weight.grad = torch.ones_like(weight)
    torch.optim.AdamW([weight], lr=5e-6).step()
    assert torch.equal(weight.detach(), torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(
        ConfigError, match=r"set dtype: float32 with mixed_precision: bf16 .* DeepSpeed .* LoRA"
    ):
        run_tiny(tiny_model_dir, tmp_path / "full", dtype="bfloat16")
    # LoRA on the same bfloat16 base trains float32 adapters (peft's default): accepted, and it trains
    trainer, result = run_tiny(tiny_model_dir, tmp_path / "lora", dtype="bfloat16", lora_r=4, max_steps=1)
    assert result.steps == 1 and all(p.dtype == torch.float32 for p in trainable_snapshot(trainer).values())


def test_configuration_errors_before_any_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        PODSTrainer(
            tiny_config(tmp_path / "no-model", tmp_path),
            reward_funcs=[count_of_a],
            train_dataset=tiny_dataset(),
        )
    with pytest.raises(ValueError, match="unknown selection rule"):
        PODSTrainer(
            tiny_config(tiny_model_dir, tmp_path, selection_rule="best"),
            reward_funcs=[count_of_a],
            train_dataset=tiny_dataset(),
        )


def test_a_reward_function_that_raises_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    from pods.scoring import RewardFunctionError

    def broken_reward(prompts, completions, **columns):
        if any("say abb" in question for question in columns["question"]):
            raise KeyError("solution")
        return [0.0] * len(completions)

    trainer = PODSTrainer(
        tiny_config(tiny_model_dir, tmp_path), reward_funcs=[broken_reward], train_dataset=tiny_dataset()
    )
    with pytest.raises(RewardFunctionError, match="'broken_reward' raised KeyError") as error:
        trainer.train()
    index = int(str(error.value).split("on completion ")[1].split(":")[0])
    first = [trainer.train_rows[i] for i in trainer.prompts.draw(0, trainer.config.prompts_per_step)]
    assert "say abb" in first[index // 4]["question"]


def test_existing_checkpoints_are_never_overwritten_silently(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_tiny(tiny_model_dir, tmp_path, max_steps=1)
    with pytest.raises(ConfigError, match="resume_from: auto"):
        run_tiny(tiny_model_dir, tmp_path, max_steps=1)
    _, result = run_tiny(tiny_model_dir, tmp_path, max_steps=2, resume_from="auto")
    assert result.steps == 2
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_two_processes_each_filter_and_skip_their_own_groups(tiny_model_dir: Path, tmp_path: Path) -> None:
    """accelerate launch, 2 CPU processes, prompt filter and GRESO: both run the same rounds of the same size (a
    process that skipped more tops up with skipped prompts), each trains on its own informative groups, the prompts
    never overlap, and the weights stay identical."""
    settings = {"max_steps": 3, **FILTER_AND_SKIP}
    command, env = two_process_launch(tiny_model_dir, tmp_path, settings)
    env.update(TINY_RUN_REWARD="half_constant", TINY_RUN_DATASET_SIZE="40")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"weights-rank{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    records = [json.loads((tmp_path / f"record-rank{rank}.json").read_text()) for rank in (0, 1)]
    steps = [[[r for r in record["scored"] if r["step"] == step] for step in range(3)] for record in records]
    n, m, wanted = TINY_SETTINGS["num_generations"], TINY_SETTINGS["num_generations_kept"], 2
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    within_an_epoch = 0
    for step, row in enumerate(rows):
        assert len(steps[0][step]) == len(steps[1][step]) == row["pods/filter/num_gen_batches"]
        sizes = [[len(r["questions"]) for r in steps[rank][step]] for rank in (0, 1)]
        assert sizes[0] == sizes[1], sizes
        questions = [{q for r in steps[rank][step] for q in r["questions"]} for rank in (0, 1)]
        drawn_before = round(rows[step - 1]["epoch"] * 40 / 2) if step else 0  # the stream's cursor
        drawn_after = round(row["epoch"] * 40 / 2)
        if drawn_before * 2 // 40 == (drawn_after * 2 - 1) // 40:  # within one epoch each prompt comes once
            assert not questions[0] & questions[1], "the processes generated for the same prompt in one step"
            within_an_epoch += 1
        dropped = 0
        for rank in (0, 1):
            rewards = torch.cat([torch.tensor(r["rewards"], dtype=torch.float64) for r in steps[rank][step]])
            texts = [text for r in steps[rank][step] for text in r["texts"]]
            passed = ~zero_variance_groups(rewards)
            groups = fill_groups(passed, wanted, "train_fewer").positions.tolist()
            update = records[rank]["updates"][step]["texts"]
            for slot, group in enumerate(groups):
                assert all(
                    text in texts[group * n : (group + 1) * n] for text in update[slot * m : (slot + 1) * m]
                )
            dropped += len(passed) - int(passed.sum()) - (wanted - int(passed[groups].sum()))
        assert row["pods/filter/groups_dropped"] == dropped
    assert sum(row["pods/filter/groups_dropped"] for row in rows) > 0
    assert within_an_epoch > 0, "every step crossed an epoch: the overlap was never checked"
