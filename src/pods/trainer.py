"""The PODS trainer. One step, per prompt (a group), reads top to bottom in :meth:`PODSTrainer.train`:

1. generate n completions with the current policy;
2. score them with the reward functions (summed into one reward each);
3. select m of the n with a down-sampling rule (per group, never across groups);
4. compute group-relative advantages over the m kept;
5. compute the GRPO loss on the m kept only and take an optimizer step.

GRPO is the special case m = n. ``accelerate`` supplies devices, DDP / DeepSpeed / FSDP, mixed precision,
trackers and state saving: each process generates and selects for its own prompts, so a group never
spans processes, and gradients are synchronised as usual.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from pods.advantages import downsample, nanstd
from pods.auto_generations import AutoGenerations
from pods.checkpoint import (
    STATE_FILE,
    TrainerState,
    checkpoint_problem,
    latest_checkpoint,
    list_checkpoint_folders,
    load_checkpoint,
    newest_intact_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
)
from pods.config import ConfigError, TrainConfig
from pods.evaluation import EvalResult, evaluate
from pods.interrupts import StopRequests, TrainingStopped
from pods.loss import completion_logprobs, mean_abs_difference, policy_loss, truncated_importance_weights
from pods.metrics import JsonlLog, read_jsonl, reward_metrics
from pods.models import Policy, load_policy, load_reference
from pods.progress import TrainingProgress
from pods.rollout import Rollouts, SamplingParams, build_engine, choose_engine
from pods.scoring import RewardFunction, reward_name, score_completions


class NonFiniteError(RuntimeError):
    """``max_consecutive_skips`` optimizer steps in a row had a non-finite loss or gradient norm."""


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


class PromptStream:
    """The prompts of each step, as a pure function of the step: exact resume needs no data state.

    Epoch e visits the rows in a permutation seeded by (seed, e); process r of W takes its own
    ``prompts_per_step`` consecutive prompts of the step's global slice.
    """

    def __init__(self, rows: list[dict[str, Any]], prompts_per_step: int, seed: int, rank: int, world: int):
        if not rows:
            raise ConfigError(
                "the training set is empty (check task, task_source, train_limit, max_prompt_length)"
            )
        self.rows, self.per_step, self.seed, self.rank, self.world = rows, prompts_per_step, seed, rank, world
        self._orders: dict[int, list[int]] = {}

    def batch(self, step: int) -> list[dict[str, Any]]:
        first = (step * self.world + self.rank) * self.per_step
        return [self.rows[self._index(position)] for position in range(first, first + self.per_step)]

    def epoch(self, step: int) -> float:
        return step * self.world * self.per_step / len(self.rows)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator).tolist()}
        return self._orders[epoch][offset]


class StepTimer:
    """Seconds spent in each phase of a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


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
            cfg.check_names()
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
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.output_dir / "config.yaml")
        acc.wait_for_everyone()
        self.checkpoint_root = self.output_dir / "checkpoints"
        self._saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint written or loaded
        self.metrics_log = JsonlLog(self.output_dir / "metrics.jsonl", enabled=acc.is_main_process)
        self.eval_log = JsonlLog(self.output_dir / "eval.jsonl", enabled=acc.is_main_process)
        self.auto = None  # num_generations: auto chooses n as it runs (pods.auto_generations)
        if cfg.num_generations == "auto":
            low, high = cfg.generation_bounds
            self.auto = AutoGenerations(
                cfg.num_generations_kept, low, high, cfg.selection_rule, cfg.num_generations_every
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
        optimizer = self._make_optimizer(trainable)
        self.scheduler = self._make_scheduler(optimizer)
        deepspeed_batch_settings(acc, cfg.micro_batch_size, micro_batches, cfg.max_grad_norm)
        self.model, self.optimizer = acc.prepare(self.policy.model, optimizer)
        self.reference = None
        if cfg.beta > 0 and not self.policy.is_lora:
            self.reference = load_reference(cfg).to(acc.device)

        try:  # config.yaml records the engine that runs, whatever was asked
            cfg.rollout_engine, self.engine_reason = choose_engine(
                cfg.rollout_engine, model=self.policy.model, load_in_4bit=cfg.load_in_4bit
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if acc.is_main_process:
            cfg.save(self.output_dir / "config.yaml")
        self.engine = build_engine(
            cfg.rollout_engine,
            acc.unwrap_model(self.model),
            self.tokenizer,
            generation_batch_size=cfg.generation_batch_size,
            max_prompt_length=cfg.max_prompt_length,
            vllm_options={
                "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
                "max_model_length": cfg.vllm_max_model_length
                or (cfg.max_prompt_length and cfg.max_prompt_length + cfg.max_completion_length),
                "tensor_parallel_size": cfg.vllm_tensor_parallel_size,
                "enable_sleep_mode": cfg.vllm_enable_sleep_mode,
                "kv_cache_gb": cfg.vllm_cpu_kv_cache_gb,
                "seed": cfg.seed + acc.process_index,
            },
        )
        self.sampling = SamplingParams(
            max_new_tokens=cfg.max_completion_length,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_strings=tuple(cfg.stop_strings),
        )
        self.prompts = PromptStream(
            self.train_rows, cfg.prompts_per_step, cfg.seed, acc.process_index, acc.num_processes
        )
        if cfg.report_to:
            acc.init_trackers("pods", config={k: str(v) for k, v in cfg.to_dict().items()})

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        cfg, acc = self.config, self.accelerator
        m = cfg.num_generations_kept
        state = self._resume_or_start()
        self.engine.sync_weights(acc.unwrap_model(self.model))  # the resumed weights, for vLLM
        if self.auto and state.step == 0:
            self.auto_log.append({"kind": "decision", **self.auto.first_decision().to_dict()})
        stop = StopRequests(reduce_max=self._synced_max if acc.num_processes > 1 else None)
        progress = TrainingProgress(cfg.progress and acc.is_main_process, cfg.max_steps, cfg.max_time)
        with stop, progress, self._trackers():
            progress.message(f"rollout engine: {cfg.rollout_engine} ({self.engine_reason})")
            if cfg.eval_at_start and state.step == 0 and state.last_eval_seconds is None:
                self._evaluate(state, progress)
            while not self._finished(state) and not stop.agreed():
                timer = StepTimer()
                self._seed_step(state.step)
                batch = self.prompts.batch(state.step)
                n = self.auto.current if self.auto else cfg.num_generations

                with timer("generate"):  # 1. n completions per prompt
                    rollouts = self.engine.generate(self._render(batch), n, self.sampling)
                with timer("score"):  # 2. one scalar reward per completion: [P, n]
                    rewards, per_function = self._score(batch, rollouts)
                with timer("select"):  # 3. m of n per group, and 4. advantages over the kept
                    chosen = downsample(
                        rewards,
                        m,
                        cfg.selection_rule,
                        scale=cfg.scale_rewards,
                        eps=cfg.advantage_eps,
                        generator=self._selection_generator(state.step),
                        gather=self._gather,
                    )
                    kept_rollouts = rollouts.select(chosen.rows)
                with timer("update"):  # 5. the GRPO update on the kept rows only
                    update = self._update(state, kept_rollouts, chosen.advantages.flatten())
                with timer("sync"):  # the engine samples the next step from the new weights (no-op for hf)
                    self.engine.sync_weights(acc.unwrap_model(self.model))

                state.step += 1
                state.train_seconds += self._synced(timer.total)
                metrics = self._step_metrics(
                    state, timer, rollouts, rewards, chosen.rewards, per_function, update
                )
                self.metrics_log.append(metrics)
                if self.auto:
                    self._auto_step(state, rewards, per_function, timer)
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
                and (cfg.eval_at_start or cfg.eval_every_seconds)
            ):
                self._evaluate(state, progress)
            checkpoint = self._save(state) if cfg.save_final or stopped else None
        if stopped:
            raise TrainingStopped(stop.agreed_signal, state.step, checkpoint, self.output_dir)
        evals = read_jsonl(self.eval_log.path) if self.eval_log.path.is_file() else []
        return TrainResult(self.output_dir, state.step, state.train_seconds, evals, checkpoint)

    @contextlib.contextmanager
    def _trackers(self):
        """Flush and close the trackers (TensorBoard, W&B, ...) however the loop ends: done, stopped or failed."""
        try:
            yield
        finally:
            if self.config.report_to:
                self.accelerator.end_training()

    # ------------------------------------------------------------------ step pieces
    def _render(self, batch: list[dict[str, Any]]) -> list[str]:
        from pods.prompts import render_prompt

        return [render_prompt(row["prompt"], self.tokenizer) for row in batch]

    def _score(
        self, batch: list[dict[str, Any]], rollouts: Rollouts
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n = rollouts.num_generations
        columns = {key: [row[key] for row in batch for _ in range(n)] for key in batch[0] if key != "prompt"}
        prompts = [row["prompt"] for row in batch for _ in range(n)]
        completion_ids = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(rollouts.completion_ids, rollouts.completion_mask, strict=True)
        ]
        total, per_function = score_completions(
            self.reward_funcs,
            self.config.reward_weights,
            prompts,
            rollouts.texts,
            completion_ids,
            columns,
            timeout=self.config.reward_timeout,
        )
        shape = (len(batch), n)
        return total.view(shape), {name: values.view(shape) for name, values in per_function.items()}

    def _update(self, state: TrainerState, batch: Rollouts, advantages: torch.Tensor) -> dict[str, float]:
        """Gradient steps on the kept rows: micro-batches accumulated, ``num_iterations`` passes."""
        cfg, acc, model = self.config, self.accelerator, self.model
        device = acc.device
        prompt_ids, prompt_mask = batch.prompt_ids.to(device), batch.prompt_mask.to(device)
        completion_ids, mask = batch.completion_ids.to(device), batch.completion_mask.to(device)
        advantages = advantages.to(device=device, dtype=torch.float32)
        rows, micro = completion_ids.shape[0], cfg.micro_batch_size
        temperature = cfg.temperature if cfg.temperature > 0 else 1.0
        # dapo divides by the tokens of the whole batch across processes; DDP averages gradients.
        total_tokens = self._synced_sum(mask.sum().double()) / acc.num_processes

        def logprobs_of(net: torch.nn.Module, part: slice) -> torch.Tensor:
            return completion_logprobs(
                net,
                prompt_ids[part],
                prompt_mask[part],
                completion_ids[part],
                mask[part],
                temperature=temperature,
            )

        parts = [slice(start, start + micro) for start in range(0, rows, micro)]
        sampling_logprobs = batch.sampling_logprobs
        correct = cfg.vllm_importance_sampling_correction and sampling_logprobs is not None
        # Old and reference log-probs: always in evaluation mode (no dropout), at every step. The first pass
        # is on-policy (ratio exactly 1, as with num_iterations = 1); later passes use the old log-probs.
        old_logprobs = ref_logprobs = None
        model.eval()
        if cfg.num_iterations > 1:
            with torch.no_grad():
                old_logprobs = torch.cat([logprobs_of(model, part) for part in parts])
        if cfg.beta > 0:
            # Under the policy's mixed precision: accelerate autocasts the prepared policy, not this copy.
            with torch.no_grad(), acc.autocast(), self._reference() as reference:
                ref_logprobs = torch.cat([logprobs_of(reference, part) for part in parts])

        model.train()
        statistics = {
            "kl": "kl",
            "clip_ratio/low_mean": "clip_low_fraction",
            "clip_ratio/high_mean": "clip_high_fraction",
            "clip_ratio/region_mean": "clip_fraction",
        }
        loss = 0.0
        # Token-weighted sums of the statistics, and the token count: averages over tokens (all micro-batches,
        # passes and processes), so they do not depend on micro_batch_size.
        sums = torch.zeros(len(statistics) + 1, dtype=torch.float64)
        grad_norms, finite, mismatch = [], True, []
        sampler_weights: dict[int, torch.Tensor] = {}  # per micro-batch, from the first pass
        for iteration in range(cfg.num_iterations):
            for part in parts:
                # accelerate syncs gradients (DDP / DeepSpeed / FSDP) and lets the optimizer step only on
                # the last micro-batch of each pass; it divides the loss by the number of micro-batches,
                # which our loss already accounts for (each part is its share of the batch loss).
                with acc.accumulate(model):
                    logprobs = logprobs_of(model, part)
                    if sampling_logprobs is not None and part.start not in sampler_weights:
                        # first pass: the trainer's log-probs before this update against the sampler's
                        before = logprobs if old_logprobs is None else old_logprobs[part]
                        sampler_weights[part.start] = truncated_importance_weights(
                            before, sampling_logprobs[part], mask[part], cfg.vllm_importance_sampling_cap
                        )
                        mismatch.append(mean_abs_difference(before, sampling_logprobs[part], mask[part]))
                    out = policy_loss(
                        logprobs,
                        advantages[part],
                        mask[part],
                        old_logprobs=None if iteration == 0 else old_logprobs[part],
                        ref_logprobs=None if ref_logprobs is None else ref_logprobs[part],
                        importance_weights=sampler_weights.get(part.start) if correct else None,
                        epsilon=cfg.epsilon,
                        epsilon_high=cfg.epsilon_high,
                        beta=cfg.beta,
                        loss_type=cfg.loss_type,
                        total_sequences=rows,
                        total_tokens=float(total_tokens),
                        max_completion_length=cfg.max_completion_length,
                    )
                    acc.backward(out.loss * acc.gradient_accumulation_steps)
                    finite = finite and math.isfinite(out.loss.item())
                    if acc.sync_gradients:
                        grad_norm = float(acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                        grad_norms.append(grad_norm)
                        # fp16: the GradScaler skips overflowing steps itself and lowers its scale.
                        usable = acc.scaler is not None or self._step_is_finite(
                            state, finite and math.isfinite(grad_norm)
                        )
                        if usable:
                            self.optimizer.step()
                            self.scheduler.step()
                        finite = True
                    self.optimizer.zero_grad(set_to_none=True)  # accelerate clears only after a sync
                loss += out.loss.item() / cfg.num_iterations
                tokens = out.num_tokens.item()
                sums += torch.tensor(
                    [getattr(out, a).item() * tokens for a in statistics.values()] + [tokens]
                )
        sums = self._synced_sum(sums.to(device)).cpu()
        means = {name: float(sums[i] / max(float(sums[-1]), 1.0)) for i, name in enumerate(statistics)}
        # TRL's names: how far the sampler's log-probs are from the trainer's, over all processes
        if mismatch:
            ratios = [
                (w.sum() / mask[slice(s, s + micro)].sum().clamp_min(1)).item()
                for s, w in sampler_weights.items()
            ]
            totals = torch.tensor(
                [sum(mismatch), len(mismatch), sum(ratios), len(ratios)], dtype=torch.float64
            )
            totals = self._synced_sum(totals.to(device)).cpu()
            means["sampling/sampling_logp_difference/mean"] = float(totals[0] / totals[1])
            means["sampling/importance_sampling_ratio/mean"] = float(totals[2] / totals[3])
        return {"loss": loss, **means, "grad_norm": sum(grad_norms) / len(grad_norms)}

    def _step_is_finite(self, state: TrainerState, finite: bool) -> bool:
        """The non-finite guard: a NaN/inf loss or gradient norm on any process skips the optimizer step
        (weights, optimizer and scheduler unchanged); ``max_consecutive_skips`` in a row end the run."""
        if self.accelerator.num_processes > 1:
            finite = not self._synced_max(int(not finite))
        if finite:
            state.consecutive_skips = 0
            return True
        state.skipped_steps += 1
        state.consecutive_skips += 1
        limit = self.config.max_consecutive_skips
        if state.consecutive_skips >= limit:
            raise NonFiniteError(
                f"{limit} optimizer steps in a row had a non-finite (NaN or infinite) loss or gradient norm, "
                f"at training step {state.step + 1}; they were skipped, so the weights are those of the last "
                f"good step and the checkpoints in {self.checkpoint_root} are intact. Lower learning_rate or "
                "max_grad_norm, or train in float32 (mixed_precision: no); max_consecutive_skips sets this limit"
            )
        return False

    @contextlib.contextmanager
    def _reference(self):
        """The KL reference: the base with the LoRA adapter disabled, or a frozen copy for full fine-tuning."""
        if self.reference is not None:
            yield self.reference
        else:
            unwrapped = self.accelerator.unwrap_model(self.model)
            with unwrapped.disable_adapter():
                yield unwrapped

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
    ) -> dict[str, Any]:
        acc = self.accelerator
        gather = lambda t: acc.gather(t.to(acc.device)).cpu()  # noqa: E731 - equal shapes on every process
        all_rewards, kept = gather(rewards), gather(kept_rewards)
        lengths = gather(rollouts.completion_mask.sum(dim=1).double())
        truncated = gather(rollouts.truncated.double())
        step_seconds = self._synced(timer.total)
        metrics: dict[str, Any] = {
            "step": state.step,
            "epoch": round(self.prompts.epoch(state.step), 4),
            "train_seconds": round(state.train_seconds, 3),
            "num_generations": rewards.shape[1],
            **reward_metrics(all_rewards, kept),
            "skipped_steps": state.skipped_steps,
        }
        for name, values in per_function.items():
            values = gather(values)
            metrics[f"rewards/{name}/mean"] = values.nanmean().item()
            metrics[f"rewards/{name}/std"] = nanstd(values.reshape(1, -1), dim=1).item()
        metrics.update(
            {
                "completions/mean_length": lengths.mean().item(),
                "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(),
                "completions/clipped_ratio": truncated.mean().item(),
                "learning_rate": self.scheduler.get_last_lr()[0],
                **{key: self._synced_mean(value) for key, value in update.items()},
            }
        )
        accuracy_name = reward_name(self.accuracy_fn)
        if accuracy_name in per_function:
            metrics["accuracy"] = (
                (gather(torch.nan_to_num(per_function[accuracy_name])) > 0.5).double().mean().item()
            )
        for phase, seconds in timer.seconds.items():
            metrics[f"seconds_{phase}"] = round(self._synced(seconds), 4)
        metrics["seconds_step"] = round(step_seconds, 4)
        metrics["tokens_per_second"] = round(lengths.sum().item() / max(step_seconds, 1e-9), 1)
        metrics["peak_memory_mb"] = round(_peak_memory_mb(), 1)
        return metrics

    def _auto_step(
        self,
        state: TrainerState,
        rewards: torch.Tensor,
        per_function: dict[str, torch.Tensor],
        timer: StepTimer,
    ) -> None:
        """``num_generations: auto``: record this step's successes per group (the accuracy reward above
        0.5, else the summed reward above 0.5) and timings, over every process; re-decide n when due."""
        scores = torch.nan_to_num(per_function.get(reward_name(self.accuracy_fn), rewards))
        successes = self._gather((scores > 0.5).sum(dim=1)).cpu().tolist()
        generate = self._synced(sum(timer.seconds.get(k, 0.0) for k in ("generate", "score", "select")))
        other = self._synced(timer.seconds.get("update", 0.0))
        self.auto_log.append(self.auto.observe(state.step, rewards.shape[1], successes, generate, other))
        decision = self.auto.decide(state.step)
        if decision is not None:
            self.auto_log.append({"kind": "decision", **decision.to_dict()})

    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's ``values`` (equal shapes), concatenated along the first dimension."""
        if self.accelerator.num_processes == 1:
            return values
        return self.accelerator.gather(values.to(self.accelerator.device)).to(values.device)

    def _synced(self, seconds: float) -> float:
        """The slowest process's value, so every process takes the same clock-based decisions."""
        if self.accelerator.num_processes == 1:
            return seconds
        value = torch.tensor(seconds, dtype=torch.float64, device=self.accelerator.device)
        return float(self.accelerator.reduce(value, "max"))

    def _synced_max(self, value: int) -> int:
        return int(self.accelerator.reduce(torch.tensor(value, device=self.accelerator.device), "max"))

    def _synced_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return value
        return self.accelerator.reduce(value.to(self.accelerator.device), "sum")

    def _synced_mean(self, value: float) -> float:
        total = self._synced_sum(torch.tensor(value, dtype=torch.float64))
        return float(total) / self.accelerator.num_processes

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
        row = {"step": state.step, "train_seconds": round(state.train_seconds, 3), **result.to_dict()}
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
        every = self.config.eval_every_seconds
        if every is None:
            return False
        return state.train_seconds - (state.last_eval_seconds or 0.0) >= every and not self._finished(state)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, state: TrainerState) -> Path:
        if self._saved is not None and self._saved[0] == state.step:
            return self._saved[1]  # already saved (or resumed from) at this step
        state.last_save_seconds = state.train_seconds
        folder = save_checkpoint(
            self.accelerator,
            self.checkpoint_root,
            state,
            self.config.save_total_limit,
            export=self._export,
            scheduler=self.scheduler,
        )
        self._saved = (state.step, folder)
        return folder

    def _export(self, folder: Path) -> None:
        """A ready-to-use copy (full model or LoRA adapter, plus tokenizer) for ``pods eval``."""
        self.accelerator.unwrap_model(self.model).save_pretrained(folder)
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

    def _resume_or_start(self) -> TrainerState:
        source = self.config.resume_from
        if self.accelerator.is_main_process:
            remove_partial_checkpoints(self.checkpoint_root)
        self.accelerator.wait_for_everyone()
        if source is None:
            if latest_checkpoint(self.checkpoint_root) is not None:
                raise ConfigError(
                    f"output_dir: {self.output_dir} already holds checkpoints; continue it with resume_from: auto, "
                    "or choose another output_dir"
                )
            self.metrics_log.reset()
            self.eval_log.reset()
            self.auto_log.reset()
            return TrainerState()
        folder = self._checkpoint_to_resume(source)
        if folder is None:  # resume_from: auto in a folder without checkpoints: a fresh start
            self.metrics_log.reset()
            self.eval_log.reset()
            return TrainerState()
        try:
            state = load_checkpoint(self.accelerator, folder, self.scheduler)
        except Exception as error:  # e.g. a pickle that weights_only=True refuses, a mismatched model
            raise ConfigError(
                f"resume_from: could not load checkpoint {folder} ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else 'no details'}); "
                "only resume checkpoints you trust, written by this run's model and settings"
            ) from error
        self._saved = (state.step, folder)
        self.metrics_log.truncate_after(state.step)
        if self.auto is not None:  # replay n's observations and decisions up to the checkpoint
            self.auto_log.truncate_after(state.step)
            self.accelerator.wait_for_everyone()
            if self.auto_log.path.is_file():
                self.auto.restore([r for r in read_jsonl(self.auto_log.path) if r["step"] <= state.step])
        self.eval_log.truncate_after(state.step)
        return state

    def _checkpoint_to_resume(self, source: str) -> Path | None:
        """The verified checkpoint to resume from, chosen on the main process and shared with the others."""
        acc = self.accelerator
        choice: tuple[str | None, str | None] = (None, None)  # (folder, error)
        if acc.is_main_process:
            try:
                folder = self._find_checkpoint(source)
                choice = (str(folder) if folder else None, None)
            except ConfigError as error:
                choice = (None, str(error))
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            choice = tuple(broadcast_object_list(list(choice)))
        if choice[1] is not None:
            raise ConfigError(choice[1])
        return Path(choice[0]) if choice[0] else None

    def _find_checkpoint(self, source: str) -> Path | None:
        path = Path(source)
        if source != "auto" and (path / STATE_FILE).is_file():
            problem = checkpoint_problem(path)
            if problem is not None:
                raise ConfigError(
                    f"resume_from: checkpoint {path} is damaged: {problem}; resume from another checkpoint "
                    f"(resume_from: auto picks the newest intact one in {path.parent.parent})"
                )
            return path
        root = self.checkpoint_root if source == "auto" else path / "checkpoints"
        found = newest_intact_checkpoint(
            root, warn=lambda text: print(f"pods: warning: {text}", file=sys.stderr)
        )
        if found is None and (source != "auto" or list_checkpoint_folders(root)):
            raise ConfigError(
                f"resume_from: no intact checkpoint in {root} (expected {root}/step-N with its {STATE_FILE} "
                "and manifest.json); choose another output_dir to start afresh"
            )
        return found

    # ------------------------------------------------------------------ set-up helpers
    def _finished(self, state: TrainerState) -> bool:
        cfg = self.config
        return (cfg.max_steps is not None and state.step >= cfg.max_steps) or (
            cfg.max_time is not None and state.train_seconds >= cfg.max_time
        )

    def _seed_step(self, step: int) -> None:
        """Reseed per step (and process): sampling after a resume matches an uninterrupted run exactly."""
        torch.manual_seed((self.config.seed * 1_000_003 + step) * 64 + self.accelerator.process_index)

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
        if not cfg.eval_at_start and cfg.eval_every_seconds is None:
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

    def _make_optimizer(self, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        cfg = self.config
        kwargs = {
            "lr": cfg.learning_rate,
            "betas": (cfg.adam_beta1, cfg.adam_beta2),
            "weight_decay": cfg.weight_decay,
        }
        if cfg.optimizer == "adamw_8bit":
            try:
                import bitsandbytes as bnb
            except ImportError:
                raise ConfigError(
                    "optimizer: adamw_8bit needs bitsandbytes (pip install bitsandbytes)"
                ) from None
            return bnb.optim.AdamW8bit(parameters, **kwargs)
        return torch.optim.AdamW(parameters, **kwargs)

    def _make_scheduler(self, optimizer: torch.optim.Optimizer):
        from transformers import get_scheduler

        cfg = self.config
        total = (cfg.max_steps or 1) * cfg.num_iterations
        warmup = math.ceil(cfg.warmup_ratio * total) if cfg.max_steps else 0
        name = "constant_with_warmup" if cfg.lr_scheduler_type == "constant" else cfg.lr_scheduler_type
        return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def deepspeed_batch_settings(
    accelerator: Any, micro_batch_size: int, micro_batches: int, max_grad_norm: float
) -> None:
    """Give DeepSpeed our batch shape and clip before ``prepare``: we prepare no DataLoader, so accelerate
    cannot fill its "auto" values, and DeepSpeed clips with its own ``gradient_clipping``, not ours."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    plugin.deepspeed_config.update(
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=micro_batches,
        gradient_clipping=max_grad_norm,
    )
    plugin.deepspeed_config.pop("train_batch_size", None)  # DeepSpeed derives it from the two above


def _peak_memory_mb() -> float:
    """Peak accelerator memory since the last call (GPU), else the process's peak resident memory (CPU)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(config: TrainConfig, **kwargs: Any) -> TrainResult:
    """Build a :class:`PODSTrainer` from ``config`` and run it (raises :class:`TrainingStopped` on SIGTERM/SIGINT)."""
    return PODSTrainer(config, **kwargs).train()
