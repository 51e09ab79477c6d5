"""The reward metrics both trainers log (TRL's names and meanings), against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pods.metrics import reward_metrics


def test_reward_metrics_mean_what_trl_means() -> None:
    nan = float("nan")
    rewards = torch.tensor([[0.0, 1.0, 1.0, nan], [2.0, 2.0, 2.0, 2.0]])
    kept = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    metrics = reward_metrics(rewards, kept)
    scored = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert metrics["reward"] == pytest.approx(scored.mean().item())  # NaN (unscorable) left out
    assert metrics["reward_std"] == pytest.approx(scored.std().item())  # whole-batch std, as TRL's
    assert metrics["frac_reward_zero_std"] == 0.5
    assert metrics["pods/reward_kept"] == pytest.approx(1.25)
    assert metrics["pods/reward_std_kept"] == pytest.approx(torch.tensor([0.0, 1.0, 2.0, 2.0]).std().item())
    assert metrics["pods/frac_reward_zero_std_kept"] == 0.5
    # Mean within-group std: group 0's scored rewards (0, 1, 1) have std sqrt(1/3); group 1's have 0.
    assert metrics["pods/group_reward_std"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert metrics["pods/group_reward_std_kept"] == pytest.approx(math.sqrt(0.5) / 2)
