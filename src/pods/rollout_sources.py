"""Where a step's batch (stages 0-2: prompts, n completions each, rewards) comes from, behind one small interface,
:class:`RolloutSource`: the batch of step t, the new weights after an update, the batches a checkpoint must hold,
close. Two sources: :class:`LocalRollouts` runs the producer in the trainer's process (``pods train``);
:class:`WorkerRollouts` takes the batches from a rollout worker process (``async_generation``, one per trainer
process), the trainer's side of :mod:`pods.rollout_worker`.

The trainer and its worker share no lock, condition or queue: they exchange messages over two pipes
(:mod:`pods.pipes`) and the weights through shared memory or a process group, and every wait is bounded and
followed by a check that the other side is alive. So a worker that dies at any moment ends the run with one line
naming it (the trainer then saves the last completed step), and a trainer that dies takes its worker with it (the
worker reads the end of its pipe, and the kernel kills it: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from pods.checkpoint import TrainerState
from pods.distributed import every_process, failure_of, local_processes, raise_any_failure
from pods.errors import RolloutWorkerError
from pods.faults import fault_point
from pods.metrics import StepTimer
from pods.pipes import NOTHING, PeerGone, link_pair
from pods.producer import ProducedBatch, Producer, ProducerState, seed_step
from pods.rollout_worker import (
    POLL_SECONDS,
    STOP_SIGNAL,
    GroupAddress,
    WorkerSpec,
    check_picklable,
    sampler_version,
    share_of_cores,
    split_cores,
    trainable_parameters,
    vllm_options,
    worker_main,
    worker_signals_blocked,
)
from pods.weight_sync import TensorLayout, WeightSender, resolve_placement, weights_store

__all__ = [
    "LocalRollouts",
    "RolloutSource",
    "WorkerRollouts",
    "from_rollout_side",
    "start_worker_rollouts",
    "trainer_vllm_options",
    "worker_placement",
]

CLOSE_SECONDS = 10.0  # how long a worker asked to stop may take before it is killed
WORKER_TRACEBACK_FILE = (
    "rollout_worker_traceback.txt"  # in the run folder, when the worker fails unexpectedly
)


class RolloutSource(Protocol):
    """Stages 0-2 as the trainer's loop sees them."""

    def batch(
        self, state: TrainerState, num_generations: int, timer: StepTimer, should_stop: Callable[[], bool]
    ) -> ProducedBatch | None:
        """The batch of step ``state.step`` (None if a stop request ended an unbounded prompt filter's rounds)."""

    def weights_updated(self, model: torch.nn.Module, timer: StepTimer) -> None:
        """The update changed ``model``'s weights: what samples the next batches must get them."""

    def in_flight(self, step: int) -> list[ProducedBatch]:
        """The batches sampled ahead that a checkpoint after ``step`` steps must hold to resume exactly."""

    def close(self) -> None:
        """Stop what the source started (a worker, its engine); safe to call twice."""


def from_rollout_side(error: BaseException) -> bool:
    """Whether ``error`` ended the rollout side rather than the update: a rollout worker's death or its own error
    (e.g. a reward function's), or the vLLM server's. The trainer then saves the last completed step."""
    from pods.errors import VLLMServerError

    return isinstance(error, RolloutWorkerError | VLLMServerError) or getattr(
        error, "from_rollout_worker", False
    )


class LocalRollouts:
    """Stages 0-2 in this process, with the trainer's own engine: what ``pods train`` runs without a worker."""

    def __init__(
        self, producer: Producer, engine: Any, seed: int, process_index: int, prompts_per_step: int
    ) -> None:
        self.producer, self.engine = producer, engine
        self.seed, self.process_index, self.prompts_per_step = seed, process_index, prompts_per_step

    def batch(
        self, state: TrainerState, num_generations: int, timer: StepTimer, should_stop: Callable[[], bool]
    ) -> ProducedBatch | None:
        # reseeded per step and process: a resumed run samples what an uninterrupted one would
        seed_step(self.seed, state.step, self.process_index)
        producing = ProducerState.of(state, self.prompts_per_step)
        sampled = self.producer.sample(producing, state.step, num_generations, timer, should_stop=should_stop)
        if sampled is None:
            return None
        after, skip_metrics = self.producer.advance(producing, sampled)  # the cursor, the pass share, GRESO
        return ProducedBatch(state.step, state.step, num_generations, sampled, after, skip_metrics)

    def weights_updated(self, model: torch.nn.Module, timer: StepTimer) -> None:
        with timer("sync"):  # a vLLM engine samples the next step from the new weights
            self.engine.sync_weights(model)

    def in_flight(self, step: int) -> list[ProducedBatch]:
        return []

    def close(self) -> None:
        pass


class WorkerRollouts:
    """The batches come from this trainer process's rollout worker, sampled ahead on the worker's own cores (see
    :mod:`pods.rollout_worker` for the schedule of weights versions). With several trainer processes each has
    its own worker, and any worker's failure is raised on every process at the same step."""

    def __init__(
        self,
        spec: WorkerSpec,
        model: torch.nn.Module,
        accelerator: Any,
        *,
        num_generations: int,
        pending: list[ProducedBatch],
        weight_sync_backend: str,
        output_dir: Path,
        trainer_cores: list[int],
        unbounded_filter: bool = False,
    ) -> None:
        config = spec.config
        self.unbounded_filter = (
            unbounded_filter  # a prompt filter whose rounds may never end: a stop cuts them
        )
        self.model, self.accelerator, self.output_dir = model, accelerator, Path(output_dir)
        self.max_staleness, self.sync_every = config["max_staleness"], config["weight_sync_steps"]
        self.first = spec.first_version
        self.ready: dict[int, ProducedBatch] = {batch.step: batch for batch in pending}
        self.published = self.taken = -1  # the last weights version written for the worker, and read by it
        self.started = self.abandoned = False
        self.threads = torch.get_num_threads()
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if trainer_cores:
            os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(config["torch_threads"] or max(1, len(trainer_cores)))

        trainable = trainable_parameters(model)
        self.sender: WeightSender | None = None
        self.shared: dict[str, torch.Tensor] | None = None
        if weight_sync_backend == "shared_memory":
            self.shared = {name: p.detach().to("cpu", copy=True).share_memory_() for name, p in trainable}
            weights: Any = self.shared
        else:  # staged on the trainer's GPU for NCCL, in host memory for gloo
            device = trainable[0][1].device if weight_sync_backend == "nccl" else "cpu"
            store = weights_store("127.0.0.1", 0, serve=True)
            self.sender = WeightSender(
                TensorLayout.of(trainable), backend=weight_sync_backend, device=device, store=store
            )
            weights = GroupAddress(weight_sync_backend, "127.0.0.1", store.port, self.sender.layout)
        context = torch.multiprocessing.get_context("spawn")
        self.link, child_ends = link_pair(context)
        self.process = context.Process(target=worker_main, args=(spec, weights, *child_ends), daemon=True)
        with worker_signals_blocked():  # a group's SIGTERM or Ctrl-C during its start-up is the trainer's
            self.process.start()
        for end in child_ends:  # the worker holds the only copies now: its death closes the pipes
            end.close()
        self.worker_pid = self.process.pid
        self._write(spec.first_version, num_generations)

    # ------------------------------------------------------------------ the interface
    def batch(
        self, state: TrainerState, num_generations: int, timer: StepTimer, should_stop: Callable[[], bool]
    ) -> ProducedBatch | None:
        """Publish the weights the schedule needs, then take this step's batch. The weights of the last update go
        to the worker here, not at the end of that step: it samples with them while this step updates, never
        during an evaluation or a checkpoint (off the clock)."""
        unbounded = should_stop if self.unbounded_filter else None

        def publish_and_take() -> ProducedBatch | None:
            with timer("sync"):
                self.publish(state.step, num_generations)
            with timer("wait_for_rollouts"):  # a step is only abandoned where its rounds may never end
                return self.take(state.step, should_stop=unbounded)

        return self.on_every_process(publish_and_take)

    def weights_updated(self, model: torch.nn.Module, timer: StepTimer) -> None:
        """Nothing yet: the next :meth:`batch` publishes them, if the schedule samples with them."""

    def in_flight(self, step: int) -> list[ProducedBatch]:
        """The batches of steps ``step``, ``step + 1``, ... that weights of version ``step`` could not sample again
        (their version is older), waiting for them; a worker that died meanwhile raises."""
        if self.abandoned:  # a stop request came while waiting for a batch: they are sampled again on resume
            return []
        wanted = [
            t
            for t in range(step, step + self.max_staleness)
            if sampler_version(t, self.max_staleness, self.sync_every, self.first) < step
        ]
        for t in wanted:
            while t not in self.ready:
                self._receive(POLL_SECONDS)
        self._receive_all()  # a worker that died is not checkpointed as if it were alive
        return [self.ready[t] for t in wanted]

    def close(self) -> None:
        """Stop the worker (its pipes closed, then :data:`STOP_SIGNAL`: it stops its engine and exits; killed if it
        has not within CLOSE_SECONDS), give the trainer back its cores and threads."""
        if self.process is None:
            return
        self.link.close()
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker_pid, STOP_SIGNAL)
            self.process.join(CLOSE_SECONDS)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.process = None
        if self.cores:
            os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(self.threads)

    # ------------------------------------------------------------------ steps of the handshake
    def wait_until_ready(self) -> None:
        """Wait until the worker has built its model and engine (seconds the trainer keeps off the training clock,
        as it does its own set-up); a worker that fails meanwhile raises its error."""
        while not self.started:
            self._receive(POLL_SECONDS)

    def publish(self, version: int, num_generations: int) -> bool:
        """Write the weights of ``version`` (the optimizer steps applied) for the worker if the schedule samples with
        them, once the worker has read the previous version; whether they were."""
        if version <= self.first or version % self.sync_every:
            return False
        while self.taken < self.published:  # the worker still reads the previous version
            self._receive(POLL_SECONDS)
        self._write(version, num_generations)
        return True

    def take(self, step: int, should_stop: Callable[[], bool] | None = None) -> ProducedBatch | None:
        """The batch of ``step``, waiting for the worker if need be (None if ``should_stop()`` turns true while
        waiting). It stays in ``ready`` until the next step's is taken: a checkpoint saved before its update (the
        last completed step, as ``prompt_filter_exhausted: error`` saves) holds it, and the worker never sends it
        again."""
        while step not in self.ready:
            if should_stop is not None and should_stop():
                self.abandoned = True  # a checkpoint now cannot wait for the batches in flight
                return None
            fault_point("trainer_waiting_for_rollouts", kill=self.kill)
            self._receive(POLL_SECONDS)
        for trained in [t for t in self.ready if t < step]:
            del self.ready[trained]
        return self.ready[step]

    def _write(self, version: int, num_generations: int) -> None:
        """Copy the trainable weights where the worker reads them (shared memory, or the sender's staging buffers,
        broadcast from a background thread), then tell it their version."""
        trainable = trainable_parameters(self.model)
        if self.sender is not None:
            while not self.sender.wait(POLL_SECONDS):  # the previous broadcast, still read by a live worker
                self._receive(0)
            self.sender.send(trainable)
        else:
            with torch.no_grad():
                for name, parameter in trainable:
                    self.shared[name].copy_(parameter.detach())
        fault_point("trainer_publishing", kill=self.kill)
        try:
            self.link.send(("weights", version, num_generations))
        except PeerGone:
            self._receive_all()  # its report, if it sent one before it went; else its death
            raise self._death() from None
        self.published = version

    def _receive(self, timeout: float) -> bool:
        """Handle the worker's next message, waiting ``timeout`` seconds at most (whether one came); its failure or
        death raises."""
        try:
            message = self.link.receive(timeout)
        except PeerGone:
            raise self._death() from None
        if message is NOTHING:
            if not self.process.is_alive():
                raise self._death()
            return False
        kind, *body = message
        if kind == "ready":
            self.started = True
        elif kind == "taken":
            self.taken = body[0]
        elif kind == "batch":
            self.ready[body[0].step] = body[0]
        elif kind == "failed":
            raise self._failure(*body)
        return True

    def _receive_all(self) -> None:
        """Handle every message already sent (raises if the worker is gone)."""
        while self._receive(0):
            pass

    def _death(self) -> RolloutWorkerError:
        self.process.join(CLOSE_SECONDS)  # its exit code (the pipes close as it dies)
        code = self.process.exitcode
        how = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
        return RolloutWorkerError(
            f"the rollout worker (pid {self.worker_pid}) died with exit code {code}{how} without a report (killed? "
            "out of memory?)"
        )

    def _failure(self, kind: str, message: str, trace: str) -> Exception:
        """The worker's error: raised as the pods error it was (e.g. a reward function's), else as a
        RolloutWorkerError whose traceback goes to the run folder."""
        from pods import errors

        cls = getattr(errors, kind, None)
        if isinstance(cls, type) and issubclass(cls, Exception) and cls is not RolloutWorkerError:
            error = cls(message)
            error.from_rollout_worker = True  # type: ignore[attr-defined]  # the trainer checkpoints first
            return error
        where = self.output_dir / (
            WORKER_TRACEBACK_FILE
            if self.accelerator.process_index == 0
            else WORKER_TRACEBACK_FILE.replace(".txt", f".{self.accelerator.process_index}.txt")
        )
        try:
            where.write_text(trace)
            saved = f" (its traceback: {where})"
        except OSError:
            saved = ""
        first = message.splitlines()[0] if message else ""
        return RolloutWorkerError(f"the rollout worker failed: {kind}: {first}{saved}")

    def kill(self) -> None:
        """SIGKILL the worker and wait until it is gone (fault injection)."""
        os.kill(self.worker_pid, signal.SIGKILL)
        self.process.join()

    def on_every_process(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` (a call on this process's worker); with several trainer processes, a failure on any of them
        is raised on all of them together, each worker's in one line."""
        acc = self.accelerator
        result, failure = failure_of(action, Exception, alone=acc.num_processes == 1)
        raise_any_failure(
            lambda value: every_process(acc, value),
            failure,
            RolloutWorkerError,
            prefix="rollout workers failed: ",
        )
        return result


def start_worker_rollouts(
    config: Any,
    accelerator: Any,
    model: torch.nn.Module,
    reward_funcs: list[Any],
    rows: list[dict[str, Any]],
    state: TrainerState,
    in_flight: list[ProducedBatch],
    *,
    device: str,
    weight_sync_backend: str,
    num_generations: int,
    output_dir: Path,
    tools: tuple[list[Any] | None, Any] = (None, None),
    prompt_style: str = "plain",
) -> WorkerRollouts:
    """Start this trainer process's rollout worker on its share of the cores (the trainer keeps the rest) and
    wait until it is ready; with several trainer processes their workers meet at a store the main process serves."""
    check_picklable(reward_funcs)
    check_picklable([*(tools[0] or []), *([tools[1]] if tools[1] is not None else [])], "tool")
    acc = accelerator
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    mine = share_of_cores(cores, acc.local_process_index, local_processes(acc))
    trainer_cores, worker_cores = split_cores(mine, config.rollout_worker_threads)
    store, host, port = _workers_store(acc)
    spec = WorkerSpec(
        config=config.to_dict(),
        reward_funcs=reward_funcs,
        rows=rows,
        cores=worker_cores,
        threads=max(1, len(worker_cores)),  # one torch thread per core it runs on
        start_step=state.step + len(in_flight),
        start_state=in_flight[-1].state_after
        if in_flight
        else ProducerState.of(state, config.prompts_per_step),
        first_version=state.step,
        device=device,
        process_index=acc.process_index,
        num_processes=acc.num_processes,
        group_host=host,
        group_port=port,
        output_dir=str(output_dir),
        tools=tools[0],
        environment_factory=tools[1],
        prompt_style=prompt_style,
    )
    rollouts = WorkerRollouts(
        spec,
        model,
        acc,
        num_generations=num_generations,
        pending=in_flight,
        weight_sync_backend=weight_sync_backend,
        output_dir=output_dir,
        trainer_cores=trainer_cores,
        unbounded_filter=config.prompt_filter != "none" and config.max_num_gen_batches == 0,
    )
    rollouts.workers_store = store  # where the workers of several processes meet, served while the run lasts
    try:
        rollouts.on_every_process(rollouts.wait_until_ready)
    except BaseException:
        rollouts.close()
        raise
    return rollouts


def _workers_store(accelerator: Any) -> tuple[Any, str, int]:
    """With several trainer processes, where their rollout workers meet (a TCP store the main process serves, on
    the launch's MASTER_ADDR); unused with one."""
    acc = accelerator
    if acc.num_processes == 1:
        return None, "127.0.0.1", 0
    from pods.process_groups import tcp_store

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store, port = None, 0
    if acc.is_main_process:
        store = tcp_store(host, 0, acc.num_processes, serve=True)
        port = store.port
    return store, host, every_process(acc, port)[0]


def trainer_vllm_options(config: Any, accelerator: Any, run_folder: Path) -> dict[str, Any]:
    """The trainer's vLLM engine settings: each process seeds its own; several processes share one server."""
    options = {**vllm_options(config, run_folder=run_folder), "seed": config.seed + accelerator.process_index}
    if config.vllm_mode == "server" and accelerator.num_processes > 1:
        from pods.rollout.vllm_server import SharedServer

        options["share"] = SharedServer(
            accelerator.is_main_process, lambda value: every_process(accelerator, value)
        )
    return options


def worker_placement(config: Any, accelerator: Any) -> tuple[str, str]:
    """With ``async_generation``: the rollout worker's device and how the weights reach it
    (:func:`pods.weight_sync.resolve_placement`; an impossible choice fails here); ``("", "")`` without."""
    if not config.async_generation:
        return "", ""
    return resolve_placement(
        config.rollout_worker_device,
        config.weight_sync_backend,
        accelerator.device,
        torch.cuda.device_count(),
        local_index=accelerator.local_process_index,
        local_processes=local_processes(accelerator),
    )
