"""GSM8K (Cobbe et al. 2021): grade-school math word problems with worked solutions ending ``#### n``.

Rows: ``question``, ``answer`` (the gold number after ``####``, thousands separators removed),
``solution`` (the original ``answer`` text), ``prompt``.
"""

from __future__ import annotations

import os
from typing import Any

from pods.data.common import TaskDataError, load_records

__all__ = ["GSM8K_HUB_NAME", "gsm8k_gold_answer", "read_gsm8k"]

GSM8K_HUB_NAME = "openai/gsm8k"
SPLITS = ("train", "test")


def gsm8k_gold_answer(solution: str, where: str = "solution") -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, without commas."""
    at = solution.rfind("####")
    answer = solution[at + 4 :].strip().replace(",", "") if at >= 0 else ""
    if not answer:
        raise TaskDataError(f"{where}: malformed row, the 'answer' text has no final '#### <number>' line.")
    return answer


def read_gsm8k(
    split: str = "train", *, source: str | os.PathLike[str] | None = None, config: str = "main"
) -> list[dict[str, Any]]:
    """GSM8K ``split`` rows from the Hub (default ``openai/gsm8k``, config ``main``) or a local JSONL /
    Parquet file or folder, with the gold number as ``answer`` and the worked text as ``solution``."""
    if split not in SPLITS:
        raise TaskDataError(f"GSM8K has splits {list(SPLITS)}, not {split!r}.")
    records = load_records(source or GSM8K_HUB_NAME, split, config=config, required=("question", "answer"))
    rows = []
    for where, row in records:
        solution = str(row["answer"])
        rows.append({**row, "solution": solution, "answer": gsm8k_gold_answer(solution, where)})
    return rows
