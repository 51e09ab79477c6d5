"""The prompt-level stages as pure functions: the group filter with bounded refill (DAPO), skipping prompts
before rollout (GRESO), the refill candidates of the prompt stream, and joining rounds of rollouts."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from pods.data.stream import PromptStream
from pods.prompt_filter import SampledGroups, fill_groups, passing_groups
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
    skip_prompts,
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


def test_fill_groups_takes_passing_groups_first_then_fills_in_order() -> None:
    passed = torch.tensor([False, True, False, True, True, False])
    assert fill_groups(passed, 2).tolist() == [1, 3]
    assert fill_groups(passed, 3).tolist() == [1, 3, 4]
    assert fill_groups(passed, 4).tolist() == [0, 1, 3, 4]  # bound hit: the first that did not pass fills
    assert fill_groups(passed, 6).tolist() == list(range(6))
    assert fill_groups(torch.zeros(4, dtype=torch.bool), 2).tolist() == [0, 1]
    with pytest.raises(ValueError, match="cannot train on 7 groups out of 6"):
        fill_groups(passed, 7)


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
    groups = sampled.take(fill_groups(sampled.passed, 2))
    assert groups.rewards.tolist() == [[0.0, 1.0], [1.0, 0.0]]
    assert groups.per_function["f"].tolist() == groups.rewards.tolist()
    assert real_tokens(groups.rollouts) == [real_tokens(sampled.all.rollouts)[row] for row in (2, 3, 6, 7)]
    assert groups.lengths.tolist() == [[2, 2], [1, 2]]
    assert (groups.rollouts.num_prompts, groups.rollouts.num_generations) == (2, 2)


# ------------------------------------------------------------------------------------------ GRESO


def test_group_outcomes() -> None:
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [NAN, NAN], [0.6, 0.6], [1.2, 1.2 + 1e-12]])
    assert group_outcomes(rewards).tolist() == [SOLVED, FAILED, INFORMATIVE, FAILED, SOLVED, SOLVED]
    assert group_outcomes(rewards, solved_reward=0.7).tolist()[4] == FAILED


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


def batches_from(start: int, size: int):
    """Candidate batches 0..size-1, size..2size-1, ... (as a prompt stream's candidates)."""
    for first in itertools.count(start, size):
        yield list(range(first, first + size))


def test_skip_prompts_keeps_each_candidate_with_its_probability() -> None:
    settings = GresoSettings()
    history = PromptHistory(
        streaks={i: (FAILED, 2) for i in range(0, 100_000, 2)}, exploration={SOLVED: 0.5, FAILED: 0.5}
    )
    chosen = skip_prompts(batches_from(0, 1000), history, settings, 1000, torch.Generator().manual_seed(0))
    assert len(chosen.ids) == 1000 and len(set(chosen.ids)) == 1000
    assert chosen.ids == sorted(chosen.ids)  # candidates in order, skipped ones left out
    seen = max(chosen.ids) + 1
    kept_streaky = sum(i % 2 == 0 for i in chosen.ids)
    assert all(i in chosen.ids for i in range(1, seen, 2))  # no history: always kept
    assert kept_streaky / (seen / 2) == pytest.approx(0.25, abs=0.03)  # 0.5 ** 2
    assert chosen.skipped == seen - 1000
    again = skip_prompts(batches_from(0, 1000), history, settings, 1000, torch.Generator().manual_seed(0))
    assert again == chosen  # the draws are the generator's: seeded, they repeat exactly


def test_skip_prompts_fills_up_with_skipped_ones_when_candidates_run_out() -> None:
    settings = GresoSettings(max_candidate_batches=2, min_keep_probability=1e-12)
    history = PromptHistory(streaks={i: (SOLVED, 60) for i in range(100) if i != 5})  # kept with p 1e-12
    chosen = skip_prompts(batches_from(0, 4), history, settings, 3, torch.Generator().manual_seed(1))
    assert chosen.ids == [5, 0, 1]  # two batches scanned: 5 kept, then the first two skipped ones
    assert chosen.skipped == 5  # 2, 3, 4, 6 and 7 were not generated


def test_greso_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="target_zero_variance"):
        GresoSettings(target_zero_variance=1.0)
    with pytest.raises(ValueError, match="exploration rates"):
        GresoSettings(initial_exploration=0.01)
    assert GresoSettings(0.3).targets == {SOLVED: pytest.approx(0.1), FAILED: pytest.approx(0.2)}


# ------------------------------------------------------------------------------------------ refill candidates


def test_refill_candidates_are_a_pure_function_of_the_step_and_disjoint_across_processes() -> None:
    rows = [{"prompt": str(i)} for i in range(40)]
    streams = [PromptStream(rows, 3, seed=5, rank=rank, world=2) for rank in (0, 1)]
    for step in (0, 7):
        drawn = [list(itertools.islice(stream.candidates(step), 4)) for stream in streams]
        step_prompts = set(drawn[0][0]) | set(drawn[1][0])
        for rank, stream in enumerate(streams):
            assert drawn[rank][0] == stream.indices(step)
            assert drawn[rank] == list(
                itertools.islice(PromptStream(rows, 3, 5, rank, 2).candidates(step), 4)
            )
        refills = [index for rank in (0, 1) for batch in drawn[rank][1:] for index in batch]
        assert len(refills) == len(set(refills)) == 18  # no prompt twice in a step, on any process
        assert not step_prompts & set(refills)
    assert (
        list(itertools.islice(streams[0].candidates(0), 2))[1]
        != list(itertools.islice(streams[0].candidates(1), 2))[1]
    )
    tiny = PromptStream(rows[:2], 2, seed=0, rank=0, world=1)  # nothing left to refill from: repeats
    assert sorted(next(itertools.islice(tiny.candidates(0), 1, 2))) == [0, 1]
