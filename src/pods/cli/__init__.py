"""The ``pods`` command line: one sub-command per job, each a thin layer over the library.

``train`` (:mod:`pods.cli.train`), ``eval`` (:mod:`pods.cli.evaluate`), ``compare`` and ``sweep``
(:mod:`pods.cli.experiments`), ``plot`` and ``demo`` (:mod:`pods.cli.tools`); what they share is in
:mod:`pods.cli.common`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pods import __version__
from pods.cli import evaluate, experiments, tools, train
from pods.cli.common import PRESETS_DIR, load_train_config, preset_names, quiet_libraries, resolve_config_path
from pods.cli.train import resume_command

__all__ = [
    "PRESETS_DIR",
    "build_parser",
    "load_train_config",
    "main",
    "preset_names",
    "quiet_libraries",
    "resolve_config_path",
    "resume_command",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pods",
        description="PODS: GRPO that generates n rollouts per prompt and trains on the m most informative.",
    )
    parser.add_argument("--version", action="version", version=f"pods {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (train, evaluate, experiments, tools):
        module.register(commands)
    return parser


def run() -> None:
    """The ``pods`` command: :func:`main` on ``sys.argv``, ending the process without the interpreter's
    teardown (:func:`pods.process_exit.exit_process`)."""
    from pods.process_exit import exit_process

    exit_process(main())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if extra and args.command not in ("train", "compare", "sweep"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from pods.errors import USER_ERRORS
    from pods.sweep import SweepInterrupted

    try:
        return args.handler(args, extra)
    # pods' own errors for input that cannot run (ConfigError: bad configuration, data, model or checkpoint)
    # or for a run that cannot go on; anything else is a bug and keeps its traceback.
    except USER_ERRORS as error:
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
