"""The training prompts, drawn in order from a cursor: exact resume needs only the cursor, an integer.

Epoch e visits the rows in a permutation seeded by (seed, e). Every draw takes the next block of the stream:
each process draws the same count, process r of W its own consecutive slice of the block, so no prompt is on
two processes at once and the cursor (prompts drawn per process) is the same everywhere. A step's first round,
its refill rounds and the candidates GRESO skips all come from this one stream, so the epoch counts every
prompt drawn and each prompt comes back once per epoch.
"""

from __future__ import annotations

from typing import Any

import torch

from pods.errors import ConfigError

__all__ = ["PromptStream", "refill_order"]


class PromptStream:
    """Draws of dataset positions: ``draw(cursor, count)`` is this process's ``count`` prompts of the block
    that starts after ``cursor`` prompts per process were drawn."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, rank: int = 0, world: int = 1):
        if not rows:
            raise ConfigError(
                "the training set is empty (check task, task_source, train_limit, max_prompt_length)"
            )
        self.rows, self.seed, self.rank, self.world = rows, seed, rank, world
        self._orders: dict[int, list[int]] = {}

    def draw(self, cursor: int, count: int) -> list[int]:
        """Positions in the dataset of this process's ``count`` prompts after ``cursor`` draws per process."""
        first = cursor * self.world + self.rank * count
        return [self._index(position) for position in range(first, first + count)]

    def epoch(self, cursor: int) -> float:
        """Passes over the training set drawn so far (every process, skipped prompts included)."""
        return cursor * self.world / len(self.rows)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator).tolist()}
        return self._orders[epoch][offset]


def refill_order(num_rows: int, seed: int, step: int) -> list[int]:
    """A permutation of ``range(num_rows)`` seeded by (seed, step): the order in which the TRL drop-in, which does
    not own the main stream of prompts, draws a generation's further prompts."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + 17)
    return torch.randperm(num_rows, generator=generator).tolist()
