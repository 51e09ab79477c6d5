"""The embedded default model: a word-level tokenizer for the arithmetic task, a ~1M-parameter Llama,
and the supervised pre-training that turns it into the base model `pods train` fine-tunes with RL.

The base model is trained on worked solutions where most "gives b to X" steps are written as additions
(see ``pods.data.arith``), so it knows both the right and a plausible wrong procedure: greedy decoding
follows the wrong one, sampling sometimes finds the right one, and RL has something to select.
"""

from __future__ import annotations

import math
import random
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

from pods.data import arith

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Each piece is an optional leading space plus a word, a single digit, "####" or one other symbol; the
# decoder concatenates pieces, so decoding is the exact inverse of encoding for any task text.
PIECE_PATTERN = r" ?####| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\s"
_PIECE = re.compile(PIECE_PATTERN)
MODEL_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}


def _task_vocabulary() -> list[str]:
    """Every piece that the task's texts can contain, in a fixed order."""
    words = [*arith.NAMES_SHE, *arith.NAMES_HE, *arith.ITEMS, "She", "He", "Then"]
    templates = [*arith.OPENINGS, *arith.QUESTIONS, arith.PROMPT_TEMPLATE]
    templates += [t for group in arith.STEP_TEMPLATES.values() for t in group]
    text = " ".join(re.sub(r"\{\w+\}", " ", t) for t in templates) + " " + " ".join(words)
    text += " 0 1 2 3 4 5 6 7 8 9 + - * = . ####"
    cores = {piece.strip(" ") for piece in _PIECE.findall(text)} - {""}
    return sorted({f"{space}{core}" for core in cores for space in ("", " ") if core != "\n"} | {" ", "\n"})


def build_tokenizer():
    """A word-level fast tokenizer for the task (one token per digit, exact round trip, left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK, *_task_vocabulary()])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def build_untrained_model(tokenizer: Any, *, seed: int = 0, sizes: dict[str, int] | None = None):
    """A randomly initialised Llama-architecture causal LM (tied embeddings) sized for the task
    (``sizes`` overrides :data:`MODEL_CONFIG`, e.g. a larger model for a GPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**MODEL_CONFIG, **(sizes or {})},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        None,
    )
    gen.max_new_tokens, gen.do_sample = 32, False
    return model


def _batch(tokenizer: Any, pairs: list[tuple[str, str]]):
    """Right-padded input ids, attention mask and labels (loss on the completion and eos only)."""
    import torch

    ids, labels = [], []
    for prompt, completion in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    return input_ids, mask, label_ids


def generate_answers(
    model: Any, tokenizer: Any, prompts: list[str], *, temperature: float = 0.0, batch_size: int = 256
) -> list[str]:
    """Completions for ``prompts`` (greedy when ``temperature`` is 0), up to 32 new tokens, with KV cache."""
    import torch

    out: list[str] = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True).to(model.device)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            ids = model.generate(
                **batch,
                max_new_tokens=32,
                **(sampling if temperature > 0 else {"do_sample": False}),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            out += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def evaluate(
    model: Any, tokenizer: Any, *, num_problems: int = 500, seed: int = 0, temperature: float = 0.0
) -> dict[str, float]:
    """Accuracy on held-out test problems, overall and split by whether the "gives" step occurs."""
    problems = arith.generate_problems(num_problems, seed=seed, split="test")
    completions = generate_answers(
        model, tokenizer, [arith.format_prompt(p.question) for p in problems], temperature=temperature
    )
    correct = [c.strip().endswith(f"#### {p.answer}") for p, c in zip(problems, completions, strict=True)]
    gives = [ok for ok, p in zip(correct, problems, strict=True) if p.has_gives]
    other = [ok for ok, p in zip(correct, problems, strict=True) if not p.has_gives]
    return {
        "accuracy": sum(correct) / len(correct),
        "accuracy_gives": sum(gives) / max(1, len(gives)),
        "accuracy_other": sum(other) / max(1, len(other)),
        "num_problems": len(correct),
    }


def build_base_model(
    output_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 600,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup_steps: int = 50,
    misconception_rate: float = 0.6,
    eval_problems: int = 500,
    progress: bool = True,
    sizes: dict[str, int] | None = None,
    device: str = "cpu",
    max_seconds: float | None = None,
    distinct_pairs: int | None = None,
) -> dict[str, Any]:
    """Supervised pre-training from scratch on the task's worked solutions (with the misconception mix)
    for a fixed number of steps; saves a standard Hugging Face folder and returns measured metrics.

    For larger models on a GPU (``scripts/gpu_check.py``): ``sizes`` overrides the model's dimensions,
    ``device`` trains there (bf16 autocast on CUDA), ``max_seconds`` ends training early (the learning
    rate schedule then follows the elapsed time) and ``distinct_pairs`` caps the generated examples
    (they are cycled), since generating them costs CPU time."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}")
    output_dir = Path(output_dir)
    tokenizer = build_tokenizer()
    model = build_untrained_model(tokenizer, seed=seed, sizes=sizes).to(device)
    count = min(steps * batch_size, distinct_pairs or steps * batch_size)
    pairs = arith.supervised_pairs(count, seed=seed, misconception_rate=misconception_rate)
    random.Random(seed).shuffle(pairs)
    pairs = pairs * math.ceil(steps * batch_size / len(pairs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))

    def schedule(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, steps - warmup_steps)
        if max_seconds:
            t = max(t, (time.perf_counter() - start) / max_seconds)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    start, losses = time.perf_counter(), []
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    columns = [
        TextColumn("pre-training base model"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
    ]
    columns += [TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("sft", total=steps, loss=float("nan"))
        for step in range(steps):
            if max_seconds and time.perf_counter() - start >= max_seconds:
                break
            batch = _batch(tokenizer, pairs[step * batch_size : (step + 1) * batch_size])
            input_ids, mask, labels = (tensor.to(device) for tensor in batch)
            with autocast:
                loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(task, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]))
    train_seconds = time.perf_counter() - start
    metrics: dict[str, Any] = {"steps": len(losses), "batch_size": batch_size, "seed": seed, "lr": lr}
    metrics |= {"final_loss": sum(losses[-20:]) / len(losses[-20:]), "train_seconds": round(train_seconds, 1)}
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    if eval_problems:
        metrics["greedy"] = evaluate(model, tokenizer, num_problems=eval_problems)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return metrics


def sampling_seconds(
    model: Any,
    tokenizer: Any,
    *,
    prompts: int = 16,
    per_prompt: int = 16,
    new_tokens: int = 32,
    repeats: int = 3,
) -> float:
    """Median seconds for ``model`` to sample ``per_prompt`` completions of exactly ``new_tokens`` tokens
    for each of ``prompts`` test prompts (HF ``generate`` with its KV cache)."""
    import statistics

    import torch

    texts = [arith.format_prompt(p.question) for p in arith.generate_problems(prompts, seed=1, split="test")]
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
                pad_token_id=tokenizer.pad_token_id,
            )
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def default_model_path() -> Path:
    """The base model shipped inside the package (``pods/assets/arith-base``)."""
    path = Path(str(resources.files("pods") / "assets" / "arith-base"))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the shipped base model is missing from {path}; rebuild it with "
            "`python scripts/build_default_model.py` or reinstall the package"
        )
    return path
