"""The rollout workers' collectives (pods.process_groups.GroupCollectives) over a real gloo group of three
processes: what pods.distributed's gather, synced_max, synced_sum and every_process give the producer there."""

from __future__ import annotations

import multiprocessing

import torch

from pods.distributed import every_process, gather, synced_max, synced_sum
from pods.process_groups import GroupCollectives, open_group, tcp_store

WORLD = 3


def _rank(rank: int, port: int, results) -> None:
    store = tcp_store("127.0.0.1", port, WORLD, serve=False)
    workers = GroupCollectives(open_group("gloo", store, rank, WORLD), rank, WORLD)
    results.put(
        (
            rank,
            gather(workers, torch.tensor([rank, 10 * rank])).tolist(),
            synced_max(workers, float(rank) / 2),
            synced_sum(workers, torch.tensor([1.0, rank])).tolist(),
            every_process(workers, {"rank": rank, "text": "x" * (100 * rank)}),  # sizes differ
        )
    )


def test_the_workers_collectives_over_a_gloo_group() -> None:
    context = multiprocessing.get_context("spawn")
    store = tcp_store("127.0.0.1", 0, WORLD, serve=True)
    results = context.Queue()
    processes = [
        context.Process(target=_rank, args=(r, store.port, results), daemon=True) for r in range(WORLD)
    ]
    for process in processes:
        process.start()
    got = sorted(results.get(timeout=120) for _ in range(WORLD))
    for process in processes:
        process.join(30)
    objects = [{"rank": r, "text": "x" * (100 * r)} for r in range(WORLD)]
    for rank, gathered, largest, total, everyone in got:
        assert gathered == [0, 0, 1, 10, 2, 20], rank  # in rank order
        assert largest == 1.0
        assert total == [3.0, 3.0]
        assert everyone == objects
