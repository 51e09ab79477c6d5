"""The PODS trainer. One step, per prompt (a group), reads top to bottom in :meth:`PODSTrainer.train`:

0. draw the round's prompts from the stream, skipping those predicted to give all-equal rewards
   (``prompt_skip``, GRESO);
1. generate n completions with the current policy;
2. score them with the reward functions (summed into one reward each);
   with a ``prompt_filter`` (DAPO), drop groups whose rewards are all equal and repeat 0-2 for as many
   prompts as are missing, at most ``max_num_gen_batches`` rounds, until the step has P groups that pass;
3. select m of the n with a down-sampling rule (per group, never across groups);
4. compute group-relative advantages over the m kept;
5. compute the GRPO loss on the m kept only and take an optimizer step.

GRPO is the special case m = n. Stages 0-2 are the producer (:meth:`PODSTrainer._generate_groups`), 3-5 the
consumer. The prompt-level stages are pure functions in :mod:`pods.prompt_skip` and :mod:`pods.prompt_filter`,
the rules in :mod:`pods.selection` (docs/selection.md). ``accelerate`` supplies devices, DDP / DeepSpeed / FSDP, mixed precision,
trackers and state saving: each process generates and selects for its own prompts, so a group never
spans processes, and gradients are synchronised as usual.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from pods.advantages import (
    Downsampled,
    difficulty_counts,
    downsample,
    nanstd,
    zero_variance_groups,
)
from pods.auto_generations import AutoGenerations
from pods.checkpoint import (
    STATE_FILE,
    TrainerState,
    adapter_only_checkpoints,
    base_model_identity,
    checkpoint_to_resume,
    resume_checkpoint,
    save_checkpoint,
)
from pods.config import TrainConfig
from pods.distributed import (
    deepspeed_batch_settings,
    deepspeed_guards_non_finite_steps,
    every_process,
    exported_state_dict,
    gather,
    local_processes,
    require_every_launched_process,
    synced_any,
    synced_max,
    synced_mean,
    synced_sum,
)
from pods.errors import ConfigError, NonFiniteError, PromptFilterExhausted, RolloutWorkerError
from pods.evaluation import EvalResult, evaluate, next_evaluation_seconds
from pods.interrupts import StopRequests, TrainingStopped
from pods.metrics import JsonlLog, StepTimer, peak_memory_mb, read_jsonl, reward_metrics
from pods.models import Policy, load_policy, load_reference, local_model_folder
from pods.optimization import build_optimizer, build_scheduler
from pods.producer import ProducedBatch, Producer, ProducerState, reward_components, score_batch, seed_step
from pods.progress import TrainingProgress
from pods.prompt_filter import (
    Groups,
    SampledGroups,
    exhausted_message,
    fill_groups,
)
from pods.registries import check_names
from pods.rollout import Rollouts, build_engine, choose_engine
from pods.rollout_worker import (
    AsyncRollouts,
    WorkerSpec,
    async_metrics,
    check_picklable,
    fresh_in_flight,
    from_rollout_worker,
    load_in_flight,
    require_async_with_several_processes,
    save_in_flight,
    share_of_cores,
    split_cores,
    vllm_options,
)
from pods.run_folder import require_shared_folder
from pods.scoring import RewardFunction, reward_name
from pods.update import NonFiniteGuard, policy_update
from pods.weight_sync import resolve_placement

__all__ = ["NonFiniteError", "PODSTrainer", "TrainResult", "TrainingStopped", "train"]


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    train_seconds: float
    evals: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Path | None = None

    @property
    def first_eval(self) -> dict[str, Any] | None:
        return self.evals[0] if self.evals else None

    @property
    def last_eval(self) -> dict[str, Any] | None:
        return self.evals[-1] if self.evals else None


class PODSTrainer:
    """Builds everything a run needs from a :class:`TrainConfig`, then :meth:`train` runs the loop."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        reward_funcs: list[RewardFunction] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
    ) -> None:
        from accelerate import Accelerator, PartialState
        from accelerate.utils import broadcast_object_list, parse_flag_from_env

        from pods.data import get_task

        self.config = cfg = config
        if reward_funcs is None:
            check_names(cfg)
            from pods.rewards import get_reward_functions

            self.task = get_task(cfg.task)
            reward_funcs = get_reward_functions(cfg.reward_funcs or list(self.task.reward_funcs))
        else:
            from pods.selection import get_rule

            get_rule(cfg.selection_rule)
            self.task = get_task(cfg.task)
        self.reward_funcs = reward_funcs
        self.prompt_style = cfg.prompt_style or self.task.prompt_style
        if cfg.reward_weights is not None and len(cfg.reward_weights) != len(reward_funcs):
            raise ConfigError(
                f"reward_weights: {len(cfg.reward_weights)} weights for {len(reward_funcs)} functions"
            )

        precision = cfg.mixed_precision
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
        # Each optimizer step accumulates the micro-batches of the kept rows (same count on every process).
        micro_batches = cfg.prompts_per_step * cfg.num_generations_kept // cfg.micro_batch_size
        # Start the process group first (as Accelerator would) so every process agrees on the run folder.
        PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
        self.output_dir = Path(broadcast_object_list([self._pick_output_dir()])[0])
        self.accelerator = Accelerator(
            mixed_precision=precision,
            log_with=cfg.report_to or None,  # TensorBoard / W&B / trackio, logging into the run folder
            project_dir=str(self.output_dir),
            gradient_accumulation_steps=micro_batches,
        )
        acc = self.accelerator
        require_every_launched_process(acc)
        if cfg.async_generation and acc.num_processes > 1:
            require_async_with_several_processes(acc, cfg)
        # async: where the rollout worker runs and how the weights reach it (an impossible choice fails here)
        self.worker_device, self.weight_sync_backend = (
            resolve_placement(
                cfg.rollout_worker_device,
                cfg.weight_sync_backend,
                acc.device,
                torch.cuda.device_count(),
                local_index=acc.local_process_index,
                local_processes=local_processes(acc),
            )
            if cfg.async_generation
            else ("", "")
        )
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.output_dir / "config.yaml")
        acc.wait_for_everyone()
        require_shared_folder(acc, self.output_dir)  # several machines resume from one checkpoint
        self.checkpoint_root = self.output_dir / "checkpoints"
        self._saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint written or loaded
        self.metrics_log = JsonlLog(self.output_dir / "metrics.jsonl", enabled=acc.is_main_process)
        self.eval_log = JsonlLog(self.output_dir / "eval.jsonl", enabled=acc.is_main_process)
        self.auto = None  # num_generations: auto chooses n as it runs (pods.auto_generations)
        if cfg.num_generations == "auto":
            low, high = cfg.generation_bounds
            self.auto = AutoGenerations(
                cfg.num_generations_kept,
                low,
                high,
                cfg.selection_rule,
                cfg.num_generations_every,
                overlapped=cfg.async_generation,
            )
        self.auto_log = JsonlLog(
            self.output_dir / "num_generations.jsonl", enabled=acc.is_main_process and self.auto is not None
        )

        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        self.policy: Policy = load_policy(cfg)
        self.tokenizer = self.policy.tokenizer
        self.train_rows = self._load_rows(
            train_dataset, cfg.task, cfg.task_source, cfg.train_split, cfg.train_limit
        )
        self.eval_dataset = eval_dataset if eval_dataset is not None else self._load_eval_dataset()
        self.accuracy_fn = get_task(cfg.eval_task or cfg.task).accuracy_function()

        trainable = [p for p in self.policy.model.parameters() if p.requires_grad]
        optimizer = build_optimizer(cfg, trainable, deepspeed=acc.state.deepspeed_plugin is not None)
        self.scheduler = build_scheduler(cfg, optimizer)
        deepspeed_batch_settings(acc, cfg.micro_batch_size, micro_batches, cfg.max_grad_norm)
        self.model, self.optimizer = acc.prepare(self.policy.model, optimizer)
        deepspeed_guards_non_finite_steps(self.model)
        self.base_model = None  # a LoRA run's frozen base: its checkpoints hold the adapter only
        if self.policy.is_lora and acc.state.deepspeed_plugin is None:
            self.base_model = base_model_identity(cfg.model, local_model_folder(cfg.model))
            adapter_only_checkpoints(acc, self.base_model)
        self.reference = None
        if cfg.beta > 0 and not self.policy.is_lora:
            self.reference = load_reference(cfg).to(acc.device)

        try:  # config.yaml records the engine that runs, whatever was asked
            cfg.rollout_engine, self.engine_reason = choose_engine(
                cfg.rollout_engine, model=self.policy.model
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if cfg.rollout_engine == "hf" and acc.is_fsdp2 and acc.num_processes > 1:
            raise ConfigError(
                "rollout_engine: hf cannot sample from a model that FSDP shards over several processes (every "
                "process would wait for the others' shards at each token); use rollout_engine: vllm"
            )
        if acc.is_main_process:
            cfg.save(self.output_dir / "config.yaml")
        self.engine = build_engine(  # async: the worker builds the rollout engine; this one evaluates
            "hf" if cfg.async_generation else cfg.rollout_engine,
            acc.unwrap_model(self.model),
            self.tokenizer,
            generation_batch_size=cfg.generation_batch_size,
            max_prompt_length=cfg.max_prompt_length,
            vllm_options=self._vllm_options(),
            share_prefix=cfg.packing,
        )
        self.rollouts: AsyncRollouts | None = None  # async_generation: the rollout worker, while train() runs
        # stages 0-2 (prompts, generation, rewards), in this process or in a rollout worker
        self.producer = Producer(
            cfg, self.engine, self.tokenizer, self.train_rows, score=self._score, accelerator=acc
        )
        self.prompts = self.producer.prompts
        names = [reward_name(fn) for fn in reward_funcs]
        if cfg.prompt_filter_reward != "total" and cfg.prompt_filter_reward not in names:
            raise ConfigError(
                f"prompt_filter_reward: {cfg.prompt_filter_reward!r} is not one of this run's reward functions "
                f"({', '.join(names)}); use total (what the rules rank) or one of those names"
            )
        if cfg.report_to:
            acc.init_trackers("pods", config={k: str(v) for k, v in cfg.to_dict().items()})

    def _num_generations(self) -> int:
        """n for the next batch: the configured one, or what ``num_generations: auto`` chose last."""
        return self.auto.current if self.auto else self.config.num_generations

    def _vllm_options(self) -> dict[str, Any]:
        """The vLLM engine's settings here: each process seeds its own; several processes share one server."""
        cfg, acc = self.config, self.accelerator
        options = {**vllm_options(cfg), "seed": cfg.seed + acc.process_index}
        if cfg.vllm_mode == "server" and acc.num_processes > 1:
            from pods.rollout.vllm_server import SharedServer

            options["share"] = SharedServer(acc.is_main_process, lambda value: every_process(acc, value))
        return options

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        cfg, acc = self.config, self.accelerator
        state, in_flight = self._resume_or_start()
        self.engine.sync_weights(acc.unwrap_model(self.model))  # the resumed weights, for vLLM
        if self.auto and state.step == 0:
            self.auto_log.append({"kind": "decision", **self.auto.first_decision().to_dict()})
        stop = StopRequests(reduce_max=(lambda v: int(synced_max(acc, v))) if acc.num_processes > 1 else None)
        progress = TrainingProgress(cfg.progress and acc.is_main_process, cfg.max_steps, cfg.max_time)
        with stop, progress, self._trackers(), self._rollout_worker(state, in_flight):
            progress.message(f"rollout engine: {cfg.rollout_engine} ({self.engine_reason})")
            if self.batches_sampled_again:
                progress.message(
                    f"{self.batches_sampled_again} batch(es) in flight in the checkpoint were sampled more than "
                    f"max_staleness = {cfg.max_staleness} steps before they would train: sampled again"
                )
            if cfg.eval_at_start and state.step == 0 and state.last_eval_seconds is None:
                self._evaluate(state, progress)
            with self._checkpoint_if_the_worker_fails(state):
                while not self._finished(state) and not stop.agreed():
                    timer = StepTimer()
                    batch = self._produce(state, timer, stop, progress)  # 0-2, here or in the rollout worker
                    if batch is None:  # a stop request during an unbounded filter's rounds: redone on resume
                        break
                    metrics = self._consume(state, batch, timer)  # 3-5, then the new weights to the sampler
                    self.metrics_log.append(metrics)
                    if cfg.report_to:
                        acc.log(metrics, step=state.step)
                    progress.update(state.step, state.train_seconds, metrics)

                    if self._eval_due(state):
                        self._evaluate(state, progress)
                    if self._save_due(state):
                        self._save(state)

            stopped = stop.agreed()  # once more on every process: a signal during the last step counts
            if (
                not stopped
                and state.last_eval_seconds != state.train_seconds
                and (cfg.eval_at_start or cfg.eval_every_seconds or cfg.eval_at_seconds)
            ):
                self._evaluate(state, progress)
            checkpoint = self._save(state) if cfg.save_final or stopped else None
        if stopped:
            raise TrainingStopped(stop.agreed_signal, state.step, checkpoint, self.output_dir)
        evals = read_jsonl(self.eval_log.path) if self.eval_log.path.is_file() else []
        return TrainResult(self.output_dir, state.step, state.train_seconds, evals, checkpoint)

    def _produce(
        self, state: TrainerState, timer: StepTimer, stop: StopRequests, progress: TrainingProgress
    ) -> ProducedBatch | None:
        """Stages 0-2 of this step: skip prompts, generate n per prompt, score (with a prompt filter, in rounds);
        taken from the rollout worker with ``async_generation``, else run here."""
        if self.rollouts is not None:
            return self._take_from_the_worker(state, timer, stop)
        self._seed_step(state.step)
        n = self._num_generations()
        producing = ProducerState.of(state, self.config.prompts_per_step)
        sampled = self.producer.sample(
            producing, state.step, n, timer, should_stop=stop.agreed, progress=progress.message
        )
        if sampled is None:
            return None
        after, skip_metrics = self.producer.advance(producing, sampled)  # the cursor, the pass share, GRESO
        return ProducedBatch(state.step, state.step, n, sampled, after, skip_metrics)

    def _consume(self, state: TrainerState, batch: ProducedBatch, timer: StepTimer) -> dict[str, Any]:
        """Stages 3-5 on this step's batch: m of n per group, their advantages, the update; then a colocated
        vLLM engine gets the new weights (a rollout worker gets them when the next step starts). Returns the
        step's metrics."""
        sampled = batch.sampled
        with timer("select"):  # 3. m of n per group, and 4. advantages over the kept
            groups, chosen = self._select(state, sampled, self.config.num_generations_kept)
            kept_rollouts = groups.rollouts.select(chosen.rows)
            trained = chosen.trained & groups.trained.unsqueeze(1)
        with timer("update"):  # 5. the GRPO update on the kept rows only
            update = self._update(state, kept_rollouts, chosen.advantages.flatten(), trained.flatten())
        batch.state_after.into(state)
        state.step += 1
        if self.rollouts is None:
            with timer("sync"):  # the colocated vLLM engine samples the next step from the new weights
                self.engine.sync_weights(self.accelerator.unwrap_model(self.model))
        state.train_seconds += synced_max(self.accelerator, timer.total)  # the slowest process sets the clock
        everything = sampled.all  # metrics describe every group generated, over the refill rounds
        metrics = self._step_metrics(
            state,
            timer,
            everything.rollouts,
            everything.rewards,
            chosen.rewards.masked_fill(~trained, float("nan")),
            everything.per_function,
            update,
            trained_groups=groups.trained,
        )
        metrics.update(self._stage_metrics(sampled, groups, chosen, trained), **batch.skip_metrics)
        if self.rollouts is not None:
            metrics.update(async_metrics(batch))
            metrics["pods/async/batches_sampled_again"] = self.batches_sampled_again  # once, after a resume
            self.batches_sampled_again = 0
        if self.auto:
            seconds = dict(timer.seconds)
            if self.rollouts is not None:  # generating is the worker's time; the trainer's waiting is neither
                seconds.pop("wait_for_rollouts", None)
                seconds = {"generate": sum(batch.seconds.values()), "update": sum(seconds.values())}
            self._auto_step(state, everything.rewards, everything.per_function, seconds)
        return metrics

    def _take_from_the_worker(
        self, state: TrainerState, timer: StepTimer, stop: StopRequests
    ) -> ProducedBatch | None:
        """Publish the weights the schedule needs, then take this step's batch from the rollout worker. With
        several trainer processes a failing worker stops every process at this step (each has its own worker)."""
        acc = self.accelerator
        unbounded = self.config.prompt_filter != "none" and self.config.max_num_gen_batches == 0

        def take() -> ProducedBatch | None:
            # The weights of the last update go to the worker here, not at the end of that step: it samples
            # with them while this step updates, never during an evaluation or a checkpoint (off the clock).
            with timer("sync"):
                self.rollouts.publish(acc.unwrap_model(self.model), state.step, self._num_generations())
            with timer("wait_for_rollouts"):  # a step is only abandoned where its rounds may never end
                return self.rollouts.take(state.step, should_stop=stop.agreed if unbounded else None)

        return self._on_every_process(take)

    def _on_every_process(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` (a call on this process's rollout worker); with several trainer processes, a failure on
        any of them is raised on all of them together, each worker's in one line, so that none waits for
        another in a collective."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return action()
        failure, result = None, None
        try:
            result = action()
        except Exception as error:
            failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        reports = every_process(acc, failure)
        if any(reports):
            raise RolloutWorkerError(
                "rollout workers failed: "
                + "; ".join(f"process {rank}: {report}" for rank, report in enumerate(reports) if report)
            )
        return result

    @contextlib.contextmanager
    def _checkpoint_if_the_worker_fails(self, state: TrainerState):
        """A rollout worker that died or failed ends the run with its error and a checkpoint of the last completed
        step (the batches in flight are sampled again on resume)."""
        try:
            yield
        except Exception as error:
            if not from_rollout_worker(error):
                raise
            self.rollouts.abandoned = True
            checkpoint = self._save(state)
            cls = type(error)  # RolloutWorkerError, or the worker's own pods error (e.g. a reward function's)
            raise cls(
                f"{error}. The last completed step ({state.step}) is saved in {checkpoint}: resume with "
                "resume_from: auto (its batches in flight are sampled again)"
            ) from None

    @contextlib.contextmanager
    def _rollout_worker(self, state: TrainerState, in_flight: list[ProducedBatch]):
        """With ``async_generation``: the rollout worker, on its own cores, for the loop's duration (stopped however
        the loop ends; the trainer's cores and threads are given back)."""
        cfg = self.config
        if not cfg.async_generation:
            yield
            return
        check_picklable(self.reward_funcs)
        acc = self.accelerator
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        mine = share_of_cores(cores, acc.local_process_index, local_processes(acc))
        trainer_cores, worker_cores = split_cores(mine, cfg.rollout_worker_threads)
        group_host, group_port = self._workers_store()
        threads = torch.get_num_threads()
        spec = WorkerSpec(
            config=cfg.to_dict(),
            reward_funcs=self.reward_funcs,
            rows=self.train_rows,
            cores=worker_cores,
            threads=max(1, len(worker_cores)),  # one torch thread per core it runs on
            start_step=state.step + len(in_flight),
            start_state=in_flight[-1].state_after
            if in_flight
            else ProducerState.of(state, cfg.prompts_per_step),
            first_version=state.step,
            device=self.worker_device,
            process_index=acc.process_index,
            num_processes=acc.num_processes,
            group_host=group_host,
            group_port=group_port,
        )
        try:
            if trainer_cores:
                os.sched_setaffinity(0, trainer_cores)
            torch.set_num_threads(cfg.torch_threads or max(1, len(trainer_cores)))
            self.rollouts = AsyncRollouts(
                spec,
                self.accelerator.unwrap_model(self.model),
                max_staleness=cfg.max_staleness,
                sync_every=cfg.weight_sync_steps,
                num_generations=self._num_generations(),
                pending=in_flight,
                weight_sync_backend=self.weight_sync_backend,
            )
            self._on_every_process(self.rollouts.wait_until_ready)
            yield
        finally:
            if self.rollouts is not None:
                self.rollouts.close()
                self.rollouts = None
            self._workers_store_server = None  # where the workers of several processes met
            if cores:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)

    def _workers_store(self) -> tuple[str, int]:
        """With several trainer processes, where their rollout workers meet (a TCP store the main process serves,
        on the launch's MASTER_ADDR); unused with one."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return "127.0.0.1", 0
        from pods.process_groups import tcp_store

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = 0
        if acc.is_main_process:
            self._workers_store_server = tcp_store(host, 0, acc.num_processes, serve=True)
            port = self._workers_store_server.port
        return host, every_process(acc, port)[0]

    @contextlib.contextmanager
    def _trackers(self):
        """Flush and close the trackers (TensorBoard, W&B, ...) however the loop ends: done, stopped or failed."""
        try:
            yield
        finally:
            if self.config.report_to:
                self.accelerator.end_training()

    # ------------------------------------------------------------------ step pieces
    def _select(self, state: TrainerState, sampled: SampledGroups, m: int) -> tuple[Groups, Downsampled]:
        """3-4. The groups the step trains on (those that passed the filter first; past the bound as
        ``prompt_filter_exhausted`` says), m (or a difficulty's k) of each, and their advantages."""
        cfg, acc = self.config, self.accelerator
        exhausted = cfg.prompt_filter_exhausted if cfg.prompt_filter != "none" else "pad"
        if exhausted == "error" and synced_any(acc, sampled.num_passed < cfg.prompts_per_step):
            checkpoint = self._save(state)  # every process: the last completed step, to resume from
            raise PromptFilterExhausted(
                f"{exhausted_message(sampled.num_passed, cfg.prompts_per_step)}. The last completed step "
                f"({state.step}) is saved in {checkpoint}: resume with resume_from: auto"
            )
        taken = fill_groups(sampled.passed, cfg.prompts_per_step, exhausted)
        groups = sampled.take(taken.positions, trained=taken.trained)
        counts = None
        if cfg.num_generations_kept_by_difficulty:  # GFPO: k per group from its mean reward's quartile
            means = gather(acc, groups.rewards.nanmean(dim=1))
            mine = slice(
                acc.process_index * len(taken.positions), (acc.process_index + 1) * len(taken.positions)
            )
            counts = difficulty_counts(means.cpu(), cfg.num_generations_kept_by_difficulty)[mine]
        components = weights = None
        if cfg.multi_objective_aggregation == "normalize_then_sum":
            components, weights = reward_components(cfg, groups.per_function)
        chosen = downsample(
            groups.ranked,
            m,
            cfg.selection_rule,
            scale=cfg.scale_rewards,
            eps=cfg.advantage_eps,
            generator=self._selection_generator(state.step),
            gather=lambda values: gather(acc, values),
            lengths=groups.lengths,
            kept_counts=counts,
            keep_signal=cfg.prompt_filter != "none",
            components=components,
            weights=weights,
        )
        return groups, chosen

    def _stage_metrics(
        self, sampled: SampledGroups, groups: Groups, chosen: Downsampled, trained: torch.Tensor
    ) -> dict[str, float]:
        """Rollouts generated (every round, every process) and groups trained with a signal, so that rollouts per
        useful group can be read from any run; with a ``prompt_filter`` its rounds, drops and shortfall; with a
        length rule under a filter, the groups whose signal a swap restored."""
        acc, cfg = self.accelerator, self.config
        kept = chosen.rewards.masked_fill(~trained, float("nan"))
        with_signal = int((groups.trained & ~zero_variance_groups(kept)).sum())
        first = len(sampled.rounds[0].rollouts)
        counts = [sampled.num_rollouts, with_signal, sampled.num_rollouts - first, chosen.signal_restored]
        generated, with_signal, extra, restored = synced_sum(acc, torch.tensor(counts)).tolist()
        metrics = {
            "pods/rollouts_generated": int(generated),
            "pods/groups_trained_with_signal": int(with_signal),
        }
        if cfg.prompt_filter == "none":
            return metrics
        wanted, passed = cfg.prompts_per_step, sampled.num_passed
        unfilled = max(wanted - passed, 0)  # slots without a group that passed (train_fewer: left out)
        failed = len(sampled.ids) - passed
        dropped, unfilled = synced_sum(acc, torch.tensor([failed - unfilled, unfilled])).tolist()
        share = sampled.pass_share.share
        return {
            **metrics,
            "pods/filter/num_gen_batches": len(sampled.rounds),
            "pods/filter/first_round_prompts": len(sampled.rounds[0].rewards),
            "pods/filter/groups_dropped": int(dropped),
            "pods/filter/extra_rollouts": int(extra),
            "pods/filter/groups_unfilled": int(unfilled),
            "pods/filter/pass_share": float("nan") if share is None else share,
            "pods/selection/signal_restored": int(restored),
        }

    def _score(
        self, batch: list[dict[str, Any]], rollouts: Rollouts
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """2. The rewards of a round (:func:`pods.producer.score_batch`; a hook for subclasses)."""
        return score_batch(self.reward_funcs, self.config, batch, rollouts)

    def _update(
        self, state: TrainerState, batch: Rollouts, advantages: torch.Tensor, trained: torch.Tensor
    ) -> dict[str, float]:
        """5. Gradient steps on the kept rows that carry weight (:func:`pods.update.policy_update`)."""
        guard = NonFiniteGuard(state, self.config.max_consecutive_skips, self.checkpoint_root)
        return policy_update(
            self.accelerator,
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            advantages,
            self.config,
            guard,
            reference=self.reference,
            trained=trained,
        )

    # ------------------------------------------------------------------ metrics
    def _step_metrics(
        self,
        state: TrainerState,
        timer: StepTimer,
        rollouts: Rollouts,
        rewards: torch.Tensor,
        kept_rewards: torch.Tensor,
        per_function: dict[str, torch.Tensor],
        update: dict[str, float],
        trained_groups: torch.Tensor,
    ) -> dict[str, Any]:
        """The step's row of metrics.jsonl: rewards of every group generated and of the kept rows of the groups
        trained on (``kept_rewards`` NaN where a position is not trained), lengths, timings, memory."""
        acc = self.accelerator
        everywhere = lambda t: gather(acc, t).cpu()  # noqa: E731 - equal shapes on every process
        all_rewards = everywhere(rewards)
        kept = everywhere(kept_rewards)[everywhere(trained_groups.to(acc.device)).bool()]
        lengths = everywhere(rollouts.completion_mask.sum(dim=1).double())
        truncated = everywhere(rollouts.truncated.double())
        step_seconds = synced_max(acc, timer.total)
        metrics: dict[str, Any] = {
            "step": state.step,
            "epoch": round(
                self.prompts.epoch(state.prompts_drawn), 4
            ),  # every prompt drawn, refills included
            "train_seconds": state.train_seconds,  # unrounded: the schedules compare against this exact clock
            "num_generations": rewards.shape[1],
            **reward_metrics(all_rewards, kept),
            "skipped_steps": state.skipped_steps,
        }
        for name, values in per_function.items():
            values = everywhere(values)
            metrics[f"rewards/{name}/mean"] = values.nanmean().item()
            metrics[f"rewards/{name}/std"] = nanstd(values.reshape(1, -1), dim=1).item()
        metrics.update(
            {
                "completions/mean_length": lengths.mean().item(),
                "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(),
                "completions/clipped_ratio": truncated.mean().item(),
                "learning_rate": self.scheduler.get_last_lr()[0],
                **{key: synced_mean(acc, value) for key, value in update.items()},
            }
        )
        accuracy_name = reward_name(self.accuracy_fn)
        if accuracy_name in per_function:
            metrics["accuracy"] = (
                (everywhere(torch.nan_to_num(per_function[accuracy_name])) > 0.5).double().mean().item()
            )
        for phase, seconds in timer.seconds.items():
            metrics[f"seconds_{phase}"] = round(synced_max(acc, seconds), 4)
        metrics["seconds_step"] = round(step_seconds, 4)
        metrics["timeline"] = [list(span) for span in timer.spans]  # when each phase ran (wall clock)
        metrics["tokens_per_second"] = round(lengths.sum().item() / max(step_seconds, 1e-9), 1)
        metrics["peak_memory_mb"] = round(peak_memory_mb(), 1)
        return metrics

    def _auto_step(
        self,
        state: TrainerState,
        rewards: torch.Tensor,
        per_function: dict[str, torch.Tensor],
        phases: dict[str, float],
    ) -> None:
        """``num_generations: auto``: record this step's successes per group (the accuracy reward above
        0.5, else the summed reward above 0.5) and timings, over every process; re-decide n when due."""
        scores = torch.nan_to_num(per_function.get(reward_name(self.accuracy_fn), rewards))
        acc = self.accelerator
        successes = gather(acc, (scores > 0.5).sum(dim=1)).cpu().tolist()
        seconds = {phase: synced_max(acc, value) for phase, value in sorted(phases.items())}
        self.auto_log.append(self.auto.observe(state.step, rewards.shape[1], successes, seconds))
        decision = self.auto.decide(state.step)
        if decision is not None:
            self.auto_log.append({"kind": "decision", **decision.to_dict()})

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, state: TrainerState, progress: TrainingProgress) -> EvalResult | None:
        cfg = self.config
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            return None
        result = evaluate(
            self.accelerator.unwrap_model(self.model),
            self.tokenizer,
            self.eval_dataset,
            self.accuracy_fn,
            protocol=cfg.eval_protocol,
            samples=cfg.eval_samples,
            temperature=cfg.eval_temperature,
            max_new_tokens=cfg.max_completion_length,
            batch_size=cfg.eval_batch_size,
            prompt_style=self.prompt_style,
            stop_strings=tuple(cfg.stop_strings),
            accelerator=self.accelerator,
            engine=self.engine,
        )
        state.last_eval_seconds = state.train_seconds
        row = {"step": state.step, "train_seconds": state.train_seconds, **result.to_dict()}
        row["eval_seconds"] = row.pop("seconds")
        self.eval_log.append(row)
        if cfg.report_to:
            self.accelerator.log(
                {f"eval/{k}": v for k, v in row.items() if isinstance(v, int | float)}, step=state.step
            )
        progress.message(
            f"eval at step {state.step} ({state.train_seconds:.0f}s of training): accuracy {result.accuracy:.1%}, "
            f"format {result.format_accuracy:.1%} on {result.num_problems} problems ({result.protocol})"
        )
        return result

    def _eval_due(self, state: TrainerState) -> bool:
        """At the first step that reaches a scheduled training time (``eval_at_seconds``, multiples of
        ``eval_every_seconds``) not yet evaluated; the last step's evaluation follows the loop."""
        cfg = self.config
        due = next_evaluation_seconds(state.last_eval_seconds, cfg.eval_every_seconds, cfg.eval_at_seconds)
        return due is not None and state.train_seconds >= due and not self._finished(state)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, state: TrainerState) -> Path:
        if self._saved is not None and self._saved[0] == state.step:
            return self._saved[1]  # already saved (or resumed from) at this step
        state.last_save_seconds = state.train_seconds
        weights = exported_state_dict(self.accelerator, self.model)  # every process: gathers if sharded
        in_flight = self.rollouts.in_flight(state.step) if self.rollouts is not None else []
        folder = save_checkpoint(
            self.accelerator,
            self.checkpoint_root,
            state,
            self.config.save_total_limit,
            export=lambda folder: self._export(folder, weights),
            scheduler=self.scheduler,
            base_model=self.base_model,
            each_process=lambda folder: save_in_flight(folder, in_flight, self.accelerator.process_index),
        )
        self._saved = (state.step, folder)
        return folder

    def _export(self, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """A ready-to-use copy (full model or LoRA adapter, plus tokenizer) for ``pods eval``; ``weights``
        are the gathered ones under ZeRO-3 or FSDP2 (peft keeps the adapter's out of a full state dict itself)."""
        self.accelerator.unwrap_model(self.model).save_pretrained(folder, state_dict=weights)
        self.tokenizer.save_pretrained(folder)

    def _save_due(self, state: TrainerState) -> bool:
        cfg = self.config
        if self._finished(state):
            return False  # the final save follows
        by_steps = cfg.save_every_steps is not None and state.step % cfg.save_every_steps == 0
        by_time = cfg.save_every_seconds is not None and (
            state.train_seconds - state.last_save_seconds >= cfg.save_every_seconds
        )
        return by_steps or by_time

    def _resume_or_start(self) -> tuple[TrainerState, list[ProducedBatch]]:
        """The state to start from: a fresh one (logs emptied) or a checkpoint's (logs cut back to its step); and
        with ``async_generation`` the checkpoint's batches in flight that are still fresh enough to train on."""
        folder = checkpoint_to_resume(self.accelerator, self.config.resume_from, self.checkpoint_root)
        if folder is None:  # a fresh start (also resume_from: auto without a checkpoint): no earlier rows
            self.metrics_log.reset()
            self.eval_log.reset()
            self.auto_log.reset()
            self.batches_sampled_again = 0
            return TrainerState(), []
        state = resume_checkpoint(self.accelerator, folder, self.scheduler)
        self._saved = (state.step, folder)
        self.metrics_log.truncate_after(state.step)
        if self.auto is not None:  # replay n's observations and decisions up to the checkpoint
            self.auto_log.truncate_after(state.step)
            self.accelerator.wait_for_everyone()
            if self.auto_log.path.is_file():
                self.auto.restore([r for r in read_jsonl(self.auto_log.path) if r["step"] <= state.step])
        self.eval_log.truncate_after(state.step)
        in_flight = (
            load_in_flight(folder, self.accelerator.process_index) if self.config.async_generation else []
        )
        fresh = fresh_in_flight(in_flight, state.step, self.config.max_staleness)
        self.batches_sampled_again = len(in_flight) - len(fresh)  # too old for this run's max_staleness
        return state, fresh

    # ------------------------------------------------------------------ set-up helpers
    def _finished(self, state: TrainerState) -> bool:
        cfg = self.config
        return (cfg.max_steps is not None and state.step >= cfg.max_steps) or (
            cfg.max_time is not None and state.train_seconds >= cfg.max_time
        )

    def _seed_step(self, step: int) -> None:
        """Reseed per step (and process): sampling after a resume matches an uninterrupted run exactly."""
        seed_step(self.config.seed, step, self.accelerator.process_index)

    def _selection_generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            self.config.seed * 7_919 + step * 64 + self.accelerator.process_index
        )

    def _pick_output_dir(self) -> str:
        cfg = self.config
        if cfg.output_dir:
            return cfg.output_dir
        if cfg.resume_from and cfg.resume_from != "auto":
            path = Path(cfg.resume_from)
            return str(path.parent.parent if (path / STATE_FILE).is_file() else path)
        return str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))

    def _load_rows(
        self, dataset: Any, task: str, source: str | None, split: str, limit: int | None
    ) -> list[dict]:
        if dataset is None:
            from pods.data import load_task

            dataset = load_task(
                task,
                split,
                source=source,
                prompt_style=self.prompt_style,
                tokenizer=self.tokenizer,
                max_prompt_tokens=self.config.max_prompt_length,
                limit=limit,
                seed=self.config.seed,
            )
        return [dataset[i] for i in range(len(dataset))]

    def _load_eval_dataset(self) -> Any:
        cfg = self.config
        if not cfg.eval_at_start and cfg.eval_every_seconds is None and not cfg.eval_at_seconds:
            return None
        from pods.data import load_task

        return load_task(
            cfg.eval_task or cfg.task,
            cfg.eval_split,
            source=cfg.eval_source if cfg.eval_task else (cfg.eval_source or cfg.task_source),
            prompt_style=self.prompt_style,
            tokenizer=self.tokenizer,
            max_prompt_tokens=cfg.max_prompt_length,
            limit=cfg.eval_limit,
            seed=cfg.seed,
        )


def train(config: TrainConfig, **kwargs: Any) -> TrainResult:
    """Build a :class:`PODSTrainer` from ``config`` and run it (raises :class:`TrainingStopped` on SIGTERM/SIGINT)."""
    return PODSTrainer(config, **kwargs).train()
