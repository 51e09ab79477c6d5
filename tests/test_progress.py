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


def test_the_live_line_shows_tool_calls_errors_and_turns_of_multi_turn_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of episodes with tools adds calls per rollout, the share that failed and turns; a step without
    tools does not (on a terminal wide enough for the line)."""
    monkeypatch.setenv("COLUMNS", "240")
    metrics = {
        "reward": 0.5,
        "tools/call_frequency": 0.75,
        "tools/failure_frequency": 0.125,
        "tools/mean_turns": 1.75,
    }
    with TrainingProgress(enabled=True, max_steps=2, max_time=None) as progress:
        progress.update(1, 0.5, metrics)
    assert "tools 0.75/rollout (err 12%) turns 1.75" in capsys.readouterr().err
    with TrainingProgress(enabled=True, max_steps=2, max_time=None) as progress:
        progress.update(1, 0.5, {"reward": 0.5})
    assert "tools" not in capsys.readouterr().err
