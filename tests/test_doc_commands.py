"""Every ``pods`` command the README and docs show is one pods accepts: its options parse, its configuration
(preset, overrides, arms, seeds, baseline) passes the checks the command makes before it trains anything."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pods.cli import build_parser, load_train_config
from pods.cli.experiments import compare_plan, sweep_plan
from pods.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")
COMMAND = re.compile(r"(?:^|[\s/])pods ((?:train|eval|compare|sweep|plot|demo)(?=\s|$).*)")
SYNOPSIS = re.compile(r"\[|\.\.\.|\||[A-Z]{3,}=|=V1")  # `pods sweep --grid KEY=V1,... [--seeds ...]`


def shown_commands(text: str) -> list[str]:
    """The pods commands in a document's code blocks and `code` spans, as the words after ``pods``. Left out:
    a synopsis (``[--key value]``, ``KEY=V1,...``), and a span of fewer than three words, which names a
    command in prose (`pods eval`, `pods eval --model`) rather than showing one."""
    lines = [(line, 1) for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()]
    lines += [(span.replace("\n", " "), 3) for span in SPAN.findall(FENCE.sub("", text))]
    commands = []
    for line, least_words in lines:
        line = re.split(r"\s#|&&|\s>|\s&$|\s&\s", line)[0]
        match = COMMAND.search(line)
        if match and not SYNOPSIS.search(match.group(1)) and len(match.group(1).split()) >= least_words:
            commands.append(" ".join(re.sub(r"<[^>]*>", "x", match.group(1)).split()))
    return commands


def check_command(words: list[str]) -> None:
    """What ``pods`` does with these words before it trains or loads anything."""
    args, extra = build_parser().parse_known_args(words)
    if args.command == "train":
        load_train_config(args.config, extra)
    elif args.command == "compare":
        compare_plan(args, extra)
    elif args.command == "sweep":
        sweep_plan(args, extra)
    else:
        assert not extra, f"pods {args.command} does not take {extra}"


COMMANDS = sorted({(doc.name, cmd) for doc in DOCUMENTS for cmd in shown_commands(doc.read_text())})


@pytest.mark.parametrize(("document", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_every_command_the_docs_show_is_accepted(document: str, command: str) -> None:
    try:
        check_command(shlex.split(command))
    except (ConfigError, SystemExit) as error:
        pytest.fail(f"{document} shows `pods {command}`, which pods refuses: {error}")


def test_the_docs_show_every_command_and_the_check_catches_refused_ones() -> None:
    shown = {command.split()[0] for _, command in COMMANDS}
    assert shown >= {"train", "eval", "compare", "sweep"}
    text = (
        "```bash\n.venv/bin/pods compare --seeds 0 --num_generations 8 \\\n  --max_time 30  # the old form\n```\n"
        "and `pods sweep --grid num_generations=4,8 --baseline n=2`, `pods train --config nope`, "
        "`pods sweep --grid KEY=V1,... [--seeds ...]`, `pods eval` and `pods eval --model` in prose"
    )
    found = shown_commands(text)
    assert found == [  # the synopsis is left out, the comment and the continuation handled
        "compare --seeds 0 --num_generations 8 --max_time 30",
        "sweep --grid num_generations=4,8 --baseline n=2",
        "train --config nope",
    ]
    refusals = {
        found[0]: "num_generations is set per arm by pods compare",
        found[1]: "--baseline 'n=2' is not an arm and no arm has those values",
        found[2]: "--config nope: no such file or preset",
    }
    for command, message in refusals.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_command(shlex.split(command))
