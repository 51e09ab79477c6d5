"""How fast the embedded task is made and solved: distinct problems generated per second, and (with
``--model``) the shipped model's sampling speed with HF ``generate`` and a KV cache.

    python benchmarks/arith_generation.py [--problems 50000] [--model]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pods.data.arith import format_prompt, format_solution, generate_problems, spec_for_difficulty


def problems_per_second(num_problems: int, *, difficulty: int = 1, split: str | None = None) -> float:
    """Distinct problems (question, answer, worked solution and prompt text) generated per second."""
    start = time.perf_counter()
    problems = generate_problems(num_problems, seed=0, spec=spec_for_difficulty(difficulty), split=split)
    for problem in problems:
        format_prompt(problem.question), format_solution(problem)
    return len(problems) / (time.perf_counter() - start)


def sampling_seconds(prompts: int, per_prompt: int, new_tokens: int = 32, repeats: int = 3) -> float:
    """Median seconds for the shipped model to sample ``per_prompt`` completions of ``new_tokens`` tokens
    for each of ``prompts`` test prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pods.embedded import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(default_model_path()).eval()
    texts = [format_prompt(p.question) for p in generate_problems(prompts, seed=1, split="test")]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                num_return_sequences=per_prompt,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=50_000)
    parser.add_argument("--model", action="store_true", help="also time the shipped model's sampling")
    args = parser.parse_args()
    for difficulty in (1, 3, 5):
        for split in (None, "train", "test"):
            n = args.problems if split != "test" else args.problems // 10
            rate = problems_per_second(n, difficulty=difficulty, split=split)
            print(
                f"difficulty {difficulty}, split {split or 'any':5}: {rate:10,.0f} distinct problems/s ({n:,})"
            )
    if args.model:
        for prompts, per_prompt in ((16, 4), (16, 16), (16, 64)):
            seconds = sampling_seconds(prompts, per_prompt)
            print(
                f"shipped model: {prompts} prompts x {per_prompt} samples x 32 tokens: {seconds:.2f} s (median of 3)"
            )


if __name__ == "__main__":
    main()
