"""Verified, atomic checkpoints through ``accelerate``.

A checkpoint is written to ``.partial-step-N``, gets a manifest (every file's size and sha256) written
last, and is renamed into place as ``step-N`` in one step; the last K are kept. A crash mid-write leaves the
previous checkpoints untouched, a failed write (disk full, permissions) is an error that says so, and a
checkpoint damaged later (a disk error, a half-copied folder) fails verification by name before any load.
Re-saving a step that exists moves the old folder aside (``.replaced-step-N``) until the new one is in place,
so that a crash or a second Ctrl-C at any point leaves one complete copy of the step; the next start puts
back whatever was aside (:func:`recover_interrupted_saves`). Resuming explicitly from an older step moves the
newer folders, another history, out of discovery's way (:func:`set_aside_newer_checkpoints`).
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
    prompt_history: dict[str, Any] | None = None  # prompt_skip greso's history (PromptHistory.to_state)
    prompts_drawn: int | None = (
        None  # prompts drawn per process (the stream's cursor); None: step x P (older runs)
    )
    pass_share: list[float] | None = (
        None  # the prompt filter's running share that passes (PassShare.to_state)
    )

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
    base_model: dict[str, Any] | None = None,
    each_process: Callable[[Path], None] | None = None,
) -> Path:
    """Save model, optimizer, scheduler, RNG states and ``state`` atomically and verifiably as ``root/step-N``.

    Every process must call this (each saves its own RNG state). ``export(folder)``, if given, is called on
    the main process to also write a ready-to-use model (``save_pretrained``) inside; ``each_process(folder)``
    on every process, to write its own files into the checkpoint's folder. ``base_model`` (the
    frozen base of an adapter-only checkpoint, see :func:`adapter_only_checkpoints`) goes into the manifest.
    A failure on any process raises :class:`CheckpointWriteError` on every process, after removing the
    partial folder.
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
        recover_interrupted_saves(root)

    def finish() -> None:
        if export is not None:
            export(partial / "model")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), partial / SCHEDULER_FILE)
        _fault_point_for_tests(state.step, "write")
        (partial / STATE_FILE).write_text(state.to_json())
        _write_manifest(partial, base_model)
        _move_into_place(partial, final)
        # Keep the newest `keep` at or before this step (newer ones, damaged ones `auto` skipped, get replaced).
        for old in [p for p in list_checkpoints(root) if checkpoint_step(p) <= state.step][:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    if main:
        attempt(prepare)
    accelerator.wait_for_everyone()
    attempt(lambda: accelerator.save_state(str(partial)))
    if each_process is not None:
        attempt(lambda: each_process(partial))
    accelerator.wait_for_everyone()  # every process's files are in place before the manifest
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


def _move_into_place(new: Path, final: Path) -> None:
    """Rename the complete folder ``new`` to ``final``. An existing ``final`` is moved aside first and deleted
    only once ``new`` is in place: interrupted anywhere, one complete copy of the step remains (the old one
    aside, or the new one in place), and :func:`recover_interrupted_saves` sorts out which."""
    aside = _aside(final)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # an older copy than ``final``, left by an earlier crash
        os.replace(final, aside)
        _fault_point_for_tests(checkpoint_step(final), "replace")
    os.replace(new, final)
    _fsync_directory(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _aside(final: Path) -> Path:
    return final.parent / f".replaced-{final.name}"


def recover_interrupted_saves(root: Path) -> None:
    """Clean up after a save that a crash or a second Ctrl-C cut short: delete partial folders, and put a step
    moved aside to be replaced back in place unless its replacement got there (then delete the old copy)."""
    if not root.is_dir():
        return
    for leftover in root.glob(".partial-step-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for aside in root.glob(".replaced-step-*"):
        final = root / aside.name.removeprefix(".replaced-")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
            _fsync_directory(root)


def list_checkpoint_folders(root: Path) -> list[Path]:
    """Every ``step-N`` folder under ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=checkpoint_step)


def _write_manifest(folder: Path, base_model: dict[str, Any] | None = None) -> None:
    """Record every file's size and sha256 (flushed to disk) in ``manifest.json``, written last, and the
    frozen base the checkpoint's adapter needs, if any."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        files[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": _sha256(path, sync=True),
        }
    target = folder / MANIFEST_FILE
    with target.open("w") as handle:
        extra = {"base_model": base_model} if base_model is not None else {}
        json.dump({"format": 1, "files": files, **extra}, handle, indent=1)
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


def _fault_point_for_tests(step: int, point: str) -> None:
    """Fault injection for tests, saving step N: ``PODS_CRASH_DURING_SAVE=N`` kills the process half-way through
    writing it (``N:replace``: after moving an existing step N aside, before renaming the new one in);
    ``PODS_INTERRUPT_DURING_SAVE`` takes the same values and raises ``KeyboardInterrupt`` (a second Ctrl-C)."""
    here = str(step) if point == "write" else f"{step}:{point}"
    if os.environ.get("PODS_CRASH_DURING_SAVE") == here:
        os._exit(17)
    if os.environ.get("PODS_INTERRUPT_DURING_SAVE") == here:
        raise KeyboardInterrupt(f"PODS_INTERRUPT_DURING_SAVE={here}")


# ---------------------------------------------------------------------------------------------- resume
def checkpoint_to_resume(accelerator, source: str | None, root: Path) -> Path | None:
    """The verified checkpoint a run continues from (None: start afresh), agreed by every process.

    ``source`` is ``resume_from``: None (a fresh run; an error if ``root`` already holds checkpoints),
    ``"auto"`` (the newest intact checkpoint under ``root``, if any), a checkpoint folder or a run folder.
    A save cut short is cleaned up first (:func:`recover_interrupted_saves`). An explicit ``source`` sets aside
    the checkpoints under ``root`` newer than the one chosen: the run continues another history from there, and
    a later ``auto`` must not pick one of them. The main process chooses and tells the others.
    """
    if accelerator.is_main_process:
        recover_interrupted_saves(root)
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
            if folder is not None and source != "auto":
                set_aside_newer_checkpoints(root, checkpoint_step(folder), _warn)
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
    found = newest_intact_checkpoint(root, warn=_warn)
    if found is None and (source != "auto" or list_checkpoint_folders(root)):
        raise ConfigError(
            f"resume_from: no intact checkpoint in {root} (expected {root}/step-N with its {STATE_FILE} "
            "and manifest.json); choose another output_dir to start afresh"
        )
    return found


def set_aside_newer_checkpoints(root: Path, step: int, warn: Callable[[str], None]) -> Path | None:
    """Move the step folders under ``root`` newer than ``step`` (a history a resume from ``step`` abandons) into
    ``root/abandoned-after-step-K``, out of reach of discovery and retention; return that folder, if any."""
    newer = [folder for folder in list_checkpoint_folders(root) if checkpoint_step(folder) > step]
    if not newer:
        return None
    target = root / f"abandoned-after-{checkpoint_dir(root, step).name}"
    suffix = 1
    while target.exists():
        suffix += 1
        target = root / f"abandoned-after-{checkpoint_dir(root, step).name}-{suffix}"
    target.mkdir()
    for folder in newer:
        os.replace(folder, target / folder.name)
    _fsync_directory(root)
    names = ", ".join(folder.name for folder in newer)
    warn(
        f"resuming from step {step}: moved the newer checkpoints of the abandoned history ({names}) to "
        f"{target}, so that resume_from: auto never picks them; delete that folder when you no longer need it"
    )
    return target


def _warn(text: str) -> None:
    print(f"pods: warning: {text}", file=sys.stderr)


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


# ---------------------------------------------------------------------------------------------- LoRA
def base_model_identity(name: str, folder: str | Path) -> dict[str, str]:
    """``{"name", "sha256"}`` of a frozen base: its configured name, and one sha256 over its weight files
    (``*.safetensors`` / ``*.bin`` of ``folder``, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    for path in files:
        digest.update(path.name.encode())
        digest.update(_sha256(path).encode())
    return {"name": name, "sha256": digest.hexdigest()}


def adapter_only_checkpoints(accelerator, base_model: dict[str, str]) -> None:
    """Make this run's checkpoints hold only the trainable (LoRA) weights of the model, besides optimizer,
    scheduler and RNG states: megabytes, not the gigabytes of the frozen base, and no bitsandbytes 4-bit
    state that accelerate's strict loading rejects. The base is named and hashed in the manifest; resuming
    onto another base is refused. For runs outside DeepSpeed (DeepSpeed saves its own checkpoint format).
    """

    def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in model.named_parameters() if p.requires_grad}

    def keep_trainable(models: list, weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
        for index, model in enumerate(models):
            names = trainable(model)
            weights[index] = {key: value for key, value in weights[index].items() if key in names}

    def load_trainable(models: list, input_dir: str) -> None:
        from safetensors.torch import load_file

        recorded = json.loads((Path(input_dir) / MANIFEST_FILE).read_text()).get("base_model")
        if recorded is not None and recorded.get("sha256") != base_model["sha256"]:
            raise ValueError(
                f"the checkpoint's adapter was trained on the base {recorded.get('name')!r} (weights sha256 "
                f"{str(recorded.get('sha256'))[:12]}...), this run's base {base_model['name']!r} has other "
                f"weights (sha256 {base_model['sha256'][:12]}...); resume with the same model"
            )
        for index, model in enumerate(list(models)):
            path = Path(input_dir) / ("model.safetensors" if index == 0 else f"model_{index}.safetensors")
            saved, names = load_file(path), trainable(model)
            if set(saved) != set(names):
                raise ValueError(
                    f"{path.name} holds {len(saved)} weights, this run trains {len(names)} others (a checkpoint "
                    "of another lora_r, lora_target_modules or model?)"
                )
            with torch.no_grad():
                for name, parameter in names.items():
                    parameter.copy_(saved[name])
            models.remove(model)  # loaded here: accelerate loads the optimizer, scheduler and RNG states

    accelerator.register_save_state_pre_hook(keep_trainable)
    accelerator.register_load_state_pre_hook(load_trainable)
