"""How fast the embedded task is made and solved: distinct problems generated per second, and (with
``--model``) the shipped model's sampling speed with HF ``generate`` and a KV cache.

    python benchmarks/arith_generation.py [--problems 50000] [--model] [--smoke]
"""

from __future__ import annotations

import argparse
import time

from pods.data.arith import format_prompt, format_solution, generate_problems, spec_for_difficulty


def problems_per_second(num_problems: int, *, difficulty: int = 1, split: str | None = None) -> float:
    """Distinct problems (question, answer, worked solution and prompt text) generated per second."""
    start = time.perf_counter()
    problems = generate_problems(num_problems, seed=0, spec=spec_for_difficulty(difficulty), split=split)
    for problem in problems:
        format_prompt(problem.question), format_solution(problem)
    return len(problems) / (time.perf_counter() - start)


def shipped_model_sampling_seconds(prompts: int, per_prompt: int) -> float:
    """Median seconds for the shipped model to sample ``per_prompt`` 32-token completions per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pods.embedded import default_model_path, sampling_seconds

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path()).eval()
    return sampling_seconds(model, tokenizer, prompts=prompts, per_prompt=per_prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=50_000)
    parser.add_argument("--model", action="store_true", help="also time the shipped model's sampling")
    parser.add_argument(
        "--smoke", action="store_true", help="smallest size, a few seconds (with the model): that it runs"
    )
    args = parser.parse_args()
    sampling_sizes = ((16, 4), (16, 16), (16, 64))
    if args.smoke:
        args.problems, args.model, sampling_sizes = 200, True, ((2, 2),)
    for difficulty in (1, 3, 5):
        for split in (None, "train", "test"):
            n = args.problems if split != "test" else args.problems // 10
            rate = problems_per_second(n, difficulty=difficulty, split=split)
            print(
                f"difficulty {difficulty}, split {split or 'any':5}: {rate:10,.0f} distinct problems/s ({n:,})"
            )
    if args.model:
        for prompts, per_prompt in sampling_sizes:
            seconds = shipped_model_sampling_seconds(prompts, per_prompt)
            print(
                f"shipped model: {prompts} prompts x {per_prompt} samples x 32 tokens: {seconds:.2f} s (median of 3)"
            )


if __name__ == "__main__":
    main()
