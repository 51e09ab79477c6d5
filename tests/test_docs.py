"""The README and docs name only repository paths that exist (links and `code` paths alike)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = ("src/", "configs/", "docs/", "tests/", "benchmarks/", "examples/", "scripts/", ".ci/")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def named_paths(document: Path) -> list[tuple[str, Path]]:
    """(as written, resolved path) for every relative link and every `code` span that is a repository path."""
    text = document.read_text()
    found = []
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if target and not re.match(r"[a-z]+:", target):
            found.append((target, document.parent / target))
    spans = CODE.findall(text) + [word for block in FENCE.findall(text) for word in block.split()]
    for span in spans:
        span = span.split(":")[0]  # path:line
        if span.startswith(TOP_LEVEL) and not re.search(r"[<>*{}]", span):
            found.append((span, ROOT / span))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_repository_path_the_docs_name_exists(document: Path) -> None:
    paths = named_paths(document)
    missing = [written for written, path in paths if not path.exists()]
    assert not missing, f"{document.name} names paths that do not exist: {missing}"


def test_the_check_finds_paths() -> None:
    written = {w for w, _ in named_paths(ROOT / "README.md")}
    assert {"configs/embedded.yaml", "configs/accelerate/deepspeed_zero2.yaml"} <= written
