"""PODS for TRL users: ``PODSConfig`` / ``PODSTrainer``, drop-in replacements for TRL's GRPO classes.

``PODSTrainer`` wraps, and does not copy, ``GRPOTrainer._generate_and_score_completions``: TRL generates
n completions per prompt (``num_generations``) and scores them as usual; then, per prompt, we select m of
the n (``num_generations_kept``) with a rule of :mod:`pods.selection`, recompute the group-relative
advantages over the kept rows with :mod:`pods.advantages`, keep only those rows of every per-row entry
TRL returned, and recount the loss tokens. With ``prompt_skip`` (GRESO) prompts predicted to give all-equal
rewards are swapped for others before TRL generates; with ``prompt_filter`` (DAPO's dynamic sampling) TRL's
generation runs again for more prompts until each process has its groups with a spread (bounded by
``max_num_gen_batches``). TRL's loss, optimizer step, logging and evaluation run unchanged (evaluation is
not down-sampled). Tested against TRL 1.16 (``pip install 'pods[trl]'``).

    from pods.integrations.trl import PODSConfig, PODSTrainer

    args = PODSConfig(output_dir="out", num_generations=64, num_generations_kept=16,
                      per_device_train_batch_size=64, gradient_accumulation_steps=4)
    PODSTrainer(model="Qwen/Qwen2.5-3B-Instruct", reward_funcs=[...], args=args,
                train_dataset=dataset).train()
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid, use_adapter
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("pods.integrations.trl needs TRL; install it with: pip install 'pods[trl]'") from error

from pods.advantages import aggregate_rewards, difficulty_counts, downsample, zero_variance_groups
from pods.architectures import packing_blocker, row_plan
from pods.config import (
    PROMPT_FILTER_EXHAUSTED,
    PROMPT_FILTERS,
    PROMPT_SKIP_MODES,
    PROMPT_SKIPS,
    check_generation_batch_prompts,
    check_kept_by_difficulty,
)
from pods.data.stream import refill_order
from pods.errors import ConfigError, PromptFilterExhausted
from pods.metrics import reward_metrics
from pods.packing import DEFAULT_TOKEN_BUDGET, hidden_size, model_inputs, pack, packable
from pods.prompt_filter import PassShare, exhausted_message, fill_groups, next_round_size, passing_groups
from pods.prompt_skip import (
    GresoSettings,
    PromptHistory,
    SkippedPrompts,
    adapt_exploration,
    greso_settings,
    group_outcomes,
    record_outcomes,
    round_prompts,
)
from pods.rollout.base import batch_multiple
from pods.selection import available_rules, uses_lengths

__all__ = [
    "PROMPT_STAGES_STATE_FILE",
    "TESTED_TRL_VERSION",
    "PODSConfig",
    "PODSTrainer",
    "advantage_scale",
    "check_batch_arithmetic",
    "concat_batches",
    "prompt_key",
    "summed_rewards",
    "take_rows",
]

PROMPT_STAGES_STATE_FILE = (
    "pods_prompt_stages.json"  # GRESO's history and the filter's pass share, per checkpoint
)
LEGACY_PROMPT_SKIP_STATE_FILE = "pods_prompt_skip.json"  # GRESO's history, as pods wrote it before
# TRL's loss types that divide by the tokens trained on (num_items_in_batch): a row with a zero loss mask weighs nothing
TOKEN_NORMALISED_LOSSES = ("dapo", "cispo", "vespo")
VLLM_ROUND_ROWS = 256  # on a GPU a round's prompts fill this many completions (vLLM's default max_num_seqs)

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


def concat_batches(batches: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """TRL batch dicts of several generation rounds as one: per-row tensors joined with prompt entries
    (``prompt_*``) re-padded on the left and completion entries on the right (``pad_id`` for ids, 0 elsewhere,
    always under a 0 mask), lists joined, scalar tensors summed. Anything else (images) raises."""
    if len(batches) == 1:
        return batches[0]
    joined: dict[str, Any] = {}
    for key, first in batches[0].items():
        values = [batch[key] for batch in batches]
        if first is None:
            joined[key] = None
        elif isinstance(first, torch.Tensor) and first.ndim == 0:
            joined[key] = sum(values)
        elif isinstance(first, torch.Tensor) and first.ndim == 1:
            joined[key] = torch.cat(values)
        elif isinstance(first, torch.Tensor) and first.ndim == 2:
            width = max(value.shape[1] for value in values)
            left = key.startswith("prompt")
            fill = pad_id if key.endswith("_ids") else 0
            joined[key] = torch.cat(
                [
                    torch.nn.functional.pad(
                        value,
                        (width - value.shape[1], 0) if left else (0, width - value.shape[1]),
                        value=fill,
                    )
                    for value in values
                ]
            )
        elif isinstance(first, list):
            joined[key] = [item for value in values for item in value]
        else:
            raise ValueError(
                f"cannot join TRL's batch entry {key!r} over generation rounds; prompt_filter and prompt_skip "
                "support text prompts only."
            )
    return joined


def prompt_key(row: dict[str, Any]) -> int:
    """A stable 60-bit id of a dataset row's prompt (the same on every process and run): GRESO's history key."""
    text = json.dumps(row["prompt"], sort_keys=True, default=str)
    return int(hashlib.sha1(text.encode()).hexdigest()[:15], 16)


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
            "pods.selection (max_variance, max_reward, random, all, shortest, reward_per_token, "
            "max_variance_shortest, or your own)."
        },
    )
    num_generations_kept_by_difficulty: list[int] | None = field(
        default=None,
        metadata={
            "help": "GFPO's adaptive difficulty: completions kept per prompt for each quartile of the groups' mean "
            "reward, easiest first, e.g. [4, 6, 8, 8] (each 2..m); the rest of a group's m rows weigh nothing."
        },
    )
    prompt_filter: str = field(
        default="none",
        metadata={
            "help": "none, or nonzero_std: drop prompts whose num_generations rewards are all equal and generate "
            "for more prompts until every process has as many as it started with (DAPO's dynamic sampling)."
        },
    )
    prompt_filter_reward: str = field(
        default="total",
        metadata={
            "help": "The reward the filter and GRESO read: total (what the rule ranks) or one reward function's "
            "name (verl's filter_groups.metric)."
        },
    )
    max_num_gen_batches: int = field(
        default=4,
        metadata={
            "help": "With a prompt_filter: generation rounds per generation batch at most, the first included; "
            "0: no bound. Past it, prompt_filter_exhausted says what happens."
        },
    )
    generation_batch_prompts: int | str | None = field(
        default=None,
        metadata={
            "help": "With a prompt_filter: prompts of the first round per process: None (the batch's own), a larger "
            "number, or 'auto' (the batch's prompts / the running share of groups that pass)."
        },
    )
    prompt_filter_exhausted: str = field(
        default="train_fewer",
        metadata={
            "help": "Past max_num_gen_batches: train_fewer (groups without a spread weigh nothing), pad (they "
            "train at advantage 0), or error (verl's)."
        },
    )
    prompt_skip: str = field(
        default="none",
        metadata={
            "help": "none, or greso: before generating, skip prompts whose recent groups had all-equal rewards, "
            "with GRESO's adaptive probability (arXiv 2506.02177)."
        },
    )
    prompt_skip_mode: str = field(
        default="shrink",
        metadata={
            "help": "greso: shrink (a skipped prompt is not generated; the batch is topped up with rows that weigh "
            "nothing) or replace (another prompt is generated instead)."
        },
    )
    prompt_skip_target: float = field(
        default=0.25,
        metadata={"help": "greso: the fraction of zero-variance groups its skip rates steer towards."},
    )
    prompt_skip_solved_mean: float | None = field(
        default=None,
        metadata={
            "help": "greso: a group whose mean reward is at least this counts as solved (GRESO: 0.98)."
        },
    )
    prompt_skip_failed_mean: float | None = field(
        default=None,
        metadata={"help": "greso: a group whose mean reward is at most this counts as failed (GRESO: 0.11)."},
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Compute the kept rows' old and reference log-probs with shared-prefix packing (each prompt "
            "forwarded once for its kept completions); off by default so that m = n stays TRL's GRPO bit for bit."
        },
    )
    token_budget: int = field(
        default=DEFAULT_TOKEN_BUDGET,
        metadata={"help": "With packing: tokens per packed row (a longer group splits, its prompt copied)."},
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
        for name, value, choices in (
            ("prompt_filter", self.prompt_filter, PROMPT_FILTERS),
            ("prompt_filter_exhausted", self.prompt_filter_exhausted, PROMPT_FILTER_EXHAUSTED),
            ("prompt_skip", self.prompt_skip, PROMPT_SKIPS),
            ("prompt_skip_mode", self.prompt_skip_mode, PROMPT_SKIP_MODES),
        ):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}.")
        if isinstance(self.max_num_gen_batches, bool) or not (
            isinstance(self.max_num_gen_batches, int) and self.max_num_gen_batches >= 0
        ):
            raise ValueError(
                f"max_num_gen_batches must be an int of at least 1 (generation rounds, the first included), or 0 "
                f"for no bound, got {self.max_num_gen_batches!r}."
            )
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be at least 1 (tokens), got {self.token_budget}.")
        if not 0 <= self.prompt_skip_target < 1:
            raise ValueError(f"prompt_skip_target must be in [0, 1), got {self.prompt_skip_target}.")
        wanted = self.per_device_train_batch_size * self.steps_per_generation // n
        try:
            check_generation_batch_prompts(self.generation_batch_prompts, wanted, self.prompt_filter)
            check_kept_by_difficulty(self.num_generations_kept_by_difficulty, self.kept_per_prompt)
            GresoSettings(solved_mean=self.prompt_skip_solved_mean, failed_mean=self.prompt_skip_failed_mean)
        except (ConfigError, ValueError) as error:
            raise ValueError(str(error)) from None
        if self.rows_weigh_nothing and self.loss_type not in TOKEN_NORMALISED_LOSSES:
            raise ValueError(
                f"{self.rows_weigh_nothing} leaves rows out of the loss through a zero loss mask, which "
                f"loss_type={self.loss_type!r} still counts in its mean over sequences or micro-batches; use "
                f"loss_type 'dapo' (TRL's default), 'cispo' or 'vespo', which divide by the tokens trained on"
                + (", or prompt_filter_exhausted='pad'" if "exhausted" in self.rows_weigh_nothing else "")
                + (", or prompt_skip_mode='replace'" if "skip" in self.rows_weigh_nothing else "")
                + "."
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
    def rows_weigh_nothing(self) -> str:
        """The settings under which some rows of a batch weigh nothing (a zero loss mask), '' where none do."""
        reasons = []
        if self.prompt_filter != "none" and self.prompt_filter_exhausted == "train_fewer":
            reasons.append("prompt_filter_exhausted='train_fewer'")
        if self.prompt_skip == "greso" and self.prompt_skip_mode == "shrink":
            reasons.append("prompt_skip_mode='shrink'")
        if self.num_generations_kept_by_difficulty is not None:
            reasons.append("num_generations_kept_by_difficulty")
        return " and ".join(reasons)

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
        self._pods_greso = greso_settings(args)
        self._pods_history = PromptHistory.start(self._pods_greso) if self._pods_greso else None
        self._pods_pass_share = PassShare()  # the filter's running share of groups that pass
        self._pods_prompts_drawn = (
            0  # prompts drawn on every process, TRL's batches and refills: the stages' epoch
        )
        self._pods_generation = (-1, 0)  # (global step, training generations in it so far): seeds the refills
        if (args.prompt_filter != "none" or self._pods_greso) and not hasattr(self.train_dataset, "__len__"):
            raise ValueError(
                "prompt_filter and prompt_skip draw further prompts from train_dataset by index, so it must be a "
                "map-style dataset (with a length), not an iterable one."
            )
        if args.prompt_filter_reward != "total" and args.prompt_filter_reward not in self.reward_func_names:
            raise ValueError(
                f"prompt_filter_reward {args.prompt_filter_reward!r} is not one of the reward functions "
                f"({', '.join(self.reward_func_names)}); use 'total' (what the rule ranks) or one of those names."
            )

    @property
    def _pods_stages(self) -> bool:
        """Whether a training batch runs the prompt-level stages (filter rounds or GRESO's skipping)."""
        return self.args.prompt_filter != "none" or self._pods_greso is not None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):  # type: ignore[override]
        """TRL's training; with the prompt-level stages a resumed run first reloads their state (GRESO's history,
        the filter's pass share)."""
        if self._pods_stages and resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            folder = Path(
                (
                    get_last_checkpoint(self.args.output_dir)
                    if resume_from_checkpoint is True
                    else resume_from_checkpoint
                )
                or self.args.output_dir
            )
            state = _read_stage_state(folder)
            if self._pods_greso is not None and state.get("prompt_history") is None:
                raise ValueError(
                    f"{folder / PROMPT_STAGES_STATE_FILE} is missing or holds no skip history: the checkpoint was "
                    "written without prompt_skip='greso', so its skip history is unknown. Resume with the settings "
                    "it was written with, or start a new run."
                )
            if self._pods_greso is not None:
                self._pods_history = PromptHistory.from_state(state["prompt_history"], self._pods_greso)
            self._pods_pass_share = PassShare.from_state(state.get("pass_share"))
            self._pods_prompts_drawn = state.get("prompts_drawn", 0)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """TRL's checkpoint, plus the prompt-level stages' state (``pods_prompt_stages.json``) when they run."""
        super()._save_checkpoint(model, trial)
        if self._pods_stages and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = (
                Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            state = {
                "prompt_history": None if self._pods_history is None else self._pods_history.to_state(),
                "pass_share": self._pods_pass_share.to_state(),
                "prompts_drawn": self._pods_prompts_drawn,
            }
            (folder / PROMPT_STAGES_STATE_FILE).write_text(json.dumps(state))

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
        """TRL's generation and scoring (in training: of the prompts GRESO keeps, in rounds while the filter drops
        groups), then keep m (or a difficulty's k) of each group of n and redo the advantages."""
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        # TRL computes old and reference log-probs for all n rows before rewards exist; PODS needs them for
        # the kept m only (text prompts; vLLM's importance-sampling correction needs them for all n).
        acc, args = self.accelerator, self.args
        n, m = self.num_generations, self.num_generations_kept
        defer = self._defer_logps(inputs)
        if self._pods_stages:
            batch, rewards_per_func, sampled = self._sampled_batch(inputs, defer)
            trained_groups = acc.gather(sampled.trained.to(acc.device)).cpu()  # [all groups]
        else:
            batch, rewards_per_func = self._scored_round(inputs, defer)
            sampled = trained_groups = None

        local_rows = batch["prompt_ids"].shape[0]
        groups = local_rows // n
        if local_rows % n or rewards_per_func.shape[0] != local_rows * acc.num_processes:
            raise RuntimeError(
                f"this process holds {local_rows} completions ({rewards_per_func.shape[0]} on all processes), not "
                f"whole groups of n={n}: groups are not process-local (see check_batch_arithmetic)."
            )
        summed = summed_rewards(rewards_per_func, self.reward_weights).view(-1, n)  # [all groups, n]
        components = rewards_per_func.view(-1, n, rewards_per_func.shape[1])
        gdpo = self.multi_objective_aggregation == "normalize_then_sum"
        ranked = aggregate_rewards(components, self.reward_weights, "normalize_then_sum") if gdpo else summed
        lengths = None
        if uses_lengths(args.selection_rule):  # every process's completion lengths, as the rewards
            lengths = acc.gather(batch["completion_mask"].sum(dim=1)).view(-1, n).to(summed.device)
        counts = None
        if args.num_generations_kept_by_difficulty is not None:
            counts = difficulty_counts(summed.nanmean(dim=1).cpu(), args.num_generations_kept_by_difficulty)

        chosen = downsample(
            ranked,
            m,
            args.selection_rule,
            scale=advantage_scale(self.scale_rewards),
            generator=self._selection_generator(),
            lengths=lengths,
            kept_counts=counts,
            keep_signal=args.prompt_filter != "none",
            components=components if gdpo else None,
            weights=self.reward_weights if gdpo else None,
        )  # over every process's groups: [all groups, m]
        weighs = (
            chosen.trained.cpu()
            if trained_groups is None
            else chosen.trained.cpu() & trained_groups.unsqueeze(1)
        )

        mine = slice(acc.process_index * groups, (acc.process_index + 1) * groups)
        trl_advantages = batch["advantages"]
        batch = take_rows(batch, chosen.rows.view(-1, m)[mine].reshape(-1) - mine.start * n, local_rows)
        if m < n or sampled is not None or counts is not None:
            advantages = chosen.advantages.masked_fill(~weighs.to(chosen.advantages.device), 0.0)
            batch["advantages"] = advantages[mine].reshape(-1).to(trl_advantages)
            # The completions table (log_completions) lists all n: show the advantage trained on, NaN if dropped.
            logged = torch.full_like(summed, float("nan")).scatter_(
                1, chosen.kept, advantages.to(summed.dtype)
            )
            logged = (
                logged.masked_fill(trained_groups.logical_not().unsqueeze(1).to(logged.device), float("nan"))
                if (trained_groups is not None)
                else logged
            )
            if sampled is not None:  # rows of every round, as TRL logged them, NaN for groups not trained on
                logged = sampled.logged_advantages(logged, acc)
            self._logs["advantages"].clear()
            self._logs["advantages"].extend(logged.reshape(-1).tolist())
        local_weighs = weighs[mine].reshape(-1)
        if not bool(local_weighs.all()):  # rows that weigh nothing: no tokens in the loss (dapo-type losses)
            for key in ("completion_mask", "tool_mask"):
                if batch.get(key) is not None:
                    batch[key] = batch[key] * local_weighs.to(batch[key]).unsqueeze(1)
        if defer:
            self._kept_row_logps(batch)
        # With m == n every row is kept and TRL's advantages are already those of the kept set (same formula;
        # TRL computes them in float32 where we use float64): keep TRL's bits so that m == n is exactly GRPO.
        loss_mask = batch["completion_mask"]
        if batch.get("tool_mask") is not None:
            loss_mask = loss_mask * batch["tool_mask"]
        batch["num_items_in_batch"] = acc.gather(loss_mask.sum()).sum()

        generated = summed if sampled is None else sampled.all_rewards  # every group generated, all processes
        kept_rewards = summed.gather(1, chosen.kept).masked_fill(~weighs.to(summed.device), float("nan"))
        if trained_groups is not None:
            kept_rewards = kept_rewards[trained_groups.to(kept_rewards.device)]
        for name, value in reward_metrics(generated, kept_rewards).items():
            if name.startswith("pods/"):  # TRL logs reward, reward_std and frac_reward_zero_std (over all n)
                self._metrics["train"][name].append(value)
        kept_ranked = ranked.gather(1, chosen.kept).masked_fill(~weighs.to(ranked.device), float("nan"))
        if trained_groups is not None:
            kept_ranked = kept_ranked[trained_groups.to(kept_ranked.device)]
        with_signal = int((~zero_variance_groups(kept_ranked)).sum()) if kept_ranked.numel() else 0
        self._metrics["train"]["pods/groups_trained_with_signal"].append(with_signal)
        self._metrics["train"]["pods/rollouts_generated"].append(
            generated.numel() if sampled is None else sampled.rollouts_generated
        )
        for name, value in ({} if sampled is None else sampled.metrics).items():
            self._metrics["train"][name].append(value)
        if args.prompt_filter != "none":
            self._metrics["train"]["pods/selection/signal_restored"].append(chosen.signal_restored)
        return batch

    def _scored_round(self, inputs: list[dict[str, Any]], defer: bool) -> tuple[dict[str, Any], torch.Tensor]:
        """TRL's generation and scoring of ``inputs``: its batch and the gathered ``[all rows, functions]`` rewards."""
        self._pods_rewards_per_func = None
        self._pods_defer_logps = defer
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self._pods_defer_logps = False
        rewards_per_func, self._pods_rewards_per_func = self._pods_rewards_per_func, None
        if rewards_per_func is None:
            raise RuntimeError(
                "TRL's _generate_and_score_completions did not call _calculate_rewards; this TRL version is not "
                f"supported by PODSTrainer (tested with {TESTED_TRL_VERSION}.x)."
            )
        return batch, rewards_per_func

    def _sampled_batch(
        self, inputs: list[dict[str, Any]], defer: bool
    ) -> tuple[dict[str, Any], torch.Tensor, _SampledRounds]:
        """The prompt-level stages on this process's P prompts: rounds of prompts (the batch's own first, then
        further draws from ``train_dataset``), GRESO skipping some, generated and scored by TRL; with a filter,
        rounds sized to what is missing until P groups pass or ``max_num_gen_batches`` rounds ran (the same rounds
        of the same size on every process). Returns the P groups as one batch, their gathered rewards, the rounds."""
        acc, n, args = self.accelerator, self.num_generations, self.args
        if "image" in inputs[0] or "images" in inputs[0]:
            raise ValueError("prompt_filter and prompt_skip support text prompts only (no images).")
        wanted = len(inputs) // n
        first = [prompt_key(inputs[g * n]) for g in range(wanted)]
        rows = {key: inputs[g * n] for g, key in enumerate(first)}
        step, count = self._pods_generation
        self._pods_generation = (self.state.global_step, count + 1 if step == self.state.global_step else 0)
        batch_keys = {key for keys in gather_object([first]) for key in keys}  # every process's batch
        draw = _PromptDraws(first, self._refill_keys(batch_keys, rows), acc.num_processes, acc.process_index)
        most = (
            (lambda value: int(acc.gather(torch.tensor([value], device=acc.device)).max()))
            if (acc.num_processes > 1)
            else (lambda value: value)
        )
        multiple = batch_multiple(acc.device.type == "cuda", VLLM_ROUND_ROWS, n)
        rounds = _SampledRounds(wanted, n, acc.num_processes, acc.process_index)
        filter_column = (
            None
            if args.prompt_filter_reward == "total"
            else self.reward_func_names.index(args.prompt_filter_reward)
        )
        while True:
            totals = acc.gather(torch.tensor([[rounds.num_passed, rounds.drawn]], device=acc.device)).sum(
                dim=0
            )
            share = self._pods_pass_share.plus(int(totals[0]), int(totals[1]))
            size = next_round_size(
                rounds_run=len(rounds.batches),
                wanted=wanted,
                missing=most(wanted - rounds.num_passed),
                share=share.share,
                prompt_filter=args.prompt_filter,
                max_num_gen_batches=args.max_num_gen_batches,
                generation_batch_prompts=args.generation_batch_prompts,
                multiple=multiple,
            )
            if size == 0:
                break
            generator = torch.Generator().manual_seed(
                ((args.seed * 1_000_003 + self._pods_seed_step) * 64 + acc.process_index) * 1_009
                + len(rounds.batches)
            )
            prompts = round_prompts(
                draw,
                size,
                settings=self._pods_greso,
                history=self._pods_history,
                generator=generator,
                mode=args.prompt_skip_mode,
                most=most,
            )
            batch, rewards_per_func = self._scored_round(
                [rows[k] for k in prompts.ids for _ in range(n)], defer
            )
            local = rewards_per_func.view(acc.num_processes, -1, rewards_per_func.shape[1])[acc.process_index]
            rewards = summed_rewards(local, self.reward_weights).view(-1, n)
            if filter_column is not None:
                signal = local[:, filter_column].view(-1, n)
            elif self.multi_objective_aggregation == "normalize_then_sum":
                signal = aggregate_rewards(
                    local.view(-1, n, local.shape[1]), self.reward_weights, "normalize_then_sum"
                )
            else:
                signal = rewards
            rounds.add(
                prompts, batch, local, rewards, passing_groups(signal, args.prompt_filter), signal, size
            )
        self._pods_pass_share = share
        epoch = self._pods_prompts_drawn / len(self.train_dataset)  # before this generation's draws
        self._pods_prompts_drawn += draw.count * acc.num_processes
        exhausted = args.prompt_filter_exhausted if args.prompt_filter != "none" else "pad"
        if exhausted == "error" and most(int(rounds.num_passed < wanted)):
            raise PromptFilterExhausted(exhausted_message(rounds.num_passed, wanted))
        batch, local_rewards_per_func = rounds.join(self._tokenizer.pad_token_id or 0, exhausted)
        rewards_per_func = acc.gather(local_rewards_per_func)  # [all processes x P x n, functions], as TRL's
        rounds.finish(acc, args.prompt_filter, share)
        rounds.metrics["pods/epoch"] = self._pods_prompts_drawn / len(self.train_dataset)
        if self._pods_greso is not None:
            keys = acc.gather(torch.tensor(rounds.ids, device=acc.device)).tolist()
            outcomes = acc.gather(group_outcomes(rounds.signals, self._pods_greso).to(acc.device))
            history = record_outcomes(self._pods_history, keys, outcomes.tolist())
            if epoch >= 1:  # as GRESO: adapt after the first epoch (of every prompt drawn, refills included)
                history = adapt_exploration(history, outcomes.tolist(), self._pods_greso)
            self._pods_history = history
            rounds.skip_metrics(acc, history, args.prompt_skip_mode)
        return batch, rewards_per_func, rounds

    @property
    def _pods_seed_step(self) -> int:
        """Seeds refill draws and GRESO's: the global step, and the generation within it (several per step)."""
        step, count = self._pods_generation
        return step * 64 + count

    def _refill_keys(self, excluded: set[int], rows: dict[int, dict[str, Any]]) -> Iterator[int]:
        """Further prompts (keys) for this generation, in an order seeded by (seed, step): every row of
        ``train_dataset`` once, none of ``excluded`` (the batch's prompts on every process) and no prompt twice,
        then again from the start if the set runs out; ``rows`` learns every key drawn. The same sequence on
        every process (each takes its own slice of it)."""
        order = refill_order(len(self.train_dataset), self.args.seed, self._pods_seed_step)
        seen = set(excluded)
        for lap in itertools.count():
            fresh = False
            for index in order:
                row = self.train_dataset[index]
                key = prompt_key(row)
                if lap == 0 and key in seen:
                    continue
                seen.add(key)
                fresh = True
                rows.setdefault(key, row)
                yield key
            if not fresh:  # nothing but the batch's own prompts in the whole set
                for key in sorted(excluded):
                    yield key

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

        rows = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
        packs = self.args.packing and packable(*rows[1::2]) and bool(rows[3].any())

        def logps(model: Any) -> torch.Tensor:
            # decided (and self-checked) on every rank, whatever its rows: the check's forwards are collectives
            blocked = self.args.packing and packing_blocker(model) is not None
            if not packs or blocked:
                return self._get_per_token_logps_and_entropies(model, ids, mask, width, batch_size=size)[0]
            with self.accelerator.autocast():
                return torch.cat(
                    [
                        fused_packed_logps(
                            model, [t[start : start + size] for t in rows], self.args.token_budget
                        )
                        for start in range(0, ids.shape[0], size)
                    ]
                )

        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            if need_old:
                batch["old_per_token_logps"] = logps(self.model)
            if self.beta != 0.0 and self.ref_model is not None:
                batch["ref_per_token_logps"] = logps(self.ref_model)
            elif self.beta != 0.0:  # LoRA: the base with the adapter disabled (or TRL's "ref" adapter)
                model = self.accelerator.unwrap_model(self.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    batch["ref_per_token_logps"] = logps(self.model)


def fused_packed_logps(model: Any, rows: list[torch.Tensor], token_budget: int) -> torch.Tensor:
    """TRL's per-token log-probs (its fused LM head, one label per position) of padded rows
    ``[prompt_ids, prompt_mask, completion_ids, completion_mask]``, over shared-prefix packed rows."""
    batch, width = rows[2].shape
    if not bool(rows[3].any()):  # a chunk of rows that weigh nothing: zeros, after a forward all the same
        # (under ZeRO-3 / FSDP a forward gathers parameters with the other processes, which run their chunk's)
        if batch and width:
            fused_packed_logps(model, [*rows[:3], first_token_only(rows[3])], token_budget)
        return torch.zeros(batch, width, device=rows[2].device)
    packed = pack(*(t.cpu() for t in rows), token_budget=token_budget, hidden_size=hidden_size(model))
    device = rows[2].device
    out = model(
        **model_inputs(model, packed, row_plan(model)),
        shift_labels=packed.labels.to(device),
        fused_lm_head=True,
    )
    values = out.log_probs.reshape(-1)[packed.label_index.to(device)].float()
    flat = torch.zeros(batch * width, dtype=values.dtype, device=device)
    return flat.scatter(0, packed.label_dest.to(device), values).view(batch, width)


def first_token_only(completion_mask: torch.Tensor) -> torch.Tensor:
    """A completion mask with the first row's first token alone: a stand-in forward's rows (one token scored)."""
    mask = torch.zeros_like(completion_mask)
    mask[0, 0] = 1
    return mask


class _PromptDraws:
    """``draw(count)`` for :func:`pods.prompt_skip.round_prompts`: the batch's own prompts first, then this process's
    slice of the shared refill sequence (every process draws the same counts, so the slices never overlap)."""

    def __init__(self, first: list[int], refills: Iterator[int], world: int, rank: int) -> None:
        self.first, self.refills, self.world, self.rank = list(first), refills, world, rank
        self._sequence: list[int] = []
        self._taken = 0  # refill keys drawn per process so far
        self.count = 0  # keys drawn on this process

    def __call__(self, count: int) -> list[int]:
        self.count += count
        own = self.first[:count]
        self.first = self.first[count:]
        extra = count - len(own)
        if extra <= 0:
            return own
        start = self._taken * self.world + self.rank * extra
        while len(self._sequence) < start + extra:
            self._sequence.append(next(self.refills))
        self._taken += extra  # the processes' slices of this draw sit side by side in the shared sequence
        return own + self._sequence[start : start + extra]


class _SampledRounds:
    """One process's generation rounds of one TRL generation batch: TRL's batches, local rewards, the filter's
    verdicts; joins the P groups the step trains on, and the metrics of the prompt-level stages."""

    def __init__(self, wanted: int, n: int, world: int, rank: int) -> None:
        self.wanted, self.n, self.world, self.rank = wanted, n, world, rank
        self.ids: list[int] = []
        self.skipped = 0
        self.drawn = 0
        self.batches: list[dict[str, Any]] = []
        self.local_rewards_per_func: list[torch.Tensor] = []
        self.round_rewards: list[torch.Tensor] = []
        self.round_signals: list[torch.Tensor] = []
        self.passed: list[torch.Tensor] = []
        self.metrics: dict[str, float] = {}

    @property
    def num_passed(self) -> int:
        return int(torch.cat(self.passed).sum()) if self.passed else 0

    @property
    def rewards(self) -> torch.Tensor:
        """``[local groups, n]`` summed rewards over every round."""
        return torch.cat(self.round_rewards)

    @property
    def signals(self) -> torch.Tensor:
        """``[local groups, n]`` the reward the prompt stages read, over every round."""
        return torch.cat(self.round_signals)

    @property
    def round_sizes(self) -> list[int]:
        return [len(rewards) for rewards in self.round_rewards]

    def add(
        self,
        prompts: SkippedPrompts,
        batch: dict[str, Any],
        local_rewards_per_func: torch.Tensor,
        rewards: torch.Tensor,
        passed: torch.Tensor,
        signal: torch.Tensor,
        drawn: int,
    ) -> None:
        """Record one round: its prompts, TRL's batch, this process's rewards (per function and summed ``[k, n]``)."""
        self.ids.extend(prompts.ids)
        self.skipped += prompts.skipped
        self.drawn += drawn
        self.batches.append(batch)
        self.local_rewards_per_func.append(local_rewards_per_func)
        self.round_rewards.append(rewards)
        self.round_signals.append(signal)
        self.passed.append(passed.cpu())

    def join(self, pad_id: int, exhausted: str) -> tuple[dict[str, Any], torch.Tensor]:
        """The P groups to train on (those that passed first; past the bound as ``exhausted`` says) as one TRL
        batch, and their rewards per function (this process's ``[P x n, functions]``). With fewer than P groups in
        all (GRESO's shrink), the first groups are repeated as fillers that weigh nothing (``trained`` False)."""
        taken = fill_groups(torch.cat(self.passed), self.wanted, exhausted)
        fillers = self.wanted - taken.positions.numel()
        self.positions = torch.cat([taken.positions, taken.positions.repeat(fillers)[:fillers]])
        self.trained = torch.cat([taken.trained, torch.zeros(fillers, dtype=torch.bool)])
        rows = (self.positions.unsqueeze(1) * self.n + torch.arange(self.n)).reshape(-1)
        joined = concat_batches(self.batches, pad_id)
        batch = take_rows(joined, rows, joined["prompt_ids"].shape[0])
        local = torch.cat(self.local_rewards_per_func)[rows.to(self.local_rewards_per_func[0].device)]
        return batch, local

    @property
    def rollouts_generated(self) -> int:
        return self.all_rewards.numel()

    def finish(self, accelerator: Any, prompt_filter: str, share: PassShare) -> None:
        """Gather what every process generated (rewards, trained positions) and count the filter's work."""
        device = accelerator.device
        mine = torch.cat(self.round_rewards).to(device)  # [local groups, n]; the same count on every process
        self.all_rewards = accelerator.gather(mine.unsqueeze(0)).reshape(-1, self.n)  # process-major
        self.all_positions = accelerator.gather(self.positions.to(device).unsqueeze(0)).cpu()  # [world, P]
        self.all_trained = accelerator.gather(self.trained.to(device).unsqueeze(0)).cpu()
        if prompt_filter == "none":
            return
        passed = torch.cat(self.passed)
        trained_passed = int(passed[self.positions][self.trained].sum())
        unfilled = self.wanted - trained_passed
        counts = torch.tensor([len(passed) - int(passed.sum()) - unfilled, unfilled], device=device)
        dropped, unfilled = accelerator.gather(counts.unsqueeze(0)).sum(dim=0).tolist()
        first = self.round_sizes[0]
        self.metrics.update(
            {
                "pods/filter/num_gen_batches": len(self.batches),
                "pods/filter/first_round_prompts": first,
                "pods/filter/groups_dropped": dropped,
                "pods/filter/extra_rollouts": (len(passed) - first) * self.n * self.world,
                "pods/filter/groups_unfilled": unfilled,
                "pods/filter/pass_share": float("nan") if share.share is None else share.share,
            }
        )

    def skip_metrics(self, accelerator: Any, history: PromptHistory, mode: str) -> None:
        """GRESO's metrics: prompts skipped (not generated) over every process, the rollouts that saved, the rates."""
        skipped = int(accelerator.gather(torch.tensor([self.skipped], device=accelerator.device)).sum())
        state = history.to_state()
        self.metrics.update(
            {
                "pods/skip/prompts_skipped": skipped,
                "pods/skip/rollouts_saved": skipped * self.n if mode == "shrink" else 0,
                "pods/skip/exploration_solved": state["exploration_solved"],
                "pods/skip/exploration_failed": state["exploration_failed"],
            }
        )

    def logged_advantages(self, trained: torch.Tensor, accelerator: Any) -> torch.Tensor:
        """The completions table's advantages for every row TRL logged this generation (each round, every
        process's rows in turn), from ``trained[all processes x P, n]`` (NaN where not kept)."""
        sizes = self.round_sizes
        starts = torch.tensor([0, *sizes]).cumsum(0)
        logged = [torch.full((self.world, size, self.n), float("nan"), dtype=trained.dtype) for size in sizes]
        values = trained.cpu().view(self.world, self.wanted, self.n)
        for process in range(self.world):
            for slot in range(self.wanted):
                if not self.all_trained[process, slot]:
                    continue
                position = int(self.all_positions[process, slot])
                round_index = int((starts[1:] <= position).sum())
                logged[round_index][process, position - int(starts[round_index])] = values[process, slot]
        return torch.cat([part.reshape(-1, self.n) for part in logged])


def _read_stage_state(folder: Path) -> dict[str, Any]:
    """The prompt-level stages' state in a checkpoint folder (``{}`` when none), or GRESO's history as older
    versions of pods wrote it."""
    path = folder / PROMPT_STAGES_STATE_FILE
    if path.is_file():
        return json.loads(path.read_text())
    legacy = folder / LEGACY_PROMPT_SKIP_STATE_FILE
    return {"prompt_history": json.loads(legacy.read_text())} if legacy.is_file() else {}
