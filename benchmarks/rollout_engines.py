"""Rollout engines side by side in one process: Hugging Face ``generate`` against vLLM (colocated, in-process).

    python benchmarks/rollout_engines.py [--repeats 3] [--output rollout_engines.json] [--smoke]

1. the embedded model (float32), 16 arithmetic test prompts x n in {4, 16, 64}, <= 32 new tokens, T = 1;
2. a long-prompt case: GSM8K test prompts in the paper's chat format, a tiny random Qwen2 model with the
   real Qwen2.5 tokenizer (151k vocabulary; ../shared/data/tokenizers/qwen2.5), 8 prompts x n = 8, 128 new
   tokens (the random model rarely stops early), one timed round after the warm-up;
   each engine also without sharing a prompt among its n samples: HF ``generate`` with n prefills
   (``share_prefix=False``), vLLM without its prefix cache;
3. the engines' start-up and first call;
4. the update (log-probs, loss, backward, AdamW step on 16 prompts x m = 4 kept rows) before any vLLM engine
   exists, and again with the engine resident in the process (vLLM lowers torch to one thread on a CPU;
   pods gives sampling and the update their threads back).

Generation figures are medians over ``--repeats`` rounds (one for the long case) after one warm-up call per
engine, the two engines called in turn within each round so that both see the same load; both go through
``RolloutEngine.generate`` (real rollouts: EOS ends a completion), so tokens generated are reported too.
Both engines run with torch's threads (all cores). ``--smoke``: 2 prompts, n = 2, 4 tokens, one round: that it
runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pods.rollout import HFGenerateEngine, SamplingParams

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def side_by_side(calls: dict, repeats: int, label: str) -> dict[str, tuple[float, int]]:
    """Per engine (median seconds, completion tokens of the last call): one warm-up call each, then
    ``repeats`` rounds that call the engines in turn, so both see the same load on a shared machine."""
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    tokens: dict[str, int] = {}
    for repeat in range(repeats):
        for name, call in calls.items():
            torch.manual_seed(repeat)
            start = time.perf_counter()
            rollouts = call()
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = int(rollouts.completion_mask.sum())
    result = {name: (statistics.median(seconds[name]), tokens[name]) for name in calls}
    print(label, {name: f"{s:.3f} s, {t} tokens" for name, (s, t) in result.items()}, flush=True)
    return result


def embedded_setup(count: int = 16):
    from transformers import AutoModelForCausalLM

    from pods.data.arith import format_prompt, generate_problems
    from pods.embedded import default_model_path
    from pods.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(default_model_path()))
    prompts = [format_prompt(p.question) for p in generate_problems(count, seed=1, split="test")]
    return model, tokenizer, prompts


def long_prompt_setup(count: int = 8):
    """A 2-layer Qwen2 with the real Qwen2.5 tokenizer (~10M parameters, the embedding dominates)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pods.data import load_task
    from pods.models import load_tokenizer
    from pods.prompts import render_prompt

    tokenizer = load_tokenizer(str(SHARED / "tokenizers" / "qwen2.5"))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    rows = load_task(
        "gsm8k", "test", source=str(SHARED / "gsm8k"), prompt_style="chat", tokenizer=tokenizer, limit=count
    )
    prompts = [render_prompt(rows[i]["prompt"], tokenizer) for i in range(len(rows))]
    return model, tokenizer, prompts


def update_seconds(model, tokenizer, prompts: list[str], repeats: int) -> float:
    """Median seconds of one PODS update on ``prompts`` x 4 kept completions (fixed rollouts)."""
    from pods.loss import completion_logprobs, policy_loss

    torch.manual_seed(0)
    batch = HFGenerateEngine(model, tokenizer).generate(
        prompts, 4, SamplingParams(max_new_tokens=32, temperature=1.0)
    )
    advantages = torch.randn(len(batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay as they are
    mask = batch.completion_mask

    def step() -> None:
        logprobs = completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, mask, temperature=1.0
        )
        loss = policy_loss(
            logprobs,
            advantages,
            mask,
            total_sequences=len(batch),
            total_tokens=int(mask.sum()),
            max_completion_length=32,
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    model.eval()
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="also write the figures to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, one round: that it runs")
    args = parser.parse_args()
    results: dict = {"torch_threads": torch.get_num_threads()}
    # prompts, n values and new tokens of the embedded cases; prompts, n and new tokens of the long case
    count, sizes, tokens, long_count, long_n, long_tokens, kv_cache_gb = 16, (4, 16, 64), 32, 8, 8, 128, 1.0
    if args.smoke:
        args.repeats, count, sizes, tokens, long_count, long_n, long_tokens, kv_cache_gb = (
            1,
            2,
            (2,),
            4,
            2,
            2,
            4,
            0.05,
        )

    model, tokenizer, prompts = embedded_setup(count)
    long_model, long_tokenizer, long_prompts = long_prompt_setup(long_count)
    short = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    long = SamplingParams(max_new_tokens=long_tokens, temperature=1.0)

    # The update first, before any vLLM engine exists in the process.
    results["update_seconds_without_engine"] = update_seconds(model, tokenizer, prompts, args.repeats)
    print(f"update without engine: {results['update_seconds_without_engine']:.3f} s", flush=True)
    hf = HFGenerateEngine(model, tokenizer, generation_batch_size=1024)
    results["hf_first_call_seconds"] = _first_call(hf, prompts, short)

    start = time.perf_counter()
    from pods.rollout.vllm import VLLMEngine

    vllm = VLLMEngine(model, tokenizer, kv_cache_gb=kv_cache_gb)
    results["vllm_startup_seconds"] = time.perf_counter() - start  # import, engine, first weight push
    results["vllm_first_call_seconds"] = _first_call(vllm, prompts, short)
    start = time.perf_counter()
    vllm.sync_weights(model)
    results["vllm_sync_seconds"] = time.perf_counter() - start
    for n in sizes:
        pair = side_by_side(
            {
                "hf": lambda n=n: hf.generate(prompts, n, short),
                "vllm": lambda n=n: vllm.generate(prompts, n, short),
            },
            args.repeats,
            f"embedded n={n}",
        )
        results[f"hf_embedded_n{n}"], results[f"vllm_embedded_n{n}"] = pair["hf"], pair["vllm"]
    results["torch_threads_with_engine"] = torch.get_num_threads()
    results["update_seconds_with_engine"] = update_seconds(model, tokenizer, prompts, args.repeats)
    vllm.close()

    hf_long = HFGenerateEngine(long_model, long_tokenizer, generation_batch_size=256)
    hf_long_unshared = HFGenerateEngine(
        long_model, long_tokenizer, generation_batch_size=256, share_prefix=False
    )
    calls = {
        "hf": lambda: hf_long.generate(long_prompts, long_n, long),
        "hf_unshared": lambda: hf_long_unshared.generate(long_prompts, long_n, long),
    }
    # --smoke starts one vLLM engine (the one above): the long case's engines are the same code again
    vllm_long = None if args.smoke else VLLMEngine(long_model, long_tokenizer, kv_cache_gb=kv_cache_gb)
    if vllm_long is not None:
        calls["vllm"] = lambda: vllm_long.generate(long_prompts, long_n, long)
    triple = side_by_side(calls, 1, "long prompts")
    results["hf_long"], results["vllm_long"] = triple["hf"], triple.get("vllm", (float("nan"), 0))
    results["hf_long_n_prefills"] = triple["hf_unshared"]
    if vllm_long is not None:
        vllm_long.close()  # one engine per process: the same case again without vLLM's prefix cache
    results["vllm_long_no_prefix_cache"] = (float("nan"), 0)
    if not args.smoke:
        uncached = VLLMEngine(
            long_model, long_tokenizer, kv_cache_gb=kv_cache_gb, enable_prefix_caching=False
        )
        results["vllm_long_no_prefix_cache"] = side_by_side(
            {"vllm": lambda: uncached.generate(long_prompts, long_n, long)},
            1,
            "long prompts, no prefix cache",
        )["vllm"]
        uncached.close()

    print(
        f"torch threads: {results['torch_threads']} (with the vLLM engine: {results['torch_threads_with_engine']})"
    )
    print("| case | HF generate | vLLM | speed-up |\n|---|---|---|---|")
    cases = [(f"embedded_n{n}", f"embedded, {count} prompts x {n}, {tokens} tokens") for n in sizes]
    cases.append(
        ("long", f"GSM8K chat prompts, tiny Qwen-vocab model, {long_count} x {long_n}, {long_tokens} tokens")
    )
    for key, label in cases:
        (hf_s, hf_tokens), (vllm_s, vllm_tokens) = results[f"hf_{key}"], results[f"vllm_{key}"]
        print(
            f"| {label} | {hf_s:.2f} s ({hf_tokens} tokens) | {vllm_s:.2f} s ({vllm_tokens} tokens) "
            f"| {hf_s / vllm_s:.1f}x |"
        )
    print(
        f"each prompt computed once per group, long case: HF generate {results['hf_long'][0]:.2f} s with one "
        f"prefill per prompt, {results['hf_long_n_prefills'][0]:.2f} s with n; vLLM {results['vllm_long'][0]:.2f} s "
        f"with its prefix cache, {results['vllm_long_no_prefix_cache'][0]:.2f} s without"
    )
    print(
        f"start-up: HF first call {results['hf_first_call_seconds']:.2f} s; "
        f"vLLM {results['vllm_startup_seconds']:.2f} s (import, engine, weights) + first call "
        f"{results['vllm_first_call_seconds']:.2f} s; weight push {results['vllm_sync_seconds'] * 1000:.0f} ms"
    )
    print(
        f"update ({count} prompts x m = 4): {results['update_seconds_without_engine']:.3f} s without the engine, "
        f"{results['update_seconds_with_engine']:.3f} s with it resident"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


def _first_call(engine, prompts: list[str], sampling: SamplingParams) -> float:
    start = time.perf_counter()
    engine.generate(prompts, 4, sampling)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
