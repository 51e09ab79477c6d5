"""Time per call of max-variance selection: ours (vectorised, O(n log n)) against the reference
code's per-group Python loop (sort, then recompute the variance of each of the m + 1 candidates) and
brute force over all subsets where that is feasible. All measured side by side in one run.

    python benchmarks/selection.py [--repeats 5] [--threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable

import torch

from pods.selection import select, subset_variance


def per_group_loop(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """How the paper's reference code selects: one group at a time, each candidate's variance recomputed."""
    kept = []
    for row in rewards:
        values, order = torch.sort(row)
        n = row.shape[0]
        best_var, best = -1.0, None
        for k in range(m + 1):
            candidate = torch.cat([order[:k], order[n - (m - k) :]])
            var = values[torch.cat([torch.arange(k), torch.arange(n - (m - k), n)])].var().item()
            if var > best_var:
                best_var, best = var, candidate
        kept.append(best)
    return torch.stack(kept)


def brute_force(rewards: torch.Tensor, m: int) -> torch.Tensor:
    subsets = torch.tensor(list(itertools.combinations(range(rewards.shape[1]), m)))
    variances = rewards[:, subsets].var(dim=2)
    return subsets[variances.argmax(dim=1)]


def seconds_per_call(fn: Callable[..., object], *args: object, repeats: int, budget: float = 20.0) -> float:
    fn(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
        if sum(times) > budget:
            break
    return sorted(times)[len(times) // 2]


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, one call each: that it runs")
    args = parser.parse_args()
    sizes, growth = ((1, 64, 1024), (16, 64, 256)), (16, 64, 256, 1024, 4096)
    if args.smoke:
        args.repeats, args.threads, sizes, growth = 1, 1, ((1, 4), (16,)), (16, 64)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of up to {args.repeats} calls\n"
    )
    print("| G | n | m | pods max_variance | per-group loop | speed-up | brute force |")
    print("|---|---|---|---|---|---|---|")
    for groups in sizes[0]:
        for n in sizes[1]:
            m = n // 4
            rewards = torch.randint(0, 2, (groups, n), generator=generator).double()
            rewards += 0.1 * torch.rand(groups, n, generator=generator, dtype=torch.float64)
            ours = seconds_per_call(select, rewards, m, repeats=args.repeats)
            loop = seconds_per_call(per_group_loop, rewards, m, repeats=args.repeats)
            ours_var = subset_variance(rewards, select(rewards, m))
            loop_var = subset_variance(rewards, per_group_loop(rewards, m))
            assert torch.allclose(ours_var, loop_var), "the loop and pods disagree"
            brute = None
            if math.comb(n, m) * groups <= 5e6:
                brute = seconds_per_call(brute_force, rewards, m, repeats=args.repeats)
                assert torch.allclose(ours_var, subset_variance(rewards, brute_force(rewards, m)))
            print(f"| {groups} | {n} | {m} | {fmt(ours)} | {fmt(loop)} | {loop / ours:.0f}x | {fmt(brute)} |")

    print("\nGrowth with n at G = 64, m = n/4 (pods max_variance):\n")
    print("| n | time per call | time / (G n log2 n) |")
    print("|---|---|---|")
    for n in growth:
        rewards = torch.rand(64, n, generator=generator, dtype=torch.float64)
        t = seconds_per_call(select, rewards, n // 4, repeats=args.repeats)
        print(f"| {n} | {fmt(t)} | {t / (64 * n * math.log2(n)) * 1e9:.2f} ns |")


if __name__ == "__main__":
    main()
