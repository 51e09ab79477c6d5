"""Verified, atomic checkpoints through ``accelerate``.

A checkpoint is written to ``.partial-step-N``, gets a manifest (every file's size and sha256) written
last, and is renamed into place as ``step-N`` in one step; the last K are kept. A crash mid-write leaves the
previous checkpoints untouched, a failed write (disk full, permissions) is an error that says so, and a
checkpoint damaged later (a disk error, a half-copied folder) fails verification by name before any load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pods.errors import CheckpointWriteError, ConfigError, DamagedCheckpointError

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
SCHEDULER_FILE = (
    "lr_scheduler.pt"  # our own, loaded with weights_only=True (accelerate's custom pickles are not)
)
_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """What the loop needs, besides model/optimizer/scheduler/RNG, to continue exactly where it stopped."""

    step: int = 0
    train_seconds: float = 0.0  # training wall-clock so far (evaluation and checkpointing excluded)
    last_eval_seconds: float | None = None  # train_seconds at the last evaluation
    last_save_seconds: float = 0.0
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm
    consecutive_skips: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def checkpoint_step(folder: Path) -> int:
    return int(_NAME.match(folder.name).group(1))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (a folder counts once its state file exists)."""
    return [p for p in list_checkpoint_folders(root) if (p / STATE_FILE).is_file()]


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def newest_intact_checkpoint(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under ``root`` that passes verification; ``warn`` names each one skipped."""
    for folder in reversed(list_checkpoint_folders(root)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        warn(f"skipping checkpoint {folder}: {problem}")
    return None


def checkpoint_problem(folder: Path, under: str = "") -> str | None:
    """What is wrong with ``folder`` against its manifest (only files below ``under`` if given), or None."""
    manifest_path = folder / MANIFEST_FILE
    if not (folder / STATE_FILE).is_file():
        return f"{STATE_FILE} is missing (an incomplete checkpoint)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing (an incomplete copy, or written by a pods without manifests)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST_FILE} is unreadable ({error})"
    for name, expected in files.items():
        if under and not name.startswith(under.rstrip("/") + "/"):
            continue
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']} (truncated or damaged)"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest (damaged)"
    return None


def verify_checkpoint(folder: Path, under: str = "") -> None:
    """Raise :class:`DamagedCheckpointError` naming the first bad file of ``folder``."""
    problem = checkpoint_problem(folder, under)
    if problem is not None:
        raise DamagedCheckpointError(f"checkpoint {folder} is damaged: {problem}")


def save_checkpoint(
    accelerator,
    root: Path,
    state: TrainerState,
    keep: int,
    export: Callable[[Path], None] | None = None,
    scheduler: Any = None,
) -> Path:
    """Save model, optimizer, scheduler, RNG states and ``state`` atomically and verifiably as ``root/step-N``.

    Every process must call this (each saves its own RNG state). ``export(folder)``, if given, is called on
    the main process to also write a ready-to-use model (``save_pretrained``) inside. A failure on any
    process raises :class:`CheckpointWriteError` on every process, after removing the partial folder.
    """
    final = checkpoint_dir(root, state.step)
    partial = root / f".partial-{final.name}"
    main = accelerator.is_main_process
    failure: list[BaseException] = []

    def attempt(action: Callable[[], None]) -> None:
        if not failure:
            try:
                action()
            except Exception as error:  # OSError, and safetensors/torch writers' own errors for ENOSPC
                failure.append(error)

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)

    def finish() -> None:
        if export is not None:
            export(partial / "model")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), partial / SCHEDULER_FILE)
        _crash_point_for_tests(state.step)
        (partial / STATE_FILE).write_text(state.to_json())
        _write_manifest(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _fsync_directory(root)
        # Keep the newest `keep` at or before this step (newer ones, from before a resume, get overwritten).
        for old in [p for p in list_checkpoints(root) if checkpoint_step(p) <= state.step][:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    if main:
        attempt(prepare)
    accelerator.wait_for_everyone()
    attempt(lambda: accelerator.save_state(str(partial)))
    accelerator.wait_for_everyone()  # every process's RNG file is in place before the manifest
    if main:
        attempt(finish)
    failed = len(failure)
    if accelerator.num_processes > 1:
        failed = int(accelerator.reduce(torch.tensor(failed, device=accelerator.device), "sum"))
    if failed:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        latest = latest_checkpoint(root)
        cause = f"{type(failure[0]).__name__}: {failure[0]}" if failure else "it failed on another process"
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {cause}. Earlier checkpoints are intact (latest: "
            f"{latest or 'none'}); free disk space or fix the folder's permissions, then continue with "
            "resume_from: auto"
        ) from (failure[0] if failure else None)
    return final


def load_checkpoint(accelerator, folder: Path, scheduler: Any = None) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG states from a verified ``folder``; return the trainer state.

    accelerate reads ``model.safetensors`` (no pickle) and ``optimizer.bin`` / ``random_states_*.pkl``
    with ``torch.load(weights_only=True)``; the scheduler state is ours, read with ``weights_only=True``.
    """
    accelerator.load_state(str(folder))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
    return TrainerState(**json.loads((folder / STATE_FILE).read_text()))


def remove_partial_checkpoints(root: Path) -> None:
    """Delete folders left by a crash in the middle of a save."""
    if root.is_dir():
        for leftover in root.glob(".partial-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)


def list_checkpoint_folders(root: Path) -> list[Path]:
    """Every ``step-N`` folder under ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=checkpoint_step)


def _write_manifest(folder: Path) -> None:
    """Record every file's size and sha256 (flushed to disk) in ``manifest.json``, written last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        files[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": _sha256(path, sync=True),
        }
    target = folder / MANIFEST_FILE
    with target.open("w") as handle:
        json.dump({"format": 1, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _sha256(path: Path, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
        if sync:
            os.fsync(handle.fileno())  # the data is on disk before the manifest vouches for it
    return digest.hexdigest()


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _crash_point_for_tests(step: int) -> None:
    """Fault injection for tests: ``PODS_CRASH_DURING_SAVE=N`` kills the process half-way through saving step N."""
    if os.environ.get("PODS_CRASH_DURING_SAVE") == str(step):
        os._exit(17)


# ---------------------------------------------------------------------------------------------- resume
def checkpoint_to_resume(accelerator, source: str | None, root: Path) -> Path | None:
    """The verified checkpoint a run continues from (None: start afresh), agreed by every process.

    ``source`` is ``resume_from``: None (a fresh run; an error if ``root`` already holds checkpoints),
    ``"auto"`` (the newest intact checkpoint under ``root``, if any), a checkpoint folder or a run folder.
    Folders left by a crash mid-save are removed first. The main process chooses and tells the others.
    """
    if accelerator.is_main_process:
        remove_partial_checkpoints(root)
    accelerator.wait_for_everyone()
    if source is None:
        if latest_checkpoint(root) is not None:
            raise ConfigError(
                f"output_dir: {root.parent} already holds checkpoints; continue it with resume_from: auto, "
                "or choose another output_dir"
            )
        return None
    choice: tuple[str | None, str | None] = (None, None)  # (folder, error)
    if accelerator.is_main_process:
        try:
            folder = find_checkpoint(source, root)
            choice = (str(folder) if folder else None, None)
        except ConfigError as error:
            choice = (None, str(error))
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        choice = tuple(broadcast_object_list(list(choice)))
    if choice[1] is not None:
        raise ConfigError(choice[1])
    return Path(choice[0]) if choice[0] else None


def find_checkpoint(source: str, root: Path) -> Path | None:
    """The checkpoint ``resume_from: source`` names: an explicit checkpoint folder (verified), or the newest
    intact one under ``root`` (``auto``) or under a run folder's ``checkpoints/``; None for ``auto`` in a
    folder that never held one."""
    path = Path(source)
    if source != "auto" and (path / STATE_FILE).is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ConfigError(
                f"resume_from: checkpoint {path} is damaged: {problem}; resume from another checkpoint "
                f"(resume_from: auto picks the newest intact one in {path.parent.parent})"
            )
        return path
    root = root if source == "auto" else path / "checkpoints"
    found = newest_intact_checkpoint(root, warn=lambda text: print(f"pods: warning: {text}", file=sys.stderr))
    if found is None and (source != "auto" or list_checkpoint_folders(root)):
        raise ConfigError(
            f"resume_from: no intact checkpoint in {root} (expected {root}/step-N with its {STATE_FILE} "
            "and manifest.json); choose another output_dir to start afresh"
        )
    return found


def resume_checkpoint(accelerator, folder: Path, scheduler: Any = None) -> TrainerState:
    """:func:`load_checkpoint`, with any failure (a pickle that ``weights_only=True`` refuses, another model's
    weights) turned into a ``ConfigError`` that names the folder."""
    try:
        return load_checkpoint(accelerator, folder, scheduler)
    except Exception as error:
        text = str(error).strip()
        raise ConfigError(
            f"resume_from: could not load checkpoint {folder} ({type(error).__name__}: "
            f"{text.splitlines()[0] if text else 'no details'}); "
            "only resume checkpoints you trust, written by this run's model and settings"
        ) from error
