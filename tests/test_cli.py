"""The ``pods`` command line, run as real subprocesses on a tiny model and the shared GSM8K files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pods import __version__
from pods.cli import PRESETS_DIR, main, preset_names


def run_pods(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pods", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def test_version_and_help() -> None:
    assert run_pods("--version").stdout.strip() == f"pods {__version__}"
    result = run_pods("--help")
    assert result.returncode == 0
    for command in ("train", "eval", "compare", "sweep", "plot", "demo"):
        assert command in result.stdout
    train_help = run_pods("train", "--help").stdout
    assert "num_generations_kept=4" in train_help and "gsm8k-pods" in train_help


def test_demo_prints_what_each_rule_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--groups", "2", "--n", "6", "--m", "3"]) == 0
    stdout = capsys.readouterr().out
    for rule in (
        "max_variance",
        "max_reward",
        "random",
        "shortest",
        "reward_per_token",
        "max_variance_shortest",
    ):
        assert len(re.findall(rf"^  {rule} +keeps \[", stdout, flags=re.MULTILINE)) == 2, rule
    assert stdout.count("lengths [") == 2
    assert "(rewards from [0.0, 0.1, 1.0, 1.2], lengths" in stdout
    assert not re.search(r"\d\.\d{6}", stdout), stdout  # no float32 artefacts (0.10000000149011612)


def test_plot_reads_old_metric_names_and_names_the_file_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A metrics.jsonl from before the renames to TRL's names (reward_mean_all) still plots; a file without
    the metric is a one-line error that names it."""
    old, foreign = tmp_path / "old", tmp_path / "foreign"
    for run, key in ((old, "reward_mean_all"), (foreign, "score")):
        run.mkdir()
        rows = [{"step": s, "train_seconds": 2.0 * s, key: 0.1 * s} for s in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (old / "eval.jsonl").write_text(json.dumps({"step": 3, "train_seconds": 6.0, "accuracy": 0.5}) + "\n")
    assert main(["plot", str(old)]) == 0 and (old / "training.png").stat().st_size > 10_000
    capsys.readouterr()
    assert main(["plot", str(foreign)]) == 2
    error = capsys.readouterr().err
    assert f"{foreign / 'metrics.jsonl'}: row 1 has no 'reward' (nor its old name 'reward_mean_all')" in error
    assert len(error.strip().splitlines()) == 1 and not (foreign / "training.png").exists()


def test_a_bug_keeps_its_traceback() -> None:
    """Only pods' own errors become one-line messages; a ValueError from a bug propagates with its traceback."""
    from pods.data import register_task

    def broken_reader(split: str, **options) -> list[dict]:
        return [{"question": "q", "answer": str(int("not a number"))}]

    register_task("broken-reader", broken_reader)
    with pytest.raises(ValueError, match="invalid literal for int"):
        main(["eval", "--model", "embedded", "--dataset", "broken-reader"])


def test_both_spellings_of_every_option() -> None:
    from pods.cli import build_parser, load_train_config

    parser = build_parser()
    base = ["eval", "--model", "m", "--dataset", "arith"]
    for spelling in ("--max_new_tokens", "--max-new-tokens"):
        args, extra = parser.parse_known_args(
            [
                *base,
                spelling,
                "7",
                spelling.replace("max", "batch").replace("new_tokens", "size").replace("new-tokens", "size"),
                "3",
            ]
        )
        assert (args.max_new_tokens, args.batch_size, extra) == (7, 3, [])
    for spelling in ("--output", "--output_dir", "--output-dir"):
        assert parser.parse_known_args(["compare", spelling, "there"])[0].output == "there"
    assert load_train_config(None, ["--max-time", "7", "--num_generations", "8"]).max_time == 7.0
    assert load_train_config(None, ["--max_time", "7", "--num-generations", "8"]).num_generations == 8


def test_bad_input_is_a_clear_error_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_pods("train", "--lerning_rate", "1e-5")  # once as a real process
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "did you mean learning_rate" in result.stderr
    for args, message in [
        (["demo", "--n", "4", "--m", "9"], "m=9"),
        (["train", "--config", "no-such-preset"], "presets: "),
        (["train", "--num_generations_kept", "64"], "cannot exceed num_generations"),
        (["train", "--max_steps", "ten"], "max_steps must be int"),
        (["eval", "--model", "/no/such/model", "--dataset", "gsm8k"], "does not exist"),
        (["compare", "--seed", "3"], "set per arm by pods compare, so it cannot be overridden; use --seeds"),
        (["compare", "--num-generations", "8"], "--num_generations is set per arm"),
        (
            ["eval", "--model", "embedded", "--dataset", "arith", "--max_time", "3"],
            "unrecognized arguments: --max_time",
        ),
        (["plot", "runs/x", "--colour", "red"], "unrecognized arguments: --colour"),
    ]:
        try:
            code = main(args)
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
        assert code == 2, args
        assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_run_config(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, shared_data: Path
) -> Path:
    """A YAML config training the tiny model on GSM8K rows from ../shared/data for a few steps."""
    path = tmp_path_factory.mktemp("cli") / "tiny.yaml"
    settings = {
        "model": str(tiny_model_dir),
        "task": "gsm8k",
        "task_source": str(shared_data / "gsm8k"),
        "prompt_style": "chat",
        "train_limit": 64,
        "eval_limit": 8,
        "max_prompt_length": None,  # no length filter: it would tokenize all 7473 rows first
        "num_generations": 4,
        "num_generations_kept": 2,
        "prompts_per_step": 2,
        "micro_batch_size": 4,
        "max_completion_length": 8,
        "max_time": None,
        "max_steps": 3,
        "eval_every_seconds": 0.5,
        "reward_funcs": ["accuracy", "format", "tag"],
        "progress": False,
    }
    path.write_text(yaml.safe_dump(settings))
    return path


@pytest.mark.slow
def test_train_eval_and_plot(
    tiny_run_config: Path, tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pods train` and `pods eval` as processes, then `pods plot` (in this process) on what they wrote."""
    run_dir = tmp_path / "run"
    result = run_pods("train", "--config", str(tiny_run_config), "--output_dir", str(run_dir), "--seed", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Held-out accuracy (greedy, 8 problems of gsm8k)" in result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # none at exit either
    for name in ("config.yaml", "metrics.jsonl", "eval.jsonl", "training.png"):
        assert (run_dir / name).is_file(), name
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == 3
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3

    report = tmp_path / "report.json"
    result = run_pods(
        "eval", "--model", str(run_dir), "--dataset", "gsm8k", "--source", str(shared_data / "gsm8k"),
        "--limit", "6", "--max-new-tokens", "8", "--protocol", "sampled", "--samples", "2", "--output", str(report),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()  # piped: no progress bar, so no empty line it would leave behind
    engine_line = next(i for i, line in enumerate(lines) if line.startswith("rollout engine:"))
    assert lines[engine_line + 1].startswith("gsm8k test (6 problems, sampled"), result.stdout
    values = json.loads(report.read_text())
    assert (
        values["num_problems"] == 6 and values["samples_per_problem"] == 2 and values["protocol"] == "sampled"
    )
    for key in ("accuracy", "format_accuracy", "correct_and_formatted"):  # counts over 6 problems x 2 samples
        assert values[key] * 12 == pytest.approx(round(values[key] * 12)) and values[key] <= 1.0, key
    assert values["correct_and_formatted"] <= min(values["accuracy"], values["format_accuracy"])

    assert main(["plot", str(run_dir), str(run_dir), "--output", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000
    assert main(["plot", str(tmp_path)]) == 2 and "not a pods run folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", preset_names())
def test_every_preset_resolves_and_runs_a_step_on_a_tiny_model(
    name: str, tiny_model_dir: Path, tmp_path: Path, shared_data: Path
) -> None:
    from pods.cli import load_train_config
    from pods.registries import check_names
    from pods.trainer import PODSTrainer

    config = load_train_config(name, [])  # parses and validates the preset as shipped
    check_names(config)
    sources = {"gsm8k": shared_data / "gsm8k", "math500": shared_data / "math500" / "test.jsonl"}
    task = "math500" if config.task == "math" else config.task  # MATH train lives on the Hub only
    overrides = {
        "model": str(tiny_model_dir),
        "load_in_4bit": False,
        "lora_r": min(config.lora_r, 4),
        "optimizer": "adamw",
        "dtype": "float32",
        "mixed_precision": "no",
        "gradient_checkpointing": False,
        "task": task,
        "train_split": "test" if task == "math500" else config.train_split,
        "task_source": str(sources[task]) if task in sources else None,
        "max_completion_length": 4,
        "max_steps": 1,
        "max_time": None,
        "eval_at_start": False,
        "eval_every_seconds": None,
        "eval_at_seconds": [],
        "save_final": False,
        "progress": False,
        "output_dir": str(tmp_path),
        "train_limit": 8,
        "max_prompt_length": None,
    }
    values = {**config.to_dict(), **overrides}
    trainer = PODSTrainer(type(config).from_dict(values))
    assert trainer.train().steps == 1
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["reward"] is not None


def test_presets_are_the_papers_settings() -> None:
    pods = yaml.safe_load((PRESETS_DIR / "gsm8k-pods.yaml").read_text())
    grpo = yaml.safe_load((PRESETS_DIR / "gsm8k-grpo.yaml").read_text())
    assert (pods["num_generations"], pods["num_generations_kept"], pods["lora_r"], pods["max_time"]) == (
        64,
        16,
        64,
        21600,
    )
    assert (grpo["num_generations"], grpo["num_generations_kept"], grpo["selection_rule"]) == (16, 16, "all")
    math = yaml.safe_load((PRESETS_DIR / "math-pods.yaml").read_text())
    assert (math["num_generations"], math["num_generations_kept"]) == (32, 8)
    multi = yaml.safe_load((PRESETS_DIR / "gsm8k-8gpu-pods.yaml").read_text())
    assert (multi["num_generations"], multi["num_generations_kept"], multi["lora_r"]) == (128, 32, 0)
    assert (PRESETS_DIR / "accelerate" / "deepspeed_zero2.yaml").is_file()


@pytest.mark.slow
def test_eval_on_a_lora_checkpoint(tiny_run_config: Path, tmp_path: Path, shared_data: Path) -> None:
    import torch

    from pods.cli import load_train_config
    from pods.cli.evaluate import load_model_for_eval
    from pods.trainer import PODSTrainer

    overrides = ["--output_dir", str(tmp_path / "lora"), "--lora_r", "4", "--max_steps", "1"]
    overrides += ["--eval_every_seconds", "null", "--eval_at_seconds", "[]", "--eval_at_start", "false"]
    overrides += ["--dtype", "bfloat16"]
    PODSTrainer(load_train_config(str(tiny_run_config), overrides)).train()
    adapter = next((tmp_path / "lora" / "checkpoints").glob("step-*")) / "model"
    assert (adapter / "adapter_config.json").is_file()  # the export is the adapter, not a full copy
    # the base is loaded in the run's dtype (the tiny model's own checkpoint is float32)
    base = load_model_for_eval(str(adapter)).get_base_model()
    assert base.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    report = tmp_path / "lora.json"
    args = [
        "eval",
        "--model",
        str(tmp_path / "lora"),
        "--dataset",
        "gsm8k",
        "--source",
        str(shared_data / "gsm8k"),
    ]
    assert main([*args, "--limit", "4", "--max-new-tokens", "4", "--output", str(report)]) == 0
    values = json.loads(report.read_text())
    assert values["model"] == str(adapter) and values["num_problems"] == 4
