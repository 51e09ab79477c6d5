"""Your own data by name or path (TRL's ``dataset_name``): a Hub dataset, or a local ``.jsonl`` / ``.json`` /
``.parquet`` / ``.csv`` file (its one split, ``train``) or a folder with a file per split (``train.jsonl``,
``test.csv``, ``train-*.parquet`` shards, ...).

Rows in TRL's formats work as they are: ``prompt`` as text (standard) or as chat messages (conversational).
Other layouts name their ``prompt_column``, or build the prompt from a ``prompt_template`` with ``{column}``
fields; ``answer_column`` copies a column into ``answer``, which the built-in checkers read. Every column stays
on the row, so each reaches the reward functions as a keyword, as in TRL.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

from pods.data.common import (
    LOCAL_SUFFIXES,
    HubUnavailableError,
    MissingDataError,
    Record,
    TaskDataError,
    is_local_source,
    read_file,
    split_files,
)
from pods.prompts import render_prompt

__all__ = [
    "build_prompt",
    "dataset_splits",
    "fill_template",
    "load_dataset_rows",
    "read_split",
    "with_every_column",
]

_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")  # every other column reaches rewards as is
_LOCAL_FILE_SPLIT = "train"  # a single file is one split, named as datasets.load_dataset names it


def dataset_splits(name: str, config: str | None = None) -> list[str]:
    """The splits a dataset has: a file's one (``train``), a folder's file names, a Hub dataset's splits."""
    if not is_local_source(name):
        return sorted(_hub_dataset(name, config))
    path = _existing(name, config)
    if path.is_file():
        return [_LOCAL_FILE_SPLIT]
    names = set()
    for suffix in LOCAL_SUFFIXES:
        names |= {p.name[: -len(suffix)] for p in path.rglob(f"*{suffix}") if p.is_file()}
    return sorted({n.split("-", 1)[0] if re.search(r"-\d+-of-\d+$", n) else n for n in names})


def read_split(name: str, split: str, config: str | None = None) -> list[Record]:
    """Rows of ``split`` with where each came from; a split the source lacks names the splits it has."""
    splits = dataset_splits(name, config)
    if split not in splits:
        what = "a single file holds the one split 'train'" if _is_file(name) else f"it has {splits}"
        raise TaskDataError(
            f"dataset_name {name!r} has no split {split!r} ({what}); set dataset_train_split / "
            f"dataset_test_split to one of {splits}, or add a file named {split}.jsonl beside the others"
        )
    if not is_local_source(name):
        dataset = _hub_dataset(name, config)[split]
        return [(f"{name}[{split}] row {i}", dict(row)) for i, row in enumerate(dataset)]
    path = _existing(name, config)
    files = [path] if path.is_file() else _one_config_files(path, split, name)
    return [record for file in files for record in read_file(file)]


def _one_config_files(folder: Path, split: str, name: str) -> list[Path]:
    """``split``'s files in a folder without ``dataset_config``: those of one configuration. Files in several
    sub-folders (one per configuration, as a Hub snapshot lays them out) are refused, as ``datasets`` refuses a
    dataset with several configurations and no config name, instead of training on all of them merged."""
    files = split_files(folder, split)
    configs = sorted({_config_of(folder, file) for file in files})
    if len(configs) > 1:
        where = ", ".join(c or "(the folder itself)" for c in configs)
        example = next(c for c in configs if c)
        raise TaskDataError(
            f"dataset_name {name!r} holds split {split!r} in {len(configs)} configurations ({where}); pick one "
            f"with dataset_config (--dataset_config {example})"
        )
    return files


def _config_of(folder: Path, file: Path) -> str:
    """The configuration a split file belongs to: its sub-folder under ``folder``, as ``dataset_config`` names it
    ('' for the folder's own files and for ``data/``, where a Hub snapshot of one configuration keeps them)."""
    where = file.parent.relative_to(folder).as_posix()
    return "" if where in (".", "data") else where


def fill_template(template: str, row: dict[str, Any], where: str = "") -> str:
    """``template`` with each ``{column}`` replaced by the row's value (``{{`` and ``}}`` are literal braces)."""

    def field(match: re.Match[str]) -> str:
        if match.group(0) in ("{{", "}}"):
            return match.group(0)[0]
        column = match.group(1)
        if column not in row:
            raise TaskDataError(
                f"{where + ': ' if where else ''}prompt_template field {{{column}}} names no column; the "
                f"columns are {sorted(row)} (write {{{{ and }}}} for literal braces)"
            )
        return str(row[column])

    return _FIELD.sub(field, template)


def build_prompt(
    row: dict[str, Any],
    where: str,
    *,
    prompt_column: str = "prompt",
    prompt_template: str | None = None,
    system_prompt: str | None = None,
    chat: bool = False,
) -> str | list[dict[str, Any]]:
    """One row's prompt: text (as it is, or a user message when ``chat``) or chat messages, with ``system_prompt``
    as the first message of a conversation that has none."""
    if prompt_template is not None:
        prompt: Any = fill_template(prompt_template, row, where)
    elif prompt_column not in row:
        example = "{" + next(iter(row), "column") + "}"
        raise TaskDataError(
            f"{where}: no column {prompt_column!r}; the columns are {sorted(row)}: set prompt_column to the "
            f"one that holds the prompt, or prompt_template to build it, e.g. 'Question: {example}'"
        )
    else:
        prompt = row[prompt_column]
    if isinstance(prompt, str):
        if not chat:
            if system_prompt:
                raise TaskDataError(
                    f"system_prompt is a chat message, and {where} has a text prompt: set prompt_style: chat "
                    "(the text becomes the user message) or drop system_prompt"
                )
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise TaskDataError(
            f"{where}: the prompt must be text or chat messages [{{'role': ..., 'content': ...}}], got "
            f"{type(prompt).__name__}; choose another prompt_column or a prompt_template"
        )
    if system_prompt and not any(m.get("role") == "system" for m in prompt):
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    return [dict(m) for m in prompt]


def load_dataset_rows(
    name: str,
    split: str,
    *,
    config: str | None = None,
    prompt_column: str = "prompt",
    prompt_template: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = None,
    prompt_style: str | None = None,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    shuffle: bool = False,
) -> list[dict[str, Any]]:
    """``split`` of a dataset as rows with a ``prompt`` (and ``answer`` from ``answer_column``) beside every
    original column; prompts over ``max_prompt_tokens`` tokens dropped, then the first ``limit`` rows kept."""
    if prompt_style not in (None, "chat", "raw"):
        raise TaskDataError(
            f"prompt_style {prompt_style!r} is for the built-in tasks; with dataset_name use chat (text prompts "
            "become user messages) or leave it unset (prompts as they are)"
        )
    rows = []
    for where, row in read_split(name, split, config):
        row = dict(row)
        clash = sorted(set(row) & set(REWARD_ARGUMENTS))
        if clash:
            raise TaskDataError(
                f"{where}: column(s) {clash} would clash with the reward functions' own arguments "
                f"({', '.join(REWARD_ARGUMENTS)}); rename them in the file"
            )
        if answer_column is not None:
            if answer_column not in row or row[answer_column] is None:
                raise TaskDataError(
                    f"{where}: no column {answer_column!r} (answer_column); the columns are {sorted(row)}"
                )
            row["answer"] = str(row[answer_column])
        row["prompt"] = build_prompt(
            row,
            where,
            prompt_column=prompt_column,
            prompt_template=prompt_template,
            system_prompt=system_prompt,
            chat=prompt_style == "chat",
        )
        rows.append(row)
    rows = with_every_column(rows)
    if shuffle:
        random.Random(seed).shuffle(rows)
    if tokenizer is not None and rows:
        render_prompt(rows[0]["prompt"], tokenizer)  # a chat prompt without a chat template fails here
    if max_prompt_tokens is not None and tokenizer is not None and rows:
        texts = [render_prompt(row["prompt"], tokenizer) for row in rows]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        rows = [row for row, n in zip(rows, lengths, strict=True) if n <= max_prompt_tokens]
    return rows if limit is None else rows[:limit]


def with_every_column(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column of the split, None where a row lacks it (as ``datasets`` fills a JSONL whose
    rows have different keys), so that every batch hands each reward function the same keywords."""
    columns = dict.fromkeys(key for row in rows for key in row)
    return [{key: row.get(key) for key in columns} for row in rows]


def _is_file(name: str) -> bool:
    return is_local_source(name) and Path(name).expanduser().is_file()


def _existing(name: str, config: str | None = None) -> Path:
    """The local file or folder; with ``dataset_config``, the folder's sub-folder of that name (one per config)."""
    path = Path(name).expanduser()
    if not path.exists():
        raise MissingDataError(
            f"dataset_name {name!r}: no such file or folder; give a .jsonl, .json, .parquet or .csv file, a folder "
            "with one file per split (train.jsonl, test.jsonl), or a Hub dataset id (owner/name)"
        )
    if config is not None and path.is_dir():
        if not (path / config).is_dir():
            folders = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise MissingDataError(
                f"dataset_config {config!r}: {path} has no sub-folder {config!r} (it has {folders}); drop "
                "dataset_config or name one of them"
            )
        path = path / config
    return path


_HUB_CACHE: dict[tuple[str, str | None], Any] = {}


def _hub_dataset(name: str, config: str | None) -> Any:
    """Every split of a Hub dataset (``datasets.load_dataset(name, config)``, as TRL's script loads it), once."""
    if (name, config) in _HUB_CACHE:
        return _HUB_CACHE[name, config]
    import datasets

    try:
        loaded = datasets.load_dataset(name, config)
    except Exception as error:
        configs = _configs_to_pick(error)
        if configs is not None:  # several configurations, none the default: datasets' message on three lines
            raise TaskDataError(
                f"dataset_name {name!r} has several configurations ({configs}) and none is the default; pick one "
                "with dataset_config (--dataset_config NAME)"
            ) from error
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
        reason = (
            "the Hub is offline (HF_HUB_OFFLINE=1) and it is not cached" if offline else "it cannot be loaded"
        )
        message = (
            f"dataset_name {name!r} (dataset_config {config!r}): {reason} ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else 'no details'}); check the id and "
            "config, or give a local file or folder"
        )
        if offline or isinstance(error, ConnectionError | OSError):
            raise HubUnavailableError(message) from error
        raise TaskDataError(message) from error
    _HUB_CACHE[name, config] = loaded
    return loaded


def _configs_to_pick(error: Exception) -> str | None:
    """The configurations ``datasets`` lists when a dataset of several is loaded without a name, else None."""
    found = re.search(
        r"Config name is missing\.\s*Please pick one among the available configs: (\[.*?\])", str(error)
    )
    return found.group(1) if found else None
