"""What a rollout engine is: sampling settings in, a padded batch of n completions per prompt out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "EngineWrapper",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "concat_rollouts",
    "cut_after_stop",
    "left_pad",
    "pack_completions",
    "tokenize_prompts",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions. ``temperature = 0`` means greedy decoding; ``top_k = 0`` turns top-k off."""

    max_new_tokens: int = 256
    temperature: float = 0.9
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, list):
            object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(
                f"stop_strings must be a tuple of non-empty strings, got {self.stop_strings!r}; "
                "write stop_strings=('</answer>',) for a single one."
            )

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0


@dataclass
class Rollouts:
    """n completions for each of P prompts, prompt-major: row ``p * n + i`` is completion i of prompt p.

    Engines return the tensors on the CPU (small; decoding needs them there anyway);
    :func:`pods.loss.completion_logprobs` moves each micro-batch to the model's device.
    """

    prompt_ids: torch.Tensor  # [P*n, Lp] left-padded with the pad id (each prompt repeated n times)
    prompt_mask: torch.Tensor  # [P*n, Lp] 1 for real tokens
    completion_ids: torch.Tensor  # [P*n, Lc] right-padded; includes the EOS token when one was produced
    completion_mask: torch.Tensor  # [P*n, Lc] 1 up to and including EOS / the end of a stop string
    texts: list[str]  # decoded completions (special tokens skipped), cut after a stop string
    truncated: torch.Tensor  # [P*n] bool: hit max_new_tokens without EOS or stop string
    num_prompts: int
    num_generations: int
    # [P*n, Lc] log-probs the sampler drew each completion token with (0 on padding), from engines that
    # report them (vLLM); the trainer corrects the sampler/trainer mismatch with them. None for HF.
    sampling_logprobs: torch.Tensor | None = None
    # [P*n, Lc] 1 where the model sampled the token, 0 where a tool or environment wrote it (multi-turn
    # rollouts): tool output is context the model reads (it stays under completion_mask) but gets no loss, no
    # KL and no gradient. None: every completion token was sampled.
    tool_mask: torch.Tensor | None = None
    # [P*n, 3] multi-turn rollouts: tool calls made, calls answered with an error, model turns
    # (pods.agents.EPISODE_STATS). None: single-turn rollouts.
    episode_stats: torch.Tensor | None = None
    # per row, the episode as chat messages in TRL's shape (assistant turns with their tool_calls, tool messages),
    # what user reward functions get as completions of chat prompts. None: text episodes and single turns.
    messages: list[list[dict]] | None = None

    def __post_init__(self) -> None:
        rows = self.num_prompts * self.num_generations
        shapes = {
            "prompt_ids": self.prompt_ids.shape,
            "prompt_mask": self.prompt_mask.shape,
            "completion_ids": self.completion_ids.shape,
            "completion_mask": self.completion_mask.shape,
        }
        bad = [name for name, shape in shapes.items() if len(shape) != 2 or shape[0] != rows]
        if (
            bad
            or self.prompt_ids.shape != self.prompt_mask.shape
            or self.completion_ids.shape != self.completion_mask.shape
            or len(self.texts) != rows
            or tuple(self.truncated.shape) != (rows,)
            or (
                self.sampling_logprobs is not None
                and self.sampling_logprobs.shape != self.completion_ids.shape
            )
        ):
            raise ValueError(
                f"inconsistent Rollouts: {self.num_prompts} prompts x {self.num_generations} generations = "
                f"{rows} rows, but shapes are { {k: tuple(v) for k, v in shapes.items()} }, "
                f"{len(self.texts)} texts, truncated {tuple(self.truncated.shape)}, sampling_logprobs "
                f"{None if self.sampling_logprobs is None else tuple(self.sampling_logprobs.shape)}."
            )
        if self.tool_mask is not None:
            check_tool_mask(self.tool_mask, tuple(self.completion_ids.shape))
        if self.messages is not None and len(self.messages) != rows:
            raise ValueError(
                f"messages must hold one conversation per row ({rows}), got {len(self.messages)}."
            )
        if self.episode_stats is not None and tuple(self.episode_stats.shape) != (rows, 3):
            raise ValueError(
                f"episode_stats must have shape ({rows}, 3), got {tuple(self.episode_stats.shape)}."
            )

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        """``[rows]`` real completion tokens per row (EOS / stop-string token and any tool output included)."""
        return self.completion_mask.sum(dim=1)

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[rows, Lc]`` the tokens the loss weighs: completion tokens the model sampled (tool output left out)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @property
    def sampled_lengths(self) -> torch.Tensor:
        """``[rows]`` completion tokens the model sampled (:attr:`completion_lengths` less any tool output)."""
        return self.loss_mask.sum(dim=1)

    def select(self, rows: torch.Tensor | list[int]) -> Rollouts:
        """Keep the given flat row indices, in the given order, and shrink the padding to the longest kept.

        With the same number of rows kept from every prompt, in prompt-major order (as after PODS
        selection of m per group), the result has ``num_prompts`` = the kept prompts and
        ``num_generations`` = rows kept per prompt; any other selection (e.g. an arbitrary micro-batch)
        gets ``num_prompts = len(rows)`` and ``num_generations = 1``.
        """
        if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
            raise ValueError("rows must be row indices, not a boolean mask; pass mask.nonzero().squeeze(1).")
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.completion_ids.device)
        if rows.ndim != 1:
            raise ValueError(f"rows must be a 1-D tensor of row indices, got shape {tuple(rows.shape)}.")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            raise ValueError(f"row indices must be in [0, {len(self)}), got {rows.tolist()}.")

        prompt_ids, prompt_mask = self.prompt_ids[rows], self.prompt_mask[rows]
        completion_ids, completion_mask = self.completion_ids[rows], self.completion_mask[rows]
        prompt_start = prompt_mask.shape[1] - int(prompt_mask.sum(dim=1).max()) if rows.numel() else 0
        completion_end = int(completion_mask.sum(dim=1).max()) if rows.numel() else 0
        num_prompts, num_generations = _group_layout(rows // self.num_generations)
        return Rollouts(
            prompt_ids=prompt_ids[:, prompt_start:],
            prompt_mask=prompt_mask[:, prompt_start:],
            completion_ids=completion_ids[:, :completion_end],
            completion_mask=completion_mask[:, :completion_end],
            texts=[self.texts[i] for i in rows.tolist()],
            truncated=self.truncated[rows],
            num_prompts=num_prompts,
            num_generations=num_generations,
            sampling_logprobs=(
                None if self.sampling_logprobs is None else self.sampling_logprobs[rows][:, :completion_end]
            ),
            tool_mask=None if self.tool_mask is None else self.tool_mask[rows][:, :completion_end],
            episode_stats=None if self.episode_stats is None else self.episode_stats[rows],
            messages=None if self.messages is None else [self.messages[i] for i in rows.tolist()],
        )


def concat_rollouts(parts: list[Rollouts], pad_id: int = 0) -> Rollouts:
    """Several batches of rollouts with the same n (refill rounds of one step) as one, prompt-major in the given
    order: prompts re-padded on the left and completions on the right (with ``pad_id``, under a 0 mask)."""
    if not parts:
        raise ValueError("concat_rollouts needs at least one batch of rollouts.")
    if len(parts) == 1:
        return parts[0]
    n = parts[0].num_generations
    if any(part.num_generations != n for part in parts):
        raise ValueError(f"cannot join rollouts of different n: {[part.num_generations for part in parts]}.")
    if len({part.sampling_logprobs is None for part in parts}) > 1:
        raise ValueError("cannot join rollouts with and without sampling log-probs.")
    prompt_width = max(part.prompt_ids.shape[1] for part in parts)
    completion_width = max(part.completion_ids.shape[1] for part in parts)

    def pad(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        missing = width - tensor.shape[1]
        return torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=value)

    return Rollouts(
        prompt_ids=torch.cat([pad(p.prompt_ids, prompt_width, pad_id, left=True) for p in parts]),
        prompt_mask=torch.cat([pad(p.prompt_mask, prompt_width, 0, left=True) for p in parts]),
        completion_ids=torch.cat(
            [pad(p.completion_ids, completion_width, pad_id, left=False) for p in parts]
        ),
        completion_mask=torch.cat([pad(p.completion_mask, completion_width, 0, left=False) for p in parts]),
        texts=[text for part in parts for text in part.texts],
        truncated=torch.cat([part.truncated for part in parts]),
        num_prompts=sum(part.num_prompts for part in parts),
        num_generations=n,
        sampling_logprobs=(
            None
            if parts[0].sampling_logprobs is None
            else torch.cat([pad(p.sampling_logprobs, completion_width, 0.0, left=False) for p in parts])
        ),
        tool_mask=(
            None
            if all(p.tool_mask is None for p in parts)
            else torch.cat([pad(sampled_tokens(p), completion_width, 0, left=False) for p in parts])
        ),
        episode_stats=(
            None
            if all(p.episode_stats is None for p in parts)
            else torch.cat([episode_stats_of(p) for p in parts])
        ),
        messages=(
            None
            if all(p.messages is None for p in parts)
            else [m for p in parts for m in (p.messages or [[] for _ in range(len(p))])]
        ),
    )


def episode_stats_of(rollouts: Rollouts) -> torch.Tensor:
    """``[rows, 3]`` the rollouts' episode statistics; single-turn rows count one turn and no calls."""
    if rollouts.episode_stats is not None:
        return rollouts.episode_stats
    stats = torch.zeros((len(rollouts), 3), dtype=torch.long)
    stats[:, 2] = 1
    return stats


def sampled_tokens(rollouts: Rollouts) -> torch.Tensor:
    """``[rows, Lc]`` the tool mask of ``rollouts`` in its completion mask's dtype, all ones when it has none."""
    if rollouts.tool_mask is not None:
        return rollouts.tool_mask.to(rollouts.completion_mask.dtype)
    return torch.ones_like(rollouts.completion_mask)


def check_tool_mask(tool_mask: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A tool mask has the completions' shape and holds only 0 and 1 (0 under a 0 completion mask is fine)."""
    if tuple(tool_mask.shape) != shape:
        raise ValueError(f"tool_mask must have the completions' shape {shape}, got {tuple(tool_mask.shape)}.")
    if tool_mask.numel() and not bool(((tool_mask == 0) | (tool_mask == 1)).all()):
        raise ValueError(
            f"tool_mask must hold only 0 (tool output) and 1 (sampled), got values {tool_mask.unique().tolist()}."
        )


def _group_layout(groups: torch.Tensor) -> tuple[int, int]:
    """(prompts, rows per prompt) when ``groups`` is k rows of each prompt in contiguous blocks, else (rows, 1)."""
    rows = groups.numel()
    if rows == 0:
        return 0, 0
    changes = int((groups[1:] != groups[:-1]).sum()) + 1
    per_group = rows // changes
    blocks = groups.reshape(-1, per_group) if per_group * changes == rows else None
    distinct = int(torch.unique(groups).numel())
    if blocks is not None and distinct == changes and bool((blocks == blocks[:, :1]).all()):
        return changes, per_group
    return rows, 1


def tokenize_prompts(engine, prompts: list[str], num_generations: int) -> list[list[int]]:
    """The arguments every engine's ``generate`` checks, then the token ids of each rendered prompt with the
    engine's ``tokenizer``, ``add_special_tokens`` and ``max_prompt_length`` (none empty, none too long)."""
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(
            "prompts must be a non-empty list of strings (already rendered with the chat template)."
        )
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    encoded = engine.tokenizer(prompts, add_special_tokens=engine.add_special_tokens)["input_ids"]
    longest, limit = max(len(ids) for ids in encoded), engine.max_prompt_length
    if limit is not None and longest > limit:
        index = next(i for i, ids in enumerate(encoded) if len(ids) == longest)
        raise ValueError(
            f"prompt {index} has {longest} tokens, more than max_prompt_length={limit}; "
            "drop or shorten long prompts before generation, or raise max_prompt_length."
        )
    if min(len(ids) for ids in encoded) == 0:
        raise ValueError("an empty prompt tokenizes to no tokens; every prompt needs at least one token.")
    return [list(ids) for ids in encoded]


def pack_completions(
    engine,
    encoded: list[list[int]],
    token_ids: list[list[int]],
    logprobs: list[list[float | None] | None],
    truncated: list[bool],
    num_generations: int,
    sampling: SamplingParams,
) -> Rollouts:
    """Rollouts from an engine's sampled token lists (prompt-major, ``num_generations`` per prompt of
    ``encoded``): completions right-padded with the engine's ``pad_token_id``, the log-prob each token was
    sampled with (0 where the engine reported none), prompts left-padded, texts cut after a stop string."""
    width = max(1, max(len(ids) for ids in token_ids))
    completion_ids = torch.full((len(token_ids), width), engine.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    sampling_logprobs = torch.zeros((len(token_ids), width), dtype=torch.float32)
    for row, (ids, lps) in enumerate(zip(token_ids, logprobs, strict=True)):
        completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[row, : len(ids)] = 1
        if lps is not None:
            sampling_logprobs[row, : len(ids)] = torch.tensor([lp or 0.0 for lp in lps], dtype=torch.float32)
    prompt_ids, prompt_mask = left_pad(encoded, engine.pad_token_id)
    texts = engine.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
    return Rollouts(
        prompt_ids=prompt_ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        texts=[cut_after_stop(text, sampling.stop_strings) for text in texts],
        truncated=torch.tensor(truncated),
        num_prompts=len(encoded),
        num_generations=num_generations,
        sampling_logprobs=sampling_logprobs,
    )


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of the sequences left-padded with ``pad_id`` to the longest."""
    longest = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        if tokens:
            ids[row, -len(tokens) :] = torch.tensor(tokens)
            mask[row, -len(tokens) :] = 1
    return ids, mask


def eos_token_ids(tokenizer, model: torch.nn.Module) -> list[int]:
    """The tokenizer's EOS plus every EOS id of the model's generation config."""
    ids = [tokenizer.eos_token_id]
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += config_eos if isinstance(config_eos, list | tuple) else [config_eos]
    return sorted({int(i) for i in ids if i is not None})


def pad_token_id(tokenizer, model: torch.nn.Module, eos_ids: list[int]) -> int:
    """The tokenizer's pad id, else the generation config's, else the first EOS id."""
    candidates = [
        tokenizer.pad_token_id,
        getattr(getattr(model, "generation_config", None), "pad_token_id", None),
        *eos_ids,
    ]
    for candidate in candidates:
        if candidate is not None:
            return int(candidate)
    raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token first.")


def cut_after_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """Cut ``text`` right after the earliest-ending stop string it contains (the last token may overhang)."""
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    return text[: min(ends)] if ends else text


def batch_multiple(on_gpu: bool, rows_per_batch: int, num_generations: int) -> int:
    """Prompts per round are rounded up to a multiple of this: on a GPU, the prompts whose n completions fill one
    batch of the engine (decoding is memory-bound there, so a full batch costs about what a partial one does);
    on a CPU 1, since every row costs its own share of the time."""
    return max(1, rows_per_batch // num_generations) if on_gpu else 1


class EngineWrapper:
    """A rollout engine around another (the rollout worker's behaviour log-probs, multi-turn episodes): the engine
    protocol's other methods and the inner engine's attributes (``tokenizer``, ``pad_token_id``, ...) are its."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (unpickling, a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)

    def round_multiple(self, num_generations: int) -> int:
        return self.engine.round_multiple(num_generations)

    def close(self) -> None:
        """Close the engine inside, where it has anything to close (a vLLM server pods started)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples completions for the trainer (HF ``generate`` or vLLM)."""

    def generate(self, prompts: list[str], num_generations: int, sampling: SamplingParams) -> Rollouts:
        """``num_generations`` completions of each rendered prompt, as a prompt-major :class:`Rollouts`."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (a no-op when it shares them)."""
        ...

    def round_multiple(self, num_generations: int) -> int:
        """What a generation round's prompt count is rounded up to (:func:`batch_multiple`)."""
        ...
