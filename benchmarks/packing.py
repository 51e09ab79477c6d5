"""Shared-prefix packing against the unpacked path, side by side in one run: the update's seconds per step
and peak memory, and HF generation's seconds with one prefill per prompt against n.

    python benchmarks/packing.py                 # every case below, median of --repeats
    python benchmarks/packing.py --smoke         # the smallest sizes: that it runs

Update cases: one real kept batch each, then :func:`pods.update.policy_update` on it with ``packing`` on and
off, alternating, the median of ``--repeats`` (the first call of each is warm-up and dropped):

- ``embedded-hard PODS 16/4`` and ``embedded-hard GRPO 4/4``: the shipped arith-hard model, 16 prompts per
  step, its own sampled completions (HF ``generate``, 32 new tokens at most);
- ``pods train default``: the shipped arith model with TrainConfig's defaults (PODS 16/4, 16 prompts);
- ``GSM8K format``: a random 2-layer Qwen2 (hidden 64) with the real Qwen2.5 tokenizer, the paper's chat
  prompt on 4 GSM8K training questions, PODS 16/4 kept rows of 128-256 random tokens, 4 rows (a group) per
  micro-batch (reads ``../shared/data``: ``--data``).

Peak memory is that of the update (``update_memory.PeakMemory``: the CUDA allocator, else the resident set
above its level before). Generation: the shipped arith model samples 16 prompts x n = 4, 16, 64
completions of 32 tokens. Timings are only comparable from a quiet machine; one thread by default.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_memory import PeakMemory

from pods.checkpoint import TrainerState
from pods.config import TrainConfig
from pods.rollout import HFGenerateEngine, Rollouts, SamplingParams
from pods.update import NonFiniteGuard, policy_update

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def arith_prompts(task: str, count: int) -> list[str]:
    """``count`` training prompts of the embedded task (its plain prompt)."""
    from pods.data import arith

    spec = arith.HARD_SPEC if task == "arith-hard" else arith.ArithSpec()
    return [arith.format_prompt(p.question) for p in arith.generate_problems(count, seed=0, spec=spec)]


def load(name: str):
    """The shipped model ``name`` and its tokenizer, in evaluation-free float32."""
    from transformers import AutoModelForCausalLM

    from pods.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), load_tokenizer(path)


def kept_rows(rollouts: Rollouts, m: int) -> Rollouts:
    """The first m completions of every group (which m does not matter for the work: lengths do)."""
    n = rollouts.num_generations
    return rollouts.select([g * n + i for g in range(rollouts.num_prompts) for i in range(m)])


def sampled_batch(model, tokenizer, task: str, prompts: int, n: int, m: int, tokens: int) -> Rollouts:
    """The kept rows of one step's rollouts, sampled by the model itself."""
    torch.manual_seed(0)
    engine = HFGenerateEngine(model, tokenizer, generation_batch_size=256)
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    return kept_rows(engine.generate(arith_prompts(task, prompts), n, sampling), m)


def gsm8k_case(data: Path, prompts: int, m: int, lengths: tuple[int, int]):
    """A random tiny Qwen2 with the Qwen2.5 tokenizer and kept rows of the paper's GSM8K chat prompts with
    random completions of ``lengths`` tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pods.models import load_tokenizer
    from pods.prompts import make_prompt, render_prompt

    tokenizer = load_tokenizer(str(data / "tokenizers" / "qwen2.5"))
    with (data / "gsm8k" / "train.jsonl").open() as lines:
        questions = [json.loads(next(lines))["question"] for _ in range(prompts)]
    texts = [render_prompt(make_prompt(q, "chat"), tokenizer) for q in questions]
    encoded = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    rows = prompts * m
    length = torch.randint(lengths[0], lengths[1] + 1, (rows,), generator=generator)
    width = int(length.max())
    completion_mask = (torch.arange(width) < length[:, None]).long()
    completion_ids = torch.randint(0, 150_000, (rows, width), generator=generator) * completion_mask
    batch = Rollouts(
        prompt_ids=encoded["input_ids"].repeat_interleave(m, dim=0),
        prompt_mask=encoded["attention_mask"].repeat_interleave(m, dim=0),
        completion_ids=completion_ids, completion_mask=completion_mask, texts=[""] * rows,
        truncated=torch.zeros(rows, dtype=torch.bool), num_prompts=prompts, num_generations=m,
    )  # fmt: skip
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config), batch


def update_figures(model, batch: Rollouts, config: TrainConfig, repeats: int, device: str) -> dict:
    """Median seconds and peak memory of ``policy_update`` on ``batch``, packed and unpacked, alternating."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(
        cpu=device == "cpu", gradient_accumulation_steps=len(batch) // config.micro_batch_size
    )
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = NonFiniteGuard(TrainerState(), 3, Path("unused"))
    advantages = torch.linspace(-1.0, 1.0, len(batch))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    peaks: dict[bool, int] = {False: 0, True: 0}
    memory = PeakMemory(torch.device(device))
    for _ in range(repeats + 1):
        for packing in (False, True):
            settings = TrainConfig(**{**config.__dict__, "packing": packing})
            memory.start()
            start = time.perf_counter()
            policy_update(accelerator, model, optimizer, scheduler, batch, advantages, settings, guard)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[packing].append(time.perf_counter() - start)
            peaks[packing] = max(peaks[packing], memory.stop()[0])
    return {
        packing: (statistics.median(values[1:]), peaks[packing] / 2**20)
        for packing, values in seconds.items()
    }


def update_table(cases: dict, repeats: int, device: str) -> None:
    print("| update case | rows | tokens (unpacked / packed) | unpacked s | packed s | speed-up | peak MB |")
    print("|---|---|---|---|---|---|---|")
    for name, (model, batch, config) in cases.items():
        model.to(device)
        figures = update_figures(model, batch, config, repeats, device)
        (u_seconds, u_peak), (p_seconds, p_peak) = figures[False], figures[True]
        print(
            f"| {name} | {len(batch)} | {work_tokens(model, batch, config, False)} / {work_tokens(model, batch, config, True)} "
            f"| {u_seconds:.3f} | {p_seconds:.3f} | {u_seconds / p_seconds:.2f}x | {u_peak:.0f} / {p_peak:.0f} |",
            flush=True,
        )


def work_tokens(model, batch: Rollouts, config: TrainConfig, packing: bool) -> int:
    """Tokens the update's forwards process per pass: padded rows, or packed rows (their padding included)."""
    from pods.packing import hidden_size, pack

    total = 0
    for start in range(0, len(batch), config.micro_batch_size):
        part = batch.select(list(range(start, start + config.micro_batch_size)))
        if packing:
            rows = (part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask)
            total += pack(*rows, config.token_budget, hidden_size(model)).input_ids.numel()
        else:
            total += part.prompt_ids.numel() + part.completion_ids.numel()
    return total


def generation_table(
    model, tokenizer, sizes: tuple[int, ...], prompts: int, tokens: int, repeats: int
) -> None:
    print(
        f"| HF generation, {prompts} prompts x {tokens} tokens | n prefills (s) | one prefill (s) | speed-up |"
    )
    print("|---|---|---|---|")
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    texts = arith_prompts("arith", prompts)
    for n in sizes:
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats + 1):
            for share in (False, True):
                engine = HFGenerateEngine(model, tokenizer, generation_batch_size=1024, share_prefix=share)
                torch.manual_seed(0)
                start = time.perf_counter()
                engine.generate(texts, n, sampling)
                seconds[share].append(time.perf_counter() - start)
        full, shared = (statistics.median(seconds[s][1:]) for s in (False, True))
        print(f"| n = {n} | {full:.3f} | {shared:.3f} | {full / shared:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per arm (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data folder (GSM8K, tokenizer)")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, a few seconds: that it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke
    repeats = 1 if smoke else args.repeats
    prompts, tokens = (2, 4) if smoke else (16, 32)

    arith_model, arith_tokenizer = load("embedded")
    generation_table(
        arith_model.to(device), arith_tokenizer, (2,) if smoke else (4, 16, 64), prompts, tokens, repeats
    )
    print()
    hard_model, hard_tokenizer = load("embedded-arith-hard")
    cases = {}
    for name, n, m in (("embedded-hard PODS 16/4", 16, 4), ("embedded-hard GRPO 4/4", 4, 4)):
        n, m = (4, 2) if smoke else (n, m)
        config = TrainConfig(
            num_generations=n, num_generations_kept=m, prompts_per_step=prompts, micro_batch_size=prompts * m,
            max_completion_length=tokens,
        )  # fmt: skip
        batch = sampled_batch(hard_model.to(device), hard_tokenizer, "arith-hard", prompts, n, m, tokens)
        cases[name] = (hard_model, batch, config)
    default = TrainConfig()
    if smoke:
        default = TrainConfig(
            num_generations=4, num_generations_kept=2, prompts_per_step=2, micro_batch_size=4, max_completion_length=4
        )  # fmt: skip
    n, m, p = default.num_generations, default.num_generations_kept, default.prompts_per_step
    batch = sampled_batch(arith_model, arith_tokenizer, "arith", p, n, m, default.max_completion_length)
    cases["pods train default"] = (arith_model, batch, default)
    m, p, lengths = (2, 2, (8, 16)) if smoke else (4, 4, (128, 256))  # 151k-vocabulary logits: 4 prompts
    gsm8k_model, batch = gsm8k_case(args.data, p, m, lengths)
    config = TrainConfig(
        num_generations=16, num_generations_kept=m, prompts_per_step=p, micro_batch_size=m,
        max_completion_length=lengths[1],
    )  # fmt: skip
    cases["GSM8K format"] = (gsm8k_model, batch, config)
    update_table(cases, repeats, device)


if __name__ == "__main__":
    main()
