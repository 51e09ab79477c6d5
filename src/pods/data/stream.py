"""The prompts of each training step, as a pure function of the step: exact resume needs no data state."""

from __future__ import annotations

from typing import Any

import torch

from pods.errors import ConfigError


class PromptStream:
    """Epoch e visits the rows in a permutation seeded by (seed, e); process r of W takes its own
    ``prompts_per_step`` consecutive prompts of the step's global slice."""

    def __init__(self, rows: list[dict[str, Any]], prompts_per_step: int, seed: int, rank: int, world: int):
        if not rows:
            raise ConfigError(
                "the training set is empty (check task, task_source, train_limit, max_prompt_length)"
            )
        self.rows, self.per_step, self.seed, self.rank, self.world = rows, prompts_per_step, seed, rank, world
        self._orders: dict[int, list[int]] = {}

    def batch(self, step: int) -> list[dict[str, Any]]:
        """This process's prompts (dataset rows) for ``step``."""
        first = (step * self.world + self.rank) * self.per_step
        return [self.rows[self._index(position)] for position in range(first, first + self.per_step)]

    def epoch(self, step: int) -> float:
        """Passes over the training set completed before ``step`` (over every process)."""
        return step * self.world * self.per_step / len(self.rows)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator).tolist()}
        return self._orders[epoch][offset]
