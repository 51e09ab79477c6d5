"""The ``pods`` command line: one sub-command per job, each a thin layer over the library."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pods import __version__

PRESETS_DIR = Path(__file__).parent / "configs"


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def resolve_config_path(name: str) -> Path:
    """A preset name (``pods train --config gsm8k-pods``) or a YAML file's path."""
    path = Path(name)
    if path.is_file():
        return path
    preset = PRESETS_DIR / f"{name}.yaml"
    if preset.is_file():
        return preset
    from pods.config import ConfigError

    raise ConfigError(f"--config {name}: no such file or preset; presets: {', '.join(preset_names())}")


def load_train_config(config: str | None, overrides: list[str]):
    from pods.config import TrainConfig, load_yaml_mapping, parse_overrides

    values = load_yaml_mapping(resolve_config_path(config)) if config else {}
    return TrainConfig.from_dict({**values, **parse_overrides(overrides)})


# ---------------------------------------------------------------------------------------------- train
def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_train_config(args.config, overrides)  # first: a bad key fails before torch is imported
    from pods.plotting import plot_runs
    from pods.trainer import TrainingStopped, train

    quiet_libraries()
    try:
        result = train(config)
    except TrainingStopped as stopped:
        if _is_main_process():
            print(
                f"\npods train: stopped by {stopped.signal_name} after step {stopped.step}; "
                f"checkpoint: {stopped.checkpoint}\nContinue this run with:\n  "
                f"{resume_command(args.config, overrides, stopped.output_dir)}",
                file=sys.stderr,
            )
        return stopped.exit_code
    if not _is_main_process():
        return 0
    plot = plot_runs([result.output_dir], result.output_dir / "training.png")
    print(f"\nTrained {result.steps} steps in {result.train_seconds:.0f} s of training time.")
    if result.first_eval and result.last_eval and result.first_eval is not result.last_eval:
        first, last = result.first_eval, result.last_eval
        print(
            f"Held-out accuracy ({last['protocol']}, {last['num_problems']} problems of {config.eval_task or config.task}): "
            f"{first['accuracy']:.1%} -> {last['accuracy']:.1%} "
            f"({100 * (last['accuracy'] - first['accuracy']):+.1f} points)"
        )
    print(f"Run folder:  {result.output_dir}")
    print(
        f"Metrics:     {result.output_dir / 'metrics.jsonl'} (per step), {result.output_dir / 'eval.jsonl'} (evaluations)"
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


# ---------------------------------------------------------------------------------------------- eval
def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.data import get_task
    from pods.evaluation import evaluate
    from pods.models import load_tokenizer

    quiet_libraries()
    model_dir = find_model_folder(args.model)
    model = load_model_for_eval(model_dir)
    tokenizer = load_tokenizer(model_dir)
    task = get_task(args.dataset)
    style = args.prompt_style or (
        "plain" if task.prompt_style == "chat" and not tokenizer.chat_template else task.prompt_style
    )
    max_new_tokens = args.max_new_tokens or task.max_new_tokens
    dataset = task.load(args.split, source=args.source, prompt_style=style, limit=args.limit)
    engine = eval_engine(args.rollout_engine, model, tokenizer, dataset, max_new_tokens, args.batch_size)
    result = evaluate(
        model,
        tokenizer,
        dataset,
        task.accuracy_function(),
        protocol=args.protocol,
        samples=args.samples,
        temperature=args.temperature,
        max_new_tokens=max_new_tokens,
        batch_size=args.batch_size,
        prompt_style=style,
        progress=True,
        engine=engine,
    )
    report = {"model": str(model_dir), "dataset": args.dataset, "split": args.split, "prompt_style": style}
    report.update(result.to_dict())
    output = Path(args.output) if args.output else Path(f"eval-{args.dataset}-{args.protocol}.json")
    output.write_text(json.dumps(report, indent=2))
    what = (
        "greedy pass@1"
        if args.protocol == "greedy"
        else f"sampled, T={args.temperature}, {args.samples} per problem"
    )
    print(f"{args.dataset} {args.split} ({result.num_problems} problems, {what}), {model_dir}:")
    print(
        f"  accuracy {result.accuracy:.2%}   format {result.format_accuracy:.2%}   both {result.correct_and_formatted:.2%}"
    )
    print(f"  report written to {output} ({result.seconds:.0f} s)")
    return 0


def eval_engine(requested: str, model, tokenizer, dataset, max_new_tokens: int, batch_size: int):
    """The rollout engine ``pods eval`` samples with (``auto``: vLLM where it can run); says which."""
    from pods.config import ConfigError
    from pods.prompts import render_prompt
    from pods.rollout import build_engine, choose_engine

    try:
        name, reason = choose_engine(requested, model=model)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    print(f"rollout engine: {name} ({reason})")
    longest = max(
        (
            len(tokenizer(render_prompt(dataset[i]["prompt"], tokenizer))["input_ids"])
            for i in range(len(dataset))
        ),
        default=1,
    )
    return build_engine(
        name,
        model,
        tokenizer,
        generation_batch_size=batch_size,
        vllm_options={"max_model_length": longest + max_new_tokens},
    )


def find_model_folder(name: str) -> str:
    """A model folder, hub name, ``embedded``, a checkpoint (uses its ``model/``) or a run (its newest intact checkpoint).

    A checkpoint's model files are checked against its manifest first: a damaged one is a clear error.
    """
    from pods.checkpoint import STATE_FILE, newest_intact_checkpoint, verify_checkpoint
    from pods.config import ConfigError
    from pods.models import resolve_model_path

    path = Path(name)
    if path.name == "model" and (path.parent / STATE_FILE).is_file():
        path = path.parent
    if (path / STATE_FILE).is_file():
        verify_checkpoint(path, under="model")
        return str(path / "model")
    if (path / "checkpoints").is_dir():
        warn = lambda text: print(f"pods eval: warning: {text}", file=sys.stderr)  # noqa: E731
        found = newest_intact_checkpoint(path / "checkpoints", warn=warn)
        if found is None:
            raise ConfigError(f"--model {name}: this run folder has no intact checkpoint")
        return str(found / "model")
    return resolve_model_path(name)


def load_model_for_eval(model_dir: str):
    """Load safetensors weights only, never running a model's own code; a broken folder is a clear error."""
    import torch

    from pods.config import ConfigError

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if (Path(model_dir) / "adapter_config.json").is_file():
            from peft import AutoPeftModelForCausalLM

            return AutoPeftModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, use_safetensors=True, trust_remote_code=False
        )
    except Exception as error:  # safetensors, OSError, ValueError, ...: name the folder and the cause
        raise ConfigError(
            f"--model {model_dir}: cannot load the model ({type(error).__name__}: {_first_line(error)}); "
            "the folder may be damaged or incomplete (pods eval reads model.safetensors only and never runs "
            "a model's own code)"
        ) from None
    return model.to(device).eval()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"


# ---------------------------------------------------------------------------------------------- sweep
def _sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.sweep import SWEEP_SETS, grid_arms, parse_arm, parse_grid, run_sweep

    grid = [parse_grid(spec) for spec in args.grid or []]
    arms = grid_arms(grid) if grid else []
    arms += [parse_arm(spec) for spec in args.arm or []]
    if not arms:
        raise SystemExit("pods sweep: error: give --grid KEY=V1,V2,... and/or --arm NAME:KEY=VALUE,...")
    per_arm = {key for arm in arms for key in arm.overrides} | set(SWEEP_SETS) | {"eval_at_start"}
    _reject_per_arm_keys(overrides, tuple(per_arm), "pods sweep", "put the values in --grid or --arm")
    config = load_train_config(args.config or "compare-embedded", overrides)
    quiet_libraries()
    output = _experiment_folder(args, "sweep")
    summary = run_sweep(
        config,
        arms,
        _seeds(args.seeds),
        output,
        baseline=args.baseline,
        target=args.target,
        swept_keys=[key for key, _ in grid],
        resume_command=_resume_command(args, output),
    )
    return _report(summary, output)


def _compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.compare import ARM_KEYS, run_comparison

    _reject_per_arm_keys(overrides, ARM_KEYS, "pods compare", "choose --arms")
    config = load_train_config(args.config or "compare-embedded", overrides)
    quiet_libraries()
    output = _experiment_folder(args, "compare")
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    summary = run_comparison(
        config, output, arms, _seeds(args.seeds), resume_command=_resume_command(args, output)
    )
    return _report(summary, output)


def _reject_per_arm_keys(overrides: list[str], keys: tuple[str, ...], command: str, hint: str) -> None:
    """An override of a key that every arm sets itself would be silently ignored: refuse it."""
    from pods.config import ConfigError, parse_overrides

    for key in parse_overrides(overrides):
        if key in keys:
            fix = {"seed": "use --seeds 0,1,...", "output_dir": "use --output FOLDER"}.get(key, hint)
            raise ConfigError(f"--{key} is set per arm by {command}, so it cannot be overridden; {fix}")


def _experiment_folder(args: argparse.Namespace, kind: str) -> Path:
    from datetime import datetime

    return Path(args.output or Path("runs") / f"{kind}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")


def _seeds(text: str) -> list[int]:
    from pods.config import ConfigError

    try:
        return [int(seed) for seed in text.split(",") if seed.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2") from None


def _resume_command(args: argparse.Namespace, output: Path) -> str:
    """The command that continues this experiment: the same arguments, with its output folder named."""
    import shlex

    words = list(args.argv)
    if not args.output:
        words += ["--output_dir", str(output)]
    return "pods " + shlex.join(words)


def _report(summary: dict, output: Path) -> int:
    from pods.sweep import format_summary

    print("\n" + format_summary(summary))
    written = [output / "summary.json", output / "evaluations.csv", *sorted(output.glob("accuracy_vs_*.png"))]
    print("\nWritten: " + ", ".join(str(path) for path in written))
    return 0


def _add_experiment_options(parser: argparse.ArgumentParser, seeds: str) -> None:
    parser.add_argument("--config", help="a preset name or YAML file (default: compare-embedded)")
    parser.add_argument("--seeds", default=seeds, help=f"comma-separated seeds (default: {seeds})")
    _option(
        parser,
        "output",
        "--output_dir",
        "--output-dir",
        help="experiment folder (default: runs/<kind>-<time>); re-run with the same folder to continue",
    )


# ---------------------------------------------------------------------------------------------- plot
def _plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.plotting import plot_runs

    output = Path(args.output) if args.output else Path(args.runs[0]) / "training.png"
    print(f"wrote {plot_runs(args.runs, output)}")
    return 0


# ---------------------------------------------------------------------------------------------- demo
def _demo(args: argparse.Namespace, overrides: list[str]) -> int:
    """Show what each selection rule keeps from a random binary/partial-credit reward matrix."""
    import torch

    from pods.config import ConfigError
    from pods.selection import available_rules, select, subset_variance

    if not 1 <= args.m <= args.n or args.groups < 1:
        raise ConfigError(
            f"--m must be between 1 and --n, and --groups at least 1; got m={args.m}, n={args.n}, groups={args.groups}"
        )
    generator = torch.Generator().manual_seed(args.seed)
    levels = torch.tensor([0.0, 0.1, 1.0, 1.2])
    rewards = levels[torch.randint(len(levels), (args.groups, args.n), generator=generator)]
    print(
        f"{args.groups} groups x n={args.n} rollouts, keeping m={args.m} per group (rewards from {levels.tolist()})"
    )
    for group in range(args.groups):
        print(f"\ngroup {group}: rewards {[round(r, 1) for r in rewards[group].tolist()]}")
        for rule in available_rules():
            if rule == "all" and args.m != args.n:
                continue
            kept = select(rewards[group : group + 1], args.m, rule, generator=generator)
            var = subset_variance(rewards[group : group + 1], kept).item()
            values = [round(r, 1) for r in rewards[group, kept[0]].tolist()]
            print(f"  {rule:<13} keeps {kept[0].tolist()} -> rewards {values}  variance {var:.3f}")
    return 0


# ---------------------------------------------------------------------------------------------- parser
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


def _option(parser: argparse.ArgumentParser, name: str, *more: str, **kwargs) -> None:
    """Add ``--name`` under both spellings, ``--max_new_tokens`` and ``--max-new-tokens``, as for
    configuration keys (the docs write underscores)."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, *more, dest=name, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pods",
        description="PODS: GRPO that generates n rollouts per prompt and trains on the m most informative.",
    )
    parser.add_argument("--version", action="version", version=f"pods {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="RL fine-tuning with PODS (default: the embedded arithmetic demo on a CPU, ~5 minutes)",
        description="Train with GRPO + PODS. With no arguments: the embedded CPU demo (configs/embedded.yaml).",
        epilog=_config_keys_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="a preset name or a YAML file (default: the built-in defaults)")
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser(
        "eval", allow_abbrev=False, help="accuracy of a model or checkpoint on a test set"
    )
    evaluate.add_argument(
        "--model", required=True, help="model folder, hub name, 'embedded', checkpoint or run folder"
    )
    evaluate.add_argument("--dataset", required=True, help="gsm8k, math500, arith (or a registered task)")
    evaluate.add_argument("--source", help="hub name or local file/folder of the dataset (default: the hub)")
    evaluate.add_argument("--split", default="test")
    evaluate.add_argument(
        "--protocol",
        choices=("greedy", "sampled"),
        default="greedy",
        help="greedy pass@1 (community convention) or the paper's sampled average (default: greedy)",
    )
    evaluate.add_argument("--samples", type=int, default=5, help="samples per problem for --protocol sampled")
    evaluate.add_argument(
        "--temperature", type=float, default=0.9, help="for --protocol sampled (default: 0.9)"
    )
    evaluate.add_argument("--limit", type=int, help="evaluate on the first N problems only")
    _option(evaluate, "max_new_tokens", type=int, help="default: the task's (32 for arith, 512 otherwise)")
    _option(evaluate, "batch_size", type=int, default=64, help="completions generated at once")
    _option(
        evaluate,
        "prompt_style",
        choices=("chat", "plain", "raw"),
        help="default: the task's (plain for arith; chat when the tokenizer has a chat template)",
    )
    _option(
        evaluate,
        "rollout_engine",
        choices=("auto", "hf", "vllm"),
        default="auto",
        help="auto: vLLM where it is installed and can run, else Hugging Face generate (default: auto)",
    )
    evaluate.add_argument("--output", help="JSON report path (default: eval-DATASET-PROTOCOL.json)")
    evaluate.set_defaults(handler=_eval)

    compare = commands.add_parser(
        "compare",
        allow_abbrev=False,
        help="GRPO vs PODS side by side under the same wall-clock budget; plot and speed-up",
        description="Run GRPO (n = m) and PODS (n = 4m) with the same seeds and training-time budget, "
        "evaluating periodically (evaluation excluded from the clock); report accuracies and speed-ups "
        "with 95% intervals over seeds. A pods sweep with named arms and GRPO as the baseline.",
        epilog="Any configuration key can be overridden as --key value, as for pods train, except those set per "
        "arm (num_generations, selection_rule, seed, output_dir, resume_from, eval_at_start).",
    )
    compare.add_argument("--arms", default="grpo,pods", help="comma-separated: grpo,pods,random,max_reward")
    _add_experiment_options(compare, seeds="0,1")
    compare.set_defaults(handler=_compare)

    sweep = commands.add_parser(
        "sweep",
        allow_abbrev=False,
        help="a grid over one or two configuration keys x seeds; accuracies and speed-ups with intervals",
        description="Train every arm (a grid value, or a named arm) for every seed under the same "
        "training-time budget, evaluation off the clock; write every evaluation (CSV), a summary with 95% "
        "intervals over seeds (accuracy at the budget, best accuracy, time to target, speed-ups against the "
        "baseline arm per second and per step) and plots. Interrupted? Run the same command again: finished "
        "runs are kept and the unfinished one resumes. See docs/experiments.md.",
        epilog="Examples:\n"
        "  pods sweep --grid num_generations=4,8,16,32,64 --seeds 0,1,2\n"
        "  pods sweep --grid selection_rule=max_variance,random,max_reward "
        "--arm grpo:num_generations=4,selection_rule=all --baseline grpo\n"
        "  pods sweep --grid learning_rate=2e-5,5e-5,1e-4 --grid num_generations=4,16\n"
        "Any configuration key can be overridden as --key value, as for pods train.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument(
        "--grid",
        action="append",
        help="KEY=V1,V2,... (repeat once for a second key: the arms are the product)",
    )
    sweep.add_argument(
        "--arm", action="append", help="NAME:KEY=VALUE,KEY=VALUE: a named arm next to the grid (repeatable)"
    )
    sweep.add_argument(
        "--baseline",
        help="the arm the speed-ups are measured against (default: the first arm), or KEY=VALUE naming some "
        "grid keys: each arm against the arm with that value and its own other keys (e.g. num_generations=4 "
        "in a learning_rate x num_generations grid: each n against n=4 at the same learning rate)",
    )
    sweep.add_argument(
        "--target", type=float, help="accuracy to time (default: 99%% of the baseline's smoothed peak)"
    )
    _add_experiment_options(sweep, seeds="0,1,2")
    sweep.set_defaults(handler=_sweep)

    plot = commands.add_parser(
        "plot", allow_abbrev=False, help="redraw accuracy and reward against time and steps from saved runs"
    )
    plot.add_argument("runs", nargs="+", help="run folders written by pods train")
    plot.add_argument("--output", help="PNG path (default: FIRST_RUN/training.png)")
    plot.set_defaults(handler=_plot)

    demo = commands.add_parser(
        "demo", allow_abbrev=False, help="show what each down-sampling rule keeps from random rewards"
    )
    demo.add_argument("--groups", type=int, default=3, help="number of groups (prompts) (default: 3)")
    demo.add_argument("--n", type=int, default=8, help="rollouts per group (default: 8)")
    demo.add_argument("--m", type=int, default=4, help="rollouts kept per group (default: 4)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if extra and args.command not in ("train", "compare", "sweep"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from pods.checkpoint import CheckpointWriteError
    from pods.config import ConfigError
    from pods.scoring import RewardFunctionError
    from pods.sweep import SweepInterrupted
    from pods.trainer import NonFiniteError

    try:
        return args.handler(args, extra)
    # pods' own errors for input that cannot run (ConfigError: bad configuration, data, model or checkpoint)
    # or for a run that cannot go on; anything else is a bug and keeps its traceback.
    except (ConfigError, RewardFunctionError, NonFiniteError, CheckpointWriteError) as error:
        print(f"pods {args.command}: error: {error}", file=sys.stderr)
        return 2
    except SweepInterrupted as stopped:
        print(f"\npods {args.command}: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt:
        resume = (
            " (pods train: the step in flight is lost; --resume_from auto continues from the last checkpoint)"
        )
        print(f"\npods {args.command}: aborted{resume if args.command == 'train' else ''}", file=sys.stderr)
        return 130


def quiet_libraries() -> None:
    """Quiet the libraries' own chatter (weight-loading bars, save notices) so the run's output reads."""
    import logging

    import transformers

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    raise SystemExit(main())
