"""GPU check: PODS against GRPO on a larger model of the embedded recipe, one command, no network.

    PYTHONPATH=src python scripts/gpu_check.py            # one GPU: about 6 minutes on an H200
    PYTHONPATH=src python scripts/gpu_check.py --tiny     # seconds on a CPU: the same path, tiny sizes (CI)

1. Builds a base model of the embedded recipe (``pods.embedded``: the arithmetic task whose "gives" steps
   the supervised data writes wrongly 60% of the time) with tens of millions of parameters, trained from
   scratch on the GPU for ``--pretrain-seconds`` (bf16 autocast), and measures its greedy accuracy.
2. Runs ``pods compare`` on it: GRPO (n = m = 4) against PODS (n = 16, m = 4, max-variance), 64 prompts
   per step, bf16 mixed precision, the same training-time budget per arm and seed, evaluation off the clock.
3. Prints the base model's figures, the generation / update split of a step per arm, and the speed-ups
   with their intervals; writes everything under ``--out`` (``gpu_check.json`` holds the figures).

Needs torch, transformers, accelerate, rich, pyyaml, numpy and matplotlib; not ``datasets``, TRL or vLLM
(the data are built in memory).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pods.cli import quiet_libraries
from pods.compare import run_comparison
from pods.config import TrainConfig
from pods.data import arith
from pods.embedded import build_base_model
from pods.sweep import format_summary

GPU_SIZES = {  # ~34M parameters: 8 layers of width 512
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
TINY_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def arith_rows(split: str, count: int, seed: int) -> list[dict[str, str]]:
    """The task's rows (prompt, question, answer) built in memory, without the ``datasets`` package."""
    problems = arith.generate_problems(count, seed=seed, split=split)
    return [
        {"prompt": arith.format_prompt(p.question), "question": p.question, "answer": str(p.answer)}
        for p in problems
    ]


def compare_config(model_dir: Path, args: argparse.Namespace, device: str) -> TrainConfig:
    """The comparison's base: the embedded compare preset scaled up for a GPU (or down for --tiny)."""
    return TrainConfig(
        model=str(model_dir),
        task="arith",
        prompt_style="plain",
        num_generations=16,
        num_generations_kept=4,
        prompts_per_step=4 if args.tiny else 64,
        micro_batch_size=16 if args.tiny else 256,
        generation_batch_size=64 if args.tiny else 1024,
        max_completion_length=8 if args.tiny else 32,
        temperature=1.0,
        learning_rate=args.lr,
        mixed_precision="bf16" if device == "cuda" else "no",
        max_time=None if args.tiny else args.budget,
        max_steps=2 if args.tiny else None,
        eval_every_seconds=None if args.tiny else args.budget / 8,
        eval_at_seconds=[],  # the periodic evaluations alone
        eval_batch_size=8 if args.tiny else 1000,
        save_every_seconds=None,
        save_final=False,
        progress=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (a test of the path)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--pretrain-seconds", type=float, default=100.0)
    parser.add_argument("--budget", type=float, default=45.0, help="training seconds per arm and seed")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--lr", type=float, default=2e-5, help="RL learning rate (the compare preset's)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("gpu_check: no CUDA device here; run with --tiny for the CPU path")
    start = time.perf_counter()
    quiet_libraries()
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpu_check on {name}, torch {torch.__version__}", flush=True)

    base_dir = args.out / "base-model"
    built = build_base_model(
        base_dir,
        sizes=TINY_SIZES if args.tiny else GPU_SIZES,
        device=device,
        steps=3 if args.tiny else 20_000,
        batch_size=8 if args.tiny else 256,
        lr=1e-3,
        warmup_steps=1 if args.tiny else 100,
        max_seconds=None if args.tiny else args.pretrain_seconds,
        distinct_pairs=None if args.tiny else 150_000,
        eval_problems=20 if args.tiny else 1000,
        progress=False,
    )
    greedy = built["greedy"]
    print(
        f"base model: {built['parameters'] / 1e6:.1f}M parameters, {built['steps']} supervised steps of "
        f"{built['batch_size']} in {built['train_seconds']:.0f} s, loss {built['final_loss']:.3f}; greedy accuracy "
        f"{greedy['accuracy']:.1%} ({greedy['accuracy_gives']:.1%} with a 'gives' step, "
        f"{greedy['accuracy_other']:.1%} without)",
        flush=True,
    )

    seeds = [int(s) for s in args.seeds.split(",")]
    test_problems = 8 if args.tiny else 500  # eval_limit applies to loaded tasks, not to given rows
    rows = {
        "train_dataset": arith_rows("train", 20_000, 0),
        "eval_dataset": arith_rows("test", test_problems, 0),
    }
    summary = run_comparison(
        compare_config(base_dir, args, device),
        args.out / "compare",
        ["grpo", "pods"],
        seeds,
        trainer_kwargs=rows,
    )
    print("\n" + format_summary(summary))
    grpo, pods = summary["arms"]["grpo"], summary["arms"]["pods"]
    print("\nstep split (seconds per step, mean over seeds):")
    for arm, row in (("GRPO 4/4", grpo), ("PODS 16/4", pods)):
        print(
            f"  {arm}: generate {row['seconds_generate_per_step']:.3f} + update {row['seconds_update_per_step']:.3f} "
            f"= {row['seconds_per_step']:.3f} s (steps {row['steps']})"
        )
    ratio = pods["seconds_generate_per_step"] / max(grpo["seconds_generate_per_step"], 1e-9)
    print(f"  4x the rollouts cost {ratio:.2f}x the generation time of GRPO's")
    figures = {
        "device": name,
        "base_model": built,
        "summary": summary,
        "seconds": time.perf_counter() - start,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2))
    print(
        f"\nWritten: {args.out / 'gpu_check.json'}, {args.out / 'compare'} ({figures['seconds']:.0f} s in all)"
    )


if __name__ == "__main__":
    main()
