"""Cross-process reductions the trainer needs, each a no-op with one process.

Every process generates, scores and selects for its own prompts; these helpers are the few places where
the processes meet: metrics over every process, and clock-based decisions that all must take together.
"""

from __future__ import annotations

from typing import Any

import torch


def gather(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """Every process's ``values`` (equal shapes), concatenated along the first dimension, on ``values``' device."""
    if accelerator.num_processes == 1:
        return values
    return accelerator.gather(values.to(accelerator.device)).to(values.device)


def synced_max(accelerator: Any, value: float) -> float:
    """The largest ``value`` over processes (e.g. the slowest process's seconds), so all decide alike."""
    if accelerator.num_processes == 1:
        return value
    tensor = torch.tensor(value, dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(tensor, "max"))


def synced_any(accelerator: Any, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(int(flag), device=accelerator.device), "max"))


def synced_sum(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over processes (on the accelerator's device with several processes)."""
    if accelerator.num_processes == 1:
        return values
    return accelerator.reduce(values.to(accelerator.device), "sum")


def synced_mean(accelerator: Any, value: float) -> float:
    """The mean of a scalar over processes."""
    total = synced_sum(accelerator, torch.tensor(value, dtype=torch.float64))
    return float(total) / accelerator.num_processes


def deepspeed_batch_settings(
    accelerator: Any, micro_batch_size: int, micro_batches: int, max_grad_norm: float
) -> None:
    """Give DeepSpeed our batch shape and clip before ``prepare``: we prepare no DataLoader, so accelerate
    cannot fill its "auto" values, and DeepSpeed clips with its own ``gradient_clipping``, not ours."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    plugin.deepspeed_config.update(
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=micro_batches,
        gradient_clipping=max_grad_norm,
    )
    plugin.deepspeed_config.pop("train_batch_size", None)  # DeepSpeed derives it from the two above
