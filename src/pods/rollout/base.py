"""What a rollout engine is: sampling settings in, a padded batch of n completions per prompt out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["RolloutEngine", "Rollouts", "SamplingParams"]


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
        ):
            raise ValueError(
                f"inconsistent Rollouts: {self.num_prompts} prompts x {self.num_generations} generations = "
                f"{rows} rows, but shapes are { {k: tuple(v) for k, v in shapes.items()} }, "
                f"{len(self.texts)} texts, truncated {tuple(self.truncated.shape)}."
            )

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        """``[rows]`` number of real completion tokens per row (EOS / stop-string token included)."""
        return self.completion_mask.sum(dim=1)

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


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples completions for the trainer (HF ``generate`` now, vLLM later)."""

    def generate(self, prompts: list[str], num_generations: int, sampling: SamplingParams) -> Rollouts:
        """``num_generations`` completions of each rendered prompt, as a prompt-major :class:`Rollouts`."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (a no-op when it shares them)."""
        ...
