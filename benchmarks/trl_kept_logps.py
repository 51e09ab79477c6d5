"""Seconds the TRL wrapper saves per generation by computing old and reference log-probs on the m kept rows
only (TRL computes them on all n before rewards exist).

    python benchmarks/trl_kept_logps.py                  # n = 64, m = 16, 4 prompts, 32 tokens, 5 rounds
    python benchmarks/trl_kept_logps.py --smoke          # n = 4, m = 2, 4 tokens, 1 round: that it runs

One PODSTrainer (beta = 0.04 and num_iterations = 2, so TRL needs both reference and old log-probs) on the
random tiny Llama of the tests; each round times ``_generate_and_score_completions`` on the same inputs
and seed twice: the wrapper's way (kept rows) and TRL's way (all n rows, then the kept are taken).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset

from pods.integrations.trl import PODSConfig, PODSTrainer
from pods.testing import build_tiny_model


def token_sum_reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(ids) % 4) for ids in completion_ids]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--length", type=int, default=32, help="max completion tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="smallest size, a few seconds: that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.n, args.m, args.length, args.rounds = 4, 2, 4, 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        model = build_tiny_model(Path(folder) / "tiny")
        prompts = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": f"Question {i}"}]} for i in range(64)]
        )
        config = PODSConfig(
            output_dir=str(Path(folder) / "out"),
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            max_completion_length=args.length,
            num_generations=args.n,
            num_generations_kept=args.m,
            per_device_train_batch_size=args.n,  # one prompt per micro-batch of generation
            gradient_accumulation_steps=4,
            num_iterations=2,
            beta=0.04,
            seed=0,
        )
        trainer = PODSTrainer(str(model), token_sum_reward, config, prompts)
        trainer.model.train()
        inputs = next(iter(trainer.get_train_dataloader()))
        seconds: dict[str, list[float]] = {"kept rows": [], "all rows": []}
        for round_index in range(args.rounds + 1):
            for way in seconds:
                trainer._defer_logps = (
                    (lambda _: False) if way == "all rows" else PODSTrainer._defer_logps.__get__(trainer)
                )
                torch.manual_seed(round_index)
                start = time.perf_counter()
                trainer._generate_and_score_completions(inputs)
                if round_index:  # the first round warms up
                    seconds[way].append(time.perf_counter() - start)
    kept, every = (statistics.median(seconds[way]) for way in ("kept rows", "all rows"))
    groups = len(inputs) // args.n
    print(f"n={args.n}, m={args.m}, {groups} prompts x {args.length} tokens, {args.rounds} rounds (median):")
    print(f"  log-probs on all n rows : {every:.3f} s per generation")
    print(f"  log-probs on kept m rows: {kept:.3f} s per generation")
    print(f"  saved: {every - kept:.3f} s per generation ({100 * (every - kept) / every:.0f}%)")


if __name__ == "__main__":
    main()
