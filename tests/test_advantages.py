"""Group-relative advantages against values computed by hand, and downsample (select + advantages + rows)."""

from __future__ import annotations

import math

import pytest
import torch

from pods.advantages import downsample, group_advantages, zero_variance_groups


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


def test_downsample_keeps_the_max_variance_rows_of_each_group_with_their_advantages() -> None:
    # Group 0 (n = 4): max variance of 2 is {0.0, 5.0} at positions 1 and 2. Group 1: {-3, 9} at 3 and 0.
    rewards = torch.tensor([[1.0, 0.0, 5.0, 2.0], [9.0, 1.0, 2.0, -3.0]])
    out = downsample(rewards, 2)
    assert out.kept.tolist() == [[1, 2], [0, 3]]
    assert out.rows.tolist() == [1, 2, 4, 7]  # group 1 starts at row n = 4
    assert out.rewards.tolist() == [[0.0, 5.0], [9.0, -3.0]]
    # Two kept values a < b: mean-centred +-(b - a)/2 over an unbiased std of (b - a)/sqrt(2).
    half = 1 / math.sqrt(2)
    expected = torch.tensor(
        [
            [-2.5 / (5 * half + 1e-4), 2.5 / (5 * half + 1e-4)],
            [6 / (12 * half + 1e-4), -6 / (12 * half + 1e-4)],
        ]
    )
    torch.testing.assert_close(out.advantages, expected)
    flat = rewards.flatten()
    assert torch.equal(flat[out.rows].view(2, 2), out.rewards)


def test_downsample_batch_scale_uses_the_gathered_kept_rewards() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    other_process = torch.tensor([[0.0, 10.0]])
    out = downsample(rewards, 2, scale="batch", gather=lambda kept: torch.cat([kept, other_process]))
    everything = torch.tensor([0.0, 1.0, 0.0, 10.0], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, torch.tensor([[-0.5, 0.5]]) / (everything.std() + 1e-4))
    local_only = downsample(rewards, 2, scale="batch")
    assert not torch.allclose(local_only.advantages, out.advantages)


def test_unscorable_completions_follow_trl_rule() -> None:
    """NaN (every reward function returned None): out of the mean and std, advantage 0, seen at the group mean."""
    nan = float("nan")
    rewards = torch.tensor([[nan, 1.0, 0.0, 0.2], [nan, 2.0, nan, 0.0]])
    out = downsample(rewards, 3)
    assert out.kept[0].tolist() == [1, 2, 3]  # the three scorable completions beat the unscorable one
    assert out.rewards[1].isnan().sum() == 1
    assert out.advantages[1][out.rewards[1].isnan()].item() == 0.0
    scored = out.rewards[1][~out.rewards[1].isnan()]
    expected = (scored - scored.mean()) / (scored.std() + 1e-4)
    torch.testing.assert_close(out.advantages[1][~out.rewards[1].isnan()], expected.float())
    assert downsample(torch.full((1, 4), nan), 2).advantages.tolist() == [[0.0, 0.0]]
