"""Shared loading helpers: local JSONL/JSON/Parquet/CSV files or folders, or the Hugging Face Hub, with
errors that name the file and line (or the hub row) and say how to fix the problem."""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pods.errors import ConfigError
from pods.prompts import make_prompt, render_prompt

__all__ = [
    "HubUnavailableError",
    "MissingDataError",
    "Record",
    "TaskDataError",
    "finish_rows",
    "is_local_source",
    "load_records",
    "read_file",
    "split_files",
]

Record = tuple[str, dict[str, Any]]
"""A row and where it came from ("path:line" or "hub-name[split] row i"), for error messages."""

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class TaskDataError(ConfigError):
    """Task data that cannot be used: a malformed row, an unknown split, an unreadable file."""


class MissingDataError(TaskDataError, FileNotFoundError):
    """A local data file or folder that does not exist or holds no file for the split."""


class HubUnavailableError(TaskDataError, ConnectionError):
    """A Hub dataset requested while offline (or unreachable) and not in the local cache."""


def is_local_source(source: str | os.PathLike[str]) -> bool:
    """True when ``source`` names a local file or folder rather than a Hub dataset ("owner/name")."""
    text = os.fspath(source)
    if Path(text).expanduser().exists():
        return True
    return (
        text.startswith(("/", ".", "~"))
        or text.endswith(LOCAL_SUFFIXES)
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
    )


def read_file(path: Path) -> list[Record]:
    """All rows of a ``.jsonl``, ``.json`` (a list of objects), ``.parquet`` or ``.csv`` (a header line) file."""
    if not path.is_file():
        raise MissingDataError(f"data file {path} does not exist.")
    if path.suffix in (".parquet", ".csv"):
        import pyarrow.csv
        import pyarrow.parquet

        kind, read = (
            ("Parquet", pyarrow.parquet.read_table)
            if path.suffix == ".parquet"
            else ("CSV", pyarrow.csv.read_csv)
        )
        try:
            table = read(path)
        except Exception as error:
            raise TaskDataError(f"{path}: not a readable {kind} file ({error}).") from error
        return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        if path.suffix == ".json":
            try:
                data = json.load(f)
            except json.JSONDecodeError as error:
                raise TaskDataError(f"{path}:{error.lineno}: invalid JSON ({error.msg}).") from error
            if not isinstance(data, list):
                raise TaskDataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}.")
            records = [(f"{path} item {i}", row) for i, row in enumerate(data)]
        else:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise TaskDataError(
                        f"{path}:{lineno}: malformed row, not valid JSON ({error.msg}); "
                        "each line must be one JSON object."
                    ) from error
                records.append((f"{path}:{lineno}", row))
    for where, row in records:
        if not isinstance(row, dict):
            raise TaskDataError(f"{where}: malformed row, expected a JSON object, got {type(row).__name__}.")
    return records


def split_files(folder: Path, split: str) -> list[Path]:
    """Files holding ``split`` in a folder: ``{split}.jsonl`` / ``.json`` / ``.parquet``, or Hub-style
    shards ``{split}-*.parquet``, directly inside or in sub-folders (one per config)."""
    patterns = [f"{split}{suffix}" for suffix in LOCAL_SUFFIXES] + [f"{split}-*.parquet"]
    found = {p for pattern in patterns for p in folder.rglob(pattern) if p.is_file()}
    return sorted(found)


def _local_records(source: str | os.PathLike[str], split: str) -> list[Record]:
    path = Path(source).expanduser()
    if not path.exists():
        raise MissingDataError(
            f"local data path {path} does not exist; pass source= an existing .jsonl/.json/.parquet file "
            "or a folder holding one per split."
        )
    if path.is_file():
        return read_file(path)
    files = split_files(path, split)
    if not files:
        raise MissingDataError(
            f"no file for split {split!r} in {path}: expected {split}.jsonl, {split}.json, {split}.parquet "
            f"or {split}-*.parquet (possibly in sub-folders)."
        )
    return [record for file in files for record in read_file(file)]


def _hub_records(name: str, config: str | None, split: str) -> list[Record]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
        reason = "the Hub is offline (HF_HUB_OFFLINE=1)" if offline else "it could not be loaded"
        hint = (
            f"Hub dataset {name!r} (config {config!r}, split {split!r}) is not available: {reason} "
            f"and it is not in the local cache ({type(error).__name__}: {error}). Point to a local copy "
            f"instead, e.g. source='/path/to/{name.split('/')[-1]}/' (a folder with {split}.jsonl or "
            f"{split}-*.parquet) or source='/path/to/{split}.jsonl'."
        )
        if offline or isinstance(error, ConnectionError | OSError):
            raise HubUnavailableError(hint) from error
        raise TaskDataError(hint) from error
    return [(f"{name}[{split}] row {i}", row) for i, row in enumerate(ds)]


def load_records(
    source: str | os.PathLike[str], split: str, *, config: str | None = None, required: Iterable[str] = ()
) -> list[Record]:
    """Rows of ``split`` from a local file/folder or a Hub dataset, each checked for ``required`` columns."""
    records = (
        _local_records(source, split) if is_local_source(source) else _hub_records(str(source), config, split)
    )
    required = tuple(required)
    for where, row in records:
        missing = [c for c in required if c not in row or row[c] is None]
        if missing:
            raise TaskDataError(
                f"{where}: malformed row, missing field(s) {missing}; every row needs {list(required)}."
            )
    return records


def finish_rows(
    rows: Iterable[dict[str, Any]],
    *,
    prompt_style: str = "chat",
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    shuffle: bool = False,
    system_prompt: str | None = None,
    template: str | None = None,
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> Any:
    """Add the ``prompt`` column, optionally shuffle (by ``seed``), drop prompts over
    ``max_prompt_tokens`` tokens, keep the first ``limit`` rows; return a ``datasets.Dataset``.

    ``rows`` may be lazy (a generator): without ``shuffle`` only the rows a ``limit`` needs are drawn."""
    import datasets

    if limit is not None and limit < 0:
        raise TaskDataError(f"limit must be a non-negative number of rows or None, got {limit}.")
    if max_prompt_tokens is not None and tokenizer is None:
        raise TaskDataError("max_prompt_tokens needs a tokenizer to count prompt tokens; pass tokenizer=...")
    if shuffle:
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    rows = iter(rows)
    if keep is not None:
        rows = (row for row in rows if keep(row))
    if max_prompt_tokens is None and limit is not None:
        rows = itertools.islice(rows, limit)

    def with_prompts(chunk: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in chunk:
            row["prompt"] = make_prompt(
                row["question"], prompt_style, system_prompt=system_prompt, template=template
            )
        return chunk

    if tokenizer is None or max_prompt_tokens is None:
        rows = with_prompts(list(rows))
        if tokenizer is not None and rows:
            render_prompt(rows[0]["prompt"], tokenizer)  # fail early on a tokenizer without chat template
    else:  # in chunks, so that a limit stops drawing and tokenizing rows once it has its rows
        kept: list[dict[str, Any]] = []
        chunk_size = max(2 * (limit or 0), 1024)
        while chunk := with_prompts(list(itertools.islice(rows, chunk_size))):
            texts = [render_prompt(row["prompt"], tokenizer) for row in chunk]
            lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
            kept += [row for row, n in zip(chunk, lengths, strict=True) if n <= max_prompt_tokens]
            if limit is not None and len(kept) >= limit:
                break
        rows = kept if limit is None else kept[:limit]
    if not rows:
        return datasets.Dataset.from_dict({"question": [], "answer": [], "solution": [], "prompt": []})
    return datasets.Dataset.from_list(rows)
