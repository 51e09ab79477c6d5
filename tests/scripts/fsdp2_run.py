"""tiny_run.py under accelerate's FSDP2 on CPU processes (gloo). accelerate applies FSDP only on accelerators
(on a CPU it silently runs plain data parallel instead), so this script lifts that one gate and runs the
rest for real: fully_shard, DTensor parameters, sharded checkpoints, gathering for vLLM and for the export.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision no \\
        tests/scripts/fsdp2_run.py MODEL_DIR OUTPUT_DIR '{...}'      (ACCELERATE_USE_CPU unset, no GPU)

The end weights go to OUTPUT_DIR/weights-rank0.pt, gathered (the main process writes them).
"""

from __future__ import annotations

import tiny_run
import torch
from accelerate import PartialState
from accelerate.utils import DistributedType

from pods.process_exit import exit_process


def save_gathered_weights(trainer: tiny_run.RecordingTrainer, output_dir: str) -> None:
    weights = trainer.accelerator.get_state_dict(trainer.model)  # a collective; full on the main process
    if trainer.accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in weights.items()}, f"{output_dir}/weights-rank0.pt")


if __name__ == "__main__":
    PartialState(cpu=True)  # the process group over gloo, as for --multi_gpu with ACCELERATE_USE_CPU
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # accelerate's gate for FSDP
    tiny_run.save_weights = save_gathered_weights
    tiny_run.main()
    exit_process(0)
