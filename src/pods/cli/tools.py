"""``pods plot`` (redraw a run's curves) and ``pods demo`` (what each selection rule keeps)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pods.errors import ConfigError


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``pods plot`` and ``pods demo`` to the command line."""
    plot = commands.add_parser(
        "plot", allow_abbrev=False, help="redraw accuracy and reward against time and steps from saved runs"
    )
    plot.add_argument("runs", nargs="+", help="run folders written by pods train")
    plot.add_argument("--output", help="PNG path (default: FIRST_RUN/training.png, or timeline.png)")
    plot.add_argument(
        "--timeline",
        metavar="FIRST,LAST",
        help="instead: when each phase of these steps ran, per process and run (e.g. 5,15)",
    )
    plot.set_defaults(handler=run_plot)

    demo = commands.add_parser(
        "demo", allow_abbrev=False, help="show what each down-sampling rule keeps from random rewards"
    )
    demo.add_argument("--groups", type=int, default=3, help="number of groups (prompts) (default: 3)")
    demo.add_argument("--n", type=int, default=8, help="rollouts per group (default: 8)")
    demo.add_argument("--m", type=int, default=4, help="rollouts kept per group (default: 4)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.set_defaults(handler=run_demo)


def run_plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from pods.plotting import plot_runs, plot_timeline

    if args.timeline:
        try:
            first, last = (int(step) for step in args.timeline.split(","))
        except ValueError:
            raise ConfigError(
                f"--timeline takes the first and last step, e.g. 5,15; got {args.timeline!r}"
            ) from None
        output = Path(args.output) if args.output else Path(args.runs[0]) / "timeline.png"
        print(f"wrote {plot_timeline(args.runs, output, (first, last))}")
        return 0
    output = Path(args.output) if args.output else Path(args.runs[0]) / "training.png"
    print(f"wrote {plot_runs(args.runs, output)}")
    return 0


# ---------------------------------------------------------------------------------------------- demo
def run_demo(args: argparse.Namespace, overrides: list[str]) -> int:
    """Show what each selection rule keeps from a random binary/partial-credit reward matrix."""
    import torch

    from pods.selection import available_rules, select, subset_variance

    if not 1 <= args.m <= args.n or args.groups < 1:
        raise ConfigError(
            f"--m must be between 1 and --n, and --groups at least 1; got m={args.m}, n={args.n}, groups={args.groups}"
        )
    generator = torch.Generator().manual_seed(args.seed)
    levels = [0.0, 0.1, 1.0, 1.2]  # printed as written (a float32 tensor's 0.1 prints as 0.10000000149011612)
    rewards = torch.tensor(levels)[torch.randint(len(levels), (args.groups, args.n), generator=generator)]
    lengths = torch.randint(5, 40, (args.groups, args.n), generator=generator)  # completion tokens
    print(
        f"{args.groups} groups x n={args.n} rollouts, keeping m={args.m} per group (rewards from {levels}, "
        "lengths 5-39 tokens)"
    )
    for group in range(args.groups):
        print(f"\ngroup {group}: rewards {[round(r, 1) for r in rewards[group].tolist()]}")
        print(f"         lengths {lengths[group].tolist()}")
        for rule in available_rules():
            if rule == "all" and args.m != args.n:
                continue
            one = slice(group, group + 1)
            kept = select(rewards[one], args.m, rule, generator=generator, lengths=lengths[one])
            var = subset_variance(rewards[one], kept).item()
            values = [round(r, 1) for r in rewards[group, kept[0]].tolist()]
            tokens = int(lengths[group, kept[0]].sum())
            print(
                f"  {rule:<21} keeps {kept[0].tolist()} -> rewards {values}  variance {var:.3f}  tokens {tokens}"
            )
    return 0
