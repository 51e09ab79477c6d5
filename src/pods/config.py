"""Training configuration as data: one flat dataclass, loadable from YAML and overridable from the CLI.

Names follow TRL's ``GRPOConfig`` where the meaning is the same (``num_generations``, ``beta``,
``epsilon``, ``loss_type``, ``scale_rewards``, ``temperature``, ``max_completion_length``, ...).
The batch arithmetic, per process and per step:

    prompts_per_step prompts  x  num_generations (n) completions each  = rollouts generated
    prompts_per_step prompts  x  num_generations_kept (m) each         = rows trained on
    rows trained on / micro_batch_size                                 = micro-batches accumulated

``micro_batch_size`` counts kept completions (rows), never prompts.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from pods.errors import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
SCHEDULERS = ("constant", "cosine", "linear")
OPTIMIZERS = ("adamw", "adamw_8bit")
EVAL_PROTOCOLS = ("greedy", "sampled")
WEIGHT_SYNC_BACKENDS = ("auto", "shared_memory", "gloo", "nccl")  # async: how the weights reach the worker
SERVER_WEIGHT_SYNCS = ("auto", "file", "gloo", "nccl")  # vllm_mode server: how the weights reach the server
ROLLOUT_ENGINES = ("auto", "hf", "vllm")  # auto: vLLM where it is installed and can run, else hf
VLLM_MODES = (
    "colocate",
    "server",
)  # TRL's names: an engine in the sampling process, or a `vllm serve` process
PRECISIONS = ("auto", "no", "bf16", "fp16")
PROMPT_FILTERS = ("none", "nonzero_std")  # pods.prompt_filter (DAPO's dynamic sampling)
PROMPT_FILTER_EXHAUSTED = ("train_fewer", "pad", "error")  # what a step does when the refill bound is hit
PROMPT_SKIPS = ("none", "greso")  # pods.prompt_skip (GRESO)
PROMPT_SKIP_MODES = ("shrink", "replace")  # a skipped prompt is not generated / is replaced by another
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # several reward functions (TRL's names)
DIFFICULTY_BUCKETS = 4  # num_generations_kept_by_difficulty: GFPO's quartiles of the groups' mean reward

EMBEDDED_MODEL = "embedded"


# transformers' attention implementations a config may name; "auto" leaves the choice to transformers (SDPA
# where the model has it, else eager: both take packing's mask).
ATTENTION_IMPLEMENTATIONS = (
    "auto",
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)


@dataclass
class TrainConfig:
    """Everything a training run needs. Defaults are the embedded CPU demo (``pods train``)."""

    # --- model ---
    model: str = EMBEDDED_MODEL  # a local folder, a hub name, or "embedded" (the shipped arithmetic model)
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "float32"  # weights' dtype: float32, bfloat16, float16, or auto
    attn_implementation: str = (
        "auto"  # auto (transformers' default: sdpa, else eager), sdpa, eager, flex_attention, ...
    )
    lora_r: int = 0  # 0 = full fine-tuning; > 0 = LoRA through peft with this rank
    lora_alpha: int = 64
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | str = "all-linear"
    load_in_4bit: bool = (
        False  # QLoRA base: NF4 computing in `dtype` (needs bitsandbytes >= 0.48; CUDA or CPU)
    )
    gradient_checkpointing: bool = False

    # --- data ---
    task: str = "arith"  # arith, gsm8k, math500, math (or a registered task)
    task_source: str | None = None  # hub name or local file/folder; None = the task's default
    train_split: str = "train"
    prompt_style: str | None = None  # chat (tokenizer's chat template), plain or raw; None = the task's
    max_prompt_length: int | None = 512  # longer prompts are filtered out of the data
    train_limit: int | None = None
    dataset_name: str | None = None  # your data instead of task: a Hub id, a .jsonl/.json/.parquet/.csv file,
    # or a folder with a file per split (docs/tasks.md "Your own data and rewards"); TRL's names from here on
    dataset_config: str | None = None  # dataset_name: the Hub dataset's configuration (subset)
    dataset_train_split: str = "train"  # dataset_name: the split trained on (a single file is split train)
    dataset_test_split: str = "test"  # dataset_name: the split evaluated on
    prompt_column: str = "prompt"  # dataset_name: the column holding the prompt, as text or as chat messages
    prompt_template: str | None = None  # dataset_name: the prompt built from columns, e.g. "Q: {problem}\nA:"
    answer_column: str | None = None  # dataset_name: copied into `answer`, which the built-in checkers read
    system_prompt: str | None = None  # a system message for chat prompts (tasks: None = the think/answer one)

    # --- rollouts ---
    num_generations: int | str = 16  # n: completions generated per prompt, or "auto" (chosen as it runs)
    num_generations_min: int | None = None  # bounds of n for "auto"; default m
    num_generations_max: int | None = None  # default 16 m
    num_generations_every: int = 5  # "auto" re-decides n every this many steps
    num_generations_kept: int = 4  # m: completions trained on per prompt (m = n is plain GRPO)
    selection_rule: str = "max_variance"  # or max_reward, random, all, shortest, reward_per_token,
    # max_variance_shortest, or a registered rule (docs/selection.md)
    prompts_per_step: int = 16  # prompts per step per process
    num_generations_kept_by_difficulty: list[int] | None = None  # GFPO's adaptive k: m per quartile of
    # the step's group mean rewards, easiest first, e.g. [2, 3, 4, 4] (each 2..m); None: m for every group
    prompt_filter: str = "none"  # or nonzero_std: drop all-equal groups, generate for more (DAPO)
    prompt_filter_reward: str = "total"  # the reward the filter and GRESO read: total, or one function's name
    max_num_gen_batches: int = (
        4  # prompt_filter: generation rounds per step at most (first included; 0: no bound)
    )
    generation_batch_prompts: int | str | None = None  # prompt_filter: prompts of a step's first round per
    # process: None = prompts_per_step, a larger number, or auto (P / the running share that passes)
    prompt_filter_exhausted: str = "train_fewer"  # past the bound: train_fewer, pad (zero advantage), error
    prompt_skip: str = "none"  # or greso: skip prompts likely to give all-equal rewards (GRESO)
    prompt_skip_mode: str = "shrink"  # greso: shrink (a skipped prompt is not generated) or replace
    prompt_skip_target: float = 0.25  # greso: fraction of zero-variance groups its rates steer towards
    prompt_skip_solved_mean: float | None = None  # greso: a group at or above this mean counts as solved
    prompt_skip_failed_mean: float | None = (
        None  # and at or below this one as failed (None: all rewards equal)
    )
    max_completion_length: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: list[str] = field(default_factory=list)
    generation_batch_size: int = 256  # completions generated per forward batch
    rollout_engine: str = "auto"  # auto (vLLM where it can run, else hf), hf (transformers generate), vllm
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM may take (colocated with training)
    vllm_enable_sleep_mode: bool = False  # GPU: offload vLLM's weights and KV cache during the update
    vllm_max_model_length: int | None = None  # default: max_prompt_length + max_completion_length
    vllm_tensor_parallel_size: int = 1  # must be 1: one engine per process and GPU (TRL's colocate default)
    vllm_max_num_batched_tokens: int | None = 4096  # tokens per engine forward; TRL's value (null: vLLM's)
    vllm_cpu_kv_cache_gb: float = 1.0  # CPU only: memory for vLLM's KV cache
    vllm_mode: str = "colocate"  # colocate (an engine in the process that samples) or server (`vllm serve`)
    vllm_server_base_url: str | None = None  # server: a running server's URL; None: pods starts one
    vllm_server_host: str = "127.0.0.1"  # server: where pods starts it
    vllm_server_port: int | None = None  # server: its port (None: a free one)
    vllm_server_timeout: float = 240.0  # server: seconds to wait for it to start or answer before an error
    vllm_server_weight_sync: str = "auto"  # server: file (same machine), gloo, nccl; auto: file if local
    async_generation: bool = False  # a rollout worker process generates the next steps during the update
    max_staleness: int = 1  # async: the batch of step t is sampled by the weights of step t - max_staleness
    weight_sync_steps: int = 1  # async: the worker gets new weights every this many steps (<= max_staleness)
    rollout_worker_threads: int | None = (
        None  # async: the worker's cores (default half); the trainer the rest
    )
    rollout_worker_device: str = "auto"  # async: cpu, cuda[:N], auto (its own GPU if free)
    weight_sync_backend: str = "auto"  # async: shared_memory, gloo, nccl; auto: nccl between 2 GPUs

    # --- tools and environments (multi-turn rollouts, docs/agents.md) ---
    tools: list[str] | None = None  # file.py:function or module:function per tool (TRL's `tools`)
    environment_factory: str | None = (
        None  # file.py:Class: one instance per rollout, reset(**row), methods as tools
    )
    tool_format: str = (
        "auto"  # chat_template (tools in the chat template), text (<call>f(x)</call>); auto: by prompt
    )
    max_tool_calling_iterations: int | None = (
        None  # rounds of tool calls per episode at most (None: no limit)
    )
    tool_timeout: float | None = 10.0  # seconds a turn's tool calls may take; then answered with an error

    # --- rewards and loss ---
    reward_funcs: list[str] | None = None  # built-ins, file.py:function, module:function; None: the task's
    reward_weights: list[float] | None = None  # one per reward (the reward model first, where there is one)
    reward_model_name_or_path: str | None = None  # a sequence-classification checkpoint as the first reward
    accuracy_reward: str | None = None  # the reward whose mean on the test split is eval accuracy; None: the
    # task's accuracy function, or with dataset_name the first of reward_funcs
    multi_objective_aggregation: str = "sum_then_normalize"  # or normalize_then_sum (TRL's; GDPO)
    reward_timeout: float | None = (
        None  # seconds per reward-function call; past it the run ends (None = no limit)
    )
    scale_rewards: str = "group"  # group (paper), batch, none (Dr. GRPO)
    advantage_eps: float = 1e-4
    loss_type: str = "grpo"
    beta: float = 0.0  # KL coefficient (k3) to the reference policy
    epsilon: float = 0.2
    epsilon_high: float | None = None  # defaults to epsilon; DAPO uses 0.28
    num_iterations: int = 1  # optimisation passes over each batch of kept rollouts
    vllm_importance_sampling_correction: bool = True  # reweight tokens by trainer/sampler prob (vLLM only)
    vllm_importance_sampling_cap: float = 3.0  # per-token importance weights are truncated at this value

    # --- optimisation ---
    learning_rate: float = 3e-5
    lr_scheduler_type: str = "constant"
    warmup_ratio: float = 0.0
    optimizer: str = "adamw"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_consecutive_skips: int = (
        3  # optimizer steps with a NaN/inf loss or grad norm are skipped; this many in a row stop the run
    )
    micro_batch_size: int = 64  # kept rows per forward/backward pass
    packing: bool = True  # rows sharing a prompt forward it once (where the attention takes the mask)
    token_budget: int = 2048  # packing: tokens per packed row; a longer group splits, prompt copied
    mixed_precision: str = "no"  # no, bf16, fp16, or auto (bf16 where the GPU supports it)

    # --- run ---
    max_steps: int | None = None
    max_time: float | None = 180.0  # training wall-clock budget in seconds (evaluation excluded)
    seed: int = 0
    torch_threads: int | None = None  # CPU threads for torch; None = torch's default (all cores)
    output_dir: str | None = None  # default: runs/<timestamp>
    eval_task: str | None = None  # defaults to task
    eval_source: str | None = None
    eval_split: str = "test"
    eval_limit: int | None = 500
    eval_protocol: str = "greedy"
    eval_samples: int = 5  # samples per problem for the sampled protocol
    eval_temperature: float = 0.9
    eval_every_seconds: float | None = 30.0  # at every multiple of this many seconds of training; None: none
    eval_at_seconds: list[float] | None = field(default_factory=lambda: [5.0, 10.0, 20.0])  # and at these
    eval_at_start: bool = True
    eval_batch_size: int = 256
    save_every_steps: int | None = None
    save_every_seconds: float | None = 60.0
    save_total_limit: int = 2
    save_final: bool = True
    resume_from: str | None = None  # a checkpoint folder, a run folder, or "auto"
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb, trackio
    progress: bool = True  # live progress display on the main process

    def __post_init__(self) -> None:
        if self.eval_at_seconds is None:  # null: none
            self.eval_at_seconds = []
        self.validate()
        self.eval_at_seconds = sorted({float(seconds) for seconds in self.eval_at_seconds})

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ConfigError`` for any setting that cannot work, before any work starts."""
        self._validate_tools()
        m = self.num_generations_kept
        _require(m >= 2, "num_generations_kept", f"must be at least 2 (advantages need a group), got {m}")
        if isinstance(self.num_generations, str):
            self._validate_auto()
        else:
            n = self.num_generations
            _require(n >= 1, "num_generations", f"must be at least 1, got {n}")
            _require(
                m <= n,
                "num_generations_kept",
                f"m={m} cannot exceed num_generations n={n}: PODS keeps m of the n rollouts of each prompt",
            )
            if self.selection_rule == "all":
                _require(
                    m == n,
                    "selection_rule",
                    f"'all' keeps every rollout, so set num_generations_kept = n = {n}",
                )
            for key in ("num_generations_min", "num_generations_max"):
                _require(
                    getattr(self, key) is None,
                    key,
                    f"bounds n only with num_generations: auto (n is fixed at {n}); remove it or set auto",
                )
        _require(
            self.prompts_per_step >= 1, "prompts_per_step", f"must be at least 1, got {self.prompts_per_step}"
        )
        rows = self.prompts_per_step * m
        _require(
            self.micro_batch_size >= 1 and rows % self.micro_batch_size == 0,
            "micro_batch_size",
            f"{self.micro_batch_size} must divide the kept rows per step per process, prompts_per_step x m = "
            f"{self.prompts_per_step} x {m} = {rows}; divisors: {_divisors(rows)}",
        )
        self._validate_prompt_stages()
        _require(
            self.token_budget >= 1, "token_budget", f"must be at least 1 (tokens), got {self.token_budget}"
        )
        _require(
            self.max_staleness >= 1, "max_staleness", f"must be at least 1 (steps), got {self.max_staleness}"
        )
        _require(
            1 <= self.weight_sync_steps <= self.max_staleness,
            "weight_sync_steps",
            f"must be from 1 to max_staleness ({self.max_staleness}): a batch is never sampled by weights more "
            f"than max_staleness steps old, got {self.weight_sync_steps}",
        )
        _require(
            self.rollout_worker_threads is None or self.rollout_worker_threads >= 1,
            "rollout_worker_threads",
            "must be at least 1, or null (half the cores)",
        )
        _require(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.rollout_worker_device) is not None,
            "rollout_worker_device",
            f"must be auto, cpu, cuda or cuda:N, got {self.rollout_worker_device!r}",
        )
        require_choice(self.weight_sync_backend, WEIGHT_SYNC_BACKENDS, "weight_sync_backend")
        require_choice(self.vllm_server_weight_sync, SERVER_WEIGHT_SYNCS, "vllm_server_weight_sync")
        _require(self.max_completion_length >= 1, "max_completion_length", "must be at least 1")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.generation_batch_size >= 1, "generation_batch_size", "must be at least 1")
        require_choice(self.loss_type, LOSS_TYPES, "loss_type")
        require_choice(self.scale_rewards, SCALE_REWARDS, "scale_rewards")
        require_choice(self.lr_scheduler_type, SCHEDULERS, "lr_scheduler_type")
        require_choice(self.optimizer, OPTIMIZERS, "optimizer")
        require_choice(self.eval_protocol, EVAL_PROTOCOLS, "eval_protocol")
        require_choice(self.rollout_engine, ROLLOUT_ENGINES, "rollout_engine")
        require_choice(self.mixed_precision, PRECISIONS, "mixed_precision")
        _require(
            0 < self.vllm_gpu_memory_utilization <= 1,
            "vllm_gpu_memory_utilization",
            f"must be in (0, 1], got {self.vllm_gpu_memory_utilization}",
        )
        _require(
            self.vllm_max_model_length is None or self.vllm_max_model_length >= 2,
            "vllm_max_model_length",
            "must be at least 2 (prompt + completion tokens) or null",
        )
        _require(
            self.vllm_tensor_parallel_size == 1,
            "vllm_tensor_parallel_size",
            f"must be 1, got {self.vllm_tensor_parallel_size}: pods runs one engine per process, each on its own "
            "GPU (TRL's colocate mode); for more rollout throughput launch more processes (accelerate launch "
            "--num_processes N), for a model too large for one GPU use LoRA with load_in_4bit",
        )
        _require(
            self.vllm_max_num_batched_tokens is None or self.vllm_max_num_batched_tokens >= 1,
            "vllm_max_num_batched_tokens",
            "must be at least 1, or null for vLLM's default",
        )
        _require(self.vllm_cpu_kv_cache_gb > 0, "vllm_cpu_kv_cache_gb", "must be positive (GiB)")
        require_choice(self.vllm_mode, VLLM_MODES, "vllm_mode")
        _require(self.vllm_server_timeout > 0, "vllm_server_timeout", "must be positive (seconds)")
        _require(
            self.vllm_mode == "server" or self.vllm_server_base_url is None,
            "vllm_server_base_url",
            "is the URL of a vLLM server: set vllm_mode: server (and rollout_engine: vllm)",
        )
        _require(
            self.vllm_importance_sampling_cap >= 1,
            "vllm_importance_sampling_cap",
            f"must be >= 1 (a cap below 1 would shrink every token's weight), got {self.vllm_importance_sampling_cap}",
        )
        if self.prompt_style is not None:
            require_choice(self.prompt_style, ("chat", "plain", "raw"), "prompt_style")
        require_choice(self.dtype, ("float32", "bfloat16", "float16", "auto"), "dtype")
        require_choice(self.attn_implementation, ATTENTION_IMPLEMENTATIONS, "attn_implementation")
        _require(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")
        _require(self.epsilon >= 0, "epsilon", f"must be >= 0, got {self.epsilon}")
        _require(self.num_iterations >= 1, "num_iterations", f"must be at least 1, got {self.num_iterations}")
        _require(self.learning_rate >= 0, "learning_rate", f"must be >= 0, got {self.learning_rate}")
        _require(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        _require(self.lora_r >= 0, "lora_r", f"must be >= 0 (0 = full fine-tuning), got {self.lora_r}")
        _require(
            not self.load_in_4bit or self.lora_r > 0,
            "load_in_4bit",
            "a 4-bit base cannot be fully fine-tuned; set lora_r > 0 (QLoRA)",
        )
        _require(
            self.reward_funcs is None or bool(self.reward_funcs),
            "reward_funcs",
            "needs at least one reward function (or null for the task's)",
        )
        _require(
            self.dataset_name is None
            or bool(self.reward_funcs)
            or self.reward_model_name_or_path is not None,
            "reward_funcs",
            "your dataset_name needs rewards: built-in names (accuracy with an answer_column), file.py:function, "
            "module:function, or reward_model_name_or_path",
        )
        if self.reward_weights is not None and self.reward_funcs is not None:
            model = [self.reward_model_name_or_path] if self.reward_model_name_or_path else []
            _require(
                len(self.reward_weights) == len(self.reward_funcs) + len(model),
                "reward_weights",
                f"has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs"
                + (" and the reward model (its weight first)" if model else ""),
            )
        _require(
            self.max_steps is not None or self.max_time is not None,
            "max_steps",
            "set max_steps or max_time (or both): the run needs an end",
        )
        _require(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be at least 1")
        _require(
            self.warmup_ratio == 0 or self.max_steps is not None,
            "warmup_ratio",
            "is a fraction of max_steps, so set max_steps (or warmup_ratio: 0)",
        )
        _require(
            self.lr_scheduler_type == "constant" or self.max_steps is not None,
            "lr_scheduler_type",
            f"{self.lr_scheduler_type!r} decays over max_steps, so set max_steps (or use 'constant')",
        )
        _require(self.max_time is None or self.max_time > 0, "max_time", "must be positive (seconds)")
        _require(self.torch_threads is None or self.torch_threads >= 1, "torch_threads", "must be at least 1")
        _require(self.save_total_limit >= 1, "save_total_limit", "must be at least 1")
        _require(self.max_consecutive_skips >= 1, "max_consecutive_skips", "must be at least 1")
        _require(
            self.reward_timeout is None or self.reward_timeout > 0,
            "reward_timeout",
            "must be positive (seconds), or null for no limit",
        )
        _require(self.eval_samples >= 1, "eval_samples", "must be at least 1")
        _require(
            self.eval_every_seconds is None or self.eval_every_seconds > 0,
            "eval_every_seconds",
            f"must be positive (seconds of training) or null, got {self.eval_every_seconds}",
        )
        at = self.eval_at_seconds
        _require(
            isinstance(at, list | tuple)
            and all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in at),
            "eval_at_seconds",
            f"must be a list of positive training times in seconds, e.g. [5, 10, 20] (or [] for none), got {at!r}",
        )

    def _validate_tools(self) -> None:
        require_choice(self.tool_format, ("auto", "chat_template", "text"), "tool_format")
        iterations = self.max_tool_calling_iterations
        _require(
            iterations is None or iterations >= 1,
            "max_tool_calling_iterations",
            f"must be >= 1 or null, got {iterations}",
        )
        _require(
            self.tool_timeout is None or self.tool_timeout > 0,
            "tool_timeout",
            f"must be > 0 seconds or null, got {self.tool_timeout}",
        )
        _require(
            self.tools is None
            or (isinstance(self.tools, list) and all(isinstance(t, str) and t for t in self.tools)),
            "tools",
            f"must be a list of file.py:function or module:function paths, got {self.tools!r}",
        )

    def _validate_prompt_stages(self) -> None:
        """The prompt filter, GRESO's skipping, the adaptive k and the reward aggregation."""
        require_choice(self.prompt_filter, PROMPT_FILTERS, "prompt_filter")
        require_choice(self.prompt_filter_exhausted, PROMPT_FILTER_EXHAUSTED, "prompt_filter_exhausted")
        require_choice(self.prompt_skip, PROMPT_SKIPS, "prompt_skip")
        require_choice(self.prompt_skip_mode, PROMPT_SKIP_MODES, "prompt_skip_mode")
        require_choice(self.multi_objective_aggregation, AGGREGATIONS, "multi_objective_aggregation")
        _require(
            self.max_num_gen_batches >= 0,
            "max_num_gen_batches",
            f"must be at least 1 (generation rounds per step, the first included), or 0 for no bound, got "
            f"{self.max_num_gen_batches}",
        )
        check_generation_batch_prompts(
            self.generation_batch_prompts, self.prompts_per_step, self.prompt_filter
        )
        _require(
            0 <= self.prompt_skip_target < 1,
            "prompt_skip_target",
            f"must be in [0, 1) (a fraction of zero-variance groups), got {self.prompt_skip_target}",
        )
        solved, failed = self.prompt_skip_solved_mean, self.prompt_skip_failed_mean
        _require(
            solved is None or failed is None or failed < solved,
            "prompt_skip_failed_mean",
            f"({failed}) must be below prompt_skip_solved_mean ({solved}): a group cannot be both",
        )
        _require(
            isinstance(self.prompt_filter_reward, str) and bool(self.prompt_filter_reward),
            "prompt_filter_reward",
            "must be total or the name of one of the reward functions",
        )
        check_kept_by_difficulty(self.num_generations_kept_by_difficulty, self.num_generations_kept)
        if self.num_generations_kept_by_difficulty is not None:
            _require(
                self.selection_rule != "all" and self.num_generations != "auto",
                "num_generations_kept_by_difficulty",
                "chooses how many of n to keep per group, so it needs a selection rule other than 'all' and a "
                "fixed num_generations",
            )

    def _validate_auto(self) -> None:
        from pods.auto_generations import MODELLED_RULES

        m = self.num_generations_kept
        _require(
            self.num_generations == "auto",
            "num_generations",
            f"must be a number or 'auto', got {self.num_generations!r}",
        )
        _require(
            self.selection_rule in MODELLED_RULES,
            "selection_rule",
            f"num_generations: auto models the rules {', '.join(MODELLED_RULES)}, not {self.selection_rule!r} "
            "(GRPO, rule 'all', has n = m: set num_generations to m)",
        )
        low, high = self.generation_bounds
        _require(low >= m, "num_generations_min", f"must be at least m = {m}, got {low}")
        _require(
            high >= low, "num_generations_max", f"must be at least num_generations_min = {low}, got {high}"
        )
        _require(self.num_generations_every >= 1, "num_generations_every", "must be at least 1")

    @property
    def generation_bounds(self) -> tuple[int, int]:
        """The range of n that ``num_generations: auto`` chooses from."""
        m = self.num_generations_kept
        low = self.num_generations_min if self.num_generations_min is not None else m
        return low, self.num_generations_max if self.num_generations_max is not None else max(16 * m, low)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a mapping; unknown keys are an error that suggests the closest valid key."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=3)
                hint = (
                    f"did you mean {', '.join(close)}?"
                    if close
                    else f"valid keys: {', '.join(sorted(known))}"
                )
                raise ConfigError(f"unknown configuration key {key!r}; {hint}")
        return cls(**{key: _coerce(key, value) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Load a YAML preset (a flat mapping), then apply overrides."""
        return cls.from_dict({**load_yaml_mapping(path), **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold a flat mapping of configuration keys."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"configuration file {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a mapping of configuration keys, got {type(values).__name__}")
    return values


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ``["--key", "value", "--flag", ...]`` or ``["key=value"]`` into a mapping (values parsed as YAML); a list
    key also takes several values, ``--reward_funcs a.py:f b.py:g``, as TRL's command line writes a list."""
    overrides: dict[str, Any] = {}
    for key, raws in group_overrides(items):
        key = key.replace("-", "_")
        values = [_override_value(key, raw) for raw in raws]
        if len(values) > 1 and key in _HINTS and not _takes_list(key):
            raise ConfigError(
                f"option --{key} takes one value, got {len(values)} ({' '.join(raws)}); quote a value with spaces"
            )
        overrides[key] = values if len(values) > 1 else values[0]
    return overrides


def group_overrides(items: list[str]) -> list[tuple[str, list[str]]]:
    """``items`` as ``(key, raw values)`` in order: ``--key value [value ...]``, ``--key=value`` or ``key=value``."""
    groups: list[tuple[str, list[str]]] = []
    index = 0
    while index < len(items):
        item = items[index]
        if item.startswith("--"):
            key, sep, raw = item[2:].partition("=")
            index += 1
            if not sep:  # the first value is taken as it is (a template may hold "="), more while they last
                if index >= len(items) or items[index].startswith("--"):
                    raise ConfigError(f"option --{key} needs a value (e.g. --{key} VALUE)")
                raw, index = items[index], index + 1
            raws = [raw]
            while not sep and index < len(items) and not _starts_override(items[index]):
                raws.append(items[index])
                index += 1
        else:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"cannot read override {item!r}: write --key value or key=value")
            raws = [raw]
            index += 1
        groups.append((key, raws))
    return groups


def _starts_override(item: str) -> bool:
    """``--key...`` or ``key=value``: the next override rather than one more value of a list."""
    return item.startswith("--") or re.match(r"[A-Za-z_][\w-]*=", item) is not None


def _override_value(key: str, raw: str) -> Any:
    as_written = _text_only(key) and raw not in ("null", "~") and not _quoted(raw)
    return raw if as_written else _parse_value(raw)


def _takes_list(key: str) -> bool:
    hint = _HINTS.get(key)
    allowed = get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return any(get_origin(kind) is list for kind in allowed)


def _quoted(raw: str) -> bool:
    """``"..."`` or ``'...'``: YAML text, e.g. with ``\\n`` escapes in double quotes."""
    return len(raw) >= 2 and raw[0] in "\"'" and raw[-1] == raw[0]


def _text_only(key: str) -> bool:
    """A key whose value is text (or null): the command line's value is taken as written, so that a template
    such as ``Question: {problem}`` stays text instead of being read as a YAML mapping."""
    hint = _HINTS.get(key)
    allowed = set(get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
    return hint is not None and allowed <= {str, type(None)}


def _parse_value(raw: str) -> Any:
    """A command-line value as YAML would read it, plus numbers such as ``1e-5`` that YAML 1.1 leaves as text."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


_HINTS = get_type_hints(TrainConfig)


def _coerce(key: str, value: Any) -> Any:
    """Check a value against the field's type, converting only the harmless cases (int -> float, str -> [str])."""
    hint = _HINTS[key]
    allowed = get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{key} cannot be null")
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    for kind in allowed:
        if get_origin(kind) is list and isinstance(value, list):
            return value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and is_number and float(value).is_integer() and not isinstance(value, float):
            return value
        if kind is float and is_number:
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    if list[str] in allowed and isinstance(value, str):
        return [value]
    if float in allowed and isinstance(value, str):  # YAML 1.1 reads 5e-6 (no dot) as text
        try:
            return float(value)
        except ValueError:
            pass
    wanted = " or ".join(
        "null"
        if k is type(None)
        else "a list ([a, b])"
        if get_origin(k) is list
        else getattr(k, "__name__", str(k))
        for k in allowed
    )
    raise ConfigError(f"{key} must be {wanted}, got {value!r}")


def check_generation_batch_prompts(
    value: int | str | None, prompts_per_step: int, prompt_filter: str
) -> None:
    """``generation_batch_prompts``: None, ``auto`` or a number of prompts at least ``prompts_per_step``, with a filter."""
    if value is None:
        return
    _require(
        value == "auto"
        or (isinstance(value, int) and not isinstance(value, bool) and value >= prompts_per_step),
        "generation_batch_prompts",
        f"must be null, auto, or a number of prompts of at least prompts_per_step ({prompts_per_step}), got {value!r}",
    )
    _require(
        prompt_filter != "none",
        "generation_batch_prompts",
        "oversamples a step's first round for the prompt filter, which drops groups; without a filter every "
        "group generated is trained on: set prompt_filter: nonzero_std, or remove generation_batch_prompts",
    )


def check_kept_by_difficulty(values: list[int] | None, kept: int) -> None:
    """``num_generations_kept_by_difficulty``: one k per quartile, each from 2 to m (``num_generations_kept``)."""
    if values is None:
        return
    _require(
        isinstance(values, list | tuple)
        and len(values) == DIFFICULTY_BUCKETS
        and all(isinstance(k, int) and not isinstance(k, bool) and 2 <= k <= kept for k in values),
        "num_generations_kept_by_difficulty",
        f"must list {DIFFICULTY_BUCKETS} counts kept per group, easiest quartile first, each from 2 to "
        f"num_generations_kept ({kept}), e.g. [2, 3, {kept}, {kept}]; got {values!r}",
    )


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def require_choice(value: str, choices: tuple[str, ...], key: str) -> None:
    """Raise ``ConfigError`` unless ``value`` is one of ``choices`` (the message lists them)."""
    if value not in choices:
        raise ConfigError(f"{key}: unknown value {value!r}; choose one of {', '.join(choices)}")


def _divisors(number: int) -> str:
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)
