"""Atomic checkpoints through ``accelerate``: written to a temporary folder, renamed into place when
complete, the last K kept. A crash mid-write leaves the previous checkpoint untouched."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """What the loop needs, besides model/optimizer/scheduler/RNG, to continue exactly where it stopped."""

    step: int = 0
    train_seconds: float = 0.0  # training wall-clock so far (evaluation and checkpointing excluded)
    last_eval_seconds: float | None = None  # train_seconds at the last evaluation
    last_save_seconds: float = 0.0
    best_accuracy: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (a folder counts once its state file exists)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def save_checkpoint(accelerator, root: Path, state: TrainerState, keep: int, export=None) -> Path:
    """Save model, optimizer, scheduler, RNG states and ``state`` atomically as ``root/step-N``.

    Every process must call this (each saves its own RNG state). ``export(folder)``, if given, is
    called on the main process to also write a ready-to-use model (``save_pretrained``) inside.
    """
    final = checkpoint_dir(root, state.step)
    partial = root / f".partial-{final.name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    if accelerator.is_main_process:
        if export is not None:
            export(partial / "model")
        _crash_point_for_tests(state.step)
        (partial / STATE_FILE).write_text(state.to_json())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, folder: Path) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG states from ``folder``; return the trainer state."""
    accelerator.load_state(str(folder))
    return TrainerState(**json.loads((folder / STATE_FILE).read_text()))


def remove_partial_checkpoints(root: Path) -> None:
    """Delete folders left by a crash in the middle of a save."""
    if root.is_dir():
        for leftover in root.glob(".partial-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _crash_point_for_tests(step: int) -> None:
    """Fault injection for tests: ``PODS_CRASH_DURING_SAVE=N`` kills the process half-way through saving step N."""
    if os.environ.get("PODS_CRASH_DURING_SAVE") == str(step):
        os._exit(17)
