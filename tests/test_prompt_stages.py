"""The prompt-level stages as pure functions: the group filter with rounds sized to need (DAPO), skipping prompts
before rollout (GRESO), the prompt stream's draws, and joining rounds of rollouts."""

from __future__ import annotations

import json

import pytest
import torch

from pods.data.stream import PromptStream
from pods.errors import PromptFilterExhausted
from pods.prompt_filter import (
    MAX_ROUND_FACTOR,
    PassShare,
    SampledGroups,
    fill_groups,
    first_round_prompts,
    next_round_size,
    passing_groups,
    refill_prompts,
)
from pods.prompt_skip import (
    FAILED,
    INFORMATIVE,
    SOLVED,
    GresoSettings,
    PromptHistory,
    adapt_exploration,
    group_outcomes,
    keep_probabilities,
    record_outcomes,
    round_prompts,
    skip_candidates,
)
from pods.rollout.base import Rollouts, concat_rollouts

NAN = float("nan")

# ------------------------------------------------------------------------------------------ the filter


def test_nonzero_std_ignores_rounding_but_not_a_real_spread() -> None:
    rewards = torch.tensor(
        [
            [0.1 + 0.2, 0.3, 0.3, 0.3],  # 0.30000000000000004 against 0.3: rounding, no signal
            [1.1, float(torch.tensor(1.1, dtype=torch.float32)), 1.1, 1.1],  # a float32 reward among float64
            [0.0, 0.0, 0.0, 1e-9],  # a tiny reward scale is still a spread
            [NAN, 1.0, 1.0, 1.0],  # unscorable completions are left out
            [NAN, NAN, NAN, NAN],
            [0.0, 1.0, 1.0, 1.0],
        ],
        dtype=torch.float64,
    )
    assert passing_groups(rewards, "nonzero_std").tolist() == [False, False, True, False, False, True]
    assert passing_groups(rewards, "none").all()
    assert (rewards[0].max() - rewards[0].min()).item() > 0  # the rounding is real
    with pytest.raises(ValueError, match="unknown prompt_filter 'mean'; choose one of none, nonzero_std"):
        passing_groups(rewards, "mean")


def test_fill_groups_takes_passing_groups_first_then_ends_as_told() -> None:
    passed = torch.tensor([False, True, False, True, True, False])
    taken = lambda wanted, mode="pad": fill_groups(passed, wanted, mode)  # noqa: E731
    assert taken(2).positions.tolist() == [1, 3] and taken(2).trained.all()
    assert taken(3).positions.tolist() == [1, 3, 4]
    assert (
        taken(4).positions.tolist() == [0, 1, 3, 4] and taken(4).trained.all()
    )  # pad: trained at advantage 0
    fewer = taken(4, "train_fewer")  # the same groups keep shapes, the one that failed weighs nothing
    assert fewer.positions.tolist() == [0, 1, 3, 4] and fewer.trained.tolist() == [False, True, True, True]
    assert taken(3, "error").positions.tolist() == [1, 3, 4]
    with pytest.raises(PromptFilterExhausted, match=r"only 3 of the 4 groups.*max_num_gen_batches"):
        taken(4, "error")
    assert taken(6).positions.tolist() == list(range(6))
    assert taken(9).positions.tolist() == list(range(6))  # fewer generated than wanted (GRESO's shrink): all
    assert fill_groups(torch.zeros(4, dtype=torch.bool), 2, "train_fewer").trained.tolist() == [False, False]
    with pytest.raises(ValueError, match="unknown prompt_filter_exhausted 'drop'"):
        taken(2, "drop")


def test_round_sizes_follow_the_share_that_passes() -> None:
    """First round: P, a number, or P / share (auto); a refill: missing / share x 1.25; rounded up to the
    engine's multiple; at most 8 P; 0 once nothing is missing or the bound is hit (0 = no bound)."""
    assert first_round_prompts(16, None, 0.25) == 16
    assert first_round_prompts(16, 40, 0.25) == 40
    assert first_round_prompts(16, "auto", None) == 16  # nothing measured yet
    assert first_round_prompts(16, "auto", 0.25) == 64
    assert first_round_prompts(16, "auto", 0.3) == 54  # 53.3 rounded up
    assert first_round_prompts(16, "auto", 0.9, multiple=8) == 24  # 17.8 -> 18 -> a multiple of 8
    assert first_round_prompts(16, "auto", 1.0) == 16
    assert first_round_prompts(16, "auto", 0.01) == MAX_ROUND_FACTOR * 16
    assert refill_prompts(1, 16, 0.77) == 2  # 1 / 0.77 x 1.25 = 1.6: two prompts, not a round of 16
    assert refill_prompts(3, 16, 0.5) == 8  # 7.5
    assert refill_prompts(3, 16, 0.5, multiple=4) == 8
    assert refill_prompts(3, 16, 0.5, multiple=16) == 16
    assert refill_prompts(3, 16, None) == 4  # no measurement: the shortfall x 1.25
    size = lambda **kw: next_round_size(  # noqa: E731
        **{
            "rounds_run": 1,
            "wanted": 16,
            "missing": 3,
            "share": 0.5,
            "prompt_filter": "nonzero_std",
            "max_num_gen_batches": 4,
            **kw,
        }
    )
    assert size(rounds_run=0, generation_batch_prompts="auto") == 32
    assert size() == 8 and size(rounds_run=3) == 8
    assert size(rounds_run=4) == 0  # the bound
    assert size(rounds_run=40, max_num_gen_batches=0) == 8  # no bound
    assert size(missing=0) == 0 and size(prompt_filter="none") == 0


def test_the_running_share_decays_the_past_and_is_smoothed() -> None:
    share = PassShare()
    assert share.share is None
    share = share.plus(passed=0, drawn=2)
    assert share.share == pytest.approx(1 / 4)  # Laplace: two failures do not make the share 0
    share = share.plus(passed=30, drawn=40)  # the earlier step weighs half
    assert (share.passed, share.drawn) == (30, 41) and share.share == pytest.approx(31 / 43)
    assert PassShare.from_state(json.loads(json.dumps(share.to_state()))) == share
    assert PassShare.from_state(None) == PassShare()


def rollouts(prompt_lengths: list[int], completion_lengths: list[int], n: int, start: int) -> Rollouts:
    """Rows whose token ids count up from ``start`` (so every token is traceable), padded with -1."""
    rows = len(prompt_lengths)
    prompt_ids = torch.full((rows, max(prompt_lengths)), -1)
    completion_ids = torch.full((rows, max(completion_lengths)), -1)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        prompt_ids[row, -p:] = torch.arange(start, start + p)
        completion_ids[row, :c] = torch.arange(start + 100, start + 100 + c)
        start += 1000
    return Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=(prompt_ids >= 0).long(),
        completion_ids=completion_ids,
        completion_mask=(completion_ids >= 0).long(),
        texts=[f"text {row}" for row in range(rows)],
        truncated=torch.zeros(rows, dtype=torch.bool),
        num_prompts=rows // n,
        num_generations=n,
        sampling_logprobs=-(completion_ids >= 0).float(),
    )


def real_tokens(batch: Rollouts) -> list[tuple[list[int], list[int]]]:
    return [
        (p[pm.bool()].tolist(), c[cm.bool()].tolist())
        for p, pm, c, cm in zip(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, strict=True
        )
    ]


def test_rounds_join_with_prompts_padded_left_and_completions_right() -> None:
    first = rollouts([2, 2, 3, 3], [1, 4, 2, 2], n=2, start=0)
    second = rollouts([5, 5], [6, 3], n=2, start=50_000)
    joined = concat_rollouts([first, second], pad_id=7)
    assert (joined.num_prompts, joined.num_generations, len(joined)) == (3, 2, 6)
    assert joined.prompt_ids.shape == (6, 5) and joined.completion_ids.shape == (6, 6)
    assert real_tokens(joined) == real_tokens(first) + real_tokens(second)
    assert joined.prompt_mask[0].tolist() == [0, 0, 0, 1, 1]  # left-padded
    assert joined.completion_mask[0].tolist() == [1, 0, 0, 0, 0, 0]  # right-padded
    assert joined.prompt_ids[0, 0].item() == 7 and joined.completion_ids[0, -1].item() == 7
    assert torch.equal(joined.sampling_logprobs, -joined.completion_mask.float())
    assert joined.texts == first.texts + second.texts
    with pytest.raises(ValueError, match="different n"):
        concat_rollouts([first, rollouts([1, 1, 1], [1, 1, 1], n=3, start=0)])


def test_sampled_groups_take_whole_groups_across_rounds() -> None:
    sampled = SampledGroups("nonzero_std")
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    sampled.add([10, 11], rollouts([2, 2, 3, 3], [1, 4, 2, 2], n=2, start=0), rewards, {"f": rewards})
    more = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    sampled.add(
        [12, 13], rollouts([5, 5, 1, 1], [6, 3, 1, 2], n=2, start=50_000), more, {"f": more}, skipped=3
    )
    assert sampled.passed.tolist() == [False, True, False, True] and sampled.num_passed == 2
    assert (sampled.ids, sampled.skipped) == ([10, 11, 12, 13], 3)
    groups = sampled.take(fill_groups(sampled.passed, 2).positions)
    assert groups.rewards.tolist() == [[0.0, 1.0], [1.0, 0.0]]
    assert groups.per_function["f"].tolist() == groups.rewards.tolist()
    assert real_tokens(groups.rollouts) == [real_tokens(sampled.all.rollouts)[row] for row in (2, 3, 6, 7)]
    assert groups.lengths.tolist() == [[2, 2], [1, 2]]
    assert (groups.rollouts.num_prompts, groups.rollouts.num_generations) == (2, 2)


# ------------------------------------------------------------------------------------------ GRESO


def test_group_outcomes() -> None:
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [NAN, NAN], [0.6, 0.6], [1.2, 1.2 + 1e-12]])
    assert group_outcomes(rewards).tolist() == [SOLVED, FAILED, INFORMATIVE, FAILED, SOLVED, SOLVED]
    assert group_outcomes(rewards, GresoSettings(solved_reward=0.7)).tolist()[4] == FAILED


def test_greso_thresholds_for_non_binary_rewards() -> None:
    """GRESO's own classification: a mean of at least 0.98 is solved, at most 0.11 failed, equal or not."""
    rewards = torch.tensor([[1.0, 0.97], [1.0, 1.0], [0.1, 0.0], [0.2, 0.2], [0.5, 0.4], [1.1, 1.1]])
    greso = GresoSettings(solved_mean=0.98, failed_mean=0.11)
    assert group_outcomes(rewards, greso).tolist() == [
        SOLVED,
        SOLVED,
        FAILED,
        INFORMATIVE,
        INFORMATIVE,
        SOLVED,
    ]
    assert group_outcomes(rewards).tolist() == [INFORMATIVE, SOLVED, INFORMATIVE, FAILED, INFORMATIVE, SOLVED]
    only_solved = group_outcomes(rewards, GresoSettings(solved_mean=0.98)).tolist()
    assert only_solved == [SOLVED, SOLVED, INFORMATIVE, FAILED, INFORMATIVE, SOLVED]
    with pytest.raises(ValueError, match="failed_mean"):
        GresoSettings(solved_mean=0.5, failed_mean=0.6)


def test_keep_probability_is_greso_formula_with_its_floor() -> None:
    settings = GresoSettings()
    history = PromptHistory(
        streaks={1: (SOLVED, 2), 2: (FAILED, 1), 3: (FAILED, 10), 4: (SOLVED, 10)},
        exploration={SOLVED: 0.5, FAILED: 0.8},
    )
    expected = [0.5**2, 0.8, 0.8**10, 0.01, 1.0]  # 0.5 ** 10 < 0.01: the exploration floor
    assert keep_probabilities(history, [1, 2, 3, 4, 5], settings).tolist() == pytest.approx(expected)


def test_history_counts_streaks_of_one_kind_and_forgets_informative_groups() -> None:
    start = PromptHistory(streaks={1: (SOLVED, 3), 2: (FAILED, 1), 3: (SOLVED, 1)})
    after = record_outcomes(
        start, [1, 2, 3, 4, 4, 5], [SOLVED, SOLVED, INFORMATIVE, FAILED, FAILED, INFORMATIVE]
    )
    assert after.streaks == {1: (SOLVED, 4), 2: (SOLVED, 1), 4: (FAILED, 2)}
    assert start.streaks == {1: (SOLVED, 3), 2: (FAILED, 1), 3: (SOLVED, 1)}  # pure: the input is unchanged
    assert after.exploration == start.exploration


def test_exploration_rates_move_towards_their_targets_within_bounds() -> None:
    settings = GresoSettings(target_zero_variance=0.3)  # targets: 0.1 solved, 0.2 failed
    history = PromptHistory.start(settings)
    # 1 solved and 1 failed of 10: solved reaches its target (skip more), failed does not (skip less).
    outcomes = [SOLVED, FAILED] + [INFORMATIVE] * 8
    moved = adapt_exploration(history, outcomes, settings)
    assert moved.exploration == {SOLVED: pytest.approx(0.49), FAILED: pytest.approx(0.51)}
    for _ in range(100):
        history = adapt_exploration(history, [SOLVED, FAILED], settings)
    assert history.exploration == {SOLVED: 0.05, FAILED: 0.05}
    for _ in range(100):
        history = adapt_exploration(history, [INFORMATIVE], settings)
    assert history.exploration == {SOLVED: 0.95, FAILED: 0.95}
    assert adapt_exploration(history, [], settings) == history


def test_history_survives_a_json_round_trip() -> None:
    history = PromptHistory(
        streaks={7: (SOLVED, 2), 3: (FAILED, 5)}, exploration={SOLVED: 0.47, FAILED: 0.53}
    )
    state = json.loads(json.dumps(history.to_state()))
    assert state["streaks"] == [[3, FAILED, 5], [7, SOLVED, 2]]
    assert PromptHistory.from_state(state, GresoSettings()) == history
    assert PromptHistory.from_state(None, GresoSettings(initial_exploration=0.6)).exploration == {
        SOLVED: 0.6,
        FAILED: 0.6,
    }


def drawing(start: int = 0):
    """A ``draw(count)`` over candidates start, start + 1, ... (as the prompt stream's), and what it drew."""
    drawn = []

    def draw(count: int) -> list[int]:
        first = start + len(drawn)
        drawn.extend(range(first, first + count))
        return list(range(first, first + count))

    return draw, drawn


STREAKY = PromptHistory(  # even prompts failed twice in a row: kept with probability 0.5 ** 2
    streaks={i: (FAILED, 2) for i in range(0, 100_000, 2)}, exploration={SOLVED: 0.5, FAILED: 0.5}
)


def test_skip_candidates_keeps_each_candidate_with_its_probability() -> None:
    ids = list(range(4000))
    kept, skipped = skip_candidates(ids, STREAKY, GresoSettings(), torch.Generator().manual_seed(0))
    assert sorted(kept + skipped) == ids and kept == sorted(kept) and skipped == sorted(skipped)
    assert all(i in kept for i in range(1, 4000, 2))  # no history: always kept
    assert sum(i % 2 == 0 for i in kept) / 2000 == pytest.approx(0.25, abs=0.03)
    again = skip_candidates(ids, STREAKY, GresoSettings(), torch.Generator().manual_seed(0))
    assert again == (kept, skipped)  # the draws are the generator's: seeded, they repeat exactly


def test_shrink_generates_for_the_kept_candidates_only() -> None:
    draw, drawn = drawing()
    chosen = round_prompts(
        draw, 400, settings=GresoSettings(), history=STREAKY, generator=torch.Generator().manual_seed(0)
    )
    assert drawn == list(range(400))  # one draw of the round's size
    assert len(chosen.ids) + chosen.skipped == 400 and chosen.skipped > 100
    assert all(i in chosen.ids for i in range(1, 400, 2))
    # another process kept more: this one tops up with its first skipped, to generate as many
    draw, _ = drawing()
    topped = round_prompts(
        draw,
        400,
        settings=GresoSettings(),
        history=STREAKY,
        generator=torch.Generator().manual_seed(0),
        most=lambda value: max(value, 300),
    )
    assert len(topped.ids) == 300 and topped.skipped == 100
    assert set(chosen.ids) < set(topped.ids)
    # everything skipped: one prompt is generated after all (a round never generates for nothing)
    solved = PromptHistory(streaks={i: (SOLVED, 60) for i in range(10)})
    draw, _ = drawing()
    none_kept = round_prompts(
        draw,
        4,
        settings=GresoSettings(min_keep_probability=1e-12),
        history=solved,
        generator=torch.Generator().manual_seed(1),
    )
    assert none_kept.ids == [0] and none_kept.skipped == 3


def test_replace_draws_more_candidates_until_the_round_is_full() -> None:
    settings = GresoSettings(max_candidate_batches=2, min_keep_probability=1e-12)
    history = PromptHistory(streaks={i: (SOLVED, 60) for i in range(100) if i != 5})  # kept with p 1e-12
    draw, drawn = drawing()
    chosen = round_prompts(
        draw,
        3,
        settings=settings,
        history=history,
        generator=torch.Generator().manual_seed(1),
        mode="replace",
    )
    assert drawn == list(range(6))  # two batches of 3 scanned
    assert (
        chosen.ids == [5, 0, 1] and chosen.skipped == 3
    )  # 5 kept, then the first skipped; 2, 3, 4 not generated
    draw, drawn = drawing()
    full = round_prompts(
        draw,
        400,
        settings=GresoSettings(),
        history=STREAKY,
        generator=torch.Generator().manual_seed(0),
        mode="replace",
    )
    assert len(full.ids) == 400 and len(drawn) > 400 and full.skipped > 0
    draw, _ = drawing()
    plain = round_prompts(draw, 4, settings=None, history=None, generator=None)
    assert (plain.ids, plain.skipped) == ([0, 1, 2, 3], 0)


def test_greso_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="target_zero_variance"):
        GresoSettings(target_zero_variance=1.0)
    with pytest.raises(ValueError, match="exploration rates"):
        GresoSettings(initial_exploration=0.01)
    assert GresoSettings(0.3).targets == {SOLVED: pytest.approx(0.1), FAILED: pytest.approx(0.2)}


# ------------------------------------------------------------------------------------------ the prompt stream


def test_the_stream_gives_each_process_its_own_slice_and_each_prompt_once_per_epoch() -> None:
    rows = [{"prompt": str(i)} for i in range(40)]
    streams = [PromptStream(rows, seed=5, rank=rank, world=2) for rank in (0, 1)]
    cursor, seen = 0, []
    for count in (3, 5, 1, 8, 3):  # rounds of different sizes, the same on both processes
        drawn = [stream.draw(cursor, count) for stream in streams]
        assert len(drawn[0]) == len(drawn[1]) == count and not set(drawn[0]) & set(drawn[1])
        seen += drawn[0] + drawn[1]
        cursor += count
    assert len(seen) == len(set(seen)) == 40  # one epoch: every prompt exactly once
    assert streams[0].epoch(cursor) == 1.0
    assert PromptStream(rows, seed=5, rank=1, world=2).draw(3, 5) == streams[1].draw(3, 5)  # a pure function
    assert streams[0].draw(20, 4) != streams[0].draw(0, 4)  # the next epoch's order differs
    assert sorted(streams[0].draw(20, 20) + streams[1].draw(20, 20)) == list(range(40))
