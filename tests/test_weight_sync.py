"""Weights over a two-rank process group (pods.weight_sync): the flat layout, a real gloo transfer between two
processes that leaves the sender free while the receiver is busy, a receiver that dies, and where
``rollout_worker_device`` and ``weight_sync_backend`` put the worker and its weights (GPU cases as a pure
function: no GPU here)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from pods.config import TrainConfig
from pods.errors import ConfigError
from pods.rollout_worker import visible_gpu
from pods.weight_sync import (
    TensorLayout,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    resolve_placement,
    weights_store,
)


def weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(int(scale))
    return [
        ("lora_A", torch.randn(4, 3, generator=generator) * scale),
        ("norm", (torch.randn(5, generator=generator) * scale).to(torch.bfloat16)),
        ("lora_B", torch.randn(2, 4, generator=generator) * scale),
    ]


def test_the_layout_gives_every_tensor_its_own_place_in_one_buffer_per_dtype() -> None:
    named = weights(1.0)
    layout = TensorLayout.of(named)
    buffers = layout.buffers("cpu")
    assert {dtype: b.numel() for dtype, b in buffers.items()} == {torch.float32: 12 + 8, torch.bfloat16: 5}
    views = layout.views(buffers)
    for name, tensor in named:
        views[name].copy_(tensor)
    for name, tensor in named:  # overlapping views would have overwritten one another
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor), name
    assert torch.equal(buffers[torch.float32][:12], named[0][1].flatten())


def _receive(layout: TensorLayout, port: int, go, results, times: int) -> None:
    store = weights_store("127.0.0.1", port, serve=False)
    receiver = WeightReceiver(layout, backend="gloo", device="cpu", store=store)
    go.wait(60)  # busy elsewhere until the sender has long returned
    for _ in range(times):
        results.put({name: tensor.clone() for name, tensor in receiver.receive().items()})


def test_gloo_sends_exact_weights_without_holding_the_sender() -> None:
    context = multiprocessing.get_context("spawn")
    first, second = weights(1.0), weights(2.0)
    sent_first = [(name, tensor.clone()) for name, tensor in first]
    store = weights_store("127.0.0.1", 0, serve=True)
    sender = WeightSender(first, backend="gloo", device="cpu", store=store)
    go, results = context.Event(), context.Queue()
    process = context.Process(target=_receive, args=(sender.layout, store.port, go, results, 2), daemon=True)
    process.start()
    try:
        sending = threading.Thread(target=sender.send, args=(first,))
        sending.start()
        sending.join(30)
        assert not sending.is_alive(), "send() waited for the receiver"
        first[0][1].add_(100.0)  # the sender's own tensors change after send(): the staged copy was sent
        go.set()
        assert sender.wait(60)
        sender.send(second)
        got = [results.get(timeout=60), results.get(timeout=60)]
    finally:
        process.join(30)
    for received, sent in zip(got, (sent_first, second), strict=True):
        assert list(received) == [name for name, _ in sent]
        for name, tensor in sent:
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_a_receiver_that_dies_fails_the_next_send_instead_of_hanging() -> None:
    context = multiprocessing.get_context("spawn")
    store = weights_store("127.0.0.1", 0, serve=True)
    sender = WeightSender(weights(1.0), backend="gloo", device="cpu", store=store)
    go, results = context.Event(), context.Queue()
    go.set()
    process = context.Process(target=_receive, args=(sender.layout, store.port, go, results, 1), daemon=True)
    process.start()
    sender.send(weights(1.0))
    results.get(timeout=60)
    process.join(30)
    sender.send(weights(2.0))  # nobody receives it
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="sending the weights over gloo failed"):
        sender.wait(60)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("device", "backend", "trainer", "gpus", "expected"),
    [
        ("auto", "auto", "cpu", 0, ("cpu", "shared_memory")),
        ("auto", "gloo", "cpu", 0, ("cpu", "gloo")),
        ("auto", "auto", "cuda", 2, ("cuda:1", "nccl")),  # a GPU of its own, GPU to GPU
        ("auto", "auto", "cuda:1", 3, ("cuda:0", "nccl")),
        ("auto", "auto", "cuda:0", 1, ("cuda:0", "shared_memory")),  # one GPU: beside the trainer
        ("cpu", "auto", "cuda:0", 2, ("cpu", "shared_memory")),
        ("cuda", "gloo", "cuda:0", 2, ("cuda:0", "gloo")),
        ("cuda:1", "auto", "cuda:0", 2, ("cuda:1", "nccl")),
    ],
)
def test_placement_of_the_worker_and_its_weights(
    device: str, backend: str, trainer: str, gpus: int, expected: tuple[str, str]
) -> None:
    assert resolve_placement(device, backend, trainer, gpus) == expected


@pytest.mark.parametrize(
    ("device", "backend", "trainer", "gpus", "message"),
    [
        ("cuda", "auto", "cpu", 0, "has none; set it to cpu or auto"),
        ("cuda:2", "auto", "cuda:0", 2, r"does not exist \(GPUs here: cuda:0 to cuda:1\)"),
        ("auto", "nccl", "cpu", 0, "use gloo or shared_memory"),
        ("cuda:0", "nccl", "cuda:0", 2, "NCCL refuses two ranks on one device"),
    ],
)
def test_placements_that_cannot_work_name_the_fix(
    device: str, backend: str, trainer: str, gpus: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_placement(device, backend, trainer, gpus)


def test_the_worker_sees_its_gpu_alone_in_the_parents_numbering() -> None:
    assert visible_gpu("cuda:1", None) == "1"
    assert visible_gpu("cuda:1", "4, 6") == "6"
    assert visible_gpu("cuda", "3,5") == "3"


@pytest.mark.parametrize(
    ("key", "value"), [("rollout_worker_device", "gpu1"), ("weight_sync_backend", "tcp")]
)
def test_bad_worker_settings_are_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TrainConfig.from_dict({key: value})


@pytest.mark.parametrize(
    ("choice", "base_url", "on_gpu", "expected"),
    [
        ("auto", None, False, "file"),  # pods starts it here
        ("auto", "http://127.0.0.1:8000", True, "file"),
        ("auto", "http://localhost:8000", False, "file"),
        ("auto", "http://10.0.0.7:8000", False, "gloo"),  # another machine: no shared file
        ("auto", "http://gpu-box:8000", True, "nccl"),
        ("gloo", None, False, "gloo"),
    ],
)
def test_how_weights_reach_a_vllm_server(
    choice: str, base_url: str | None, on_gpu: bool, expected: str
) -> None:
    from pods.rollout.vllm_server import _resolve_weight_sync

    assert _resolve_weight_sync(choice, base_url, on_gpu) == expected


def test_nccl_to_a_server_from_the_cpu_is_refused() -> None:
    from pods.rollout.vllm_server import _resolve_weight_sync

    with pytest.raises(ConfigError, match="use gloo"):
        _resolve_weight_sync("nccl", "http://gpu-box:8000", on_gpu=False)
