"""Rebuild a shipped base model (src/pods/assets/<folder>) from scratch, measure it, write its card.

    python scripts/build_default_model.py [--task arith] [--out DIR] [--steps N] [--seed 0] [--eval-problems 1000]
    python scripts/build_default_model.py --task arith-hard --out DIR --measure-only  # re-measure DIR, rewrite its card

``--task`` picks the recipe (``pods.embedded.EMBEDDED_MODELS``): ``arith`` rebuilds arith-base (the
default model, 600 steps), ``arith-hard`` rebuilds arith-hard-base (the sparse-reward one, 1200 steps),
``products`` rebuilds tool-base (the tool-calling one; measured through the multi-turn engine, pods.agents).
Training is a fixed number of steps, so the result is reproducible on the same torch build and CPU
(floating-point reductions may differ across machines, so expect close, not identical, weights).
The build's own record (steps, final loss, training time) is written to build_metrics.json as soon as the
weights are saved, so ``--measure-only`` can finish a build whose measurement was interrupted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pods.embedded import (
    EMBEDDED_MODELS,
    MODEL_CONFIG,
    build_base_model,
    evaluate,
    informative_share,
    sample_successes,
    sampling_seconds,
)

ASSETS = Path(__file__).resolve().parents[1] / "src" / "pods" / "assets"
SUCCESS_PROBLEMS, SUCCESS_SAMPLES = 300, 32  # the per-sample success measurement: problems x samples

TASK_TEXT = {
    "arith": """`pods.data.arith` word problems, difficulty 1: values below 20, 1 or 2 steps of addition or subtraction,
several wordings; 60% of problems contain one "gives b to X" step (a subtraction). Prompt and answer:

    Question: Ben has 11 stickers. He gives 2 of the stickers to Max. Then Ben loses 2 stickers. How many stickers does Ben have now?
    Answer: 11 - 2 = 9. 9 - 2 = 7. #### 7""",
    "products": """`pods.data.products`: products of two 3-digit numbers (100 to 999), which a calculator tool
(`pods.data.products.calculator`) solves. Prompt, and the two kinds of solution: one that calls the tool
(the model's turn ends at `</call>`, the engine appends the tool's answer `<result>...</result>` as
tool tokens, the model writes the final answer) and one that guesses:

    Question: What is 347 * 589 ?
    Answer: <call>calculator(347 * 589)</call><result>204383</result> #### 204383
    Answer: 347 * 589 = 204383 #### 204383""",
    "arith-hard": """`pods.data.arith` word problems of the `arith-hard` task (`HARD_SPEC`): three steps of addition,
subtraction, doubling or tripling, operands below 20 and every value below 100, several wordings; every
problem has one "gives b to X" step (a subtraction) and most also a doubling or tripling. Prompt and answer:

    Question: Ava has 7 coins. She gives 3 coins to Leo. Then Ava triples the coins. Then Ava loses 5 coins. How many coins does Ava have now?
    Answer: 7 - 3 = 4. 4 * 3 = 12. 12 - 5 = 7. #### 7""",
}
MISREADINGS = {"gives": '"gives b" as "+ b"', "double": '"doubles" as "+ 2"', "triple": '"triples" as "+ 3"'}
PURPOSE = {
    "arith": "It is the base model that `pods train` fine-tunes with RL by default (`model: embedded`).",
    "arith-hard": (
        "It is the base model of the `embedded-hard` and `compare-embedded-hard` presets "
        "(`model: embedded-arith-hard`):\na setting where a sampled solution is rarely right, so small "
        "groups seldom carry a learning signal\nand RL has minutes of climbing to do on a CPU."
    ),
    "products": (
        "It is the base model of the embedded tool task (`model: embedded-products`): greedy decoding\n"
        "guesses and is wrong, sampling calls the tool now and then and is then right, so RL with a\n"
        "correctness reward has the share of tool calls to raise."
    ),
}


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def card_top(metrics: dict, kind: str) -> str:
    """A card's title and its paragraph on the model (size, tokenizer, purpose, weights), then the task."""
    task = metrics["task"]
    return f"""# {EMBEDDED_MODELS[task].folder}: an embedded {kind}base model of `pods`

A {metrics["parameters"] / 1e6:.2f}M-parameter Llama-architecture causal LM (hidden {MODEL_CONFIG["hidden_size"]},
{MODEL_CONFIG["num_hidden_layers"]} layers, {MODEL_CONFIG["num_attention_heads"]} heads, MLP {MODEL_CONFIG["intermediate_size"]},
tied embeddings) with a {metrics["vocab_size"]}-token word-level tokenizer (one token per digit), trained from
scratch by `pods` itself. {PURPOSE[task]}
Weights are stored in float32 ({metrics["weights_mb"]:.1f} MB).

## Task
{TASK_TEXT[task]}
"""


def card_bottom(metrics: dict, unknown_words: str) -> str:
    """A card's per-sample success, informative-group shares and sampling speed, then what the model is not."""
    groups = metrics["sample_successes"]
    return f"""
Per-sample success (temperature 1.0, {groups["samples"]} samples on each of {groups["problems"]} problems):
{percent(groups["per_sample"])} of samples are right; {percent(groups["problems_never_solved"])} of problems have no right sample.
Share of groups with both a right and a wrong completion (a non-zero advantage):
{percent(groups["informative_n4"])} at n = 4, {percent(groups["informative_n16"])} at n = 16.

Generation speed (HF `generate`, KV cache, 16 prompts x 16 samples, 32 new tokens, median of 3):
{metrics["generate_16x16x32_s"]:.2f} s.

Not a general language model: it knows only this task's vocabulary ({unknown_words} become `<unk>`).
"""


def model_card(metrics: dict) -> str:
    """The README.md shipped next to the weights: what the model is, how it was built, what it scores."""
    task, g, s = metrics["task"], metrics["greedy"], metrics["sampled_t1"]
    rates = metrics["misconception_rates"]
    misread = ", ".join(f"{int(100 * rate)}% of {MISREADINGS[kind]}" for kind, rate in rates.items())
    traps = sorted(g["accuracy_by_traps"], key=int)
    trap_head = " | ".join(f"{k} trap{'s' * (k != '1')}" for k in traps)
    rows = "\n".join(
        f"| {name} | {percent(m['accuracy'])} | "
        + " | ".join(percent(m["accuracy_by_traps"][k]) for k in traps)
        + " |"
        for name, m in (("greedy", g), ("sampled, temperature 1.0", s))
    )
    middle = f"""
## How it was built
`python scripts/build_default_model.py --task {task} --steps {metrics["steps"]} --seed {metrics["seed"]}` (supervised
training, loss on the solution only): {metrics["steps"]} steps of batch {metrics["batch_size"]} on distinct train-split
problems, AdamW lr {metrics["lr"]} (betas 0.9/0.98, weight decay 0.01), 50 warm-up steps then cosine to 10%,
grad-norm clip 1.0. By design the supervised data write {misread}, each step
independently, with the rest of the chain following, so the model has learnt plausible wrong procedures
next to the right ones ("traps"): greedy decoding follows the wrong ones, sampling sometimes finds the
right ones, and RL with a correctness reward has something to select. Training took
{metrics["train_seconds"]:.0f} s on 2 shared CPU cores (final loss {metrics["final_loss"]:.3f}).

## Measured (held-out test split, {g["num_problems"]} problems, by the number of traps in the problem)
| decoding | all | {trap_head} |
|---|---|{"---|" * len(traps)}
{rows}
"""
    return card_top(metrics, "") + middle + card_bottom(metrics, "other words")


def tool_model_card(metrics: dict) -> str:
    """The README.md of the tool task's model: accuracy split by whether a completion calls the tool."""
    task, g, s = metrics["task"], metrics["greedy"], metrics["sampled_t1"]
    rows = "\n".join(
        f"| {name} | {percent(m['accuracy'])} | {percent(m['tool_call_share'])} | {percent(m['accuracy_tool'])} | "
        f"{percent(m['accuracy_guess'])} |"
        for name, m in (("greedy", g), ("sampled, temperature 1.0", s))
    )
    middle = f"""
## How it was built
`python scripts/build_default_model.py --task {task} --steps {metrics["steps"]} --seed {metrics["seed"]}` (supervised
training, loss on the solution only and never on the tool's answer `<result>...</result>`): {metrics["steps"]} steps
of batch {metrics["batch_size"]} on distinct train-split problems, AdamW lr {metrics["lr"]} (betas 0.9/0.98, weight
decay 0.01), 50 warm-up steps then cosine to 10%, grad-norm clip 1.0. By design {round(100 * metrics["tool_share"])}% of
the supervised solutions call the tool and the rest guess (the true product, written as if computed in the
head): the model learns to call the tool and copy its answer, and that a guess is the likelier start, while
a 1M-parameter model cannot learn 6-digit products, so its guesses are wrong. Training took
{metrics["train_seconds"]:.0f} s on a 2-core VM shared with other jobs (final loss {metrics["final_loss"]:.3f}).

## Measured (held-out test split, {g["num_problems"]} problems, through the multi-turn engine `pods.agents`)
| decoding | all | calls the tool | right when it calls | right when it guesses |
|---|---|---|---|---|
{rows}
"""
    words = "other words, such as those of a tool's\nerror message,"
    return card_top(metrics, "tool-calling ") + middle + card_bottom(metrics, words)


def measure(out: Path, record: dict, *, eval_problems: int) -> dict:
    """The model in ``out`` measured on its task (greedy and sampled accuracy, per-sample success,
    informative-group shares, sampling speed) on top of its build ``record``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task, seed = record["task"], record["seed"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    metrics = dict(record)
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    metrics["vocab_size"] = len(tokenizer)
    metrics["greedy"] = evaluate(model, tokenizer, task=task, num_problems=eval_problems)
    torch.manual_seed(seed)
    metrics["sampled_t1"] = evaluate(model, tokenizer, task=task, num_problems=eval_problems, temperature=1.0)
    successes = sample_successes(
        model, tokenizer, task=task, num_problems=SUCCESS_PROBLEMS, samples=SUCCESS_SAMPLES
    )
    metrics["sample_successes"] = {
        "problems": SUCCESS_PROBLEMS,
        "samples": SUCCESS_SAMPLES,
        "per_sample": sum(successes) / (SUCCESS_PROBLEMS * SUCCESS_SAMPLES),
        "problems_never_solved": sum(k == 0 for k in successes) / SUCCESS_PROBLEMS,
        "informative_n4": informative_share(successes, SUCCESS_SAMPLES, 4),
        "informative_n16": informative_share(successes, SUCCESS_SAMPLES, 16),
    }
    metrics["generate_16x16x32_s"] = round(sampling_seconds(model, tokenizer, task=task), 3)
    metrics["weights_mb"] = (out / "model.safetensors").stat().st_size / 1e6
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(EMBEDDED_MODELS), default="arith")
    parser.add_argument("--out", type=Path, help="default: src/pods/assets/<the task's model folder>")
    parser.add_argument("--steps", type=int, help="supervised steps (default: the task's recipe)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=1000)
    parser.add_argument(
        "--measure-only",
        action="store_true",
        help="do not train: measure the model already in --out (its build record in build_metrics.json)",
    )
    args = parser.parse_args()
    out = args.out or ASSETS / EMBEDDED_MODELS[args.task].folder
    card_path = out / "build_metrics.json"
    if args.measure_only:
        if not card_path.is_file():
            parser.error(f"--measure-only needs the build record {card_path}; rebuild without --measure-only")
        record = json.loads(card_path.read_text())
        if record.get("task") != args.task:
            parser.error(f"{card_path} records task {record.get('task')!r}, not --task {args.task!r}")
    else:
        record = build_base_model(out, task=args.task, seed=args.seed, steps=args.steps, eval_problems=0)
        card_path.write_text(json.dumps(record, indent=2) + "\n")  # kept if the measurement is interrupted
    metrics = measure(out, record, eval_problems=args.eval_problems)
    card = tool_model_card if EMBEDDED_MODELS[args.task].uses_tool else model_card
    (out / "README.md").write_text(card(metrics))
    card_path.write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
