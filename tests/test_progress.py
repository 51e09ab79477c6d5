"""The live progress display prints our messages as written."""

from __future__ import annotations

import pytest

from pods.progress import TrainingProgress


def test_messages_are_printed_as_written_not_as_rich_markup(capsys: pytest.CaptureFixture[str]) -> None:
    text = "rollout engine: hf (vLLM is not installed: pip install 'pods[vllm]'; [bold]x[/bold] :smile:)"
    with TrainingProgress(enabled=True, max_steps=2, max_time=None) as progress:
        progress.message(text)
        progress.update(1, 0.5, {"reward": 0.25})
    assert text in capsys.readouterr().err.splitlines()
    with TrainingProgress(enabled=False, max_steps=2, max_time=None) as progress:
        progress.message(text)
    assert capsys.readouterr().err == ""
