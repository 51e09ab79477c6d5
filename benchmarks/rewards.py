"""Reward-function throughput and agreement with human-checked labels, on the shared data.

Run from the project root: ``python benchmarks/rewards.py``. Prints a table of completions per second
for each reward, the agreement of ``accuracy_reward`` with the ``is_correct`` labels of real GSM8K model
solutions (gsm8k/example_model_solutions.jsonl), and the MATH-500 self-check through math-verify.
``--smoke`` uses the first 20 rows of each file: that it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pods.rewards import accuracy_reward, format_reward, math_accuracy_reward, tag_reward
from pods.rewards.symbolic import verify_with_math_verify

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rate(fn, completions: list, golds: list[str]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    scores = fn(None, completions, answer=golds)
    return len(completions) / (time.perf_counter() - start), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the first 20 rows of each file: that it runs")
    args = parser.parse_args()
    rows = 20 if args.smoke else None
    gsm = _jsonl(DATA / "gsm8k" / "test.jsonl")[:rows]
    solutions = [r["answer"] for r in gsm]
    golds = [s.rsplit("####", 1)[1].strip().replace(",", "") for s in solutions]
    print("| reward | data | completions/s |\n|---|---|---|")
    for fn in (accuracy_reward, format_reward, tag_reward):
        rate, _ = _rate(fn, solutions, golds)
        print(f"| {fn.__name__} | GSM8K test solutions ({len(solutions)}) | {rate:,.0f} |")

    examples = _jsonl(DATA / "gsm8k" / "example_model_solutions.jsonl")[:rows]
    texts, labels, gold_answers = [], [], []
    for row, gold in zip(examples, golds, strict=True):
        for value in row.values():
            if isinstance(value, dict) and "is_correct" in value:
                texts.append(value["solution"])
                labels.append(bool(value["is_correct"]))
                gold_answers.append(gold)
    rate, scores = _rate(accuracy_reward, texts, gold_answers)
    agree = sum((s == 1.0) == label for s, label in zip(scores, labels, strict=True))
    false_pos = sum(s == 1.0 and not label for s, label in zip(scores, labels, strict=True))
    false_neg = sum(s == 0.0 and label for s, label in zip(scores, labels, strict=True))
    print(f"| accuracy_reward | GSM8K model solutions ({len(texts)}) | {rate:,.0f} |")
    print(
        f"\nagreement with is_correct labels: {agree}/{len(texts)} ({100 * agree / len(texts):.2f}%), "
        f"{false_pos} scored 1 but labelled wrong, {false_neg} scored 0 but labelled right"
    )

    math = _jsonl(DATA / "math500" / "test.jsonl")[:rows]
    math_solutions, math_golds = [r["solution"] for r in math], [r["answer"] for r in math]
    math_accuracy_reward(None, ["\\boxed{1}"], answer=["1"])  # start the math-verify child untimed
    rate, scores = _rate(math_accuracy_reward, math_solutions, math_golds)
    print(
        f"\nmath_accuracy_reward, MATH-500 own solutions: {sum(scores):.0f}/{len(math)}, {rate:,.0f} completions/s"
    )
    start = time.perf_counter()
    verified = sum(verify_with_math_verify(s, g) for s, g in zip(math_solutions, math_golds, strict=True))
    seconds = time.perf_counter() - start
    print(
        f"math-verify alone (no fast path): {verified}/{len(math)} in {seconds:.1f} s ({len(math) / seconds:,.0f}/s)"
    )
    others = math_golds[1:] + math_golds[:1]
    _, crossed = _rate(math_accuracy_reward, math_solutions, others)
    same = sum(a == b for a, b in zip(math_golds, others, strict=True))
    print(
        f"MATH-500 solutions against the next problem's answer: {sum(crossed):.0f}/{len(math)} score 1 ({same} equal answers)"
    )


if __name__ == "__main__":
    main()
