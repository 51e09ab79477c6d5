"""MATH (Hendrycks et al. 2021): competition problems with LaTeX solutions and answers.

- ``math500``: the 500-problem test subset (Hub ``HuggingFaceH4/MATH-500``, columns ``problem``,
  ``solution``, ``answer``, ``subject``, ``level``, ``unique_id``), gold answers as given.
- ``math``: the full training set (Hub ``EleutherAI/hendrycks_math``, all seven subjects by default);
  it has no answer column, so the gold answer is the last ``\\boxed{...}`` of the solution.

Rows add ``question`` (= ``problem``) and ``prompt`` to the original columns.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pods.data.common import TaskDataError, is_local_source, load_records
from pods.rewards.extract import find_boxed

__all__ = ["MATH500_HUB_NAME", "MATH_HUB_NAME", "MATH_SUBJECTS", "read_math", "read_math500"]

logger = logging.getLogger(__name__)

MATH500_HUB_NAME = "HuggingFaceH4/MATH-500"
MATH_HUB_NAME = "EleutherAI/hendrycks_math"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


def _with_question(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        row["question"] = str(row["problem"])
        row["answer"] = str(row["answer"])
    return rows


def read_math500(
    split: str = "test", *, source: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """MATH-500 rows (test split only) from the Hub or a local JSONL / Parquet file or folder."""
    if split != "test":
        raise TaskDataError(f"MATH-500 has only a 'test' split, not {split!r}; pass split='test'.")
    records = load_records(source or MATH500_HUB_NAME, split, required=("problem", "solution", "answer"))
    return _with_question([dict(row) for _, row in records])


def read_math(
    split: str = "train",
    *,
    source: str | os.PathLike[str] | None = None,
    subjects: list[str] | tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Rows of the MATH train or test set (all subjects, or ``subjects``) from the Hub or a local file or
    folder (a Hub-style folder has one sub-folder per subject). Rows whose solution has no
    ``\\boxed{}`` answer are dropped with a warning."""
    if split not in ("train", "test"):
        raise TaskDataError(f"MATH has splits ['train', 'test'], not {split!r}.")
    subjects = tuple(subjects or MATH_SUBJECTS)
    unknown = sorted(set(subjects) - set(MATH_SUBJECTS))
    if unknown:
        raise ValueError(f"unknown MATH subject(s) {unknown}; known: {list(MATH_SUBJECTS)}.")
    source = source or MATH_HUB_NAME
    required = ("problem", "solution")
    if is_local_source(source):
        records = load_records(source, split, required=required)
        if Path(source).is_dir() and subjects != MATH_SUBJECTS:  # Hub layout: <subject>/<split>-*.parquet
            records = [r for r in records if any(f"/{s}/" in r[0].replace(os.sep, "/") for s in subjects)]
    else:
        records = [r for s in subjects for r in load_records(source, split, config=s, required=required)]
    rows, dropped = [], 0
    for _, row in records:
        answer = row.get("answer") or find_boxed(str(row["solution"]))
        if not answer:
            dropped += 1
            continue
        rows.append({**row, "answer": answer})
    if dropped:
        logger.warning("MATH %s: dropped %d row(s) whose solution has no \\boxed{} answer.", split, dropped)
    return _with_question(rows)
