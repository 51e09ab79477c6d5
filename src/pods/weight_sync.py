"""Weights from the trainer to a rollout process over a two-rank torch process group: gloo between CPU processes
(TCP: on one machine or across machines), NCCL between two GPUs (device to device, no host copy).

The group is stateless, with its own TCP store (:func:`weights_store`: either side may host it), not torch's
default group, so it lives beside accelerate's group in the trainer and vLLM's in a server. Rank 0 sends, rank 1 receives, one flat buffer per dtype in a
:class:`TensorLayout` both sides hold. :meth:`WeightSender.send` copies the weights into its staging buffers and
returns; a background thread broadcasts them, so the trainer is held for the copy only, and a receiver that
takes them later costs the trainer nothing. The staging buffers cost one more copy of the sent weights (the
trainable ones: the LoRA adapter with LoRA).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pods.errors import ConfigError

__all__ = [
    "TensorLayout",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "resolve_placement",
    "weights_store",
]

# How long one side of a transfer waits for the other (a dead peer ends a transfer at once).
GROUP_TIMEOUT = timedelta(hours=1)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8)


class WeightSyncError(RuntimeError):
    """A transfer of weights failed (the other side died or its connection broke)."""


@dataclass(frozen=True)
class TensorLayout:
    """Where each named tensor lies in the flat buffers (one per dtype), in a fixed order both sides share."""

    entries: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> TensorLayout:
        return cls(tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in named))

    def to_json(self) -> list[list[Any]]:
        """The layout as JSON data (to a vLLM server): [name, shape, dtype name] per tensor."""
        return [[name, list(shape), str(dtype).removeprefix("torch.")] for name, shape, dtype in self.entries]

    @classmethod
    def from_json(cls, entries: list[list[Any]]) -> TensorLayout:
        dtypes = {str(dtype).removeprefix("torch."): dtype for dtype in _DTYPES}
        return cls(tuple((name, tuple(shape), dtypes[dtype]) for name, shape, dtype in entries))

    def buffers(self, device: torch.device | str) -> dict[torch.dtype, torch.Tensor]:
        """Empty flat buffers on ``device``, one per dtype, that hold every tensor of the layout."""
        sizes: dict[torch.dtype, int] = {}
        for _, shape, dtype in self.entries:
            sizes[dtype] = sizes.get(dtype, 0) + _numel(shape)
        return {dtype: torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()}

    def views(self, buffers: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor of the layout as a view into ``buffers`` (writing a view writes the buffer)."""
        offsets = dict.fromkeys(buffers, 0)
        views = {}
        for name, shape, dtype in self.entries:
            start, size = offsets[dtype], _numel(shape)
            views[name] = buffers[dtype][start : start + size].view(shape)
            offsets[dtype] = start + size
        return views


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def weights_store(host: str, port: int, *, serve: bool) -> dist.TCPStore:
    """The TCP store two ranks meet at: served here on ``port`` (0: a free one; its ``.port`` says which) or
    reached at ``host:port``."""
    if serve:
        return dist.TCPStore(host, port, 2, True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    return dist.TCPStore(host, port, 2, False, timeout=GROUP_TIMEOUT)


def _open_group(backend: str, store: dist.Store, rank: int, device: torch.device) -> Any:
    """The two ranks' process group (blocks until both have joined: gloo connects at once, NCCL at its first
    transfer)."""
    prefixed = dist.PrefixStore("pods-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, GROUP_TIMEOUT)
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = GROUP_TIMEOUT
    return dist.ProcessGroupNCCL(prefixed, rank, 2, options)


def _broadcast(group: Any, buffers: dict[torch.dtype, torch.Tensor]) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for buffer in buffers.values():
        group.broadcast([buffer], options).wait()
    for buffer in buffers.values():
        if buffer.is_cuda:  # the transfer ran on NCCL's stream: done before the buffers are read or reused
            torch.cuda.synchronize(buffer.device)


class WeightSender:
    """The trainer's side (rank 0): copies the weights into staging buffers on ``device`` and broadcasts them
    from a background thread, to the receiver that meets it at ``store``."""

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor]],
        *,
        backend: str,
        device: torch.device | str,
        store: dist.Store,
    ) -> None:
        self.backend, self.device, self.store = backend, torch.device(device), store
        self.layout = TensorLayout.of(named)
        self.staging = self.layout.buffers(self.device)
        self._views = self.layout.views(self.staging)
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy ``named`` (the layout's tensors) into the staging buffers and broadcast them in the background,
        after the previous broadcast has ended (it has once the receiver holds it)."""
        self.wait()
        with torch.no_grad():
            for name, tensor in named:
                self._views[name].copy_(tensor.detach())
        self._thread = threading.Thread(target=self._broadcast, name="pods-weight-sender", daemon=True)
        self._thread.start()

    def _broadcast(self) -> None:
        try:
            if self._group is None:
                self._group = _open_group(self.backend, self.store, 0, self.device)
            _broadcast(self._group, self.staging)
        except BaseException as error:  # raised in the trainer's thread by the next wait()
            self._error = error

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the broadcast in flight (``timeout`` seconds at most); whether it has ended. Its failure
        raises :class:`WeightSyncError`."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise WeightSyncError(f"sending the weights over {self.backend} failed: {error}") from None
        return True


class WeightReceiver:
    """A rollout process's side (rank 1): joins the sender's group at ``store`` and receives each broadcast of
    ``layout`` into its own buffers on ``device``."""

    def __init__(
        self, layout: TensorLayout, *, backend: str, device: torch.device | str, store: dist.Store
    ) -> None:
        self.backend, self.device, self.store, self.layout = backend, torch.device(device), store, layout
        self.buffers = layout.buffers(self.device)
        self.views = layout.views(self.buffers)
        self._group: Any = None

    def receive(self) -> dict[str, torch.Tensor]:
        """The next weights the sender broadcasts (waits for them), as views into this receiver's buffers."""
        try:
            if self._group is None:
                self._group = _open_group(self.backend, self.store, 1, self.device)
            _broadcast(self._group, self.buffers)
        except Exception as error:
            raise WeightSyncError(f"receiving the weights over {self.backend} failed: {error}") from None
        return self.views


def resolve_placement(
    device: str, backend: str, trainer_device: torch.device | str, cuda_devices: int
) -> tuple[str, str]:
    """(the rollout worker's device, the weights' path to it) for ``rollout_worker_device`` and
    ``weight_sync_backend``. ``auto`` puts the worker on a GPU of its own where there is one more than the
    trainer's (else beside the trainer) and sends the weights GPU to GPU with NCCL between two GPUs, else through
    shared memory; a choice that cannot work is a :class:`~pods.errors.ConfigError` naming the fix."""
    trainer = torch.device(trainer_device)
    if trainer.type == "cuda" and trainer.index is None:
        trainer = torch.device("cuda", 0)
    if device == "auto":
        others = [i for i in range(cuda_devices) if trainer.type != "cuda" or i != trainer.index]
        device = f"cuda:{others[0]}" if trainer.type == "cuda" and others else str(trainer)
    worker = torch.device(device)
    if worker.type == "cuda":
        if cuda_devices == 0:
            raise ConfigError(
                f"rollout_worker_device: {device} needs a GPU and this machine has none; set it to cpu or auto"
            )
        worker = torch.device("cuda", worker.index or 0)
        if worker.index >= cuda_devices:
            raise ConfigError(
                f"rollout_worker_device: {device} does not exist (GPUs here: cuda:0 to cuda:{cuda_devices - 1})"
            )
    elif worker.type != "cpu":
        raise ConfigError(f"rollout_worker_device: {device!r} is neither cpu nor cuda[:N] nor auto")
    both_gpus = worker.type == "cuda" and trainer.type == "cuda"
    if backend == "auto":
        backend = "nccl" if both_gpus and worker != trainer else "shared_memory"
    if backend == "nccl" and not both_gpus:
        raise ConfigError(
            f"weight_sync_backend: nccl sends weights between two GPUs, but the trainer is on {trainer} and the "
            f"rollout worker on {worker}; use gloo or shared_memory (or auto)"
        )
    if backend == "nccl" and worker == trainer:
        raise ConfigError(
            f"weight_sync_backend: nccl needs the rollout worker on another GPU than the trainer's ({trainer}): "
            "NCCL refuses two ranks on one device; set rollout_worker_device to another GPU, or use shared_memory"
        )
    return str(worker), backend
