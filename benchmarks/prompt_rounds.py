"""Rollouts per useful group of the prompt filter's round sizing, simulated: each group passes the filter with a
fixed probability p (no model, no engine), a step wants P groups that pass within max_num_gen_batches rounds.
Side by side: the sizing before 2026-12-05 (every round P prompts), pods's rounds sized to the shortfall with a
first round of P, and with ``generation_batch_prompts: auto``. The figure is the ratio of prompts generated per
group trained with a signal to what the share that passes allows (1 / p): the issue's goal is at most 1.2.

    python benchmarks/prompt_rounds.py [--steps 400] [--prompts 16] [--bound 4] [--smoke]
"""

from __future__ import annotations

import argparse

import torch

from pods.prompt_filter import PassShare, next_round_size


def simulate(
    p: float, policy: str, *, steps: int, wanted: int, bound: int, seed: int = 0
) -> tuple[float, float]:
    """(prompts generated per group trained with a signal, divided by 1 / p; rounds per step) over ``steps``."""
    generator = torch.Generator().manual_seed(seed)
    share, generated, useful, rounds = PassShare(), 0, 0, 0
    for _ in range(steps):
        passed, drawn, step_rounds = 0, 0, 0
        while True:
            if policy == "every round P":
                size = wanted if step_rounds == 0 or (passed < wanted and step_rounds < bound) else 0
            else:
                size = next_round_size(
                    rounds_run=step_rounds,
                    wanted=wanted,
                    missing=wanted - passed,
                    share=share.plus(passed, drawn).share,
                    prompt_filter="nonzero_std",
                    max_num_gen_batches=bound,
                    generation_batch_prompts="auto" if policy == "shortfall, auto first" else None,
                )
            if size == 0:
                break
            passed += int((torch.rand(size, generator=generator) < p).sum())
            drawn += size
            step_rounds += 1
        share = share.plus(passed, drawn)
        generated, useful, rounds = generated + drawn, useful + min(passed, wanted), rounds + step_rounds
    return generated / max(useful, 1) * p, rounds / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--prompts", type=int, default=16, help="P, groups a step trains on")
    parser.add_argument("--bound", type=int, default=4, help="max_num_gen_batches")
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check that it runs")
    args = parser.parse_args()
    steps = 20 if args.smoke else args.steps
    policies = ("every round P", "shortfall, P first", "shortfall, auto first")
    print(
        f"P = {args.prompts}, max_num_gen_batches = {args.bound}, {steps} steps; ratio to 1 / p (rounds per step)"
    )
    print("| p | " + " | ".join(policies) + " |")
    print("|---|" + "---|" * len(policies))
    for p in (0.1, 0.3, 0.5, 0.77, 0.95):
        cells = []
        for policy in policies:
            ratio, rounds = simulate(p, policy, steps=steps, wanted=args.prompts, bound=args.bound)
            cells.append(f"{ratio:.2f} ({rounds:.1f})")
        print(f"| {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
