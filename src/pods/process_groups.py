"""Stateless torch process groups: a TCP store of their own and a gloo or NCCL group built on it, not torch's
default group, so that they live beside accelerate's group in a trainer and vLLM's in a server. The weights path
to a rollout worker or a server (:mod:`pods.weight_sync`) and the rollout workers of several trainer processes
(:class:`GroupCollectives`) meet through them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GROUP_TIMEOUT", "GroupCollectives", "open_group", "tcp_store"]

# How long one side of a collective waits for the others (a dead peer ends it at once with gloo).
GROUP_TIMEOUT = timedelta(hours=1)


def tcp_store(host: str, port: int, world_size: int, *, serve: bool) -> dist.TCPStore:
    """The TCP store the ranks meet at: served here on ``port`` (0: a free one; its ``.port`` says which) or
    reached at ``host:port``."""
    if serve:
        return dist.TCPStore(host, port, world_size, True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    return dist.TCPStore(host, port, world_size, False, timeout=GROUP_TIMEOUT)


def open_group(
    backend: str, store: dist.Store, rank: int, world_size: int, device: torch.device | None = None
) -> Any:
    """The group of ``world_size`` ranks on ``store`` (blocks until all have joined: gloo connects at once, NCCL
    at its first collective, on ``device``)."""
    prefixed = dist.PrefixStore(f"pods-{backend}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, GROUP_TIMEOUT)
    if device is not None:
        torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = GROUP_TIMEOUT
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


@dataclass
class GroupCollectives:
    """What :class:`~pods.producer.Producer` reads of an accelerator, for the rollout worker of one of several
    trainer processes: its rank among the workers and the collectives :mod:`pods.distributed` calls, over the
    workers' own gloo group."""

    group: Any
    process_index: int
    num_processes: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` (equal shapes), concatenated along the first dimension."""
        values = values.detach().to("cpu").contiguous()
        parts = [torch.empty_like(values) for _ in range(self.num_processes)]
        self.group.allgather([parts], [values]).wait()
        return torch.cat(parts) if values.dim() else torch.stack(parts)

    def reduce(self, values: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """``values`` summed (``sum``) or maximised (``max``) over the ranks."""
        result = values.detach().to("cpu").clone()
        options = dist.AllreduceOptions()
        options.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[reduction]
        self.group.allreduce([result], options).wait()
        return result

    def every_process(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on each rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        sizes = self.gather(torch.tensor([data.numel()])).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = self.gather(padded.unsqueeze(0))
        return [pickle.loads(part[:size].numpy().tobytes()) for part, size in zip(parts, sizes, strict=True)]
