"""Group-relative advantages against values computed by hand, and downsample (select + advantages + rows)."""

from __future__ import annotations

import math

import pytest
import torch

from pods.advantages import (
    aggregate_rewards,
    difficulty_counts,
    downsample,
    group_advantages,
    restore_signal,
    zero_variance_groups,
)
from pods.selection import select

NAN = float("nan")


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


# ------------------------------------------------------------------------------ several rewards, adaptive k, signal


def test_aggregate_rewards_sums_or_normalises_each_function_first() -> None:
    parts = torch.tensor([[[1.0, 10.0], [0.0, 30.0], [NAN, NAN]], [[2.0, NAN], [4.0, 5.0], [0.0, 5.0]]])
    weights = torch.tensor([1.0, 0.5])
    summed = aggregate_rewards(parts, weights)
    torch.testing.assert_close(summed[:, :2], torch.tensor([[6.0, 15.0], [2.0, 6.5]], dtype=torch.float64))
    assert summed[0, 2].isnan() and not summed[1, 2].isnan()  # every function None: unscorable
    gdpo = aggregate_rewards(parts, weights, "normalize_then_sum")
    # group 0: function 1 over (1, 0) -> (+-0.5 / std 0.7071), function 2 over (10, 30) -> (-+10 / 14.142)
    z1, z2 = 0.5 / (math.sqrt(0.5) + 1e-4), 10 / (math.sqrt(200) + 1e-4)
    torch.testing.assert_close(
        gdpo[0, :2], torch.tensor([z1 - 0.5 * z2, -z1 + 0.5 * z2], dtype=torch.float64)
    )
    # group 1: function 1 over (2, 4, 0), function 2 over (5, 5) only (None left out): a zero spread adds 0
    f1 = torch.tensor([2.0, 4.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(gdpo[1], (f1 - f1.mean()) / (f1.std() + 1e-4))
    with pytest.raises(ValueError, match="unknown multi_objective_aggregation"):
        aggregate_rewards(parts, weights, "mean")


def test_difficulty_counts_follow_the_quartiles_of_the_group_means() -> None:
    means = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.3, NAN])
    # quartiles of the finite means 0.1 .. 0.9: 0.3, 0.5, 0.7; above 0.7 easiest, at or below 0.3 hardest
    assert difficulty_counts(means, [2, 3, 4, 5]).tolist() == [2, 5, 4, 3, 5, 5]
    assert difficulty_counts(torch.tensor([0.5, 0.5, 0.5]), [2, 3, 4, 5]).tolist() == [5, 5, 5]  # ties share
    assert difficulty_counts(torch.tensor([NAN, NAN]), [2, 3, 4, 5]).tolist() == [5, 5]


def test_restore_signal_swaps_one_kept_rollout_where_a_spread_was_lost() -> None:
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    kept = torch.tensor([[0, 1], [0, 1], [0, 1]])
    valid = torch.ones(3, 2, dtype=torch.bool)
    lengths = torch.tensor([[5.0, 9.0, 7.0, 3.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    restored, changed = restore_signal(rewards, kept, valid, lengths)
    assert changed == 1  # the all-equal group has nothing to restore; the third already has a spread
    assert restored.tolist() == [[0, 3], [0, 1], [0, 1]]  # longest kept (9 tokens) out, shortest other (3) in
    by_position, _ = restore_signal(rewards, kept, valid)
    assert by_position[0].tolist() == [0, 2]  # without lengths: the last kept out, the first other in
    # a filler position holding the rollout brought in gets the one taken out (no rollout twice)
    fillers = restore_signal(rewards[:1], torch.tensor([[0, 1, 2]]), torch.tensor([[True, True, False]]))[0]
    assert fillers.tolist() == [[0, 2, 1]]


def test_downsample_keeps_k_per_group_and_fillers_weigh_nothing() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.9], [1.0, 0.0, 0.0, 1.0, 0.3]])
    chosen = downsample(rewards, 3, kept_counts=torch.tensor([2, 3]))
    assert chosen.trained.tolist() == [[True, True, False], [True, True, True]]
    assert chosen.kept[0, :2].tolist() == select(rewards[:1], 2).tolist()[0] == [0, 1]
    assert chosen.kept[1].tolist() == select(rewards[1:], 3).tolist()[0]
    assert chosen.kept[0, 2].item() not in (0, 1) and chosen.advantages[0, 2] == 0
    torch.testing.assert_close(chosen.advantages[0, :2], group_advantages(torch.tensor([[0.0, 1.0]]))[0])
    with pytest.raises(ValueError, match=r"counts must be in 1\.\.m = 3"):
        downsample(rewards, 3, kept_counts=torch.tensor([4, 3]))


def test_downsample_keep_signal_under_a_length_rule() -> None:
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    lengths = torch.tensor([[2.0, 3.0, 9.0, 8.0, 4.0]])
    plain = downsample(rewards, 2, "shortest", lengths=lengths)
    assert plain.kept.tolist() == [[0, 1]] and plain.advantages.abs().sum() == 0  # no signal left
    kept = downsample(rewards, 2, "shortest", lengths=lengths, keep_signal=True)
    assert kept.kept.tolist() == [[0, 3]] and kept.signal_restored == 1 and kept.advantages.abs().sum() > 0


def test_downsample_normalize_then_sum_trains_on_the_mode_over_the_kept_rows() -> None:
    parts = torch.tensor(
        [[[1.0, 3.0], [0.0, 2.0], [1.0, 0.0], [0.0, 9.0]], [[0.0, 1.0], [1.0, 1.0], [1.0, 4.0], [0.0, 0.0]]],
        dtype=torch.float64,
    )
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    ranked = aggregate_rewards(parts, weights, "normalize_then_sum")
    chosen = downsample(ranked, 2, components=parts, weights=weights)
    assert chosen.kept.tolist() == select(ranked, 2).tolist()
    kept = parts.gather(1, chosen.kept.unsqueeze(2).expand(-1, -1, 2))
    summed = (
        ((kept - kept.mean(dim=1, keepdim=True)) / (kept.std(dim=1, keepdim=True) + 1e-4)) * weights
    ).sum(2)
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    torch.testing.assert_close(chosen.advantages, expected)
