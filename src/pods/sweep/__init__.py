"""Experiments as commands: a grid over one or two configuration keys (or named arms), times seeds, each
run trained under the same budget with evaluation off the clock, summarised with intervals over seeds.

Layout of a sweep folder::

    sweep.json                 what was asked (base config, arms, seeds, baseline)
    <arm>/seed<k>/             one training run (config.yaml, metrics.jsonl, eval.jsonl, ...), done.json when finished
    evaluations.csv            every evaluation of every run
    summary.json               per arm: accuracy at the budget, best accuracy, time to target, speed-ups
    accuracy_vs_time.png       mean curve per arm with a 95% band over seeds
    accuracy_vs_<key>.png      accuracy at the budget against the swept value (grids only)

Re-running the same command skips the finished runs and resumes an unfinished one from its latest
checkpoint (or restarts it when it has none), so an interrupted sweep continues where it stopped.
`pods compare` is this machinery with named arms (GRPO against PODS and the other rules).
"""

from pods.sweep.plan import (
    SWEEP_SETS,
    Arm,
    arm_config,
    check_plan,
    grid_arms,
    parse_arm,
    parse_grid,
    resolve_baselines,
)
from pods.sweep.run import SweepInterrupted, run_sweep
from pods.sweep.summary import (
    SeedRun,
    auto_against_best_fixed,
    format_summary,
    load_seed_run,
    summarise,
    summarise_and_write,
    write_evaluations_csv,
)

__all__ = [
    "SWEEP_SETS",
    "Arm",
    "SeedRun",
    "SweepInterrupted",
    "arm_config",
    "auto_against_best_fixed",
    "check_plan",
    "format_summary",
    "grid_arms",
    "load_seed_run",
    "parse_arm",
    "parse_grid",
    "resolve_baselines",
    "run_sweep",
    "summarise",
    "summarise_and_write",
    "write_evaluations_csv",
]
