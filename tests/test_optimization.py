"""The learning-rate schedules: transformers' formulas without importing transformers.optimization."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_scheduler

from pods.config import SCHEDULERS, TrainConfig
from pods.optimization import build_scheduler


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)


def learning_rates(scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize(
    ("max_steps", "num_iterations", "warmup_ratio"), [(10, 1, 0.0), (7, 2, 0.3), (5, 3, 0.5), (4, 1, 0.9)]
)
def test_every_schedule_equals_transformers_step_by_step(
    name: str, max_steps: int, num_iterations: int, warmup_ratio: float
) -> None:
    config = TrainConfig(
        lr_scheduler_type=name, max_steps=max_steps, num_iterations=num_iterations, warmup_ratio=warmup_ratio
    )
    total = max_steps * num_iterations
    warmup = math.ceil(warmup_ratio * total)  # TrainingArguments.get_warmup_steps' rounding
    reference = get_scheduler(
        "constant_with_warmup" if name == "constant" else name,
        optimizer(),
        num_warmup_steps=warmup,
        num_training_steps=total,
    )
    expected = learning_rates(reference, total + 2)
    assert learning_rates(build_scheduler(config, optimizer()), total + 2) == pytest.approx(
        expected, abs=1e-15
    )
    assert len(set(expected)) > (1 if name == "constant" and warmup else 0)  # the cases do move the rate


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_a_transformers_schedule_state_resumes_in_ours_and_back(name: str) -> None:
    """Checkpoints written before (transformers' LambdaLR) and after load into each other and go on the same."""
    config = TrainConfig(lr_scheduler_type=name, max_steps=8, warmup_ratio=0.25)
    reference = get_scheduler(name, optimizer(), num_warmup_steps=2, num_training_steps=8)
    learning_rates(reference, 3)
    ours = build_scheduler(config, optimizer())
    ours.load_state_dict(reference.state_dict())
    assert learning_rates(ours, 6) == pytest.approx(learning_rates(reference, 6), abs=1e-15)
    back = get_scheduler(name, optimizer(), num_warmup_steps=2, num_training_steps=8)
    back.load_state_dict(ours.state_dict())
    assert back.last_epoch == ours.last_epoch == 9


def test_a_training_process_does_not_import_peft() -> None:
    """What the schedule was rewritten for: building it leaves peft (and bitsandbytes) unimported."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from pods.config import TrainConfig; from pods.optimization import build_scheduler;"
        "build_scheduler(TrainConfig(lr_scheduler_type='cosine', max_steps=4),"
        " torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0));"
        "print(sorted({'peft', 'bitsandbytes', 'transformers.optimization'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
