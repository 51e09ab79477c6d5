"""Group-relative advantages against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pods.advantages import group_advantages, zero_variance_groups


def test_group_scale_matches_hand_computation() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    # Group 0: mean 0.5, unbiased std sqrt(1/3). Group 1: mean 0.25, unbiased std 0.5.
    std0 = math.sqrt(1 / 3)
    expected = torch.tensor(
        [
            [0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), 0.5 / (std0 + 1e-4)],
            [-0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0.75 / 0.5001],
        ]
    )
    torch.testing.assert_close(group_advantages(rewards), expected)


def test_batch_scale_uses_std_of_whole_batch() -> None:
    rewards = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]])
    batch_std = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 4.0]).std().item()
    expected = torch.tensor([[-1.0, 1.0], [0.0, 0.0], [-2.0, 2.0]]) / (batch_std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, scale="batch"), expected)


def test_none_scale_only_centres() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.2]])
    torch.testing.assert_close(group_advantages(rewards, scale="none"), torch.tensor([[0.6, -0.4, -0.2]]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_gives_exact_zeros(scale: str) -> None:
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.5]])
    advantages = group_advantages(rewards, scale=scale)
    assert torch.equal(advantages[0], torch.zeros(3))
    assert advantages[1].abs().sum() > 0
    assert zero_variance_groups(rewards).tolist() == [True, False]


def test_dtype_is_kept_and_integers_become_float32() -> None:
    assert group_advantages(torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert group_advantages(torch.tensor([[0, 1]])).dtype == torch.float32


def test_custom_eps() -> None:
    advantages = group_advantages(torch.tensor([[0.0, 2.0]]), eps=0.0)
    torch.testing.assert_close(advantages, torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2)]]))


@pytest.mark.parametrize(
    ("rewards", "kwargs", "message"),
    [
        (torch.zeros(3), {}, "2-D"),
        (torch.zeros(0, 2), {}, "non-empty"),
        (torch.zeros(2, 2), {"scale": "std"}, "group, batch, none"),
        (torch.zeros(2, 2), {"eps": -1.0}, "non-negative"),
    ],
)
def test_errors(rewards: torch.Tensor, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, **kwargs)
