"""PODS on GSM8K inside TRL: Qwen2.5-3B-Instruct + LoRA, rollouts from vLLM colocated on the GPU; each
prompt gets n = 64 completions, and the policy is updated on the m = 16 chosen by max-variance selection.

    pip install 'pods[trl,vllm]'
    python examples/trl_gsm8k.py                                # PODS 64/16, max_variance
    python examples/trl_gsm8k.py --n 16 --m 16 --rule all       # the GRPO baseline of the paper
    python examples/trl_gsm8k.py --source ../shared/data/gsm8k  # a local copy instead of openai/gsm8k

The settings follow the paper's single-GPU run: lr 5e-6 constant after 1% warm-up, AdamW betas (0.9, 0.99),
weight decay 0.1, grad-norm clip 0.1, bf16, temperature 0.9, prompts and completions of at most 512 tokens,
no KL (beta 0), LoRA r = alpha = 64 on every projection, vLLM with half of the GPU's memory, one prompt per
step. The paper also loaded the model in 4 bit and used 8-bit AdamW: ``--optim adamw_8bit`` (bitsandbytes).

Batch arithmetic (per process): each step takes ``--prompts-per-step`` prompts and generates n completions
for each; m per prompt are kept and trained on in micro-batches of ``--micro-batch`` completions. In TRL's
terms: gradient_accumulation_steps = prompts x m / micro-batch, and per_device_train_batch_size (which counts
*generated* completions) = prompts x n / gradient_accumulation_steps.
"""

from __future__ import annotations

import argparse
from typing import Any

from pods.integrations.trl import PODSConfig, PODSTrainer

MAX_PROMPT_TOKENS = 512
MAX_COMPLETION_TOKENS = 512


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags: model, data source, n, m, rule, output folder and the batch layout."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-3B-Instruct", help="Hub name or local folder")
    parser.add_argument(
        "--source", default=None, help="GSM8K Hub name or local folder (default openai/gsm8k)"
    )
    parser.add_argument(
        "--n", type=int, default=64, help="completions generated per prompt (num_generations)"
    )
    parser.add_argument(
        "--m", type=int, default=16, help="completions kept per prompt (num_generations_kept)"
    )
    parser.add_argument(
        "--rule", default="max_variance", help="selection rule (pods.selection.available_rules())"
    )
    parser.add_argument("--output-dir", default="outputs/trl-gsm8k-pods", help="checkpoints and logs")
    parser.add_argument(
        "--prompts-per-step", type=int, default=1, help="prompts per optimizer step and process"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=4, help="kept completions per forward/backward pass"
    )
    parser.add_argument("--max-steps", type=int, default=500, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=5e-6, help="learning rate")
    parser.add_argument("--lora-r", type=int, default=64, help="LoRA rank (alpha = rank)")
    parser.add_argument("--optim", default="adamw_torch", help="TRL/transformers optimizer name")
    parser.add_argument("--no-vllm", action="store_true", help="generate with transformers instead of vLLM")
    parser.add_argument(
        "--vllm-memory", type=float, default=0.5, help="vLLM's share of GPU memory (colocate)"
    )
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training problems")
    parser.add_argument("--max-completion-length", type=int, default=MAX_COMPLETION_TOKENS, help="new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="smoke test on CPU: no vLLM, no bf16, no LoRA")
    return parser


def batch_layout(n: int, m: int, prompts_per_step: int, micro_batch: int) -> tuple[int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps)`` for the layout described above."""
    kept = prompts_per_step * m
    if kept % micro_batch:
        raise ValueError(
            f"--micro-batch {micro_batch} must divide the kept completions per step, prompts x m = "
            f"{prompts_per_step} x {m} = {kept}."
        )
    accumulation = kept // micro_batch
    generated = prompts_per_step * n
    if generated % accumulation:
        raise ValueError(
            f"the {generated} completions generated per step (prompts x n = {prompts_per_step} x {n}) must split "
            f"into {accumulation} accumulation steps (prompts x m / micro-batch); choose another --micro-batch."
        )
    return generated // accumulation, accumulation


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The paper's single-GPU GSM8K settings, as keyword arguments of :class:`PODSConfig`."""
    use_cpu = args.cpu
    per_device, accumulation = batch_layout(args.n, args.m, args.prompts_per_step, args.micro_batch)
    return dict(
        output_dir=args.output_dir,
        num_generations=args.n,
        num_generations_kept=args.m,
        selection_rule=args.rule,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=0.01,  # a float below 1 is a fraction of max_steps
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        max_grad_norm=0.1,
        optim=args.optim,
        bf16=not use_cpu,
        use_cpu=use_cpu,
        model_init_kwargs=None if use_cpu else {"dtype": "bfloat16"},
        gradient_checkpointing=not use_cpu,
        temperature=0.9,
        max_completion_length=args.max_completion_length,
        beta=0.0,
        use_vllm=not (args.no_vllm or use_cpu),
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.vllm_memory,
        vllm_max_model_length=MAX_PROMPT_TOKENS + args.max_completion_length,
        logging_steps=1,
        save_strategy="steps",
        save_steps=100,
        report_to="none",
        seed=args.seed,
    )


def build_config(args: argparse.Namespace) -> PODSConfig:
    """The :class:`PODSConfig` of this run (bf16 needs a GPU unless ``--cpu``)."""
    return PODSConfig(**config_kwargs(args))


def build_peft_config(args: argparse.Namespace) -> Any:
    """LoRA r = alpha on the attention and MLP projections (the paper's adapter)."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_r,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )


def main(argv: list[str] | None = None) -> None:
    """Load GSM8K train with chat prompts, build the trainer, train, save the adapter."""
    from transformers import AutoTokenizer

    from pods.data import get_task

    args = build_parser().parse_args(argv)
    config = build_config(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    task = get_task("gsm8k")  # its reader, chat prompt, rewards (accuracy, format, tag) and accuracy function
    dataset = task.load(
        "train",
        source=args.source,
        prompt_style="chat",
        tokenizer=tokenizer,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        limit=args.limit,
        seed=args.seed,
    )
    trainer = PODSTrainer(
        model=args.model,
        reward_funcs=task.reward_functions(),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=None if args.cpu else build_peft_config(args),
    )
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
