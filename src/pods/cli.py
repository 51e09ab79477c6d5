"""The ``pods`` command line: one sub-command per job, each a thin layer over the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pods import __version__


def _demo(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pods",
        description="PODS: GRPO that generates n rollouts per prompt and trains on the m most informative.",
    )
    parser.add_argument("--version", action="version", version=f"pods {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser("demo", help="show what each down-sampling rule keeps from random rewards")
    demo.add_argument("--groups", type=int, default=3, help="number of groups (prompts) (default: 3)")
    demo.add_argument("--n", type=int, default=8, help="rollouts per group (default: 8)")
    demo.add_argument("--m", type=int, default=4, help="rollouts kept per group (default: 4)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"pods {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
