"""Asynchronous rollouts (``async_generation: true``): a rollout worker process runs stages 0-2 (prompts,
generation, rewards, the prompt filter's rounds) for the next steps while the trainer runs stages 3-5 on the
current one, each on its own cores.

The schedule is fixed, so that a run is reproducible and resumes exactly: the batch of step t is sampled by the
weights after step ``v(t) = ceil((t - s) / k) x k`` (at least the weights the process started from), s =
``max_staleness`` and k = ``weight_sync_steps`` <= s, so its staleness t - v(t) is at most s. The trainer
publishes those versions only and waits before overwriting one until the worker has taken it; the worker
waits for the version a batch needs. The weights (the trainable ones) travel through shared memory, or through
a two-rank process group (:mod:`pods.weight_sync`: gloo, or NCCL from the trainer's GPU to the worker's). Batches go
through a bounded queue and carry the version that sampled them and the producer's state after them (the
stream's cursor, GRESO's history, the pass share). A checkpoint at step T holds the batches in flight that the
checkpoint's weights could not sample again (those of steps T.. with v(t) < T), so that a resumed run trains
exactly what an uninterrupted one trains.

Everything the worker needs travels in a :class:`WorkerSpec` (pickled: reward functions must be module-level
functions or picklable objects). The worker and the trainer (:class:`pods.rollout_sources.WorkerRollouts`) talk
over two pipes (:mod:`pods.pipes`): the trainer says which weights version it published, the worker says when it
has read them, sends its batches and reports its own error. The worker dies with the trainer (the pipes' end, and
``PR_SET_PDEATHSIG``) and stops its engine when the trainer asks (:data:`STOP_SIGNAL`). It ignores SIGTERM and
SIGINT: sent to the whole process group (Ctrl-C in a terminal, ``kill -TERM -PGID``, a scheduler's stop) they reach
the trainer too, which finishes its step, saves the batches in flight and then stops the worker. It starts with
them blocked (:func:`worker_signals_blocked`), so that one sent while it is still starting up cannot kill it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pods.child_process import die_with_parent
from pods.errors import ConfigError, RolloutWorkerError
from pods.faults import fault_point
from pods.metrics import StepTimer
from pods.pipes import NOTHING, Link, PeerGone
from pods.process_exit import exit_process
from pods.producer import ProducedBatch, ProducerState
from pods.prompt_filter import SampledGroups
from pods.rollout.base import EngineWrapper, tokenize_prompts
from pods.weight_sync import TensorLayout, WeightReceiver, weights_store

__all__ = [
    "IN_FLIGHT_FILE",
    "STOP_SIGNAL",
    "BehaviourLogprobs",
    "GroupAddress",
    "WorkerSpec",
    "async_metrics",
    "check_picklable",
    "fresh_in_flight",
    "in_flight_file",
    "load_in_flight",
    "require_async_with_several_processes",
    "sampler_version",
    "save_in_flight",
    "share_of_cores",
    "split_cores",
    "trainable_parameters",
    "visible_gpu",
    "vllm_options",
    "worker_main",
    "worker_signals_blocked",
]

IN_FLIGHT_FILE = "rollouts_in_flight.pt"  # in a checkpoint: the batches its weights could not sample again
POLL_SECONDS = 0.5  # the longest either side (trainer, worker) waits without checking that the other is alive
SERVER_LOG_FILE = "vllm_server.log"  # in the run folder: the log of a vLLM server pods started
STOP_SIGNAL = signal.SIGUSR1  # how the trainer asks its worker to stop (SIGTERM and SIGINT are the group's)
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the worker leaves these to the trainer


def sampler_version(step: int, max_staleness: int, sync_every: int, first: int = 0) -> int:
    """The weights version (optimizer steps applied) that samples the batch of ``step``: ``ceil((step - s) / k) x
    k``, at least ``first`` (the version the run started or resumed from)."""
    return max(first, math.ceil((step - max_staleness) / sync_every) * sync_every)


def check_picklable(reward_funcs: list[Any], what: str = "reward function") -> None:
    """The reward functions (and the Python API's tools) travel to the rollout worker by pickle: a lambda or a
    function defined inside another cannot; say which and how to fix it, before the worker starts."""
    import pickle

    for fn in reward_funcs:
        try:
            pickle.dumps(fn)
        except Exception as error:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            raise ConfigError(
                f"async_generation: the {what} {name!r} cannot be sent to the rollout worker ({error}); "
                "define it at the top level of a module (or use a picklable object, functools.partial), or set "
                "async_generation: false"
            ) from None


def fresh_in_flight(batches: list[ProducedBatch], step: int, max_staleness: int) -> list[ProducedBatch]:
    """The checkpoint's batches in flight a run resumed at ``step`` may train on: the consecutive ones from
    ``step`` on whose staleness is within ``max_staleness`` (a resume with a smaller bound drops the rest, which
    the worker then samples again)."""
    fresh = []
    for expected, batch in enumerate(batches, start=step):
        if batch.step != expected or batch.step - batch.version > max_staleness:
            break
        fresh.append(batch)
    return fresh


def async_metrics(batch: ProducedBatch) -> dict[str, Any]:
    """A step's metrics of the asynchronous rollouts: the batch's staleness, how long the worker waited for the
    weights (the trainer's wait is ``seconds_wait_for_rollouts``), and the worker's own phases
    (``seconds_generate``, ``seconds_score``: generation off the trainer's clock) and when they ran."""
    staleness = batch.step - batch.version
    metrics = {
        "pods/async/staleness_mean": float(staleness),
        "pods/async/staleness_max": float(staleness),
        "pods/async/worker_idle_seconds": round(batch.idle_seconds, 4),
    }
    for phase, seconds in batch.seconds.items():
        metrics[f"pods/async/worker_seconds_{phase}"] = round(seconds, 4)
    metrics["pods/async/worker_timeline"] = [list(span) for span in batch.spans]
    metrics["seconds_generate"] = round(batch.seconds.get("generate", 0.0), 4)
    metrics["seconds_score"] = round(batch.seconds.get("score", 0.0), 4)
    return metrics


def require_async_with_several_processes(accelerator: Any, config: Any) -> None:
    """Async mode with several trainer processes (each with its own rollout worker) needs each process to hold
    the whole trainable weights, and the prompt filter's rounds bounded (a stop must reach every process at the
    same step); else a :class:`~pods.errors.ConfigError` naming the fix."""
    from pods.distributed import weights_are_sharded

    if weights_are_sharded(accelerator):
        raise ConfigError(
            "async_generation with several processes sends each process's weights to its rollout worker, and "
            "under DeepSpeed ZeRO-3 or FSDP each process holds a shard only; use DDP or ZeRO-1/2, or set "
            "async_generation: false"
        )
    if config.prompt_filter != "none" and config.max_num_gen_batches == 0:
        raise ConfigError(
            "async_generation with several processes needs the prompt filter's rounds bounded (a stop must reach "
            "every process at the same step): set max_num_gen_batches to 1 or more"
        )


def share_of_cores(cores: list[int], local_index: int, local_processes: int) -> list[int]:
    """The cores of one of ``local_processes`` trainer processes on this machine (with its worker): an equal
    share of ``cores`` each, or all of them when there are fewer cores than processes."""
    if local_processes <= 1 or len(cores) < local_processes:
        return list(cores)
    size = len(cores) // local_processes
    return list(cores[local_index * size : (local_index + 1) * size])


def split_cores(cores: list[int], worker_threads: int | None) -> tuple[list[int], list[int]]:
    """(trainer's cores, worker's cores) out of the cores this process may use: the worker gets
    ``worker_threads`` of them (default half, at least 1), the trainer the rest (at least 1; with one core
    both share it)."""
    if len(cores) < 2:
        return list(cores), list(cores)
    take = worker_threads if worker_threads is not None else len(cores) // 2
    take = min(max(take, 1), len(cores) - 1)
    return list(cores[: len(cores) - take]), list(cores[len(cores) - take :])


@dataclass
class WorkerSpec:
    """Everything the rollout worker builds itself from (pickled into the worker process)."""

    config: dict[str, Any]  # TrainConfig.to_dict(), with rollout_engine resolved
    reward_funcs: list[Any]
    rows: list[dict[str, Any]]
    cores: list[int]
    threads: int
    start_step: int  # the first step the worker samples
    start_state: ProducerState
    first_version: int  # the weights version the trainer starts from
    device: str = "cpu"  # where the worker's model and engine run (cuda:N: the trainer's numbering)
    process_index: int = 0  # with several trainer processes: its trainer's, and the workers' group's store
    num_processes: int = 1
    group_host: str = "127.0.0.1"
    group_port: int = 0
    output_dir: str = ""  # the run folder (a vLLM server the worker starts logs there)
    tools: list[Any] | None = None  # the Python API's tools (None: the config's import paths)
    environment_factory: Any = None  # the Python API's environment factory (None: the config's)
    prompt_style: str = "plain"  # the run's prompt style (tool_format: auto follows it)


@dataclass(frozen=True)
class GroupAddress:
    """Where the worker joins the trainer's weights group, and the layout of what it receives."""

    backend: str
    host: str
    port: int
    layout: TensorLayout


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The weights an update changes, the ones the worker receives."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


# ---------------------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------------------


def worker_main(
    spec: WorkerSpec,
    weights: dict[str, torch.Tensor] | GroupAddress,
    incoming: Connection,
    outgoing: Connection,
) -> None:
    """The worker process: build its own policy copy, engine and producer, then for each step in turn wait for
    the weights its batch is sampled by, load them, run stages 0-2 and send the batch. It ends when the trainer
    closes the link or sends :data:`STOP_SIGNAL` (its engine stopped first), and reports any error of its own."""
    die_with_parent()
    for signum in GROUP_SIGNALS:  # the trainer stops the worker once it has saved what it must
        signal.signal(signum, signal.SIG_IGN)  # (one that came while starting, blocked, is dropped)
    signal.signal(STOP_SIGNAL, _exit_when_asked)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (*GROUP_SIGNALS, STOP_SIGNAL))
    _no_shared_locks()
    link = Link(incoming, outgoing)
    try:
        fault_point("worker_start")
        _place(spec.cores, spec.threads, spec.device)
        _produce_forever(spec, weights, link)
    except (PeerGone, SystemExit):  # the trainer is gone or stopped this worker: nothing to report
        exit_process(0)  # its engine is stopped: no teardown of torch and vLLM to wait for
    except BaseException as error:  # everything reaches the trainer, which decides what it means
        with contextlib.suppress(Exception):
            link.send(("failed", type(error).__name__, str(error), traceback.format_exc()))
        raise SystemExit(1) from None


def _exit_when_asked(signum: int, frame: Any) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def worker_signals_blocked() -> Any:
    """Start the worker inside this (in the trainer): the signals it handles are blocked in this thread meanwhile,
    so that it inherits them blocked until :func:`worker_main` has set its own handling; the trainer's own
    pending ones arrive at the end."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started by the worker's start otherwise, it would unblock SIGTERM and SIGINT
    signals = (*GROUP_SIGNALS, STOP_SIGNAL)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _no_shared_locks() -> None:
    """No progress bars in the worker (the trainer shows the run's) and no multiprocessing lock for tqdm: a worker
    killed while it holds one would leave the trainer's resource tracker a semaphore to warn about at exit."""
    import threading

    import tqdm
    from transformers.utils import logging

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    logging.disable_progress_bar()
    tqdm.tqdm.set_lock(threading.RLock())


def _produce_forever(spec: WorkerSpec, weights: dict[str, torch.Tensor] | GroupAddress, link: Link) -> None:
    """Build the worker's own policy copy, engine and producer, then produce until the trainer stops it."""
    from pods.agents import multi_turn_engine
    from pods.config import TrainConfig
    from pods.models import load_policy
    from pods.rollout import build_engine

    config = TrainConfig.from_dict(spec.config)
    workers = _workers(spec)
    policy = load_policy(config, _local_device(spec.device))
    model = policy.model.eval()
    options = vllm_options(config, spec.cores, spec.output_dir)
    if workers.num_processes > 1 and config.vllm_mode == "server":  # one server for every worker
        from pods.rollout.vllm_server import SharedServer

        options["share"] = SharedServer(workers.process_index == 0, workers.every_process)
    engine = build_engine(
        config.rollout_engine,
        model,
        policy.tokenizer,
        generation_batch_size=config.generation_batch_size,
        max_prompt_length=config.max_prompt_length,
        vllm_options=options,
        share_prefix=config.packing,
    )
    engine = BehaviourLogprobs(engine, model, config)
    engine = multi_turn_engine(
        engine, config, policy.tokenizer, spec.prompt_style,
        tools=spec.tools, environment_factory=spec.environment_factory,
    )  # fmt: skip
    try:
        link.send(("ready",))
        _produce(spec, weights, link, config, model, engine, policy.tokenizer, workers)
    finally:
        engine.close()  # a vLLM server pods started stops with the worker


def _workers(spec: WorkerSpec) -> Any:
    """What the producer reads of an accelerator: this worker alone, or its rank among the workers of several
    trainer processes, which meet in a gloo group (the prompt filter's rounds and GRESO's history are agreed
    across processes, as the trainers agree on them in sync mode)."""
    from pods.process_groups import GroupCollectives, open_group, tcp_store
    from pods.producer import OneProcess

    if spec.num_processes == 1:
        return OneProcess()
    store = tcp_store(spec.group_host, spec.group_port, spec.num_processes, serve=False)
    group = open_group("gloo", store, spec.process_index, spec.num_processes)
    return GroupCollectives(group, spec.process_index, spec.num_processes)


def _produce(
    spec: WorkerSpec,
    weights: dict[str, torch.Tensor] | GroupAddress,
    link: Link,
    config: Any,
    model: Any,
    engine: Any,
    tokenizer: Any,
    workers: Any,
) -> None:
    from pods.producer import Producer, score_batch, seed_step

    def score(batch: list[dict[str, Any]], rollouts: Any, environments: list[Any] | None = None) -> Any:
        fault_point("worker_scoring")
        return score_batch(spec.reward_funcs, config, batch, rollouts, environments)

    trainable = dict(trainable_parameters(model))
    incoming = _incoming_weights(weights, trainable)
    producer = Producer(config, engine, tokenizer, spec.rows, score=score, accelerator=workers)
    step, state, loaded, published, num_generations = spec.start_step, spec.start_state, None, -1, 0
    while True:
        want = sampler_version(step, config.max_staleness, config.weight_sync_steps, spec.first_version)
        waited = time.perf_counter()
        while published < want:  # the trainer publishes each version once the previous one is read
            fault_point("worker_waiting_for_weights")
            message = link.receive(POLL_SECONDS)
            if message is not NOTHING:
                _, published, num_generations = message
        if loaded != want:  # the published version is exactly ``want``: the trainer waits for this read
            with torch.no_grad():
                for name, tensor in incoming():
                    trainable[name].copy_(tensor)
            link.send(("taken", want))
            engine.sync_weights(model)
            loaded = want
        idle = time.perf_counter() - waited
        seed_step(config.seed, step, spec.process_index)
        timer = StepTimer()
        sampled = producer.sample(state, step, num_generations, timer)
        after, skip_metrics = producer.advance(state, sampled)
        batch = ProducedBatch(
            step, want, num_generations, sampled, after, skip_metrics, timer.seconds, idle, timer.spans
        )
        link.send(("batch", batch), on_full=lambda: fault_point("worker_queue_full"))
        step, state = step + 1, after


def _incoming_weights(
    weights: dict[str, torch.Tensor] | GroupAddress, trainable: dict[str, torch.Tensor]
) -> Any:
    """A function that returns the published weights, (name, tensor) pairs: the shared-memory tensors, or the
    next broadcast of the trainer's group (received on the worker's device), after checking that they are the
    worker's trainable ones."""
    if isinstance(weights, dict):
        return weights.items
    names = [name for name, _, _ in weights.layout.entries]
    if names != list(trainable):
        raise RolloutWorkerError(
            f"the rollout worker's trainable weights differ from the trainer's ({len(trainable)} against "
            f"{len(names)} tensors): they must build the same model from the same configuration"
        )
    device = next(iter(trainable.values())).device
    store = weights_store(weights.host, weights.port, serve=False)
    receiver = WeightReceiver(weights.layout, backend=weights.backend, device=device, store=store)
    return receiver.receive


class BehaviourLogprobs(EngineWrapper):
    """An engine whose rollouts carry the log-probs they were sampled with: vLLM reports them; for HF
    ``generate`` they are computed right after sampling, by the same weights, under the same temperature and
    top-k / top-p (what the trainer's truncated importance weights compare against), and both run under the
    trainer's mixed precision (accelerate autocasts the trainer's prepared model; the worker's copy is not
    prepared)."""

    def __init__(self, engine: Any, model: torch.nn.Module, config: Any) -> None:
        super().__init__(engine)
        self.model, self.config = model, config
        self.precision = mixed_precision(config, next(model.parameters()).device)

    def generate(self, prompts: list[str], num_generations: int, sampling: Any) -> Any:
        return self.generate_tokens(
            tokenize_prompts(self.engine, prompts, num_generations), num_generations, sampling
        )

    def generate_tokens(self, encoded: list[list[int]], num_generations: int, sampling: Any) -> Any:
        """:meth:`generate` from token ids (a multi-turn episode's turns: each turn's log-probs under its context)."""
        from pods.loss import completion_logprobs
        from pods.rollout import HFGenerateEngine

        if not isinstance(self.engine, HFGenerateEngine):  # vLLM: its own dtype, and it reports its log-probs
            rollouts = self.engine.generate_tokens(encoded, num_generations, sampling)
            fault_point("worker_generating")
            return rollouts
        with self.precision():
            rollouts = self.engine.generate_tokens(encoded, num_generations, sampling)
        fault_point("worker_generating")
        with torch.no_grad(), self.precision():
            rollouts.sampling_logprobs = completion_logprobs(
                self.model,
                rollouts.prompt_ids,
                rollouts.prompt_mask,
                rollouts.completion_ids,
                rollouts.completion_mask,
                temperature=sampling.temperature if sampling.temperature > 0 else 1.0,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                packing=self.config.packing,
                token_budget=self.config.token_budget,
            ).float()
        return rollouts


def mixed_precision(config: Any, device: torch.device) -> Any:
    """A context factory for the trainer's ``mixed_precision`` (bf16 or fp16 autocast on ``device``; none for
    ``no``), as accelerate applies it to the trainer's prepared model."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def vllm_options(config: Any, cores: list[int] | None = None, run_folder: str | Path = "") -> dict[str, Any]:
    """The vLLM engine's settings from a :class:`~pods.config.TrainConfig` (the trainer's and the worker's): the
    colocated engine's, or with ``vllm_mode: server`` the server's (a server pods starts logs into
    ``run_folder``)."""
    max_model_length = config.vllm_max_model_length or (
        config.max_prompt_length and config.max_prompt_length + config.max_completion_length
    )
    common = {
        "gpu_memory_utilization": config.vllm_gpu_memory_utilization,
        "max_model_length": max_model_length,
        "kv_cache_gb": config.vllm_cpu_kv_cache_gb,
        "seed": config.seed,
    }
    if config.vllm_mode == "server":
        return {
            **common,
            "mode": "server",
            "base_url": config.vllm_server_base_url,
            "host": config.vllm_server_host,
            "port": config.vllm_server_port,
            "timeout": config.vllm_server_timeout,
            "weight_sync": config.vllm_server_weight_sync,
            "cores": cores,
            "log_file": str(Path(run_folder) / SERVER_LOG_FILE) if run_folder else None,
        }
    return {
        **common,
        "enable_sleep_mode": config.vllm_enable_sleep_mode,
        "max_num_batched_tokens": config.vllm_max_num_batched_tokens,
    }


def _place(cores: list[int], threads: int, device: str = "cpu") -> None:
    """Run on ``cores`` with ``threads`` torch threads (and vLLM's CPU threads bound to the same cores); on GPU
    ``device`` only (it is then this process's cuda:0, where a vLLM engine or server it starts runs too)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    torch.set_num_threads(max(1, threads))
    if torch.device(device).type == "cuda":  # before anything here touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu(device, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_gpu(device: str, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES that shows a process ``device`` alone (cuda:N in the numbering ``visible``, the
    parent's CUDA_VISIBLE_DEVICES, sets up)."""
    index = torch.device(device).index or 0
    numbering = (
        [name.strip() for name in visible.split(",")] if visible else [str(i) for i in range(index + 1)]
    )
    return numbering[index]


def _local_device(device: str) -> torch.device:
    """The worker's device as the worker numbers it (its one visible GPU is cuda:0)."""
    return torch.device("cuda", 0) if torch.device(device).type == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------
# Batches in flight, in a checkpoint
# ---------------------------------------------------------------------------------------------------------


def in_flight_file(process_index: int = 0) -> str:
    """The file of a checkpoint that holds one trainer process's batches in flight."""
    return IN_FLIGHT_FILE if process_index == 0 else IN_FLIGHT_FILE.replace(".pt", f".{process_index}.pt")


def save_in_flight(folder: Path, batches: list[ProducedBatch], process_index: int = 0) -> None:
    """Write the batches a checkpoint must hold for one trainer process (tensors and plain data only, read back
    without unpickling code); nothing when there are none."""
    if batches:
        torch.save([_plain(batch) for batch in batches], folder / in_flight_file(process_index))


def load_in_flight(folder: Path, process_index: int = 0) -> list[ProducedBatch]:
    """The batches :func:`save_in_flight` wrote into a checkpoint folder for a process ([] when there are none)."""
    path = folder / in_flight_file(process_index)
    if not path.is_file():
        return []
    try:
        return [_from_plain(item) for item in torch.load(path, weights_only=True)]
    except Exception as error:
        raise ConfigError(f"{path} cannot be read ({error}); delete it to regenerate those batches") from None


def _plain(batch: ProducedBatch) -> dict[str, Any]:
    import dataclasses

    sampled = batch.sampled
    rounds = []
    for part in sampled.rounds:
        rollouts = dataclasses.asdict(part.rollouts)
        rounds.append(
            {
                "rollouts": rollouts,
                "rewards": part.rewards,
                "per_function": part.per_function,
                "ranked": part.ranked_rewards,
                "signal": part.signal,
            }
        )
    return {
        "step": batch.step,
        "version": batch.version,
        "num_generations": batch.num_generations,
        "prompt_filter": sampled.prompt_filter,
        "pad_id": sampled.pad_id,
        "ids": sampled.ids,
        "skipped": sampled.skipped,
        "drawn": sampled.drawn,
        "cursor": sampled.cursor,
        "pass_share": sampled.pass_share.to_state(),
        "round_sizes": [len(part.rewards) for part in sampled.rounds],
        "rounds": rounds,
        "state_after": dataclasses.asdict(batch.state_after),
        "skip_metrics": batch.skip_metrics,
        "seconds": batch.seconds,
        "idle_seconds": batch.idle_seconds,
        "spans": [list(span) for span in batch.spans],
    }


def _from_plain(item: dict[str, Any]) -> ProducedBatch:
    from pods.prompt_filter import PassShare
    from pods.rollout import Rollouts

    sampled = SampledGroups(item["prompt_filter"], pad_id=item["pad_id"])
    start = 0
    for size, part in zip(item["round_sizes"], item["rounds"], strict=True):
        ids = item["ids"][start : start + size]
        start += size
        sampled.add(
            ids,
            Rollouts(**part["rollouts"]),
            part["rewards"],
            part["per_function"],
            ranked=part["ranked"],
            signal=part["signal"],
        )
    sampled.skipped, sampled.drawn, sampled.cursor = item["skipped"], item["drawn"], item["cursor"]
    sampled.pass_share = PassShare.from_state(item["pass_share"])
    return ProducedBatch(
        item["step"],
        item["version"],
        item["num_generations"],
        sampled,
        ProducerState(**item["state_after"]),
        item["skip_metrics"],
        item["seconds"],
        item["idle_seconds"],
        [tuple(span) for span in item.get("spans", [])],
    )
