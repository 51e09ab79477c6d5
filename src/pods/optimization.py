"""The optimizer and learning-rate schedule a configuration asks for."""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from pods.config import TrainConfig
from pods.errors import ConfigError


def build_optimizer(
    config: TrainConfig, parameters: list[torch.nn.Parameter], *, deepspeed: bool = False
) -> torch.optim.Optimizer:
    """AdamW (torch) or 8-bit AdamW (bitsandbytes, the paper's single-GPU setting) over ``parameters``.

    Outside DeepSpeed (which keeps float32 master weights of its own) the trainable weights must be float32:
    these optimizers update weights in place, and a bfloat16 weight near 1 cannot move by less than 2**-8,
    so updates of a learning rate like 5e-6 round away. Half-precision trainable weights are refused.
    """
    half = sorted({str(p.dtype).removeprefix("torch.") for p in parameters if p.dtype in _HALF})
    if half and not deepspeed:
        raise ConfigError(
            f"dtype: the trained weights are {', '.join(half)}, and {config.optimizer} would update them in "
            "place, rounding small updates away; set dtype: float32 with mixed_precision: bf16 (float32 "
            "master weights, bfloat16 compute), launch with DeepSpeed (accelerate launch --config_file "
            "configs/accelerate/deepspeed_zero2.yaml keeps float32 master weights), or train LoRA (lora_r > 0)"
        )
    kwargs = {
        "lr": config.learning_rate,
        "betas": (config.adam_beta1, config.adam_beta2),
        "weight_decay": config.weight_decay,
    }
    if config.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("optimizer: adamw_8bit needs bitsandbytes (pip install bitsandbytes)") from None
        return bnb.optim.AdamW8bit(parameters, **kwargs)
    return torch.optim.AdamW(parameters, **kwargs)


_HALF = (torch.bfloat16, torch.float16)


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer) -> LambdaLR:
    """The learning-rate schedule: linear warm-up over ``warmup_ratio`` of the ``max_steps`` x
    ``num_iterations`` optimizer steps, then constant, linear to 0 or half a cosine to 0 at the last step.

    transformers' formulas (``get_scheduler``'s constant_with_warmup, linear and cosine) in a ``LambdaLR``
    of the same state, so checkpoints of either resume with the other. Written out because importing
    ``transformers.optimization`` imports peft and bitsandbytes: 2.4 s of every start on 2 CPU cores."""
    total = (config.max_steps or 1) * config.num_iterations
    warmup = math.ceil(config.warmup_ratio * total) if config.max_steps else 0
    decay = _SCHEDULES[config.lr_scheduler_type]
    return LambdaLR(optimizer, functools.partial(_factor, decay=decay, warmup=warmup, total=total))


def _factor(step: int, *, decay, warmup: int, total: int) -> float:
    """The learning rate's multiplier at ``step``: linear from 0 during warm-up, then ``decay``'s."""
    return step / max(1, warmup) if step < warmup else decay(step, warmup, total)


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _linear(step: int, warmup: int, total: int) -> float:
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, warmup: int, total: int) -> float:
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


_SCHEDULES = {"constant": _constant, "linear": _linear, "cosine": _cosine}
