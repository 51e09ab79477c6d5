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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pods.agents import (
    environment_rewards,
    load_environment_factory,
    load_tools,
    multi_turn_engine,
    run_tools,
)
from pods.auto_generations import AutoGenerations
from pods.checkpoint import (
    TrainerState,
    adapter_only_checkpoints,
    base_model_identity,
    checkpoint_to_resume,
    resume_checkpoint,
    save_checkpoint,
)
from pods.config import TrainConfig
from pods.consumer import observe_for_auto, select_kept, stage_metrics, step_metrics
from pods.distributed import (
    deepspeed_batch_settings,
    deepspeed_guards_non_finite_steps,
    exported_state_dict,
    require_every_launched_process,
    synced_any,
    synced_max,
)
from pods.errors import ConfigError, NonFiniteError, PromptFilterExhausted
from pods.evaluation import EvalResult, evaluate_with_config, next_evaluation_seconds
from pods.faults import fault_point
from pods.interrupts import StopRequests, TrainingStopped
from pods.metrics import JsonlLog, StepTimer, read_jsonl, trackers_closed
from pods.models import Policy, load_policy, load_reference, local_model_folder
from pods.optimization import build_optimizer, build_scheduler
from pods.producer import ProducedBatch, Producer, score_batch
from pods.progress import TrainingProgress
from pods.prompt_filter import (
    SampledGroups,
    exhausted_message,
)
from pods.registries import check_names
from pods.rollout import Rollouts, build_engine, engine_choice
from pods.rollout_sources import (
    LocalRollouts,
    RolloutSource,
    from_rollout_side,
    start_worker_rollouts,
    trainer_vllm_options,
    worker_placement,
)
from pods.rollout_worker import (
    async_metrics,
    fresh_in_flight,
    load_in_flight,
    require_async_with_several_processes,
    save_in_flight,
)
from pods.run_folder import require_shared_folder, start_accelerator
from pods.run_inputs import (
    accuracy_function,
    check_reward_columns,
    dataset_rows,
    no_held_out_evaluation,
    reward_functions,
)
from pods.scoring import RewardFunction, name_among, reward_names
from pods.update import NonFiniteGuard, policy_update

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
        tools: list[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | None = None,
    ) -> None:
        from pods.data import get_task

        self.config = cfg = config
        if reward_funcs is None:
            check_names(cfg)
            self.task = get_task(cfg.task)
            reward_funcs = reward_functions(cfg)  # built-in names, import paths, a reward model
        else:
            from pods.selection import get_rule

            get_rule(cfg.selection_rule)
            self.task = get_task(cfg.task)
        # tools or an environment: episodes turn by turn (the engine is wrapped below; the worker wraps its own)
        self.api_tools = (tools, environment_factory)  # the Python API's own (the worker gets them pickled)
        self.tools = list(tools) if tools is not None else load_tools(run_tools(cfg))
        self.environment_factory = environment_factory or load_environment_factory(cfg.environment_factory)
        owned = environment_rewards(self.environment_factory)  # TRL: an environment with get_reward owns one
        if owned and cfg.reward_weights is not None:
            cfg.reward_weights = [*cfg.reward_weights, 1.0]  # weighed 1, as TRL does
        self.reward_funcs = reward_funcs = [*reward_funcs, *owned]
        self.prompt_style = cfg.prompt_style or self.task.prompt_style
        if cfg.reward_weights is not None and len(cfg.reward_weights) != len(reward_funcs):
            raise ConfigError(
                f"reward_weights: {len(cfg.reward_weights)} weights for {len(reward_funcs)} functions"
            )

        # Each optimizer step accumulates the micro-batches of the kept rows (same count on every process).
        micro_batches = cfg.prompts_per_step * cfg.num_generations_kept // cfg.micro_batch_size
        self.accelerator, self.output_dir = start_accelerator(cfg, micro_batches)
        acc = self.accelerator
        require_every_launched_process(acc)
        if cfg.async_generation and acc.num_processes > 1:
            require_async_with_several_processes(acc, cfg)
        # async: where the rollout worker runs and how the weights reach it (an impossible choice fails here)
        self.worker_device, self.weight_sync_backend = worker_placement(cfg, acc)
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.output_dir / "config.yaml")
        acc.wait_for_everyone()
        require_shared_folder(acc, self.output_dir)  # several machines resume from one checkpoint
        self.checkpoint_root = self.output_dir / "checkpoints"
        self._saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint written or loaded
        self.metrics_log = JsonlLog(self.output_dir / "metrics.jsonl", enabled=acc.is_main_process)
        self.eval_log = JsonlLog(self.output_dir / "eval.jsonl", enabled=acc.is_main_process)
        self.auto = AutoGenerations.of(cfg)  # num_generations: auto chooses n as it runs (else None)
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
        self.no_held_out: str | None = None  # why a run on dataset_name has no held-out evaluation
        self.eval_dataset = eval_dataset if eval_dataset is not None else self._load_eval_dataset()
        self.accuracy_fn = accuracy_function(cfg, reward_funcs)
        self.accuracy_name = name_among(reward_funcs, self.accuracy_fn)  # its column among the run's rewards
        if cfg.dataset_name is not None and train_dataset is None:  # your rewards against your columns, now
            check_reward_columns(
                reward_funcs, self.train_rows, f"dataset_name {cfg.dataset_name!r}",
                extra=("environments",) if self.environment_factory is not None else (),
            )  # fmt: skip

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

        # config.yaml records the engine that runs, whatever was asked; async: the worker builds its own engine
        cfg.rollout_engine, self.engine_reason = engine_choice(cfg, acc, self.policy.model)
        if acc.is_main_process:
            cfg.save(self.output_dir / "config.yaml")
        self.engine = build_engine(  # the trainer's engine: it samples (sync) and evaluates
            "hf" if cfg.async_generation else cfg.rollout_engine,
            acc.unwrap_model(self.model),
            self.tokenizer,
            generation_batch_size=cfg.generation_batch_size,
            max_prompt_length=cfg.max_prompt_length,
            vllm_options=trainer_vllm_options(cfg, acc, self.output_dir),
            share_prefix=cfg.packing,
        )
        self.engine = multi_turn_engine(
            self.engine, cfg, self.tokenizer, self.prompt_style,
            tools=self.tools, environment_factory=self.environment_factory,
        )  # fmt: skip
        self.rollouts: RolloutSource | None = None  # stages 0-2: here or in a rollout worker, in train()
        self.producer = Producer(
            cfg, self.engine, self.tokenizer, self.train_rows, score=self._score, accelerator=acc
        )
        self.prompts = self.producer.prompts
        names = reward_names(reward_funcs)
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

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        cfg, acc = self.config, self.accelerator
        state, in_flight = self._resume_or_start()
        self.engine.sync_weights(acc.unwrap_model(self.model))  # the resumed weights, for vLLM
        if self.auto and state.step == 0:
            self.auto_log.append({"kind": "decision", **self.auto.first_decision().to_dict()})
        stop = StopRequests(reduce_max=(lambda v: int(synced_max(acc, v))) if acc.num_processes > 1 else None)
        progress = TrainingProgress(cfg.progress and acc.is_main_process, cfg.max_steps, cfg.max_time)
        # a failure of the rollout side ends the run with a checkpoint of the last completed step
        checkpointing = self._checkpoint_on_rollout_failure(state)
        with (
            stop,
            progress,
            trackers_closed(acc, bool(cfg.report_to)),
            checkpointing,
            self._rollout_source(state, in_flight) as rollouts,
        ):
            progress.message(f"rollout engine: {cfg.rollout_engine} ({self.engine_reason})")
            if self.no_held_out:
                progress.message(self.no_held_out)
            if self.batches_sampled_again:
                progress.message(
                    f"{self.batches_sampled_again} batch(es) in flight in the checkpoint were sampled more than "
                    f"max_staleness = {cfg.max_staleness} steps before they would train: sampled again"
                )
            if cfg.eval_at_start and state.step == 0 and state.last_eval_seconds is None:
                self._evaluate(state, progress)
            while not self._finished(state) and not stop.agreed():
                timer = StepTimer()
                batch = rollouts.batch(state, self._num_generations(), timer, stop.agreed)  # 0-2
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
                self._evaluate(state, progress, final=True)
            checkpoint = self._save(state) if cfg.save_final or stopped else None
        if stopped:
            raise TrainingStopped(stop.agreed_signal, state.step, checkpoint, self.output_dir)
        evals = read_jsonl(self.eval_log.path) if self.eval_log.path.is_file() else []
        return TrainResult(self.output_dir, state.step, state.train_seconds, evals, checkpoint)

    def _consume(self, state: TrainerState, batch: ProducedBatch, timer: StepTimer) -> dict[str, Any]:
        """Stages 3-5 on this step's batch: m of n per group, their advantages, the update; then a colocated
        vLLM engine gets the new weights (a rollout worker gets them when the next step starts). Returns the
        step's metrics."""
        sampled = batch.sampled
        cfg, acc = self.config, self.accelerator
        with timer("select"):  # 3. m of n per group, and 4. advantages over the kept
            self._unless_the_filter_came_up_short(state, sampled)
            generator = torch.Generator().manual_seed(cfg.seed * 7_919 + state.step * 64 + acc.process_index)
            groups, chosen = select_kept(cfg, acc, sampled, cfg.num_generations_kept, generator)
            kept_rollouts = groups.rollouts.select(chosen.rows)
            trained = chosen.trained & groups.trained.unsqueeze(1)
        with timer("update"):  # 5. the GRPO update on the kept rows only
            update = self._update(state, kept_rollouts, chosen.advantages.flatten(), trained.flatten())
        batch.state_after.into(state)
        state.step += 1
        self.rollouts.weights_updated(self.accelerator.unwrap_model(self.model), timer)
        state.train_seconds += synced_max(self.accelerator, timer.total)  # the slowest process sets the clock
        everything = sampled.all  # metrics describe every group generated, over the refill rounds
        kept_rewards = chosen.rewards.masked_fill(~trained, float("nan"))
        metrics = step_metrics(acc, state, timer, everything.rollouts, everything.rewards, kept_rewards,
                               everything.per_function, update, trained_groups=groups.trained,
                               epoch=self.prompts.epoch(state.prompts_drawn),
                               learning_rate=self.scheduler.get_last_lr()[0],
                               accuracy_name=self.accuracy_name)  # fmt: skip
        metrics.update(stage_metrics(cfg, acc, sampled, groups, chosen, trained), **batch.skip_metrics)
        if self.config.async_generation:
            metrics.update(async_metrics(batch))
            metrics["pods/async/batches_sampled_again"] = self.batches_sampled_again  # once, after a resume
            self.batches_sampled_again = 0
        if self.auto:  # num_generations: auto observes the step's successes and timings
            rows = observe_for_auto(self.auto, acc, state.step, batch, timer, self.accuracy_name)
            for row in rows:
                self.auto_log.append(row)
        return metrics

    @contextlib.contextmanager
    def _rollout_source(self, state: TrainerState, in_flight: list[ProducedBatch]):
        """Where stages 0-2 run for the loop's duration: this process, or with ``async_generation`` a rollout
        worker on its own cores (stopped however the loop ends)."""
        cfg, acc = self.config, self.accelerator
        if cfg.async_generation:  # started (ready) or closed again when this raises
            self.rollouts = start_worker_rollouts(
                cfg,
                acc,
                acc.unwrap_model(self.model),
                self.reward_funcs,
                self.train_rows,
                state,
                in_flight,
                device=self.worker_device,
                weight_sync_backend=self.weight_sync_backend,
                num_generations=self._num_generations(),
                output_dir=self.output_dir,
                tools=self.api_tools,
                prompt_style=self.prompt_style,
            )
        else:
            self.rollouts = LocalRollouts(
                self.producer, self.engine, cfg.seed, acc.process_index, cfg.prompts_per_step
            )
        try:
            yield self.rollouts
        finally:
            self.rollouts.close()
            self.rollouts = None

    @contextlib.contextmanager
    def _checkpoint_on_rollout_failure(self, state: TrainerState):
        """A failure of the rollout side (a dead or failing rollout worker, a lost vLLM server) ends the run with
        its error and a checkpoint of the last completed step, saved once the rollout side is closed (its batches
        in flight are sampled again on resume)."""
        try:
            yield
        except Exception as error:
            if not from_rollout_side(error):
                raise
            checkpoint = self._save(state)
            raise type(error)(
                f"{error}. The last completed step ({state.step}) is saved in {checkpoint}: resume with "
                "resume_from: auto"
            ) from None

    # ------------------------------------------------------------------ step pieces
    def _unless_the_filter_came_up_short(self, state: TrainerState, sampled: SampledGroups) -> None:
        """``prompt_filter_exhausted: error``: a step short of groups that pass ends the run, after a checkpoint of
        the last completed step on every process."""
        cfg, acc = self.config, self.accelerator
        if (
            cfg.prompt_filter != "none"
            and cfg.prompt_filter_exhausted == "error"
            and synced_any(acc, sampled.num_passed < cfg.prompts_per_step)
        ):
            checkpoint = self._save(state)
            raise PromptFilterExhausted(
                f"{exhausted_message(sampled.num_passed, cfg.prompts_per_step)}. The last completed step "
                f"({state.step}) is saved in {checkpoint}: resume with resume_from: auto"
            )

    def _score(
        self, batch: list[dict[str, Any]], rollouts: Rollouts, environments: list[Any] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """2. The rewards of a round (:func:`pods.producer.score_batch`; a hook for subclasses)."""
        return score_batch(self.reward_funcs, self.config, batch, rollouts, environments)

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
    # ------------------------------------------------------------------ evaluation
    def _evaluate(
        self, state: TrainerState, progress: TrainingProgress, final: bool = False
    ) -> EvalResult | None:
        cfg = self.config
        if self.eval_dataset is None or len(self.eval_dataset) == 0:
            return None
        if final:
            fault_point("trainer_final_evaluation", kill=getattr(self.rollouts, "kill", None))
        model = self.accelerator.unwrap_model(self.model)
        result = evaluate_with_config(cfg, model, self.tokenizer, self.eval_dataset, self.accuracy_fn, self.prompt_style,
                                      accelerator=self.accelerator, engine=self.engine)  # fmt: skip
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
        kill = getattr(self.rollouts, "kill", None)

        def export(folder: Path) -> None:
            fault_point("trainer_checkpointing", kill=kill)
            self._export(folder, weights)

        folder = save_checkpoint(
            self.accelerator,
            self.checkpoint_root,
            state,
            self.config.save_total_limit,
            export=export,
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

    def _load_rows(
        self, dataset: Any, task: str, source: str | None, split: str, limit: int | None
    ) -> list[dict]:
        if dataset is None and self.config.dataset_name is not None:
            split = self.config.dataset_train_split
            dataset = dataset_rows(self.config, split, tokenizer=self.tokenizer, limit=limit)
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
                system_prompt=self.config.system_prompt,
            )
        return [dataset[i] for i in range(len(dataset))]

    def _load_eval_dataset(self) -> Any:
        cfg = self.config
        if not cfg.eval_at_start and cfg.eval_every_seconds is None and not cfg.eval_at_seconds:
            return None
        if cfg.dataset_name is not None:
            self.no_held_out = no_held_out_evaluation(cfg)  # a single file: trained on, nothing held out
            if self.no_held_out:
                return None
            return dataset_rows(cfg, cfg.dataset_test_split, tokenizer=self.tokenizer, limit=cfg.eval_limit)
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
            system_prompt=cfg.system_prompt,
        )


def train(config: TrainConfig, **kwargs: Any) -> TrainResult:
    """Build a :class:`PODSTrainer` from ``config`` and run it (raises :class:`TrainingStopped` on SIGTERM/SIGINT)."""
    return PODSTrainer(config, **kwargs).train()
