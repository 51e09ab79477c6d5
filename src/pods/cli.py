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
    from pods.plotting import plot_runs
    from pods.trainer import train

    config = load_train_config(args.config, overrides)
    quiet_libraries()
    result = train(config)
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


# ---------------------------------------------------------------------------------------------- eval
def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.data import load_task
    from pods.evaluation import evaluate
    from pods.models import load_tokenizer
    from pods.rewards import REWARD_FUNCTIONS
    from pods.trainer import ACCURACY_REWARDS

    if overrides:
        raise SystemExit(f"pods eval: error: unrecognized arguments: {' '.join(overrides)}")
    quiet_libraries()
    model_dir = find_model_folder(args.model)
    model = load_model_for_eval(model_dir)
    tokenizer = load_tokenizer(model_dir)
    style = args.prompt_style or (
        "plain" if args.dataset == "arith" or not tokenizer.chat_template else "chat"
    )
    max_new_tokens = args.max_new_tokens or (32 if args.dataset == "arith" else 512)
    dataset = load_task(args.dataset, args.split, source=args.source, prompt_style=style, limit=args.limit)
    result = evaluate(
        model,
        tokenizer,
        dataset,
        REWARD_FUNCTIONS[ACCURACY_REWARDS.get(args.dataset, "accuracy")],
        protocol=args.protocol,
        samples=args.samples,
        temperature=args.temperature,
        max_new_tokens=max_new_tokens,
        batch_size=args.batch_size,
        prompt_style=style,
        progress=True,
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


def find_model_folder(name: str) -> str:
    """A model folder, hub name, ``embedded``, a checkpoint (uses its ``model/``) or a run (its latest checkpoint)."""
    from pods.checkpoint import latest_checkpoint
    from pods.models import resolve_model_path

    path = Path(name)
    if (path / "trainer_state.json").is_file():
        return str(path / "model")
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path / "checkpoints")
        if latest is None:
            from pods.config import ConfigError

            raise ConfigError(f"--model {name}: this run folder has no complete checkpoint yet")
        return str(latest / "model")
    return resolve_model_path(name)


def load_model_for_eval(model_dir: str):
    import torch

    if (Path(model_dir) / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(model_dir).eval()
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


# ---------------------------------------------------------------------------------------------- sweep
def _sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.sweep import grid_arms, parse_arm, parse_grid, run_sweep

    grid = [parse_grid(spec) for spec in args.grid or []]
    arms = grid_arms(grid) if grid else []
    arms += [parse_arm(spec) for spec in args.arm or []]
    if not arms:
        raise SystemExit("pods sweep: error: give --grid KEY=V1,V2,... and/or --arm NAME:KEY=VALUE,...")
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
    from pods.compare import run_comparison

    config = load_train_config(args.config or "compare-embedded", overrides)
    quiet_libraries()
    output = _experiment_folder(args, "compare")
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    summary = run_comparison(
        config, output, arms, _seeds(args.seeds), resume_command=_resume_command(args, output)
    )
    return _report(summary, output)


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
    parser.add_argument(
        "--output",
        "--output_dir",
        "--output-dir",
        dest="output",
        help="experiment folder (default: runs/<kind>-<time>); re-run with the same folder to continue",
    )


# ---------------------------------------------------------------------------------------------- plot
def _plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.plotting import plot_runs

    if overrides:
        raise SystemExit(f"pods plot: error: unrecognized arguments: {' '.join(overrides)}")
    output = Path(args.output) if args.output else Path(args.runs[0]) / "training.png"
    print(f"wrote {plot_runs(args.runs, output)}")
    return 0


# ---------------------------------------------------------------------------------------------- demo
def _demo(args: argparse.Namespace, overrides: list[str]) -> int:
    """Show what each selection rule keeps from a random binary/partial-credit reward matrix."""
    import torch

    from pods.selection import available_rules, select, subset_variance

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
        "Any configuration key can be set as --key value (or key=value), after --config.\n"
        f"Presets (--config NAME): {', '.join(preset_names())}.\nKeys and defaults: "
        + ", ".join(fields)
        + "\n"
        "See docs/configuration.md for what each key means."
    )


def _default_of(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        return str(field.default_factory())
    return str(field.default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pods",
        description="PODS: GRPO that generates n rollouts per prompt and trains on the m most informative.",
    )
    parser.add_argument("--version", action="version", version=f"pods {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="RL fine-tuning with PODS (default: the embedded arithmetic demo on a CPU, ~5 minutes)",
        description="Train with GRPO + PODS. With no arguments: the embedded CPU demo (configs/embedded.yaml).",
        epilog=_config_keys_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="a preset name or a YAML file (default: the built-in defaults)")
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser("eval", help="accuracy of a model or checkpoint on a test set")
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
    evaluate.add_argument("--max-new-tokens", type=int, help="default: 32 for arith, 512 otherwise")
    evaluate.add_argument("--batch-size", type=int, default=64, help="completions generated at once")
    evaluate.add_argument(
        "--prompt-style",
        choices=("chat", "plain"),
        help="default: chat when the tokenizer has a chat template",
    )
    evaluate.add_argument("--output", help="JSON report path (default: eval-DATASET-PROTOCOL.json)")
    evaluate.set_defaults(handler=_eval)

    compare = commands.add_parser(
        "compare",
        help="GRPO vs PODS side by side under the same wall-clock budget; plot and speed-up",
        description="Run GRPO (n = m) and PODS (n = 4m) with the same seeds and training-time budget, "
        "evaluating periodically (evaluation excluded from the clock); report accuracies and speed-ups "
        "with 95% intervals over seeds. A pods sweep with named arms and GRPO as the baseline.",
        epilog="Any configuration key can be overridden as --key value, as for pods train.",
    )
    compare.add_argument("--arms", default="grpo,pods", help="comma-separated: grpo,pods,random,max_reward")
    _add_experiment_options(compare, seeds="0,1")
    compare.set_defaults(handler=_compare)

    sweep = commands.add_parser(
        "sweep",
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
        "--baseline", help="the arm the speed-ups are measured against (default: the first arm)"
    )
    sweep.add_argument(
        "--target", type=float, help="accuracy to time (default: 99%% of the baseline's smoothed peak)"
    )
    _add_experiment_options(sweep, seeds="0,1,2")
    sweep.set_defaults(handler=_sweep)

    plot = commands.add_parser(
        "plot", help="redraw accuracy and reward against time and steps from saved runs"
    )
    plot.add_argument("runs", nargs="+", help="run folders written by pods train")
    plot.add_argument("--output", help="PNG path (default: FIRST_RUN/training.png)")
    plot.set_defaults(handler=_plot)

    demo = commands.add_parser("demo", help="show what each down-sampling rule keeps from random rewards")
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
    from pods.config import ConfigError
    from pods.scoring import RewardFunctionError
    from pods.sweep import SweepInterrupted

    try:
        return args.handler(args, extra)
    except (ConfigError, RewardFunctionError, ValueError, FileNotFoundError, ImportError) as error:
        print(f"pods {args.command}: error: {error}", file=sys.stderr)
        return 2
    except SweepInterrupted as stopped:
        print(f"\npods {args.command}: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt:
        print(f"\npods {args.command}: interrupted", file=sys.stderr)
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
