"""``pods compare`` and ``pods sweep``: several arms x seeds under one budget, summarised with intervals."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pods.cli.common import load_train_config, option, quiet_libraries
from pods.errors import ConfigError


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``pods compare`` and ``pods sweep`` to the command line."""
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
    compare.set_defaults(handler=run_compare)

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
        "Any configuration key can be overridden as --key value, as for pods train. Evaluations run every\n"
        "eval_every_seconds and at the times in eval_at_seconds (compare-embedded: 1, 2, 3, 4, 6, 8 s); for\n"
        "evenly spaced ones only, give both: --eval_every_seconds 3 --eval_at_seconds null.",
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
        "--target",
        type=float,
        help="accuracy to time (default: 99%% of the baseline's plateau, its mean over the last third of the run)",
    )
    _add_experiment_options(sweep, seeds="0,1,2")
    sweep.set_defaults(handler=run_sweep_command)


def sweep_plan(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """What ``pods sweep`` would train (run_sweep's arguments), every setting checked; trains nothing."""
    from pods.sweep import SWEEP_SETS, check_plan, grid_arms, parse_arm, parse_grid

    grid = [parse_grid(spec) for spec in args.grid or []]
    arms = grid_arms(grid) if grid else []
    arms += [parse_arm(spec) for spec in args.arm or []]
    if not arms:
        raise ConfigError("give --grid KEY=V1,V2,... and/or --arm NAME:KEY=VALUE,...")
    per_arm = {key for arm in arms for key in arm.overrides} | set(SWEEP_SETS) | {"eval_at_start"}
    _reject_per_arm_keys(overrides, tuple(per_arm), "pods sweep", "put the values in --grid or --arm")
    config = load_train_config(args.config or "compare-embedded", overrides)
    seeds, output = _seeds(args.seeds), _experiment_folder(args, "sweep")
    check_plan(config, arms, seeds, output, args.baseline)
    swept_keys = [key for key, _ in grid]
    return dict(base=config, arms=arms, seeds=seeds, output_dir=output, baseline=args.baseline,
                target=args.target, swept_keys=swept_keys, reuse_from=_reuse_from(args))  # fmt: skip


def compare_plan(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """What ``pods compare`` would train (run_sweep's arguments), every setting checked; trains nothing."""
    from pods.compare import ARM_KEYS, BASELINE, compare_arms
    from pods.sweep import check_plan

    _reject_per_arm_keys(overrides, ARM_KEYS, "pods compare", "choose --arms")
    config = load_train_config(args.config or "compare-embedded", overrides)
    arms = compare_arms(config, [arm.strip() for arm in args.arms.split(",") if arm.strip()])
    seeds, output = _seeds(args.seeds), _experiment_folder(args, "compare")
    check_plan(config, arms, seeds, output, BASELINE)
    return dict(
        base=config,
        arms=arms,
        seeds=seeds,
        output_dir=output,
        baseline=BASELINE,
        reuse_from=_reuse_from(args),
    )


def run_sweep_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.sweep import run_sweep

    plan = sweep_plan(args, overrides)
    quiet_libraries()
    summary = run_sweep(**plan, resume_command=_resume_command(args, plan["output_dir"]))
    return _report(summary, plan["output_dir"])


def run_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.sweep import run_sweep

    plan = compare_plan(args, overrides)
    quiet_libraries()
    summary = run_sweep(**plan, resume_command=_resume_command(args, plan["output_dir"]))
    return _report(summary, plan["output_dir"])


def _reject_per_arm_keys(overrides: list[str], keys: tuple[str, ...], command: str, hint: str) -> None:
    """An override of a key that every arm sets itself would be silently ignored: refuse it."""
    from pods.config import parse_overrides

    for key in parse_overrides(overrides):
        if key in keys:
            fix = {"seed": "use --seeds 0,1,...", "output_dir": "use --output FOLDER"}.get(key, hint)
            raise ConfigError(f"--{key} is set per arm by {command}, so it cannot be overridden; {fix}")


def _experiment_folder(args: argparse.Namespace, kind: str) -> Path:
    from datetime import datetime

    return Path(args.output or Path("runs") / f"{kind}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")


def _seeds(text: str) -> list[int]:
    try:
        return [int(seed) for seed in text.split(",") if seed.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2") from None


def _reuse_from(args: argparse.Namespace) -> list[Path]:
    folders = [Path(folder) for folder in args.reuse_from or []]
    for folder in folders:
        if not folder.is_dir():
            raise ConfigError(
                f"--reuse_from {folder}: no such folder; name the output folder of an earlier sweep or compare"
            )
    return folders


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
    option(
        parser,
        "output",
        "--output_dir",
        "--output-dir",
        help="experiment folder (default: runs/<kind>-<time>); re-run with the same folder to continue",
    )
    option(
        parser,
        "reuse_from",
        action="append",
        metavar="FOLDER",
        help="an earlier sweep's or compare's folder (repeatable): a run with the same settings and seed "
        "finished there is linked into this experiment instead of trained again",
    )
