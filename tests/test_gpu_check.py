"""scripts/gpu_check.py in its CPU mode (--tiny), as a real subprocess in which ``datasets``, TRL and
vLLM cannot be imported, as on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_tiny_runs_without_datasets_trl_or_vllm(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    for name in ("datasets", "trl", "vllm"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not on the GPU machine')\n"
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), *sys.path])}
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--seeds", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GRPO 4/4: generate" in result.stdout and "PODS 16/4: generate" in result.stdout
    figures = json.loads((out / "gpu_check.json").read_text())
    assert figures["device"] == "cpu" and figures["base_model"]["parameters"] > 0
    assert set(figures["summary"]["arms"]) == {"grpo", "pods"}
    assert figures["summary"]["arms"]["pods"]["steps"] == [2]
    assert (out / "base-model" / "config.json").is_file()
