"""The optimizer and learning-rate schedule a configuration asks for."""

from __future__ import annotations

import math
from typing import Any

import torch

from pods.config import TrainConfig
from pods.errors import ConfigError


def build_optimizer(config: TrainConfig, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW (torch) or 8-bit AdamW (bitsandbytes, the paper's single-GPU setting) over ``parameters``."""
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


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer) -> Any:
    """transformers' schedule of that name; warm-up is a fraction of ``max_steps`` x ``num_iterations``
    optimizer steps (``constant`` means constant after warm-up)."""
    from transformers import get_scheduler

    total = (config.max_steps or 1) * config.num_iterations
    warmup = math.ceil(config.warmup_ratio * total) if config.max_steps else 0
    name = "constant_with_warmup" if config.lr_scheduler_type == "constant" else config.lr_scheduler_type
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
