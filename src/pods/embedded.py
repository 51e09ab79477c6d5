"""The embedded models: a word-level tokenizer for each embedded task, a ~1M-parameter Llama, and
the supervised pre-training that turns it into a base model `pods train` fine-tunes with RL.

A base model is trained on worked solutions where most steps of some kinds are written wrongly (a
"gives b to X" step as an addition, ...; see ``pods.data.arith``), so it knows both the right and a
plausible wrong procedure: greedy decoding follows the wrong one, sampling sometimes finds the right
one, and RL has something to select. Three are shipped (:data:`EMBEDDED_MODELS`): ``arith-base`` for the
``arith`` task (the default), ``arith-hard-base`` for ``arith-hard``, where sampled solutions are
rarely right (the sparse-reward regime, with room to climb for minutes on a CPU), and ``tool-base`` for
the tool task ``products`` (``pods.data.products``), whose supervised solutions call a calculator in only
part of them and guess otherwise: greedy decoding guesses (wrongly), sampling sometimes calls the tool
(and is right), and it is measured through the multi-turn engine (``pods.agents``).
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pods.data import arith, products

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


@dataclass(frozen=True)
class EmbeddedModel:
    """How one shipped base model is built: the task it is for, its problems, the share of each kind of
    step written with its misconception in the supervised data (the arith tasks) or the share of solutions
    that call the tool (the tool task), and the number of supervised steps."""

    folder: str  # pods/assets/<folder>
    task: str  # the registered task (pods.data) it is trained and evaluated on
    spec: arith.ArithSpec | None  # the arith tasks' problems; None for the tool task
    misconception_rates: Mapping[str, float]
    steps: int
    max_new_tokens: int  # longest solution, misconceived ones and tool results included, plus eos
    tool_share: float | None = None  # the tool task: share of supervised solutions that call the tool

    @property
    def uses_tool(self) -> bool:
        """Whether its solutions call a tool, so that measuring it needs the multi-turn engine."""
        return self.tool_share is not None


EMBEDDED_MODELS = {
    "arith": EmbeddedModel("arith-base", "arith", arith.spec_for_difficulty(1), {"gives": 0.6}, 600, 32),
    "arith-hard": EmbeddedModel(
        "arith-hard-base",
        "arith-hard",
        arith.HARD_SPEC,
        {"gives": 0.85, "double": 0.7, "triple": 0.7},
        1200,
        40,
    ),
    "products": EmbeddedModel(
        "tool-base", "products", None, {}, 800, products.MAX_NEW_TOKENS, tool_share=0.35
    ),
}
"""The shipped base models by task; a config names one as ``embedded-<task>`` (``embedded`` is ``arith``'s)."""


def _arith_text() -> str:
    """Every word and symbol of the arithmetic tasks' prompts and solutions (templates with fields blanked)."""
    words = [*arith.NAMES_SHE, *arith.NAMES_HE, *arith.ITEMS, "She", "He", "Then"]
    templates = [*arith.OPENINGS, *arith.QUESTIONS, arith.PROMPT_TEMPLATE]
    templates += [t for group in arith.STEP_TEMPLATES.values() for t in group]
    return " ".join(re.sub(r"\{\w+\}", " ", t) for t in templates) + " " + " ".join(words)


def _products_text() -> str:
    """Every word and symbol of the tool task's prompts, tool calls, tool results and solutions."""
    return " ".join(re.sub(r"\{\w+\}", " ", t) for t in products.TEMPLATES)


_TASK_TEXTS = {"arith": _arith_text, "arith-hard": _arith_text, "products": _products_text}


def _task_vocabulary(task: str = "arith") -> list[str]:
    """Every piece that ``task``'s texts can contain, in a fixed order (the arith tasks share one)."""
    if task not in _TASK_TEXTS:
        raise ValueError(f"no embedded tokenizer for task {task!r}; known: {sorted(_TASK_TEXTS)}")
    text = _TASK_TEXTS[task]() + " 0 1 2 3 4 5 6 7 8 9 + - * = . ####"
    cores = {piece.strip(" ") for piece in _PIECE.findall(text)} - {""}
    return sorted({f"{space}{core}" for core in cores for space in ("", " ") if core != "\n"} | {" ", "\n"})


def build_tokenizer(task: str = "arith"):
    """A word-level fast tokenizer for ``task`` (one token per digit, exact round trip, left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK, *_task_vocabulary(task)])}
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


Completion = str | Sequence[tuple[str, bool]]
"""A supervised completion: a text, or (text, written by a tool) segments whose tool parts are context only."""


def _completion_ids(tokenizer: Any, completion: Completion) -> tuple[list[int], list[int]]:
    """Token ids of ``completion`` plus eos, and its labels: the ids, with -100 over a tool's output."""
    segments = [(completion, False)] if isinstance(completion, str) else completion
    ids, labels = [], []
    for text, from_tool in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += [-100] * len(piece) if from_tool else piece
    return [*ids, tokenizer.eos_token_id], [*labels, tokenizer.eos_token_id]


def _batch(tokenizer: Any, pairs: Sequence[tuple[str, Completion]]):
    """Right-padded input ids, attention mask and labels (loss on the completion and eos only, never on a
    tool's output)."""
    import torch

    ids, labels = [], []
    for prompt, completion in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c, c_labels = _completion_ids(tokenizer, completion)
        ids.append(p + c)
        labels.append([-100] * len(p) + c_labels)
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    return input_ids, mask, label_ids


def generate_answers(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    temperature: float = 0.0,
    batch_size: int = 256,
    max_new_tokens: int = 32,
    num_return_sequences: int = 1,
) -> list[str]:
    """Completions for ``prompts`` (greedy when ``temperature`` is 0; ``num_return_sequences`` samples per
    prompt, consecutive), with KV cache."""
    import torch

    out: list[str] = []
    model.eval()
    per_batch = max(1, batch_size // num_return_sequences)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        for i in range(0, len(prompts), per_batch):
            batch = tokenizer(prompts[i : i + per_batch], return_tensors="pt", padding=True).to(model.device)
            ids = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                num_return_sequences=num_return_sequences,
                **(sampling if temperature > 0 else {"do_sample": False}),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            out += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def _test_problems(task: str, num_problems: int, seed: int) -> list[Any]:
    """The first ``num_problems`` held-out test problems of ``task`` (each with a question and an answer)."""
    recipe = EMBEDDED_MODELS[task]
    if recipe.uses_tool:
        return products.generate_problems(num_problems, seed=seed, split="test")
    return arith.generate_problems(num_problems, seed=seed, spec=recipe.spec, split="test")


def _is_correct(completion: str, problem: Any) -> bool:
    return completion.strip().endswith(f"#### {problem.answer}")


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _completions(
    model: Any, tokenizer: Any, task: str, problems: Sequence[Any], *, temperature: float, samples: int
) -> tuple[list[str], list[int] | None]:
    """``samples`` completions of each problem (consecutive), and for the tool task each one's number of
    tool calls (None for the others): its episodes run through the multi-turn engine, tool answers included."""
    recipe = EMBEDDED_MODELS[task]
    prompts = [arith.format_prompt(p.question) for p in problems]
    if not recipe.uses_tool:
        texts = generate_answers(
            model,
            tokenizer,
            prompts,
            temperature=temperature,
            max_new_tokens=recipe.max_new_tokens,
            num_return_sequences=samples,
        )
        return texts, None
    from pods.agents import MultiTurnEngine, TextFormat
    from pods.rollout.base import SamplingParams
    from pods.rollout.hf import HFGenerateEngine

    engine = MultiTurnEngine(
        HFGenerateEngine(model, tokenizer, generation_batch_size=256),
        TextFormat(tokenizer),
        tools=[products.calculator],
        max_completion_length=recipe.max_new_tokens,
    )
    sampling = SamplingParams(max_new_tokens=recipe.max_new_tokens, temperature=temperature)
    rollouts = engine.episodes([{"prompt": prompt} for prompt in prompts], samples, sampling).rollouts
    return rollouts.texts, rollouts.episode_stats[:, 0].tolist()


def evaluate(
    model: Any,
    tokenizer: Any,
    *,
    task: str = "arith",
    num_problems: int = 500,
    seed: int = 0,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Accuracy on ``task``'s held-out test problems: overall, split by whether the "gives" step occurs
    (``None`` where no problem falls on a side) and by the number of steps with a misconception; for the
    tool task, split by whether the completion calls the tool, with the share that does."""
    problems = _test_problems(task, num_problems, seed)
    completions, calls = _completions(model, tokenizer, task, problems, temperature=temperature, samples=1)
    correct = [_is_correct(c, p) for p, c in zip(problems, completions, strict=True)]
    metrics: dict[str, Any] = {"accuracy": sum(correct) / len(correct)}
    if calls is not None:
        metrics["tool_call_share"] = sum(k > 0 for k in calls) / len(calls)
        metrics["accuracy_tool"] = _share([ok for ok, k in zip(correct, calls, strict=True) if k > 0])
        metrics["accuracy_guess"] = _share([ok for ok, k in zip(correct, calls, strict=True) if k == 0])
        return metrics | {"num_problems": len(correct)}
    by_traps = {
        str(k): _share([ok for ok, p in zip(correct, problems, strict=True) if p.traps == k])
        for k in sorted({p.traps for p in problems})
    }
    return metrics | {
        "accuracy_gives": _share([ok for ok, p in zip(correct, problems, strict=True) if p.has_gives]),
        "accuracy_other": _share([ok for ok, p in zip(correct, problems, strict=True) if not p.has_gives]),
        "accuracy_by_traps": by_traps,
        "num_problems": len(correct),
    }


def sample_successes(
    model: Any,
    tokenizer: Any,
    *,
    task: str = "arith",
    num_problems: int = 200,
    samples: int = 32,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[int]:
    """How many of ``samples`` completions sampled at ``temperature`` are right, for each of ``task``'s
    first ``num_problems`` held-out test problems (the raw material of :func:`informative_share`)."""
    problems = _test_problems(task, num_problems, seed)
    completions, _ = _completions(model, tokenizer, task, problems, temperature=temperature, samples=samples)
    return [
        sum(_is_correct(c, p) for c in completions[i * samples : (i + 1) * samples])
        for i, p in enumerate(problems)
    ]


def informative_share(successes: Sequence[int], samples: int, group_size: int) -> float:
    """The expected share of groups of ``group_size`` completions that hold both a right and a wrong one
    (a non-zero GRPO advantage), from ``successes[i]`` right among ``samples`` drawn for problem ``i``.

    Unbiased: a group is a random ``group_size``-subset of the drawn samples, so it is all-wrong with
    probability C(samples - k, n) / C(samples, n) and all-right with C(k, n) / C(samples, n)."""
    if not 1 <= group_size <= samples:
        raise ValueError(f"group_size must lie in [1, samples={samples}], got {group_size}")
    total = math.comb(samples, group_size)
    shares = [1 - (math.comb(samples - k, group_size) + math.comb(k, group_size)) / total for k in successes]
    return sum(shares) / len(shares)


def build_base_model(
    output_dir: str | Path,
    *,
    task: str = "arith",
    seed: int = 0,
    steps: int | None = None,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup_steps: int = 50,
    misconception_rates: Mapping[str, float] | None = None,
    eval_problems: int = 500,
    progress: bool = True,
    sizes: dict[str, int] | None = None,
    device: str = "cpu",
    max_seconds: float | None = None,
    distinct_pairs: int | None = None,
) -> dict[str, Any]:
    """Supervised pre-training from scratch on ``task``'s worked solutions (with the misconception mix of
    its :data:`EMBEDDED_MODELS` recipe unless ``misconception_rates`` is given; for the tool task, the
    recipe's share of tool calls, the tool's output out of the loss) for a fixed number of steps (the
    recipe's unless ``steps`` is given); saves a standard Hugging Face folder and returns measured metrics.

    For larger models on a GPU (``scripts/gpu_check.py``): ``sizes`` overrides the model's dimensions,
    ``device`` trains there (bf16 autocast on CUDA), ``max_seconds`` ends training early (the learning
    rate schedule then follows the elapsed time) and ``distinct_pairs`` caps the generated examples
    (they are cycled), since generating them costs CPU time."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if task not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded recipe for task {task!r}; known: {sorted(EMBEDDED_MODELS)}")
    recipe = EMBEDDED_MODELS[task]
    steps = recipe.steps if steps is None else steps
    rates = recipe.misconception_rates if misconception_rates is None else misconception_rates
    if recipe.uses_tool and misconception_rates:
        raise ValueError(
            f"task {task!r} has no misconceptions; its supervised data mix tool calls and guesses"
        )
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}")
    output_dir = Path(output_dir)
    tokenizer = build_tokenizer(task)
    model = build_untrained_model(tokenizer, seed=seed, sizes=sizes).to(device)
    count = min(steps * batch_size, distinct_pairs or steps * batch_size)
    pairs = _supervised_pairs(recipe, count, seed, rates)
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
        sft = bar.add_task("sft", total=steps, loss=float("nan"))
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
            bar.update(sft, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]))
    train_seconds = time.perf_counter() - start
    metrics: dict[str, Any] = {
        "task": task,
        "steps": len(losses),
        "batch_size": batch_size,
        "seed": seed,
        "lr": lr,
    }
    metrics |= {"tool_share": recipe.tool_share} if recipe.uses_tool else {"misconception_rates": dict(rates)}
    metrics |= {"final_loss": sum(losses[-20:]) / len(losses[-20:]), "train_seconds": round(train_seconds, 1)}
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    if eval_problems:
        metrics["greedy"] = evaluate(model, tokenizer, task=task, num_problems=eval_problems)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return metrics


def _supervised_pairs(
    recipe: EmbeddedModel, count: int, seed: int, rates: Mapping[str, float]
) -> list[tuple[str, Completion]]:
    """``count`` supervised (prompt, completion) pairs of the recipe's task from its train split."""
    if recipe.uses_tool:
        return list(products.supervised_pairs(count, seed=seed, tool_share=recipe.tool_share))
    return list(arith.supervised_pairs(count, seed=seed, spec=recipe.spec, misconception_rate=rates))


def sampling_seconds(
    model: Any,
    tokenizer: Any,
    *,
    task: str = "arith",
    prompts: int = 16,
    per_prompt: int = 16,
    new_tokens: int = 32,
    repeats: int = 3,
) -> float:
    """Median seconds for ``model`` to sample ``per_prompt`` completions of exactly ``new_tokens`` tokens
    for each of ``prompts`` test prompts of ``task`` (HF ``generate`` with its KV cache)."""
    import statistics

    import torch

    problems = _test_problems(task, prompts, seed=1)
    batch = tokenizer([arith.format_prompt(p.question) for p in problems], return_tensors="pt", padding=True)
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


def model_path(task: str = "arith") -> Path:
    """The base model for ``task`` shipped inside the package (``pods/assets/<folder>``)."""
    if task not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded model for task {task!r}; shipped: {sorted(EMBEDDED_MODELS)}")
    folder = EMBEDDED_MODELS[task].folder
    path = Path(str(resources.files("pods") / "assets" / folder))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the shipped base model is missing from {path}; rebuild it with "
            f"`python scripts/build_default_model.py --task {task}` or reinstall the package"
        )
    return path


def default_model_path() -> Path:
    """The default base model shipped inside the package (``pods/assets/arith-base``)."""
    return model_path("arith")
