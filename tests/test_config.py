"""Configuration as data: defaults, YAML, overrides, and an error naming the key for every bad setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pods.config import ConfigError, TrainConfig, parse_overrides


def test_defaults_are_the_embedded_cpu_demo() -> None:
    config = TrainConfig()
    assert config.model == "embedded" and config.task == "arith"
    assert (config.num_generations, config.num_generations_kept) == (16, 4)
    assert config.selection_rule == "max_variance"


def test_yaml_round_trip_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    TrainConfig(num_generations=8, num_generations_kept=8, selection_rule="all", micro_batch_size=16).save(
        path
    )
    loaded = TrainConfig.from_yaml(path, overrides={"learning_rate": "5e-6"})
    assert loaded.num_generations == 8 and loaded.selection_rule == "all"
    assert loaded.learning_rate == 5e-6  # YAML 1.1 reads 5e-6 as text; we take it as the number it is


def test_yaml_exponent_without_dot_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 5e-6\nreward_funcs: accuracy\n")
    config = TrainConfig.from_yaml(path)
    assert config.learning_rate == 5e-6 and config.reward_funcs == ["accuracy"]


def test_parse_overrides() -> None:
    parsed = parse_overrides(
        ["--num_generations", "8", "learning_rate=1e-5", "--stop-strings", "[a, b]", "--x=true"]
    )
    assert parsed == {"num_generations": 8, "learning_rate": 1e-5, "stop_strings": ["a", "b"], "x": True}
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--num_generations"])
    with pytest.raises(ConfigError, match="--key value"):
        parse_overrides(["oops"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"lerning_rate": 1e-5}, "did you mean learning_rate"),
        ({"num_generations_kept": 32}, "cannot exceed num_generations"),
        ({"num_generations_kept": 1}, "at least 2"),
        ({"micro_batch_size": 5}, "must divide the kept rows"),
        ({"token_budget": 0}, "token_budget: must be at least 1"),
        (
            {"attn_implementation": "flash"},
            "attn_implementation: unknown value .flash.; choose one of auto, sdpa",
        ),
        ({"loss_type": "ppo"}, "grpo, bnpo, dapo, dr_grpo"),
        ({"scale_rewards": True}, "scale_rewards must be str"),
        ({"selection_rule": "all"}, "num_generations_kept = n"),
        ({"max_steps": 1.5}, "max_steps must be int"),
        ({"max_steps": None, "max_time": None}, "needs an end"),
        ({"lr_scheduler_type": "cosine", "max_steps": None}, "set max_steps"),
        ({"warmup_ratio": 0.1, "max_steps": None}, "fraction of max_steps"),
        ({"load_in_4bit": True}, "lora_r > 0"),
        ({"reward_funcs": ["accuracy"], "reward_weights": [1.0, 2.0]}, "2 weights for 1 reward_funcs"),
        ({"progress": "yes"}, "progress must be bool"),
        ({"temperature": -1}, "temperature"),
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size: must be 1.*accelerate launch"),
        ({"vllm_max_num_batched_tokens": 0}, "vllm_max_num_batched_tokens: must be at least 1"),
        ({"max_num_gen_batches": -1}, "max_num_gen_batches: must be at least 1 .* or 0 for no bound"),
        ({"prompt_filter_exhausted": "wait"}, "prompt_filter_exhausted: unknown value 'wait'"),
        (
            {"prompt_skip_mode": "drop"},
            "prompt_skip_mode: unknown value 'drop'; choose one of shrink, replace",
        ),
        ({"generation_batch_prompts": "auto"}, "generation_batch_prompts: oversamples .* set prompt_filter"),
        (
            {"generation_batch_prompts": 8, "prompt_filter": "nonzero_std"},
            r"generation_batch_prompts: must be null, auto, or a number of prompts of at least prompts_per_step \(16\)",
        ),
        (
            {"prompt_skip_solved_mean": 0.5, "prompt_skip_failed_mean": 0.5},
            "must be below prompt_skip_solved_mean",
        ),
        ({"num_generations_kept_by_difficulty": [2, 3, 4]}, "must list 4 counts kept per group"),
        ({"num_generations_kept_by_difficulty": [1, 2, 4, 4]}, r"each from 2 to num_generations_kept \(4\)"),
        (
            {
                "num_generations_kept_by_difficulty": [2, 2, 4, 4],
                "selection_rule": "all",
                "num_generations": 4,
            },
            "other than 'all'",
        ),
        ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation: unknown value 'mean'"),
    ],
)
def test_bad_settings_name_the_key(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(values)


def test_registry_names_are_checked() -> None:
    from pods.registries import check_names

    with pytest.raises(ConfigError, match=r"selection_rule: unknown value 'best'.*max_variance"):
        check_names(TrainConfig(selection_rule="best"))
    with pytest.raises(ConfigError, match="reward_funcs: unknown value 'speed'"):
        check_names(TrainConfig(reward_funcs=["speed"]))
    with pytest.raises(ConfigError, match="task: unknown value 'chess'"):
        check_names(TrainConfig(task="chess"))


def test_bad_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="mapping"):
        TrainConfig.from_yaml(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.from_yaml(tmp_path / "broken.yaml")
