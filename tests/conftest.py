"""Shared fixtures: tiny real models built on the fly (no downloads), and the shared data folder."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The processes tests start (pods train, accelerate launch, servers' clients) run tiny models: one torch thread
# each, as the test processes themselves (below). Two threads per process, with the other pytest worker
# holding a core, slow each other 1.4-3x (docs/async.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# DeepSpeed compiles a C++ op the first time a process starts it on the CPU (minutes on 2 busy cores), into
# TORCH_EXTENSIONS_DIR: ~/.cache by default, where another environment's DeepSpeed rebuilds it over ours, and
# where a build killed half-way leaves a lock that makes every later start wait forever. The test scripts
# skip that op (pods.testing.use_torch_collectives_under_deepspeed); should anything build one anyway, keep
# this environment's own and drop a lock older than any build (the subprocesses inherit the setting).
EXTENSIONS = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
for lock in EXTENSIONS.glob("*/lock"):
    if time.time() - lock.stat().st_mtime > 20 * 60:
        lock.unlink(missing_ok=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# Tiny models run faster on one thread than on two competing ones (and leave a core to subprocesses);
# set once here for the whole suite.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (GSM8K, MATH-500, the Qwen2.5 tokenizer); skips where it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a byte-level BPE tokenizer and a chat template, saved to disk."""
    from pods.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tool_model_dir(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (hidden 32) on the Qwen2.5 tokenizer and TRL's Qwen2.5 chat template, fitted in seconds to
    answer "What is a times b?" with a call of ``multiply(3, 4)`` and any tool answer with ``Done.``
    (tests/tool_model.py); skips without TRL (its chat template)."""
    pytest.importorskip("trl")
    from tool_model import fit_tool_model

    return fit_tool_model(shared_data, tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="session")
def tool_vllm_model_dir(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`tool_model_dir` with head size 32 (hidden 64, 2 heads, fitted at a lower learning rate): vLLM's CPU
    attention has no kernel for head size 8. It also calls the tool again after the answer ``tool_model.AGAIN``."""
    pytest.importorskip("trl")
    from tool_model import fit_tool_model

    folder = tmp_path_factory.mktemp("tool-vllm-model")
    return fit_tool_model(
        shared_data, folder, hidden_size=64, num_heads=2, num_kv_heads=1, lr=1e-2, call_again=True
    )


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; start every test without another test's settings."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def pytest_configure(config: pytest.Config) -> None:
    """Stop at once where ``--dist loadgroup`` cannot group: pytest-xdist appends a test's ``xdist_group`` to
    its node id, which pytest 9.2 no longer reads (pytest-xdist issue 1386). Each worker would then start the
    expensive fixture a group shares (tests/test_vllm.py's engine) for itself."""
    if config.getvalue("dist") != "loadgroup" or hasattr(config, "workerinput"):
        return

    class Probe(pytest.Item):
        def runtest(self) -> None: ...

    probe = object.__new__(Probe)  # what xdist does to each grouped test on a worker
    probe._nodeid = "test@group"
    try:
        grouped = probe.nodeid == "test@group"
    except AttributeError:
        grouped = False
    if not grouped:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} ignores the xdist_group marks under --dist loadgroup: install the "
            "versions pyproject.toml's test extra pins (pip install -e '.[dev]')"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first (stable order otherwise): the two xdist workers then finish on short tests together,
    instead of one waiting alone for a minute-long test handed out last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
