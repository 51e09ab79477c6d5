"""``pods train``: one training run from a preset or file plus ``--key value`` overrides."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pods.cli.common import is_main_process, load_train_config, preset_names, quiet_libraries


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``pods train`` to the command line."""
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="RL fine-tuning with PODS (default: the embedded arithmetic demo on a CPU, ~5 minutes)",
        description="Train with GRPO + PODS. With no arguments: the embedded CPU demo (configs/embedded.yaml).\n"
        "Your own data and rewards (docs/tasks.md): --dataset_name FILE_FOLDER_OR_HUB_ID\n"
        "  --reward_funcs rewards.py:function accuracy, and --prompt_column, --prompt_template,\n"
        "  --answer_column, --reward_model_name_or_path, --accuracy_reward.",
        epilog=_config_keys_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="a preset name or a YAML file (default: the built-in defaults)")
    train.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_train_config(args.config, overrides)  # first: a bad key fails before torch is imported
    from pods.distributed import close_process_group
    from pods.plotting import plot_runs
    from pods.trainer import TrainingStopped, train

    quiet_libraries()
    try:
        result = train(config)
        close_process_group()
    except TrainingStopped as stopped:
        close_process_group()
        if is_main_process():
            print(
                f"\npods train: stopped by {stopped.signal_name} after step {stopped.step}; "
                f"checkpoint: {stopped.checkpoint}\nContinue this run with:\n  "
                f"{resume_command(args.config, overrides, stopped.output_dir)}",
                file=sys.stderr,
            )
        return stopped.exit_code
    if not is_main_process():
        return 0
    plot = plot_runs([result.output_dir], result.output_dir / "training.png")
    print(f"\nTrained {result.steps} steps in {result.train_seconds:.0f} s of training time.")
    if result.first_eval and result.last_eval and result.first_eval is not result.last_eval:
        first, last = result.first_eval, result.last_eval
        print(
            f"Held-out accuracy ({last['protocol']}, {last['num_problems']} problems of {config.dataset_name or config.eval_task or config.task}): "
            f"{first['accuracy']:.1%} -> {last['accuracy']:.1%} "
            f"({100 * (last['accuracy'] - first['accuracy']):+.1f} points)"
        )
    print(f"Run folder:  {result.output_dir}")
    evals = result.output_dir / "eval.jsonl"  # empty where nothing was held out (a single data file)
    print(
        f"Metrics:     {result.output_dir / 'metrics.jsonl'} (per step)"
        + (f", {evals} (evaluations)" if evals.is_file() and evals.stat().st_size else "")
    )
    if result.checkpoint:
        print(f"Checkpoint:  {result.checkpoint} (model for `pods eval`: {result.checkpoint / 'model'})")
    print(f"Plot:        {plot}")
    return 0


def resume_command(config: str | None, overrides: list[str], output_dir: Path) -> str:
    """The ``pods train`` command that continues a run: the same options, its run folder, ``--resume_from auto``."""
    import shlex

    kept, index = [], 0
    while index < len(overrides):
        item = overrides[index]
        key, sep, _ = item.lstrip("-").partition("=")
        takes_value = item.startswith("--") and not sep and index + 1 < len(overrides)
        width = 2 if takes_value and not overrides[index + 1].startswith("--") else 1
        if key.replace("-", "_") not in ("output_dir", "resume_from"):
            kept += overrides[index : index + width]
        index += width
    head = ["pods", "train"] + (["--config", config] if config else [])
    return shlex.join(head + kept + ["--output_dir", str(output_dir), "--resume_from", "auto"])


def _config_keys_epilog() -> str:
    from pods.config import TrainConfig

    fields = [f"{f.name}={_default_of(f)}" for f in dataclasses.fields(TrainConfig)]
    return (
        "Any configuration key can be set as --key value (or key=value), after --config; --max_time and\n"
        "--max-time are the same option (so for every key and every option of every command).\n"
        f"Presets (--config NAME): {', '.join(preset_names())}.\nKeys and defaults: "
        + ", ".join(fields)
        + "\n"
        "See docs/configuration.md for what each key means."
    )


def _default_of(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        return str(field.default_factory())
    return str(field.default)
