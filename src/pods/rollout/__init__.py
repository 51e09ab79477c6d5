"""Rollout engines: sample n completions per prompt behind one small protocol (HF ``generate`` or vLLM).

:func:`choose_engine` turns the ``rollout_engine`` setting (``auto``, ``hf``, ``vllm``) into the engine
that runs here and says why; :func:`build_engine` builds it around the model being trained.
"""

from __future__ import annotations

from typing import Any

import torch

from pods.config import ROLLOUT_ENGINES
from pods.rollout.base import RolloutEngine, Rollouts, SamplingParams
from pods.rollout.hf import HFGenerateEngine

__all__ = [
    "ROLLOUT_ENGINES",
    "HFGenerateEngine",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "build_engine",
    "choose_engine",
]


def choose_engine(requested: str, *, model: torch.nn.Module | None = None) -> tuple[str, str]:
    """``(engine, reason)``: ``auto`` is vLLM where it is installed and can run here, else HF ``generate``.
    A 4-bit base runs on either (vLLM gets it dequantized)."""
    if requested not in ROLLOUT_ENGINES:
        raise ValueError(
            f"rollout_engine: unknown value {requested!r}; choose one of {', '.join(ROLLOUT_ENGINES)}"
        )
    if requested == "hf":
        return "hf", "requested"
    from pods.rollout.vllm import vllm_unavailable_reason

    reason = vllm_unavailable_reason(model)
    if reason is None and requested == "auto" and _cpu_processes() > 1:
        reason = "several CPU processes: one vLLM engine per process is untested on the CPU backend"
    if requested == "vllm":
        if reason is not None:
            raise ValueError(
                f"rollout_engine: vllm cannot run here: {reason}; use rollout_engine: hf or auto"
            )
        return "vllm", "requested"
    if reason is not None:
        return "hf", f"auto: {reason}"
    return "vllm", "auto: vLLM is installed and can run here"


def engine_choice(config: Any, accelerator: Any, model: torch.nn.Module) -> tuple[str, str]:
    """:func:`choose_engine` for a run, as one-line configuration errors (also: HF ``generate`` cannot sample
    from a model FSDP shards over several processes)."""
    from pods.errors import ConfigError

    try:
        engine, reason = choose_engine(config.rollout_engine, model=model)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if engine == "hf" and accelerator.is_fsdp2 and accelerator.num_processes > 1:
        raise ConfigError(
            "rollout_engine: hf cannot sample from a model that FSDP shards over several processes (every "
            "process would wait for the others' shards at each token); use rollout_engine: vllm"
        )
    return engine, reason


def build_engine(
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    generation_batch_size: int = 64,
    max_prompt_length: int | None = None,
    vllm_options: dict[str, Any] | None = None,
    share_prefix: bool = True,
) -> RolloutEngine:
    """The engine called ``name`` ("hf" or "vllm") sampling from ``model``; ``vllm_options`` go to VLLMEngine;
    ``share_prefix``: HF prefills each prompt once for its n samples (vLLM's prefix cache does it itself)."""
    if name == "hf":
        return HFGenerateEngine(
            model,
            tokenizer,
            generation_batch_size=generation_batch_size,
            max_prompt_length=max_prompt_length,
            share_prefix=share_prefix,
        )
    if name == "vllm":
        options = dict(vllm_options or {})
        if options.pop("mode", "colocate") == "server":
            from pods.rollout.vllm_server import VLLMServerEngine

            return VLLMServerEngine(model, tokenizer, max_prompt_length=max_prompt_length, **options)
        from pods.rollout.vllm import VLLMEngine

        return VLLMEngine(model, tokenizer, max_prompt_length=max_prompt_length, **options)
    raise ValueError(f"unknown rollout engine {name!r}; choose hf or vllm")


def _cpu_processes() -> int:
    """Processes of this launch when training on the CPU (0 with a GPU)."""
    import os

    return 0 if torch.cuda.is_available() else int(os.environ.get("WORLD_SIZE", "1"))
