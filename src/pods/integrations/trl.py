"""PODS for TRL users: ``PODSConfig`` / ``PODSTrainer``, drop-in replacements for TRL's GRPO classes.

``PODSTrainer`` wraps, and does not copy, ``GRPOTrainer._generate_and_score_completions``: TRL generates
n completions per prompt (``num_generations``) and scores them as usual; then, per prompt, we select m of
the n (``num_generations_kept``) with a rule of :mod:`pods.selection`, recompute the group-relative
advantages over the kept rows with :mod:`pods.advantages`, keep only those rows of every per-row entry
TRL returned, and recount the loss tokens. TRL's loss, optimizer step, logging and evaluation run
unchanged (evaluation is not down-sampled). Tested against TRL 1.16 (``pip install 'pods[trl]'``).

    from pods.integrations.trl import PODSConfig, PODSTrainer

    args = PODSConfig(output_dir="out", num_generations=64, num_generations_kept=16,
                      per_device_train_batch_size=64, gradient_accumulation_steps=4)
    PODSTrainer(model="Qwen/Qwen2.5-3B-Instruct", reward_funcs=[...], args=args,
                train_dataset=dataset).train()
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid, use_adapter
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pods.integrations.trl needs TRL; install it with: pip install 'pods[trl]'") from error

from pods.advantages import downsample
from pods.metrics import reward_metrics
from pods.selection import available_rules

__all__ = [
    "TESTED_TRL_VERSION",
    "PODSConfig",
    "PODSTrainer",
    "advantage_scale",
    "check_batch_arithmetic",
    "summed_rewards",
    "take_rows",
]

TESTED_TRL_VERSION = "1.16"
if not trl.__version__.startswith(TESTED_TRL_VERSION + "."):
    warnings.warn(
        f"pods.integrations.trl is tested with TRL {TESTED_TRL_VERSION}.x, but TRL {trl.__version__} is "
        f"installed; it wraps TRL internals that change between releases. "
        f"Install the tested version with: pip install 'pods[trl]'",
        stacklevel=2,
    )


# ---------------------------------------------------------------------------------------------------------
# Pure helpers (no trainer needed; unit-testable)
# ---------------------------------------------------------------------------------------------------------


def check_batch_arithmetic(
    per_device_train_batch_size: int,
    steps_per_generation: int,
    num_generations: int,
    num_generations_kept: int,
    num_processes: int = 1,
) -> int:
    """Completions each process keeps per generation; a ``ValueError`` explaining the fix in n and m if
    a prompt's group would straddle processes or the kept rows would not split evenly into TRL's chunks."""
    n, m, steps = num_generations, num_generations_kept, steps_per_generation
    generated = per_device_train_batch_size * steps
    if generated % n:
        raise ValueError(
            f"PODS selects m={m} of the n={n} completions of each prompt, so all n must be generated on the "
            f"same process. Each process generates per_device_train_batch_size x steps_per_generation = "
            f"{per_device_train_batch_size} x {steps} = {generated} completions per generation, which is not a "
            f"multiple of n={n} (num_generations), so TRL would spread a prompt's group over {num_processes} "
            f"processes. Fix: make per_device_train_batch_size x steps_per_generation a multiple of n, e.g. "
            f"per_device_train_batch_size={n}."
        )
    prompts = generated // n
    kept = prompts * m
    if kept % steps:
        raise ValueError(
            f"After selection each process keeps (per_device_train_batch_size x steps_per_generation / n) x m = "
            f"({per_device_train_batch_size} x {steps} / {n}) x {m} = {prompts} prompts x {m} = {kept} "
            f"completions, and TRL splits them into steps_per_generation={steps} equal micro-batches (one per "
            f"gradient-accumulation step). {kept} is not a multiple of {steps}, so TRL would silently drop "
            f"{kept % steps} kept completions at every generation. Fix: choose the prompts per process "
            f"({prompts}) so that prompts x m is a multiple of {steps}, e.g. per_device_train_batch_size={n} "
            f"(one prompt per micro-batch; each micro-batch then trains on m={m} completions)."
        )
    return kept


def advantage_scale(scale_rewards: str | bool) -> str:
    """Map TRL's ``scale_rewards`` ("group"/"batch"/"none", or the older booleans) to our ``scale``."""
    scale = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # type: ignore[arg-type]
    if scale not in ("group", "batch", "none"):
        raise ValueError(
            f"scale_rewards must be 'group', 'batch', 'none' (or True/False), got {scale_rewards!r}."
        )
    return scale


def summed_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One scalar reward per completion: the weighted sum over reward functions, as TRL computes it (a
    ``None`` from one function counts as 0; a completion every function scored ``None`` is NaN, TRL's rule)."""
    summed = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    return summed.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def take_rows(batch: dict[str, Any], rows: torch.Tensor, num_rows: int) -> dict[str, Any]:
    """Keep ``rows`` of every per-row entry of TRL's batch dict (tensors and lists with ``num_rows``
    entries; per-image tensors are split per row with TRL's own helpers first). Scalars and ``None`` pass
    through; anything else raises, so that a new TRL field is never silently misaligned."""
    batch = split_pixel_values_by_grid(batch)
    index = rows.tolist()
    kept: dict[str, Any] = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            kept[key] = value
        elif isinstance(value, torch.Tensor) and value.shape[0] == num_rows:
            kept[key] = value.index_select(0, rows.to(value.device))
        elif isinstance(value, list | tuple) and len(value) == num_rows:
            kept[key] = [value[i] for i in index]
        else:
            size = tuple(value.shape) if isinstance(value, torch.Tensor) else len(value)
            raise ValueError(
                f"cannot down-sample TRL's batch entry {key!r} (size {size}): it is not one entry per completion "
                f"({num_rows}). This TRL version or feature is not supported by PODSTrainer; please report it."
            )
    return unsplit_pixel_values_by_grid(kept)


# ---------------------------------------------------------------------------------------------------------
# Config and trainer
# ---------------------------------------------------------------------------------------------------------


@dataclass
class PODSConfig(GRPOConfig):
    """TRL's ``GRPOConfig`` plus PODS's two knobs. ``num_generations`` keeps TRL's meaning (n completions
    generated per prompt); ``num_generations_kept`` (m) of them are trained on, chosen by ``selection_rule``."""

    num_generations_kept: int | None = field(
        default=None,
        metadata={
            "help": "m: completions kept per prompt for the policy update, out of num_generations (n). "
            "None keeps all n (plain GRPO)."
        },
    )
    selection_rule: str = field(
        default="max_variance",
        metadata={
            "help": "Rule choosing the m kept completions of each prompt: any name registered in "
            "pods.selection (max_variance, max_reward, random, all, or your own)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        n, m = self.num_generations, self.num_generations_kept
        if m is not None and (isinstance(m, bool) or not isinstance(m, int)):
            raise ValueError(
                f"num_generations_kept (m) must be an int or None, got {type(m).__name__} {m!r}."
            )
        if m is not None and not 2 <= m <= n:
            raise ValueError(
                f"num_generations_kept (m) must be between 2 and num_generations (n={n}), got {m}: advantages "
                "are relative to the other kept completions of the same prompt, so m=1 gives no signal."
            )
        if self.selection_rule not in available_rules():
            raise ValueError(
                f"unknown selection_rule {self.selection_rule!r}; known rules: {', '.join(available_rules())}. "
                "Register your own with pods.selection.register_rule(name, fn) before creating the config."
            )
        if self.selection_rule == "all" and self.kept_per_prompt != n:
            raise ValueError(
                f"selection_rule='all' keeps every completion, so num_generations_kept must be None or "
                f"n={n}; got m={m}."
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"PODS ranks completions by their weighted summed reward, so it needs "
                f"multi_objective_aggregation='sum_then_normalize' (TRL's default); got "
                f"{self.multi_objective_aggregation!r}."
            )
        advantage_scale(self.scale_rewards)
        check_batch_arithmetic(
            self.per_device_train_batch_size,
            self.steps_per_generation,
            n,
            self.kept_per_prompt,
            self.world_size,
        )

    @property
    def kept_per_prompt(self) -> int:
        """m, resolved: ``num_generations_kept``, or ``num_generations`` when it is None."""
        return self.num_generations if self.num_generations_kept is None else self.num_generations_kept


class PODSTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` that trains on m of every n completions per prompt (PODS down-sampling).

    Same constructor as ``GRPOTrainer``; ``args`` must be a :class:`PODSConfig`. Logs ``pods/*`` metrics
    beside TRL's own (docs/metrics.md). Evaluation is TRL's, unchanged.
    """

    def __init__(
        self, model: Any, reward_funcs: Any = None, args: PODSConfig | None = None, *rest: Any, **kwargs: Any
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = PODSConfig(f"{str(name).rstrip('/').split('/')[-1]}-PODS")
        if not isinstance(args, PODSConfig):
            raise ValueError(
                f"PODSTrainer needs args=PODSConfig(...), got {type(args).__name__}. PODSConfig takes every "
                "GRPOConfig field plus num_generations_kept and selection_rule."
            )
        self._pods_defer_logps = False
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.num_generations_kept = args.kept_per_prompt
        check_batch_arithmetic(
            args.per_device_train_batch_size,
            args.steps_per_generation,
            self.num_generations,
            self.num_generations_kept,
            self.accelerator.num_processes,
        )
        self._pods_rewards_per_func: torch.Tensor | None = None

    def _selection_generator(self) -> torch.Generator:
        """The random rule's draws, a pure function of (seed, step): the same on every process (each selects
        over the gathered batch and must agree with the others) and the same after a resume."""
        return torch.Generator().manual_seed(self.args.seed * 7_919 + self.state.global_step)

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        """TRL's log-probs; skipped (None) while TRL generates and scores a training batch that PODS will
        down-sample: the old and reference log-probs are then computed on the kept rows only."""
        if self._pods_defer_logps:
            return None, None, None
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[override]
        """TRL's reward computation, unchanged; keeps its gathered ``[all rows, functions]`` result for selection."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._pods_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:  # type: ignore[override]
        """TRL's generation and scoring, then (in training) keep m of each group of n and redo the advantages."""
        self._pods_rewards_per_func = None
        # TRL computes old and reference log-probs for all n rows before rewards exist; PODS needs them for
        # the kept m only (text prompts; vLLM's importance-sampling correction needs them for all n).
        n, m = self.num_generations, self.num_generations_kept
        defer = self._defer_logps(inputs)
        self._pods_defer_logps = defer
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self._pods_defer_logps = False
        rewards_per_func, self._pods_rewards_per_func = self._pods_rewards_per_func, None
        if not self.model.training:
            return batch
        if rewards_per_func is None:
            raise RuntimeError(
                "TRL's _generate_and_score_completions did not call _calculate_rewards; this TRL version is not "
                f"supported by PODSTrainer (tested with {TESTED_TRL_VERSION}.x)."
            )

        summed = summed_rewards(rewards_per_func, self.reward_weights)  # [all rows], every process's rows
        local_rows = batch["prompt_ids"].shape[0]
        groups = local_rows // n
        if local_rows % n or summed.shape[0] != local_rows * self.accelerator.num_processes:
            raise RuntimeError(
                f"this process holds {local_rows} completions ({summed.shape[0]} on all processes), not whole "
                f"groups of n={n}: groups are not process-local (see check_batch_arithmetic)."
            )
        rewards = summed.view(-1, n)  # [all groups, n]

        chosen = downsample(
            rewards,
            m,
            self.args.selection_rule,
            scale=advantage_scale(self.scale_rewards),
            generator=self._selection_generator(),
        )  # over every process's groups: [all groups, m]
        kept, kept_rewards, advantages = chosen.kept, chosen.rewards, chosen.advantages

        mine = slice(self.accelerator.process_index * groups, (self.accelerator.process_index + 1) * groups)
        trl_advantages = batch["advantages"]
        batch = take_rows(batch, chosen.rows.view(-1, m)[mine].reshape(-1) - mine.start * n, local_rows)
        if m < n:
            batch["advantages"] = advantages[mine].reshape(-1).to(trl_advantages)
            # The completions table (log_completions) lists all n: show the advantage trained on, NaN if dropped.
            logged = torch.full_like(rewards, float("nan")).scatter_(1, kept, advantages.to(rewards.dtype))
            self._logs["advantages"].clear()
            self._logs["advantages"].extend(logged.reshape(-1).tolist())
        if defer:
            self._kept_row_logps(batch)
        # With m == n every row is kept and TRL's advantages are already those of the kept set (same formula;
        # TRL computes them in float32 where we use float64): keep TRL's bits so that m == n is exactly GRPO.
        loss_mask = batch["completion_mask"]
        if batch.get("tool_mask") is not None:
            loss_mask = loss_mask * batch["tool_mask"]
        batch["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()

        for name, value in reward_metrics(rewards, kept_rewards).items():
            if name.startswith(
                "pods/"
            ):  # TRL logs reward, reward_std and frac_reward_zero_std (over all n) itself
                self._metrics["train"][name].append(value)
        return batch

    def _defer_logps(self, inputs: list[dict[str, Any]]) -> bool:
        """Whether this batch's old/reference log-probs wait for the selection (training, m < n, text only)."""
        return (
            self.model.training
            and self.num_generations_kept < self.num_generations
            and "image" not in inputs[0]
            and "images" not in inputs[0]
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        )

    def _kept_row_logps(self, batch: dict[str, Any]) -> None:
        """Old (when TRL would use them) and reference (``beta != 0``) log-probs of the kept rows, as TRL
        computes them for all rows."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        need_old = self.args.gradient_accumulation_steps % generate_every != 0
        if not need_old and self.beta == 0.0:
            return
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        width, size = batch["completion_ids"].size(1), self.args.per_device_train_batch_size
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            if need_old:
                batch["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, width, batch_size=size
                )[0]
            if self.beta != 0.0 and self.ref_model is not None:
                batch["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.ref_model, ids, mask, width, batch_size=size
                )[0]
            elif self.beta != 0.0:  # LoRA: the base with the adapter disabled (or TRL's "ref" adapter)
                model = self.accelerator.unwrap_model(self.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    batch["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                        self.model, ids, mask, width, batch_size=size
                    )[0]
