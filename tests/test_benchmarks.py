"""Every script under benchmarks/ runs at its smallest size (``--smoke``) and prints its figures, so that none
breaks unseen; a new script without ``--smoke``, or without an entry here, fails too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py"))
FIGURES = {  # a line of figures each script prints at --smoke size
    "arith_generation.py": r"^shipped model: 2 prompts x 2 samples x 32 tokens: [\d.]+ s",
    "logprobs_memory.py": r"^backward +[\d.]+ +[\d.]+ +([\d.]+|nan)$",
    "packing.py": r"^\| embedded-hard PODS 16/4 \| 4 \| \d+ / \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \| \d+ / \d+ \|$",
    "prompt_rounds.py": r"^\| 0\.77 \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \|$",
    "rewards.py": r"^agreement with is_correct labels: \d+/\d+ \([\d.]+%\)",
    "rollout_engines.py": r"^\| embedded, 2 prompts x 2, 4 tokens \| [\d.]+ s \(\d+ tokens\) \| [\d.]+ s",
    "selection.py": r"^\| 4 \| 16 \| 4 \| [\d.]+ (us|ms) \| [\d.]+ (us|ms) \| \d+x \|",
    "stats.py": r"^\| 5 \| gain_90 \| [\d.]+% \([\d.]+%\) \| [\d.]+% \| [\d.]+% \| [\d.]+% \|$",
    "threads.py": r"^\| 1 thread \| [\d.]+ \([\d.]+\) \| - \| - \|$",
    "trl_kept_logps.py": r"^  saved: -?[\d.]+ s per generation",
    "update_memory.py": r"^\| 64 \| 8 \| 8 x 4 \| 4\.0 \| [\d.]+ \|",
    "vs_trl.py": r"^ratio pods / TRL = [\d.]+",
    "weight_sync.py": r"^\| 4 MiB \| gloo \| [\d.]+ \| [\d.]+ \|$",
}


def smoke_run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},  # tiny sizes: one thread is faster
    )


def _skip_reason(script: str) -> str | None:
    if script == "rollout_engines.py":
        from pods.rollout.vllm import vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        return reason and f"rollout_engines.py compares with vLLM: {reason}"
    return None


def test_every_benchmark_is_checked() -> None:
    assert sorted(FIGURES) == SCRIPTS, "add the new benchmark's --smoke figures line to FIGURES"


@pytest.mark.slow
@pytest.mark.usefixtures("shared_data")  # some smoke runs read ../shared/data: skipped where it is absent
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_runs_at_its_smallest_size(script: str) -> None:
    if _skip_reason(script):
        pytest.skip(_skip_reason(script))
    result = smoke_run(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(FIGURES.get(script, "no figures line given"), result.stdout, re.MULTILINE), result.stdout
