"""The run folder, one folder for every process of a run, wherever they run.

A checkpoint is written once, by the main process (plus each rank's own files: RNG states, DeepSpeed or
FSDP shards), and every process resumes from it; the metric logs are written by the main process alone. So
the machines of a multi-machine run must share the run folder (a disk each mounts at the same path).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from pods.distributed import synced_any
from pods.errors import ConfigError

__all__ = ["require_shared_folder"]


def require_shared_folder(accelerator, folder: Path) -> None:
    """Stop every process with a :class:`ConfigError` unless all machines of the launch see ``folder`` as one
    folder (a collective; nothing to check on one machine). Each machine's first process writes a marker
    named by a token the main process chose, then looks for the other machines' markers."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import broadcast_object_list, gather_object

    local_main = accelerator.is_local_main_process
    firsts = gather_object([accelerator.process_index if local_main else None])
    machines = [index for index in firsts if index is not None]
    if len(machines) == 1:
        return
    token = broadcast_object_list([uuid.uuid4().hex if accelerator.is_main_process else None])[0]
    markers = folder / f".machines-{token}"
    if local_main:
        markers.mkdir(parents=True, exist_ok=True)
        (markers / str(accelerator.process_index)).touch()
    accelerator.wait_for_everyone()
    unseen = synced_any(accelerator, local_main and any(not (markers / str(i)).exists() for i in machines))
    if local_main:  # every machine has looked (the reduction above waited for all of them)
        shutil.rmtree(markers, ignore_errors=True)
    if unseen:
        raise ConfigError(
            f"output_dir: {folder} is not one folder shared by the {len(machines)} machines of this launch "
            "(a machine cannot see the files another writes there), so they could not resume from one "
            "checkpoint; put output_dir on a disk every machine mounts at the same path (NFS, Lustre, GPFS, ...)"
        )


def pick_output_dir(config) -> str:
    """The run folder: ``output_dir``, else the run a ``resume_from`` checkpoint belongs to, else a new
    ``runs/<date-time>``."""
    from datetime import datetime

    from pods.checkpoint import STATE_FILE

    if config.output_dir:
        return config.output_dir
    if config.resume_from and config.resume_from != "auto":
        path = Path(config.resume_from)
        return str(path.parent.parent if (path / STATE_FILE).is_file() else path)
    return str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))


def start_accelerator(config: Any, micro_batches: int) -> tuple[Any, Path]:
    """The run's ``Accelerator`` (mixed precision, trackers logging into the run folder, ``micro_batches``
    accumulated per optimizer step) and the run folder, which every process agrees on: the process group starts
    first, as Accelerator would, and the main process's choice is broadcast."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import broadcast_object_list, parse_flag_from_env

    precision = config.mixed_precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    output_dir = Path(broadcast_object_list([pick_output_dir(config)])[0])
    accelerator = Accelerator(
        mixed_precision=precision,
        log_with=config.report_to or None,  # TensorBoard / W&B / trackio, logging into the run folder
        project_dir=str(output_dir),
        gradient_accumulation_steps=micro_batches,
    )
    return accelerator, output_dir
