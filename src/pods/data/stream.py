"""The prompts of each training step, as a pure function of the step: exact resume needs no data state."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from pods.errors import ConfigError

__all__ = ["PromptStream", "refill_order"]


class PromptStream:
    """Epoch e visits the rows in a permutation seeded by (seed, e); process r of W takes its own
    ``prompts_per_step`` consecutive prompts of the step's global slice. Refill rounds (a prompt filter
    or skipped prompts) draw further candidates from a permutation seeded by (seed, step)."""

    def __init__(self, rows: list[dict[str, Any]], prompts_per_step: int, seed: int, rank: int, world: int):
        if not rows:
            raise ConfigError(
                "the training set is empty (check task, task_source, train_limit, max_prompt_length)"
            )
        self.rows, self.per_step, self.seed, self.rank, self.world = rows, prompts_per_step, seed, rank, world
        self._orders: dict[int, list[int]] = {}

    def batch(self, step: int) -> list[dict[str, Any]]:
        """This process's prompts (dataset rows) for ``step``."""
        return [self.rows[index] for index in self.indices(step)]

    def indices(self, step: int) -> list[int]:
        """Positions in the dataset of this process's prompts for ``step``."""
        return self._slice(step, self.rank)

    def candidates(self, step: int) -> Iterator[list[int]]:
        """This process's candidate prompts for ``step``, ``prompts_per_step`` at a time, without end: its own
        prompts, then refill draws that no process has among the step's prompts and no other process draws."""
        yield self.indices(step)
        taken = {index for rank in range(self.world) for index in self._slice(step, rank)}
        order = refill_order(len(self.rows), self.seed, step, exclude=taken)
        for chunk in itertools.count():
            first = (chunk * self.world + self.rank) * self.per_step
            yield [order[(first + k) % len(order)] for k in range(self.per_step)]

    def epoch(self, step: int) -> float:
        """Passes over the training set completed before ``step`` (over every process)."""
        return step * self.world * self.per_step / len(self.rows)

    def _slice(self, step: int, rank: int) -> list[int]:
        first = (step * self.world + rank) * self.per_step
        return [self._index(position) for position in range(first, first + self.per_step)]

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator).tolist()}
        return self._orders[epoch][offset]


def refill_order(
    num_rows: int, seed: int, step: int, exclude: set[int] | frozenset[int] = frozenset()
) -> list[int]:
    """The order in which a step's refill rounds draw prompts: a permutation of ``range(num_rows)`` seeded by
    (seed, step), without ``exclude`` unless that would leave nothing (a dataset smaller than one step)."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + 17)
    order = torch.randperm(num_rows, generator=generator).tolist()
    rest = [index for index in order if index not in exclude]
    return rest or order
