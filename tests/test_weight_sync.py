"""Weights over a two-rank process group (pods.weight_sync): the buckets; real gloo transfers between two
processes, staged (the sender free while the receiver is busy) and streamed; a receiver that dies; and where
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
from pods.rollout_worker import share_of_cores, visible_gpu
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
        ("bias", torch.randn(3, generator=generator) * scale),
    ]


SMALL_BUCKETS = 48  # bytes: weights() travels in three buckets


def test_buckets_pack_consecutive_tensors_of_one_dtype_up_to_the_bound() -> None:
    layout = TensorLayout.of(weights(1.0), bucket_bytes=SMALL_BUCKETS)
    names = [[name for name, _, _ in bucket] for bucket in layout.buckets()]
    assert names == [["lora_A"], ["norm"], ["lora_B", "bias"]]  # 48 B; another dtype; 32 + 12 B
    assert [len(b) for b in TensorLayout.of(weights(1.0), bucket_bytes=8).buckets()] == [1, 1, 1, 1]
    assert len(TensorLayout.of(weights(1.0), bucket_bytes=2**20).buckets()) == 3  # the dtype still splits
    assert TensorLayout.from_json(layout.to_json()) == layout


def _receive(layout: TensorLayout, port: int, go, results, times: int) -> None:
    store = weights_store("127.0.0.1", port, serve=False)
    receiver = WeightReceiver(layout, backend="gloo", device="cpu", store=store)
    go.wait(60)  # busy elsewhere until the sender has long returned
    for _ in range(times):
        results.put(dict(receiver.receive()))


def start_receiver(layout: TensorLayout, store, times: int, go=None):
    context = multiprocessing.get_context("spawn")
    if go is None:
        go = context.Event()
        go.set()
    results = context.Queue()
    process = context.Process(target=_receive, args=(layout, store.port, go, results, times), daemon=True)
    process.start()
    process.keep = (go, results)  # alive until the child has them (a collected Event unlinks its semaphore)
    return process, results


def assert_same(received: dict[str, torch.Tensor], sent: list[tuple[str, torch.Tensor]]) -> None:
    assert list(received) == [name for name, _ in sent]
    for name, tensor in sent:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_gloo_sends_exact_weights_without_holding_the_sender() -> None:
    """Staged (the rollout worker's way): send() returns while the receiver is busy elsewhere, and what it sends
    is the weights at send(), in several buckets."""
    first, second = weights(1.0), weights(2.0)
    sent_first = [(name, tensor.clone()) for name, tensor in first]
    store = weights_store("127.0.0.1", 0, serve=True)
    layout = TensorLayout.of(first, bucket_bytes=SMALL_BUCKETS)
    sender = WeightSender(layout, backend="gloo", device="cpu", store=store)
    go = multiprocessing.get_context("spawn").Event()
    process, results = start_receiver(layout, store, 2, go)
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
    assert_same(got[0], sent_first)
    assert_same(got[1], second)


def test_gloo_streams_unstaged_weights_bucket_by_bucket() -> None:
    """Unstaged (a vLLM server's way: no copy of the whole model): the tensors are read as the buckets go."""
    named = weights(3.0)
    store = weights_store("127.0.0.1", 0, serve=True)
    layout = TensorLayout.of(named, bucket_bytes=SMALL_BUCKETS)
    sender = WeightSender(layout, backend="gloo", device="cpu", store=store, staged=False)
    assert sender.staging is None
    process, results = start_receiver(layout, store, 1)
    try:
        sender.send(named)
        assert sender.wait(60)
        assert_same(results.get(timeout=60), named)
    finally:
        process.join(30)


def test_a_receiver_that_dies_fails_the_next_send_instead_of_hanging() -> None:
    store = weights_store("127.0.0.1", 0, serve=True)
    layout = TensorLayout.of(weights(1.0))
    sender = WeightSender(layout, backend="gloo", device="cpu", store=store)
    process, results = start_receiver(layout, store, 1)
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


def test_the_workers_of_several_trainer_processes_get_the_gpus_no_trainer_uses() -> None:
    def auto(trainer: str, index: int, processes: int, gpus: int) -> tuple[str, str]:
        return resolve_placement("auto", "auto", trainer, gpus, local_index=index, local_processes=processes)

    assert [auto(f"cuda:{i}", i, 4, 8) for i in range(4)] == [(f"cuda:{4 + i}", "nccl") for i in range(4)]
    assert auto("cuda:1", 1, 2, 3) == ("cuda:1", "shared_memory")  # one free GPU for two workers: beside
    assert auto("cpu", 1, 2, 0) == ("cpu", "shared_memory")


def test_each_trainer_process_and_its_worker_get_a_share_of_the_cores() -> None:
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [share_of_cores(cores, i, 2) for i in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert share_of_cores([0, 1], 1, 2) == [1]
    assert share_of_cores([0], 1, 2) == [0]  # fewer cores than processes: all of them
    assert share_of_cores(cores, 0, 1) == cores


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
