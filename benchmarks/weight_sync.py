"""Weights to the rollout worker (``weight_sync_backend``): how long the trainer is held (its ``seconds_sync``)
and how long until the worker holds them, through shared memory and through a gloo process group, for weights
of a LoRA adapter's size and of a small full model's.

    python benchmarks/weight_sync.py [--repeats 5] [--sizes-mb 4,64,512] [--smoke]

Each path runs in two processes on this machine, one torch thread each; the median over the repeats is printed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from pods.weight_sync import TensorLayout, WeightReceiver, WeightSender, weights_store

TENSOR_MB = (
    4  # the weights as tensors of this size (a LoRA adapter: many small ones; here what is moved counts)
)


def make_weights(megabytes: int) -> list[tuple[str, torch.Tensor]]:
    count = max(1, megabytes // TENSOR_MB)
    per_tensor = megabytes * 2**20 // 4 // count
    return [(f"w{i}", torch.randn(per_tensor)) for i in range(count)]


def _shared_memory_worker(shared, published, taken, stop) -> None:
    torch.set_num_threads(1)
    local = {name: torch.empty_like(tensor) for name, tensor in shared.items()}
    seen = 0
    while not stop.is_set():
        if published.value > seen:
            for name, tensor in shared.items():
                local[name].copy_(tensor)
            seen = published.value
            taken.value = time.perf_counter()
        else:
            time.sleep(0.0005)


def _gloo_worker(layout, port, taken, times) -> None:
    torch.set_num_threads(1)
    receiver = WeightReceiver(
        layout, backend="gloo", device="cpu", store=weights_store("127.0.0.1", port, serve=False)
    )
    for _ in range(times):
        for _name, _tensor in receiver.receive():
            pass
        taken.put(time.perf_counter())


def shared_memory(named, repeats: int) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    shared = {name: tensor.clone().share_memory_() for name, tensor in named}
    published, taken, stop = context.Value("q", 0), context.Value("d", 0.0), context.Event()
    process = context.Process(
        target=_shared_memory_worker, args=(shared, published, taken, stop), daemon=True
    )
    process.start()
    held, delivered = [], []
    for round_ in range(1, repeats + 2):  # the first round waits for the worker to start: not timed
        time.sleep(0.2)
        start = time.perf_counter()
        for name, tensor in named:
            shared[name].copy_(tensor)
        published.value = round_
        held.append(time.perf_counter() - start)
        while taken.value < start:
            time.sleep(0.0005)
        delivered.append(taken.value - start)
    stop.set()
    process.join(10)
    return statistics.median(held[1:]), statistics.median(delivered[1:])


def gloo(named, repeats: int) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    store = weights_store("127.0.0.1", 0, serve=True)
    layout = TensorLayout.of(named)
    sender = WeightSender(layout, backend="gloo", device="cpu", store=store)
    taken = context.Queue()
    process = context.Process(target=_gloo_worker, args=(layout, store.port, taken, repeats + 1), daemon=True)
    process.start()
    sender.send(named)  # the group's rendezvous, not timed
    taken.get(timeout=120)
    held, delivered = [], []
    for _ in range(repeats):
        time.sleep(0.2)
        start = time.perf_counter()
        sender.send(named)
        held.append(time.perf_counter() - start)
        delivered.append(taken.get(timeout=120) - start)
        sender.wait()
    process.join(10)
    return statistics.median(held), statistics.median(delivered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes-mb", default="4,64,512", help="sizes of the weights sent, in MiB (float32)")
    parser.add_argument("--smoke", action="store_true", help="4 MiB, 2 repeats: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.sizes_mb = 2, "4"
    torch.set_num_threads(1)
    print("| weights | path | trainer held (ms) | worker holds them after (ms) |")
    print("|---|---|---|---|")
    for megabytes in (int(size) for size in args.sizes_mb.split(",")):
        named = make_weights(megabytes)
        for name, run in (("shared_memory", shared_memory), ("gloo", gloo)):
            held, delivered = run(named, args.repeats)
            print(f"| {megabytes} MiB | {name} | {held * 1e3:.1f} | {delivered * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
