"""Peak memory of the update phase of one real PODS step: (n = 64, m = 8) against (8, 8) and (64, 64).

    python benchmarks/update_memory.py                 # 21.4M-parameter random Llama, 256-token completions
    python benchmarks/update_memory.py --length 64     # a quicker look
    python benchmarks/update_memory.py --smoke         # a 0.1M-parameter model, 4 tokens: that it runs
    python benchmarks/update_memory.py --no-packing    # the update unpacked (packing: false)
    python benchmarks/update_memory.py --token-budget 512   # packed forwards of at most 512 tokens

One prompt per step and the whole kept batch in one micro-batch (micro_batch_size = m), so nothing hides
the update's cost behind gradient accumulation: the paper's comparison. Each configuration runs one step
of the real :class:`pods.trainer.PODSTrainer` in a fresh process, with ``trainer._update`` wrapped to
measure around it. On CUDA the figure is ``max_memory_allocated`` above the allocation just before the
update. On CPU it is the peak resident set (VmHWM, reset just before) above the resident set just before;
just before the update, freed heap memory is handed back to the OS and glibc's mmap threshold is pinned
to 64 KiB, so that freed buffers go back to the OS and the resident set counts live memory only. The model's EOS token lies outside its output vocabulary, so every completion is
exactly ``--length`` tokens (the table reports the measured mean length).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from pods.packing import DEFAULT_TOKEN_BUDGET

CONFIGS = ((8, 8), (64, 8), (64, 64))  # (n generated, m kept) per prompt


def build_word_model(
    path: str | Path,
    *,
    vocab_size: int = 4096,
    hidden_size: int = 512,
    num_layers: int = 6,
    intermediate_size: int = 1408,
    num_heads: int = 8,
    seed: int = 0,
) -> Path:
    """Save a random Llama with a word-level tokenizer (``w0 w1 ...``) under ``path``; return the path.

    The EOS token gets the id ``vocab_size``, one past the model's output vocabulary, so the model can
    never sample it: every completion runs to the maximum length, making the work of a step exact.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if vocab_size < 16:
        raise ValueError(f"vocab_size must be at least 16, got {vocab_size}")
    words = {f"w{i}": i + 2 for i in range(vocab_size - 2)}
    backend = Tokenizer(
        models.WordLevel(vocab={"<pad>": 0, "<unk>": 1, **words, "<eos>": vocab_size}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=vocab_size,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = vocab_size
    model.generation_config.pad_token_id = 0
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def word_prompts(count: int, words: int = 8, vocab_size: int = 4096, seed: int = 0) -> list[str]:
    """``count`` random prompts of ``words`` word tokens each."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (count, words), generator=generator)
    return [" ".join(f"w{i - 2}" for i in row.tolist()) for row in ids]


def even_id_share(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """Reward: the share of completion tokens with an even id (any vocabulary; spread within a group)."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]


# ---------------------------------------------------------------------- memory probes
def _status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _release_freed_memory() -> None:
    """glibc: hand freed heap pages back to the OS and, from now on, serve every buffer over 64 KiB with its
    own mmap (returned on free), so the resident set counts live memory only. Set here, after generation,
    rather than for the whole process: per-token KV-cache buffers served by mmap make generation slow."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: the resident set may then include freed, unreturned memory
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 65536)
    libc.malloc_trim(0)


class PeakMemory:
    """Peak memory above the level at ``start()``: CUDA allocator, Linux VmHWM, or a psutil sampling thread."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.linux = os.path.exists("/proc/self/clear_refs")
        self._sampler: threading.Thread | None = None

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.linux:
            _release_freed_memory()
            self.base = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # resets VmHWM to the current resident set
        else:
            import psutil

            process, self._stop, self._peak = psutil.Process(), threading.Event(), 0
            self.base = process.memory_info().rss

            def sample() -> None:
                while not self._stop.is_set():
                    self._peak = max(self._peak, process.memory_info().rss)
                    time.sleep(0.002)

            self._sampler = threading.Thread(target=sample, daemon=True)
            self._sampler.start()

    def stop(self) -> tuple[int, int]:
        """(peak bytes above the start level, absolute peak bytes)."""
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        elif self.linux:
            peak = _status_bytes("VmHWM")
        else:
            self._stop.set()
            self._sampler.join()
            peak = self._peak
        return peak - self.base, peak


# ---------------------------------------------------------------------- one configuration
def run_config(
    model_dir: str,
    n: int,
    m: int,
    length: int,
    workdir: str,
    packing: bool = True,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
) -> dict:
    """One real trainer step at (n, m); the update phase's peak memory and the step's measured shape."""
    from datasets import Dataset

    from pods.config import TrainConfig
    from pods.trainer import PODSTrainer

    config = TrainConfig(
        model=model_dir,
        output_dir=workdir,
        num_generations=n,
        num_generations_kept=m,
        selection_rule="all" if m == n else "max_variance",
        prompts_per_step=1,
        micro_batch_size=m,  # the whole kept batch in one forward/backward
        generation_batch_size=n,
        max_completion_length=length,
        max_prompt_length=None,
        learning_rate=1e-5,
        max_steps=1,
        max_time=None,
        eval_at_start=False,
        eval_every_seconds=None,
        eval_at_seconds=[],
        save_every_seconds=None,
        save_final=False,
        progress=False,
        rollout_engine="hf",  # the update phase is measured; keep one engine for every setting
        packing=packing,
        token_budget=token_budget,
    )
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    prompts = word_prompts(4, vocab_size=vocab)
    trainer = PODSTrainer(
        config, reward_funcs=[even_id_share], train_dataset=Dataset.from_dict({"prompt": prompts})
    )
    probe, measured, update = PeakMemory(trainer.accelerator.device), {}, trainer._update

    def measured_update(state, batch, advantages, trained):
        probe.start()
        result = update(state, batch, advantages, trained)
        measured["update_peak"], measured["absolute_peak"] = probe.stop()
        measured["rows"], measured["width"] = tuple(batch.completion_ids.shape)
        return result

    trainer._update = measured_update
    trainer.train()
    metrics = json.loads((Path(workdir) / "metrics.jsonl").read_text().splitlines()[-1])
    return {
        "n": n,
        "m": m,
        **measured,
        "completion_length_mean": metrics["completions/mean_length"],
        "seconds_generate": metrics["seconds_generate"],
        "seconds_update": metrics["seconds_update"],
        "device": str(trainer.accelerator.device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=256, help="completion tokens (every one runs to it)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared box)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest size, a few seconds: checks that it runs, measures nothing",
    )
    parser.add_argument("--no-packing", action="store_true", help="the update without shared-prefix packing")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=DEFAULT_TOKEN_BUDGET,
        help="packing: tokens per forward (default: pods' default)",
    )
    parser.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "N", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.length, args.hidden, args.layers, args.intermediate, args.vocab = 4, 32, 1, 64, 256
    torch.set_num_threads(args.threads)
    if args.worker:
        model_dir, n, m = args.worker[0], int(args.worker[1]), int(args.worker[2])
        with tempfile.TemporaryDirectory() as workdir:
            result = run_config(model_dir, n, m, args.length, workdir, not args.no_packing, args.token_budget)
            print(json.dumps(result), flush=True)
        return

    with tempfile.TemporaryDirectory() as root:
        model_dir = build_word_model(
            Path(root) / "model",
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            intermediate_size=args.intermediate,
        )
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        params = sum(p.numel() for p in model.parameters())
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        results = {}
        for n, m in CONFIGS:
            if args.smoke:  # one process for all three: whether it runs, not what it measures
                with tempfile.TemporaryDirectory() as workdir:
                    results[n, m] = run_config(
                        str(model_dir), n, m, args.length, workdir, not args.no_packing, args.token_budget
                    )
                continue
            command = [sys.executable, __file__, *sys.argv[1:], "--worker", str(model_dir), str(n), str(m)]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise SystemExit(f"configuration n={n}, m={m} failed:\n{done.stderr[-3000:]}")
            results[n, m] = json.loads(done.stdout.strip().splitlines()[-1])

    device = results[CONFIGS[0]]["device"]
    print(
        f"model: random Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}, "
        f"vocab {args.vocab}); one prompt per step, micro_batch_size = m, {args.length}-token completions; "
        f"device {device}, {args.threads} thread(s), packing "
        f"{'off' if args.no_packing else f'on (token_budget {args.token_budget})'}"
    )
    what = "max_memory_allocated" if device.startswith("cuda") else "peak RSS"
    print(
        f"| n | m | kept rows x width | mean completion length | update peak above start ({what}), MiB "
        "| absolute peak, MiB | generate s | update s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (n, m), r in results.items():
        print(
            f"| {n} | {m} | {r['rows']} x {r['width']} | {r['completion_length_mean']:.1f} "
            f"| {r['update_peak'] / 2**20:.1f} | {r['absolute_peak'] / 2**20:.1f} "
            f"| {r['seconds_generate']:.1f} | {r['seconds_update']:.1f} |"
        )
    pods, grpo_small, grpo_large = (results[c]["update_peak"] for c in ((64, 8), (8, 8), (64, 64)))
    near, half = (pods / base if base else float("nan") for base in (grpo_small, grpo_large))  # 0: --smoke
    print(
        f"(64, 8) / (8, 8)   = {near:.3f}  (bar: within 15%, i.e. 0.85 to 1.15: {_verdict(abs(near - 1) <= 0.15)})"
    )
    print(f"(64, 8) / (64, 64) = {half:.3f}  (bar: at most 0.5: {_verdict(half <= 0.5)})")
    if args.smoke:
        print("--smoke: the benchmark runs; at this size, in one process, its figures mean nothing")


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


if __name__ == "__main__":
    main()
