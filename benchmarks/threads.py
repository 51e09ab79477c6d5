"""Seconds per training step by torch thread count and OpenMP wait policy, on a quiet machine and next to a
process that keeps one core busy: what falls off the "OpenMP cliff" (threads spinning at every barrier while
one of them waits for a core) and what does not; and the asynchronous mode (a rollout worker and the trainer,
one thread each) next to the synchronous one. pods sets OMP_WAIT_POLICY=PASSIVE unless the environment sets
it or GOMP_SPINCOUNT; libgomp's own default (what torch does without pods) spins 300,000 times first. Each case is a real `pods train` run in its own process; the
figure is the median step time after the first steps.

    python benchmarks/threads.py [--config embedded-hard] [--steps 12] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [  # name, pods train options, extra environment
    ("1 thread", {"torch_threads": 1}, {}),
    ("2 threads, waiting passively (pods's default)", {"torch_threads": 2}, {}),
    ("2 threads, spinning (libgomp's default)", {"torch_threads": 2}, {"GOMP_SPINCOUNT": "300000"}),
    ("async: worker 1 + trainer 1 thread", {"async_generation": True, "torch_threads": 1}, {}),
]


def busy_core() -> subprocess.Popen:
    """A process that keeps one core busy (a pure-Python loop), as a test or another job would."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def step_seconds(config: str, steps: int, options: dict, environment: dict) -> tuple[float, float]:
    """(median seconds per step after the first two, median generate seconds) of a `pods train` run."""
    with tempfile.TemporaryDirectory() as folder:
        overrides = {
            "max_steps": steps,
            "max_time": None,
            "eval_at_start": False,
            "eval_every_seconds": None,
            "eval_at_seconds": None,
            "save_final": False,
            "save_every_seconds": None,
            "progress": False,
            "output_dir": folder,
            **options,
        }
        arguments = [item for key, value in overrides.items() for item in (f"--{key}", json.dumps(value))]
        command = [sys.executable, "-m", "pods", "train", "--config", config, *arguments]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **environment}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"pods train failed:\n{result.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    late = rows[2:] or rows
    return statistics.median(r["seconds_step"] for r in late), statistics.median(
        r["seconds_generate"] for r in late
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="embedded-hard")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--num_generations", type=int, default=4, help="n (GRPO: 4; PODS: 16)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="3 steps of the first case, quiet only, HF generate (no vLLM start-up), 64 training rows",
    )
    args = parser.parse_args()
    steps = 3 if args.smoke else args.steps
    cases = CASES[:1] if args.smoke else CASES
    extra = {
        "num_generations": args.num_generations,
        "selection_rule": "all" if args.num_generations == 4 else "max_variance",
        **({"rollout_engine": "hf", "train_limit": 64} if args.smoke else {}),  # 64 rows: no 20,000 to load
    }
    if args.num_generations == 4:
        extra["num_generations_kept"] = 4
    print(f"{args.config}, n = {args.num_generations}, {steps} steps; median seconds per step (generating)")
    print("| case | quiet | one core busy | busy / quiet |")
    print("|---|---|---|---|")
    for name, options, environment in cases:
        quiet, quiet_generate = step_seconds(args.config, steps, {**extra, **options}, environment)
        if args.smoke:
            print(f"| {name} | {quiet:.2f} ({quiet_generate:.2f}) | - | - |")
            continue
        load = busy_core()
        time.sleep(0.5)
        try:
            busy, busy_generate = step_seconds(args.config, steps, {**extra, **options}, environment)
        finally:
            load.kill()
            load.wait()
        print(
            f"| {name} | {quiet:.2f} ({quiet_generate:.2f}) | {busy:.2f} ({busy_generate:.2f}) | {busy / quiet:.1f}x |"
        )


if __name__ == "__main__":
    main()
