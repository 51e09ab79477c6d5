"""Selection rules against brute force, and every error path of ``pods.selection.select``."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pods.selection import available_rules, register_rule, select, subset_variance, uses_lengths

REWARD_KINDS = ("binary", "multilevel", "continuous", "negative", "large_offset", "few_ties")


def make_rewards(kind: str, groups: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """A reward matrix of one of the kinds the rules must handle exactly."""
    shape = (groups, n)
    if kind == "binary":
        return torch.randint(0, 2, shape, generator=generator).double()
    if kind == "multilevel":
        levels = torch.tensor([0.0, 0.1, 1.0, 1.2], dtype=torch.float64)
        return levels[torch.randint(0, 4, shape, generator=generator)]
    if kind == "continuous":
        return torch.rand(shape, generator=generator, dtype=torch.float64)
    if kind == "negative":
        return -5.0 * torch.rand(shape, generator=generator, dtype=torch.float64)
    if kind == "large_offset":
        return 1e6 + 1e-3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "few_ties":
        return torch.randint(-2, 3, shape, generator=generator).double() * 0.5
    raise AssertionError(kind)


def brute_force_max_variance(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """Largest sample variance over every m-subset of each row: ``[G]``."""
    n = rewards.shape[1]
    subsets = torch.tensor(list(itertools.combinations(range(n), m)))  # [C, m]
    chosen = rewards[:, subsets]  # [G, C, m]
    if m == 1:
        return rewards.new_zeros(rewards.shape[0])
    centred = chosen - chosen.mean(dim=2, keepdim=True)
    return ((centred * centred).sum(dim=2) / (m - 1)).max(dim=1).values


def assert_valid_indices(indices: torch.Tensor, groups: int, n: int, m: int) -> None:
    assert indices.dtype == torch.long
    assert indices.shape == (groups, m)
    assert bool(((indices >= 0) & (indices < n)).all())
    for row in indices.tolist():
        assert len(set(row)) == m
        assert row == sorted(row)


@pytest.mark.parametrize("kind", REWARD_KINDS)
def test_max_variance_matches_brute_force_on_thousands_of_instances(kind: str) -> None:
    generator = torch.Generator().manual_seed(1234)
    beaten = 0  # instances where the m highest rewards are not a max-variance subset: the check has teeth
    for n in range(1, 13):
        for m in range(1, n + 1):
            groups = 60 if n <= 10 else 15
            rewards = make_rewards(kind, groups, n, generator)
            kept = select(rewards, m, "max_variance")
            assert_valid_indices(kept, groups, n, m)
            got = subset_variance(rewards, kept)
            best = brute_force_max_variance(rewards, m)
            scale = rewards.abs().max().item() if kind != "large_offset" else 1.0
            torch.testing.assert_close(got, best, rtol=1e-9, atol=1e-12 * max(scale, 1.0) ** 2)
            top = subset_variance(rewards, select(rewards, m, "max_reward"))
            beaten += int((top < best - 1e-9 * best.abs().clamp_min(1.0)).sum())
    assert beaten > 500


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(min_value=1, max_value=12),
    kind=st.sampled_from(REWARD_KINDS),
)
def test_max_variance_property(data: st.DataObject, n: int, kind: str) -> None:
    m = data.draw(st.integers(min_value=1, max_value=n))
    seed = data.draw(st.integers(min_value=0, max_value=2**31 - 1))
    rewards = make_rewards(kind, 3, n, torch.Generator().manual_seed(seed))
    kept = select(rewards, m)
    assert_valid_indices(kept, 3, n, m)
    torch.testing.assert_close(
        subset_variance(rewards, kept), brute_force_max_variance(rewards, m), rtol=1e-9, atol=1e-12
    )


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.floats(-1e3, 1e3), min_size=6, max_size=6), min_size=1, max_size=4),
    m=st.integers(1, 6),
)
def test_max_variance_on_arbitrary_floats(rows: list[list[float]], m: int) -> None:
    rewards = torch.tensor(rows, dtype=torch.float64)
    kept = select(rows, m)
    best = brute_force_max_variance(rewards, m)
    torch.testing.assert_close(subset_variance(rewards, kept), best, rtol=1e-9, atol=1e-7)


@pytest.mark.parametrize("factor", [1e200, 1e-300, -1e250])
def test_max_variance_is_scale_free_at_extreme_magnitudes(factor: float) -> None:
    """Squares of rewards above ~1e154 overflow and below ~1e-154 underflow; the subset must not change."""
    base = torch.rand(50, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = select(base, 4, "max_variance")
    assert torch.equal(select(base * factor, 4, "max_variance"), expected)
    assert torch.equal(select(1e300 + base * 1e290, 4, "max_variance"), expected)


def test_binary_rewards_take_correct_as_close_to_half_as_possible() -> None:
    n, m = 16, 8
    for correct in range(n + 1):
        rewards = torch.zeros(n)
        rewards[torch.randperm(n, generator=torch.Generator().manual_seed(correct))[:correct]] = 1.0
        kept = select(rewards, m)
        kept_correct = int(rewards[kept].sum())
        expected = min(max(m // 2, m - (n - correct)), correct)
        assert kept_correct == expected, (correct, kept_correct)


def test_ties_are_deterministic_and_documented() -> None:
    # All equal: the first m rollouts.
    assert select([3.0] * 6, 4).tolist() == [0, 1, 2, 3]
    # Odd m on binary rewards: one more low than high (fewest highest among equally good splits),
    # earliest rollouts among equal rewards on the low side.
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert select(rewards, 3).tolist() == [1, 3, 4]
    assert select(rewards, 3).tolist() == select(torch.tensor(rewards), 3).tolist()


def test_max_reward_and_all_and_random() -> None:
    rewards = torch.tensor([[0.5, 2.0, 1.0, 2.0, -1.0]])
    assert select(rewards, 2, "max_reward").tolist() == [[1, 3]]
    assert select(rewards, 5, "all").tolist() == [[0, 1, 2, 3, 4]]
    first = select(rewards.expand(50, 5), 3, "random", generator=torch.Generator().manual_seed(7))
    again = select(rewards.expand(50, 5), 3, "random", generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, again)
    assert_valid_indices(first, 50, 5, 3)
    assert len({tuple(row) for row in first.tolist()}) > 1  # not the same subset every time


def test_random_is_uniform_over_positions() -> None:
    kept = select(torch.zeros(20000, 8), 2, "random", generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(kept.flatten(), minlength=8).double()
    assert (counts / counts.sum() - 1 / 8).abs().max() < 0.01


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64])
def test_any_dtype_gives_the_float64_answer(dtype: torch.dtype) -> None:
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 3.0]])
    kept = select(rewards.to(dtype), 4)
    assert kept.tolist() == select(rewards.double(), 4).tolist()


def test_one_group_as_1d_input_returns_1d() -> None:
    kept = select([0.0, 1.0, 0.5, 1.0], 2)
    assert kept.ndim == 1 and kept.tolist() == [0, 3]  # highest side takes the later of equal rewards


def test_groups_never_mix() -> None:
    # Group 1 has all the high rewards; selection in group 0 must not be influenced by it.
    rewards = torch.tensor([[0.0, 0.1, 0.2, 0.3], [10.0, 20.0, 30.0, 40.0]])
    assert select(rewards, 2).tolist() == [[0, 3], [0, 3]]
    assert select(rewards[:1], 2).tolist() == [[0, 3]]


@pytest.mark.parametrize(
    ("rewards", "m", "rule", "message"),
    [
        ([[1.0, 2.0]], 3, "max_variance", "m=3"),
        ([[1.0, 2.0]], 0, "max_variance", "at least 1"),
        ([[1.0, float("nan")]], 1, "max_variance", "finite"),
        ([[1.0, float("inf")]], 1, "max_variance", "finite"),
        ([[[1.0]]], 1, "max_variance", "2-D"),
        (torch.zeros(0, 4), 1, "max_variance", "empty"),
        (torch.zeros(2, 0), 1, "max_variance", "empty"),
        ([[1.0, 2.0]], 1, "no_such_rule", "max_variance, max_reward, random, all"),
        ([[1.0, 2.0, 3.0]], 2, "all", "m must equal n"),
        ([[1.0, 2.0], [1.0]], 1, "max_variance", "equal-length"),
        ([[1.0, 2.0]], 1.0, "max_variance", "must be an int"),
        (torch.tensor([[1 + 1j, 2]]), 1, "max_variance", "complex"),
    ],
)
def test_bad_input_gets_a_clear_error(rewards: object, m: object, rule: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        select(rewards, m, rule)  # type: ignore[arg-type]


def test_registered_rule_is_used_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    import pods.selection

    # the registry is process-wide: the broken rules below must not reach later tests (pods demo lists every rule)
    monkeypatch.setattr(pods.selection, "_RULES", dict(pods.selection._RULES))

    def lowest(rewards: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
        return rewards.argsort(dim=1)[:, :m]

    register_rule("test_lowest_selection", lowest)
    assert "test_lowest_selection" in available_rules()
    assert select([[3.0, 1.0, 2.0]], 2, "test_lowest_selection").tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="already registered"):
        register_rule("test_lowest_selection", lowest)
    register_rule("test_lowest_selection", lowest, overwrite=True)
    with pytest.raises(ValueError, match="built-in"):
        register_rule("max_variance", lowest)

    bad_outputs = {
        "test_shape": (lambda r, m, g: torch.zeros(r.shape[0], m + 1, dtype=torch.long), "shape"),
        "test_range": (lambda r, m, g: torch.full((r.shape[0], m), r.shape[1], dtype=torch.long), "outside"),
        "test_dupes": (lambda r, m, g: torch.zeros(r.shape[0], m, dtype=torch.long), "same rollout twice"),
        "test_float": (lambda r, m, g: torch.zeros(r.shape[0], m), "integer"),
        "test_list": (lambda r, m, g: [[0] * m], "torch.Tensor"),
    }
    for name, (fn, message) in bad_outputs.items():
        register_rule(name, fn, overwrite=True)
        with pytest.raises(ValueError, match=message) as error:
            select([[3.0, 1.0, 2.0]], 2, name)
        assert name in str(error.value)


def test_callable_rule_without_registering() -> None:
    kept = select([[3.0, 1.0, 2.0, 0.0]], 2, lambda r, m, g: r.argsort(dim=1, descending=True)[:, :m])
    assert kept.tolist() == [[0, 2]]


def test_rule_name_validation() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        register_rule("", lambda r, m, g: r)
    with pytest.raises(ValueError, match="callable"):
        register_rule("x", 3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ length-aware rules (GFPO)


def brute_force_best_tokens(rewards: torch.Tensor, lengths: torch.Tensor, m: int) -> tuple[torch.Tensor, ...]:
    """Over every m-subset of each row: the largest sample variance, and the fewest tokens among the subsets
    that reach it (within rounding): ``([G], [G])``."""
    n = rewards.shape[1]
    subsets = torch.tensor(list(itertools.combinations(range(n), m)))
    variance = rewards[:, subsets].var(dim=2) if m > 1 else rewards.new_zeros(rewards.shape[0], len(subsets))
    best = variance.max(dim=1, keepdim=True).values
    tied = variance >= best - 1e-9 * best.abs().clamp_min(1e-12)
    tokens = lengths[:, subsets].sum(dim=2).masked_fill(~tied, float("inf"))
    return best.squeeze(1), tokens.min(dim=1).values


@pytest.mark.parametrize("kind", REWARD_KINDS)
def test_max_variance_shortest_matches_brute_force(kind: str) -> None:
    """Max variance exactly, and among every max-variance subset the fewest tokens: checked on every subset."""
    generator = torch.Generator().manual_seed(99)
    shorter = 0  # instances where plain max_variance keeps more tokens: the tie-break has teeth
    for n in range(1, 10):
        for m in range(1, n + 1):
            rewards = make_rewards(kind, 30, n, generator)
            lengths = torch.randint(1, 6, (30, n), generator=generator).double()
            kept = select(rewards, m, "max_variance_shortest", lengths=lengths)
            assert_valid_indices(kept, 30, n, m)
            best, fewest = brute_force_best_tokens(rewards, lengths, m)
            got = subset_variance(rewards, kept) if m > 1 else torch.zeros(30, dtype=torch.float64)
            torch.testing.assert_close(got, best, rtol=1e-9, atol=1e-12)
            assert torch.equal(lengths.gather(1, kept).sum(dim=1), fewest), (n, m)
            plain = lengths.gather(1, select(rewards, m, "max_variance")).sum(dim=1)
            shorter += int((plain > fewest).sum())
    assert shorter > (100 if kind in ("binary", "multilevel", "few_ties") else 0)


def test_shortest_and_reward_per_token_match_brute_force() -> None:
    generator = torch.Generator().manual_seed(3)
    for n in range(1, 9):
        for m in range(1, n + 1):
            rewards = make_rewards("multilevel", 40, n, generator)
            lengths = torch.randint(0, 7, (40, n), generator=generator).double()
            subsets = torch.tensor(list(itertools.combinations(range(n), m)))
            kept = select(rewards, m, "shortest", lengths=lengths)
            assert_valid_indices(kept, 40, n, m)
            fewest = lengths[:, subsets].sum(dim=2).min(dim=1).values
            assert torch.equal(lengths.gather(1, kept).sum(dim=1), fewest)
            kept = select(rewards, m, "reward_per_token", lengths=lengths)
            assert_valid_indices(kept, 40, n, m)
            tokens = lengths.clamp_min(1)
            efficiency = torch.where(rewards >= 0, rewards / tokens, rewards * tokens)
            best = (
                efficiency[:, subsets].sum(dim=2).max(dim=1).values
            )  # the m best ratios have the largest sum
            torch.testing.assert_close(efficiency.gather(1, kept).sum(dim=1), best, rtol=1e-12, atol=1e-12)


def test_reward_per_token_ranks_a_long_wrong_answer_below_a_short_one() -> None:
    """With negative rewards reward / length would prefer the longest wrong answer (-1/1000 > -1/10): a negative
    reward counts as reward x length instead, so the short wrong answer is kept and the long one is not."""
    rewards = torch.tensor([[1.0, -1.0, -1.0]])
    lengths = torch.tensor([[100.0, 10.0, 1000.0]])
    assert select(rewards, 2, "reward_per_token", lengths=lengths).tolist() == [[0, 1]]
    assert select(
        torch.tensor([[-2.0, -1.0, 0.0]]), 1, "reward_per_token", lengths=[[1.0, 5.0, 9.0]]
    ).tolist() == [[2]]  # zero beats every negative, whatever the lengths
    # reward x length: -2 in 1 token (-2) ranks above -1 in 5 tokens (-5), and below -1 in 1 token
    assert select(torch.tensor([[-2.0, -1.0]]), 1, "reward_per_token", lengths=[[1.0, 5.0]]).tolist() == [[0]]
    assert select(torch.tensor([[-2.0, -1.0]]), 1, "reward_per_token", lengths=[[1.0, 1.0]]).tolist() == [[1]]


def test_length_rules_break_ties_as_documented() -> None:
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])
    lengths = torch.tensor([[5.0, 2.0, 3.0, 2.0, 3.0, 9.0]])
    assert select(rewards, 2, "shortest", lengths=lengths).tolist() == [[1, 3]]  # equal lengths: earlier
    assert select(rewards, 2, "reward_per_token", lengths=lengths).tolist() == [[2, 4]]  # 1/3 twice: earlier
    # Max variance keeps one 1 and one 0: the shortest of each (1 -> position 2, 0 -> position 1).
    assert select(rewards, 2, "max_variance_shortest", lengths=lengths).tolist() == [[1, 2]]
    assert select(rewards, 2, "max_variance").tolist() == [[1, 4]]
    # A value on both sides of the split: [0, 1, 1, 1, 2] keeps 0, 2 and the two shortest 1s.
    rewards = torch.tensor([[1.0, 0.0, 1.0, 2.0, 1.0]])
    lengths = torch.tensor([[1.0, 8.0, 9.0, 8.0, 2.0]])
    assert select(rewards, 4, "max_variance_shortest", lengths=lengths).tolist() == [[0, 1, 3, 4]]


def test_rules_with_and_without_lengths_share_one_protocol() -> None:
    """Old three-argument user rules keep working (and get no lengths); a rule asking for lengths gets them."""
    seen: list[torch.Tensor] = []

    def longest(rewards: torch.Tensor, m: int, generator: torch.Generator | None, *, lengths: torch.Tensor):
        seen.append(lengths)
        return lengths.argsort(dim=1, descending=True, stable=True)[:, :m]

    register_rule("test_longest", longest, overwrite=True)
    assert uses_lengths("test_longest") and uses_lengths(longest)
    assert not uses_lengths("max_variance") and not uses_lengths(lambda r, m, g: r.argsort(dim=1)[:, :m])
    assert select([[0.0, 1.0, 2.0]], 2, "test_longest", lengths=[[3, 1, 2]]).tolist() == [[0, 2]]
    assert seen[0].dtype == torch.float64 and seen[0].tolist() == [[3.0, 1.0, 2.0]]
    assert select([0.0, 1.0, 2.0], 1, "shortest", lengths=[4, 2, 3]).tolist() == [1]  # one group, 1-D
    assert select(
        [[3.0, 1.0, 2.0]], 2, lambda r, m, g: r.argsort(dim=1)[:, :m], lengths=[[1, 1, 1]]
    ).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="'shortest' ranks completions by length: pass lengths"):
        select([[1.0, 2.0]], 1, "shortest")
    with pytest.raises(ValueError, match=r"lengths has shape \(1, 3\), but rewards has \(1, 2\)"):
        select([[1.0, 2.0]], 1, "shortest", lengths=[[1, 2, 3]])
    with pytest.raises(ValueError, match="non-negative"):
        select([[1.0, 2.0]], 1, "reward_per_token", lengths=[[1, -2]])
