"""Step time of pods' trainer against TRL's ``GRPOTrainer`` on the same GRPO work, side by side in one run.

    python benchmarks/vs_trl.py                                   # 4 prompts x 8 completions x 32 tokens
    python benchmarks/vs_trl.py --length 128 --micro 8 --rounds 4
    python benchmarks/vs_trl.py --smoke                           # the smallest run: that it runs

Both trainers get the same random tiny Llama (its EOS lies outside the output vocabulary, so every
completion is exactly ``--length`` tokens and both do identical work), the same prompts, the same reward,
n = m (GRPO, rule ``all``), the same prompts per step, rows per optimizer step and micro-batch, beta = 0,
the same loss type, a constant learning rate, float32 and the same gradient-checkpointing setting (TRL
defaults to bf16 and checkpointing on: both set explicitly), and no evaluation, saving or logging. In TRL terms:
``per_device_train_batch_size`` = micro-batch rows, ``gradient_accumulation_steps`` = rows / micro,
``steps_per_generation`` = that too, so one generation feeds exactly one optimizer step, as in pods.

The two trainers alternate in one process: each round runs ``--steps`` steps of one, then of the other.
A step's time is the wall clock between the ends of consecutive steps (everything a step costs, data and
bookkeeping included); the first step of each call and the whole first round are warm-up and are dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_memory import build_word_model, word_prompts


def low_id_share(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """Reward (TRL's signature, used by both): share of completion tokens in the lower half of the ids."""
    return [sum(token < LOW_IDS for token in ids) / max(len(ids), 1) for ids in completion_ids]


LOW_IDS = 512


class Clock:
    """Timestamps of step ends, the wall-clock length of each step, and seconds per named phase."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.phase_seconds: dict[str, list[float]] = {}
        self._last: float | None = None

    def new_call(self) -> None:
        self._last = None  # the first step of a train() call has no previous end: warm-up, dropped

    def step_end(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.append(now - self._last)
        self._last = now

    def timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase_seconds.setdefault(phase, []).append(time.perf_counter() - start)

        return wrapper

    def reset(self) -> None:
        self.step_seconds, self.phase_seconds = [], {}


def make_pods(model_dir: str, prompts: list[str], args, workdir: str):
    """pods' trainer for ``args.steps`` GRPO steps per ``train()`` call, its clock wired in."""
    from datasets import Dataset

    from pods.config import TrainConfig
    from pods.trainer import PODSTrainer

    config = TrainConfig(
        model=model_dir,
        output_dir=workdir,
        num_generations=args.n,
        num_generations_kept=args.n,
        selection_rule="all",
        prompts_per_step=args.prompts,
        micro_batch_size=args.micro,
        generation_batch_size=args.prompts * args.n,
        max_completion_length=args.length,
        max_prompt_length=None,
        temperature=1.0,
        loss_type=args.loss_type,
        beta=0.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=args.steps,
        max_time=None,
        eval_at_start=False,
        eval_every_seconds=None,
        eval_at_seconds=[],
        save_every_seconds=None,
        save_final=False,
        progress=False,
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing,
        packing=not args.no_packing,
        rollout_engine="hf",  # both trainers generate with transformers (vLLM: benchmarks/rollout_engines.py)
    )
    trainer = PODSTrainer(
        config, reward_funcs=[low_id_share], train_dataset=Dataset.from_dict({"prompt": prompts})
    )
    clock = Clock()
    append = trainer.metrics_log.append
    step_metrics: list[dict] = []

    def append_and_tick(row: dict) -> None:
        append(row)
        step_metrics.append(row)
        clock.step_end()  # the row is written once per step, right after the update

    trainer.metrics_log.append = append_and_tick
    return trainer, clock, step_metrics


def make_trl(model_dir: str, prompts: list[str], args, workdir: str):
    """TRL's ``GRPOTrainer`` on the same work, its clock wired in through a callback and method wrappers."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = args.prompts * args.n
    accumulation = rows // args.micro
    config = GRPOConfig(
        output_dir=workdir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        num_generations=args.n,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        max_completion_length=args.length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type=args.loss_type,
        scale_rewards="group",
        beta=0.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        seed=0,
        dataloader_num_workers=0,
        bf16=False,  # TRL's default is True; pods runs float32 (mixed_precision "no")
        gradient_checkpointing=args.gradient_checkpointing,  # TRL's default is True, pods' False
    )
    clock = Clock()

    class StepEnd(TrainerCallback):
        def on_train_begin(self, *_, **__):
            clock.new_call()

        def on_step_end(self, *_, **__):
            clock.step_end()

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=low_id_share,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[StepEnd()],
    )
    trainer._generate = clock.timed("generate", trainer._generate)
    trainer._generate_and_score_completions = clock.timed(
        "generate_and_score", trainer._generate_and_score_completions
    )
    return trainer, clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (GRPO: all kept)")
    parser.add_argument("--length", type=int, default=32, help="completion tokens (every one runs to it)")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="tokens per prompt (words of one token)")
    parser.add_argument("--no-packing", action="store_true", help="pods without shared-prefix packing")
    parser.add_argument("--micro", type=int, default=None, help="rows per micro-batch (default: all rows)")
    parser.add_argument("--loss-type", default="grpo", choices=["grpo", "dapo", "bnpo", "dr_grpo"])
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on for both (TRL's default)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds; the first is warm-up")
    parser.add_argument("--steps", type=int, default=6, help="steps per trainer per round")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared box)"
    )
    parser.add_argument("--smoke", action="store_true", help="smallest size, a few seconds: that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.n, args.length, args.rounds, args.steps = 2, 2, 4, 2, 2
        args.hidden, args.layers, args.vocab = 32, 1, 64
    rows = args.prompts * args.n
    args.micro = args.micro or rows
    if rows % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide prompts x n = {rows}")
    if args.steps < 2 or args.rounds < 2:
        raise SystemExit(
            "--steps and --rounds must be at least 2 (the first step of a call and round 1 are warm-up)"
        )
    global LOW_IDS
    LOW_IDS = args.vocab // 2
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as root:
        model_dir = str(
            build_word_model(
                Path(root) / "model",
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                num_layers=args.layers,
                intermediate_size=4 * args.hidden,
                num_heads=max(1, args.hidden // 32),
            )
        )
        prompts = word_prompts(64, words=args.prompt_tokens, vocab_size=args.vocab)
        pods, pods_clock, pods_metrics = make_pods(model_dir, prompts, args, str(Path(root) / "pods"))
        trl, trl_clock = make_trl(model_dir, prompts, args, str(Path(root) / "trl"))
        params = sum(p.numel() for p in pods.model.parameters())
        for round_index in range(args.rounds):
            pods_clock.new_call()
            pods.train()
            with contextlib.redirect_stdout(io.StringIO()):  # TRL prints a summary per call
                trl.train()
            if round_index == 0:  # warm-up round
                pods_clock.reset()
                trl_clock.reset()
                pods_metrics.clear()

    generated = [row["completions/mean_length"] for row in pods_metrics]
    ours = statistics.median(pods_clock.step_seconds)
    theirs = statistics.median(trl_clock.step_seconds)
    ours_gen = statistics.median(row["seconds_generate"] for row in pods_metrics)
    ours_score = statistics.median(row["seconds_score"] + row["seconds_select"] for row in pods_metrics)
    trl_gen = statistics.median(trl_clock.phase_seconds["generate"])
    trl_score = statistics.median(trl_clock.phase_seconds["generate_and_score"]) - trl_gen
    print(
        f"model: random Llama, {params / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}); GRPO n = m = {args.n}, {args.prompts} prompts per step, {rows} rows per optimizer step in "
        f"micro-batches of {args.micro}, {args.length}-token completions (measured mean "
        f"{statistics.mean(generated):.1f}), loss {args.loss_type}, beta 0, float32, gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}; {args.threads} thread(s); "
        f"{args.rounds - 1} measured rounds x {args.steps - 1} steps each"
    )
    print(
        "| trainer | step s (median) | generate s | score + advantages s | update and the rest s | steps timed |"
    )
    print("|---|---|---|---|---|---|")
    for name, step, gen, score, clock in (
        ("pods", ours, ours_gen, ours_score, pods_clock),
        ("TRL GRPOTrainer", theirs, trl_gen, trl_score, trl_clock),
    ):
        print(
            f"| {name} | {step:.3f} | {gen:.3f} | {score:.3f} | {step - gen - score:.3f} "
            f"| {len(clock.step_seconds)} |"
        )
    ratio = ours / theirs
    print(f"ratio pods / TRL = {ratio:.3f}  (bar: <= 1.0: {'PASS' if ratio <= 1.0 else 'FAIL'})")
    print(json.dumps({"pods_steps": pods_clock.step_seconds, "trl_steps": trl_clock.step_seconds}))


if __name__ == "__main__":
    main()
