"""Rebuild the shipped base model (src/pods/assets/arith-base) from scratch, measure it, write its card.

    python scripts/build_default_model.py [--out DIR] [--steps 600] [--seed 0] [--eval-problems 1000]

Training is a fixed number of steps, so the result is reproducible on the same torch build and CPU
(floating-point reductions may differ across machines, so expect close, not identical, weights).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pods.embedded import MODEL_CONFIG, build_base_model, evaluate, sampling_seconds

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "pods" / "assets" / "arith-base"


def model_card(metrics: dict) -> str:
    """The README.md shipped next to the weights: what the model is, how it was built, what it scores."""
    g, s = metrics["greedy"], metrics["sampled_t1"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    return f"""# arith-base: the embedded default model of `pods`

A {metrics["parameters"] / 1e6:.2f}M-parameter Llama-architecture causal LM (hidden {MODEL_CONFIG["hidden_size"]},
{MODEL_CONFIG["num_hidden_layers"]} layers, {MODEL_CONFIG["num_attention_heads"]} heads, MLP {MODEL_CONFIG["intermediate_size"]},
tied embeddings) with a {metrics["vocab_size"]}-token word-level tokenizer (one token per digit), trained from
scratch by `pods` itself. It is the base model that `pods train` fine-tunes with RL by default.
Weights are stored in float32 ({metrics["weights_mb"]:.1f} MB).

## Task
`pods.data.arith` word problems, difficulty 1: values below 20, 1 or 2 steps of addition or subtraction,
several wordings; 60% of problems contain one "gives b to X" step (a subtraction). Prompt and answer:

    Question: Ben has 11 stickers. He gives 2 of the stickers to Max. Then Ben loses 2 stickers. How many stickers does Ben have now?
    Answer: 11 - 2 = 9. 9 - 2 = 7. #### 7

## How it was built
`python scripts/build_default_model.py --steps {metrics["steps"]} --seed {metrics["seed"]}` (supervised training, loss on the
solution only): {metrics["steps"]} steps of batch {metrics["batch_size"]} on distinct train-split problems, AdamW lr
{metrics["lr"]} (betas 0.9/0.98, weight decay 0.01), 50 warm-up steps then cosine to 10%, grad-norm clip 1.0.
By design, {int(100 * metrics["misconception_rate"])}% of the "gives" steps in the supervised data are written as additions
(`11 + 2 = 13`) with the rest of the chain following, so the model has learnt a plausible wrong procedure
next to the right one: greedy decoding follows the wrong one, sampling sometimes finds the right one, and
RL with a correctness reward has something to select. Training took {metrics["train_seconds"]:.0f} s on 2 shared CPU cores
(final loss {metrics["final_loss"]:.3f}).

## Measured (held-out test split, {g["num_problems"]} problems, 2 shared CPU cores)
| decoding | all | with a "gives" step | without |
|---|---|---|---|
| greedy | {pct(g["accuracy"])} | {pct(g["accuracy_gives"])} | {pct(g["accuracy_other"])} |
| sampled, temperature 1.0 | {pct(s["accuracy"])} | {pct(s["accuracy_gives"])} | {pct(s["accuracy_other"])} |

Generation speed (HF `generate`, KV cache, 16 prompts x 16 samples, 32 new tokens, median of 3):
{metrics["generate_16x16x32_s"]:.2f} s.

Not a general language model: it knows only this task's vocabulary (other words become `<unk>`).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=1000)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = build_base_model(args.out, seed=args.seed, steps=args.steps, eval_problems=0)
    model = AutoModelForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    metrics["misconception_rate"] = 0.6
    metrics["vocab_size"] = len(tokenizer)
    metrics["greedy"] = evaluate(model, tokenizer, num_problems=args.eval_problems)
    torch.manual_seed(args.seed)
    metrics["sampled_t1"] = evaluate(model, tokenizer, num_problems=args.eval_problems, temperature=1.0)
    metrics["generate_16x16x32_s"] = round(sampling_seconds(model, tokenizer), 3)
    metrics["weights_mb"] = (args.out / "model.safetensors").stat().st_size / 1e6
    (args.out / "README.md").write_text(model_card(metrics))
    (args.out / "build_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
