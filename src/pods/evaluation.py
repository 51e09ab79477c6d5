"""Held-out evaluation: greedy pass@1 (the community's convention) or the paper's sampled protocol
(temperature 0.9, k samples per problem, averaged). Reports answer accuracy, format accuracy and both."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pods.rollout import HFGenerateEngine, RolloutEngine, SamplingParams

_ANSWER_TAG = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_HASH_ANSWER = re.compile(r"####\s*\S")


@dataclass
class EvalResult:
    accuracy: float  # fraction of samples whose answer is correct
    format_accuracy: float  # fraction that state their answer in the requested format
    correct_and_formatted: float  # both at once
    num_problems: int
    samples_per_problem: int
    protocol: str
    temperature: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def next_evaluation_seconds(after: float | None, every: float | None, at: Sequence[float]) -> float | None:
    """The training time of the next evaluation due after one at ``after`` seconds (None: none yet): the
    earliest of the times ``at`` and the multiples of ``every`` that lies beyond it; None when there is none.
    A step that passes several due times is followed by one evaluation, which counts for all of them."""
    after = after or 0.0
    due = [seconds for seconds in at if seconds > after]
    if every is not None:
        due.append(every * (math.floor(after / every + 1e-9) + 1))
    return min(due, default=None)


def follows_format(text: str, prompt_style: str) -> bool:
    """Chat prompts ask for ``<answer>...</answer>``; plain prompts for a final ``#### <answer>`` line."""
    return bool(_ANSWER_TAG.search(text) if prompt_style == "chat" else _HASH_ANSWER.search(text))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Any,
    accuracy_fn: Callable[..., list[float]],
    *,
    protocol: str = "greedy",
    samples: int = 5,
    temperature: float = 0.9,
    max_new_tokens: int = 512,
    batch_size: int = 256,
    prompt_style: str = "plain",
    stop_strings: tuple[str, ...] = (),
    accelerator: Any = None,
    progress: bool = False,
    engine: RolloutEngine | None = None,
) -> EvalResult:
    """Score ``model`` on every row of ``dataset`` (a ``prompt`` column; every other column reaches ``accuracy_fn``
    as a keyword, e.g. ``answer``), sharded over processes.

    ``engine`` samples the completions (the trainer passes its own, which holds the training weights);
    by default HF ``generate`` on ``model``. HF ``generate`` gets ``batch_size`` completions per call; any
    other engine (vLLM, which schedules its own batches) gets the whole set in one call.
    """
    from pods.agents import sample_rollouts
    from pods.distributed import synced_max
    from pods.scoring import reward_columns, score_completions

    if protocol not in ("greedy", "sampled"):
        raise ValueError(f"unknown evaluation protocol {protocol!r}; choose greedy or sampled")
    k = 1 if protocol == "greedy" else samples
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0 if protocol == "greedy" else temperature,
        stop_strings=tuple(stop_strings),
    )
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    rows = [dataset[i] for i in range(rank, len(dataset), world)]
    scored_rows = len(rows)
    # Every process generates as many batches of as many rows: with weights sharded over the processes (ZeRO-3,
    # FSDP) each generation forward is a collective. One row fewer is made up by a repeat that is not scored.
    rows += [dataset[0]] * (-(-len(dataset) // world) - scored_rows)  # 0 or 1 (none without a row)
    engine = engine or HFGenerateEngine(model, tokenizer, generation_batch_size=batch_size)
    most = (lambda value: int(synced_max(accelerator, value))) if world > 1 else None  # turns in step
    chunked = isinstance(getattr(engine, "engine", engine), HFGenerateEngine)  # a multi-turn engine's inside
    prompts_per_batch = max(1, batch_size // k) if chunked else max(1, len(rows))

    start = time.perf_counter()
    totals = torch.zeros(3, dtype=torch.float64)  # correct, formatted, both
    batches = range(0, len(rows), prompts_per_batch)
    for begin in _maybe_progress(batches, progress and rank == 0, "evaluating"):
        chunk = rows[begin : begin + prompts_per_batch]
        episodes = sample_rollouts(engine, chunk, k, sampling, tokenizer, most=most)  # with tools: episodes
        rollouts, environments = episodes.rollouts, episodes.environments
        if begin + len(chunk) > scored_rows:  # the repeat: generated (in step with the others), not scored
            chunk = chunk[: max(0, scored_rows - begin)]
            if not chunk:
                continue
            rollouts = rollouts.select(list(range(len(chunk) * k)))
            environments = None if environments is None else environments[: len(chunk) * k]
        prompts = [row["prompt"] for row in chunk for _ in range(k)]
        columns = reward_columns(chunk, k)
        if environments is not None:
            columns["environments"] = environments
        pairs = zip(rollouts.completion_ids, rollouts.completion_mask, strict=True)
        ids = [row[mask.bool()].tolist() for row, mask in pairs]
        # every column, as in training; a failing function is named with the completion it fails on
        _, scores = score_completions(
            [accuracy_fn], None, prompts, rollouts.texts, ids, columns, conversations=rollouts.messages
        )
        correct = next(iter(scores.values())) > 0.5  # None (NaN): not right
        formatted = torch.tensor([follows_format(text, prompt_style) for text in rollouts.texts])
        totals += torch.stack([correct.sum(), formatted.sum(), (correct & formatted).sum()]).double()

    count = torch.tensor(float(scored_rows * k), dtype=torch.float64)
    if accelerator is not None and world > 1:
        sums = accelerator.reduce(torch.cat([totals, count.view(1)]).to(accelerator.device), "sum").cpu()
        totals, count = sums[:3], sums[3]
    fractions = (totals / count.clamp_min(1)).tolist()
    return EvalResult(
        accuracy=fractions[0],
        format_accuracy=fractions[1],
        correct_and_formatted=fractions[2],
        num_problems=len(dataset),
        samples_per_problem=k,
        protocol=protocol,
        temperature=sampling.temperature,
        seconds=time.perf_counter() - start,
    )


def _maybe_progress(items: range, enabled: bool, description: str):
    """A transient progress bar on a terminal; nothing in a log or a pipe (where rich would leave an empty line)."""
    from rich.console import Console

    if not enabled or not Console().is_terminal:
        return items
    from rich.progress import track

    return track(items, description=description, transient=True)


def evaluate_with_config(
    config: Any,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    accuracy_fn: Any,
    prompt_style: str,
    *,
    accelerator: Any = None,
    engine: Any = None,
) -> EvalResult:
    """:func:`evaluate` with a :class:`~pods.config.TrainConfig`'s evaluation settings (a training run's)."""
    return evaluate(
        model,
        tokenizer,
        dataset,
        accuracy_fn,
        protocol=config.eval_protocol,
        samples=config.eval_samples,
        temperature=config.eval_temperature,
        max_new_tokens=config.max_completion_length,
        batch_size=config.eval_batch_size,
        prompt_style=prompt_style,
        stop_strings=tuple(config.stop_strings),
        accelerator=accelerator,
        engine=engine,
    )
