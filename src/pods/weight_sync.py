"""Weights from the trainer to a rollout process over a two-rank torch process group: gloo between CPU processes
(TCP: on one machine or across machines), NCCL between two GPUs (device to device, no host copy).

The group is stateless (:mod:`pods.process_groups`: a TCP store of its own, which either side may host), so it
lives beside accelerate's group in the trainer and vLLM's in a server. Rank 0 sends, rank
1 receives, in the buckets of a :class:`TensorLayout` both sides hold (consecutive tensors of one dtype packed
into one flat buffer of at most ``bucket_bytes``: a few large transfers, not one per tensor). A background
thread broadcasts, so the trainer's :meth:`WeightSender.send` returns at once: with ``staged`` (the rollout
worker) after copying the weights into staging buffers, one more copy of what is sent (the trainable weights:
the LoRA adapter with LoRA), so that the trainer may update its own meanwhile; without (a vLLM server, which
takes the whole merged model) one bucket at a time, so that sending costs one bucket of memory on each side.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pods.errors import ConfigError
from pods.process_groups import open_group, tcp_store

__all__ = [
    "TensorLayout",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "resolve_placement",
    "weights_store",
]

BUCKET_BYTES = 256 * 2**20  # TRL's vLLM client streams the weights in chunks of this order too

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8)

Entry = tuple[str, tuple[int, ...], torch.dtype]


class WeightSyncError(RuntimeError):
    """A transfer of weights failed (the other side died or its connection broke)."""


@dataclass(frozen=True)
class TensorLayout:
    """The tensors sent, in a fixed order both sides share, and the buckets they travel in."""

    entries: tuple[Entry, ...]
    bucket_bytes: int = BUCKET_BYTES

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], bucket_bytes: int | None = None) -> TensorLayout:
        """The layout of ``named``, in buckets of ``bucket_bytes`` (None: :data:`BUCKET_BYTES`)."""
        entries = tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in named)
        return cls(entries, bucket_bytes or BUCKET_BYTES)

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON data (to a vLLM server)."""
        entries = [
            [name, list(shape), str(dtype).removeprefix("torch.")] for name, shape, dtype in self.entries
        ]
        return {"entries": entries, "bucket_bytes": self.bucket_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorLayout:
        dtypes = {str(dtype).removeprefix("torch."): dtype for dtype in _DTYPES}
        entries = tuple((name, tuple(shape), dtypes[dtype]) for name, shape, dtype in data["entries"])
        return cls(entries, int(data["bucket_bytes"]))

    def buckets(self) -> list[tuple[Entry, ...]]:
        """Consecutive entries of one dtype, at most ``bucket_bytes`` each (a larger tensor travels alone)."""
        buckets: list[list[Entry]] = []
        size = 0
        for entry in self.entries:
            nbytes = math.prod(entry[1]) * entry[2].itemsize
            if not buckets or buckets[-1][0][2] != entry[2] or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(entry)
            size += nbytes
        return [tuple(bucket) for bucket in buckets]


def _bucket_buffer(bucket: tuple[Entry, ...], device: torch.device) -> torch.Tensor:
    return torch.empty(sum(math.prod(shape) for _, shape, _ in bucket), dtype=bucket[0][2], device=device)


def _bucket_views(bucket: tuple[Entry, ...], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``bucket`` as a view into its flat ``buffer`` (writing a view writes the buffer)."""
    views, start = [], 0
    for name, shape, _ in bucket:
        size = math.prod(shape)
        views.append((name, buffer[start : start + size].view(shape)))
        start += size
    return views


def _pack(bucket: tuple[Entry, ...], buffer: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the tensors of ``bucket`` from ``tensors`` (by name) into its flat ``buffer``."""
    with torch.no_grad():
        for name, view in _bucket_views(bucket, buffer):
            view.copy_(tensors[name].detach())


def weights_store(host: str, port: int, *, serve: bool) -> dist.TCPStore:
    """The TCP store the two ranks meet at: served here on ``port`` (0: a free one; its ``.port`` says which) or
    reached at ``host:port``."""
    return tcp_store(host, port, 2, serve=serve)


def _broadcast(group: Any, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()
    if buffer.is_cuda:  # the transfer ran on NCCL's stream: done before the buffer is read or reused
        torch.cuda.synchronize(buffer.device)


class WeightSender:
    """The trainer's side (rank 0): broadcasts the weights of ``layout`` from a background thread, bucket by
    bucket, to the receiver that meets it at ``store``; ``staged``: out of staging buffers on ``device`` that
    :meth:`send` fills (see the module's text)."""

    def __init__(
        self,
        layout: TensorLayout,
        *,
        backend: str,
        device: torch.device | str,
        store: dist.Store,
        staged: bool = True,
    ) -> None:
        self.backend, self.device, self.store, self.layout = backend, torch.device(device), store, layout
        self.buckets = layout.buckets()
        self.staging = [_bucket_buffer(bucket, self.device) for bucket in self.buckets] if staged else None
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Send ``named`` (the layout's tensors, in its order) once the previous broadcast has ended (it has once
        the receiver holds it). Staged, ``named`` is copied before this returns; else it is read as the buckets
        go and must not change until :meth:`wait` says the broadcast ended."""
        self.wait()
        tensors = dict(named)
        if self.staging is not None:
            for bucket, buffer in zip(self.buckets, self.staging, strict=True):
                _pack(bucket, buffer, tensors)
            tensors = {}
        self._thread = threading.Thread(
            target=self._broadcast, args=(tensors,), name="pods-weight-sender", daemon=True
        )
        self._thread.start()

    def _broadcast(self, tensors: dict[str, torch.Tensor]) -> None:
        try:
            if self._group is None:
                self._group = open_group(self.backend, self.store, 0, 2, self.device)
            for index, bucket in enumerate(self.buckets):
                if self.staging is not None:
                    buffer = self.staging[index]
                else:  # packed here, one bucket of memory at a time
                    buffer = _bucket_buffer(bucket, self.device)
                    _pack(bucket, buffer, tensors)
                _broadcast(self._group, buffer)
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
    ``layout`` on ``device``, bucket by bucket."""

    def __init__(
        self, layout: TensorLayout, *, backend: str, device: torch.device | str, store: dist.Store
    ) -> None:
        self.backend, self.device, self.store, self.layout = backend, torch.device(device), store, layout
        self.buckets = layout.buckets()
        self._group: Any = None

    def receive(self, layout: TensorLayout | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The next weights the sender broadcasts, (name, tensor) in the layout's order (``layout`` if it
        changed), each bucket received as the iteration reaches it (into a buffer of its own: the tensors stay
        valid). Iterate to the end: the sender waits for every bucket."""
        if layout is not None and layout != self.layout:
            self.layout, self.buckets = layout, layout.buckets()
        try:
            if self._group is None:
                self._group = open_group(self.backend, self.store, 1, 2, self.device)
            for bucket in self.buckets:
                buffer = _bucket_buffer(bucket, self.device)
                _broadcast(self._group, buffer)
                yield from _bucket_views(bucket, buffer)
        except Exception as error:
            raise WeightSyncError(f"receiving the weights over {self.backend} failed: {error}") from None


def resolve_placement(
    device: str,
    backend: str,
    trainer_device: torch.device | str,
    cuda_devices: int,
    *,
    local_index: int = 0,
    local_processes: int = 1,
) -> tuple[str, str]:
    """(the rollout worker's device, the weights' path to it) for ``rollout_worker_device`` and
    ``weight_sync_backend``, for trainer process ``local_index`` of the ``local_processes`` on this machine
    (they train on cuda:0, cuda:1, ...). ``auto`` puts the worker on a GPU no trainer uses where there is one
    for every process (else beside its trainer) and sends the weights GPU to GPU with NCCL between two GPUs, else
    through shared memory; a choice that cannot work is a :class:`~pods.errors.ConfigError` naming the fix."""
    trainer = torch.device(trainer_device)
    if trainer.type == "cuda" and trainer.index is None:
        trainer = torch.device("cuda", 0)
    if device == "auto":
        device = str(trainer)
        if trainer.type == "cuda":
            trainers = set(range(local_processes)) if local_processes > 1 else {trainer.index}
            free = [i for i in range(cuda_devices) if i not in trainers]
            if len(free) >= local_processes:
                device = f"cuda:{free[local_index]}"
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
