"""How well the sweep's 95% intervals hold, by simulation (pods.curve_simulation): for 2, 3 and 5 seeds per
arm, the share of experiments in which two identical arms get a "faster" or "slower" verdict (at most 5% is
the promise), the coverage of a true 1.5x and 2x speed-up (95% is the promise), the power to call a true
2x speed-up "faster", and the coverage of the accuracy intervals over seeds.

    python benchmarks/stats.py [--experiments 2000] [--tau 15] [--budget 120] [--every 5] [--smoke]

The default scenario: 30% -> 77% with a 15-s time constant, each seed's speed log-normal (15%), an
evaluation every 5 s on 500 problems (binomial noise), 120 s of training. docs/experiments.md prints its table.
"""

from __future__ import annotations

import argparse
import time

from pods.curve_simulation import METRICS, Scenario, accuracy_coverage, speedup_rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", type=int, default=2000, help="simulated experiments per cell")
    parser.add_argument("--seeds", default="2,3,5", help="seeds per arm, comma-separated")
    parser.add_argument("--tau", type=float, default=Scenario.tau, help="the baseline's time constant (s)")
    parser.add_argument("--budget", type=float, default=Scenario.budget, help="seconds of training")
    parser.add_argument("--every", type=float, default=Scenario.every, help="seconds between evaluations")
    parser.add_argument("--problems", type=int, default=Scenario.problems, help="problems per evaluation")
    parser.add_argument("--seed_spread", type=float, default=Scenario.seed_spread, help="sd of log speed")
    parser.add_argument("--smoke", action="store_true", help="a few experiments, to check the script runs")
    args = parser.parse_args()
    experiments = 10 if args.smoke else args.experiments
    scenario = Scenario(
        tau=args.tau,
        budget=args.budget,
        every=args.every,
        problems=args.problems,
        seed_spread=args.seed_spread,
    )
    print(f"{scenario}, {experiments} experiments per cell")
    print()
    print(
        "| seeds | metric | identical arms: faster + slower (undetermined) | coverage 1.5x | coverage 2x | power at 2x |"
    )
    print("|---|---|---|---|---|---|")
    started = time.perf_counter()
    seed_counts = [int(s) for s in args.seeds.split(",")]
    for seeds in seed_counts:
        same = speedup_rates(scenario, 1.0, seeds, experiments, seed=seeds)
        faster_15 = speedup_rates(scenario, 1.5, seeds, experiments, seed=50 + seeds)
        double = speedup_rates(scenario, 2.0, seeds, experiments, seed=100 + seeds)
        for metric in METRICS:
            wrong = same[metric].faster + same[metric].slower
            print(
                f"| {seeds} | {metric} | {wrong:.1%} ({same[metric].undetermined:.1%}) | "
                f"{faster_15[metric].coverage:.1%} | {double[metric].coverage:.1%} | {double[metric].faster:.1%} |"
            )
    print()
    print("| seeds | coverage: accuracy at the budget | coverage: best accuracy |")
    print("|---|---|---|")
    for seeds in seed_counts:
        coverage = accuracy_coverage(scenario, seeds, experiments, seed=seeds)
        print(f"| {seeds} | {coverage['accuracy_at_budget']:.1%} | {coverage['best_accuracy']:.1%} |")
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
