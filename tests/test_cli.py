"""The ``pods`` entry point, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

from pods import __version__


def run_pods(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pods", *args], capture_output=True, text=True, timeout=120)


def test_version_and_help() -> None:
    assert run_pods("--version").stdout.strip() == f"pods {__version__}"
    result = run_pods("--help")
    assert result.returncode == 0 and "demo" in result.stdout


def test_demo_prints_what_each_rule_keeps() -> None:
    result = run_pods("demo", "--groups", "2", "--n", "6", "--m", "3")
    assert result.returncode == 0, result.stderr
    for rule in ("max_variance", "max_reward", "random"):
        assert result.stdout.count(rule) == 2


def test_demo_bad_m_is_a_clear_error() -> None:
    result = run_pods("demo", "--n", "4", "--m", "9")
    assert result.returncode == 2
    assert "m=9" in result.stderr and "Traceback" not in result.stderr
