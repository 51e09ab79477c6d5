"""Cross-process reductions the trainer needs, each a no-op with one process.

Every process generates, scores and selects for its own prompts; these helpers are the few places where
the processes meet: metrics over every process, and clock-based decisions that all must take together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pods.errors import ConfigError


def require_every_launched_process(accelerator: Any) -> None:
    """Stop with a :class:`ConfigError` when the launcher started more processes (``WORLD_SIZE``) than
    accelerate joined into this run: each would train alone and write the same run folder. accelerate does
    that on a CPU with DeepSpeed, for one."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes (WORLD_SIZE) but accelerate runs this one as "
            f"{accelerator.num_processes} of {accelerator.num_processes} ({accelerator.distributed_type.value}), "
            "so each would train alone into the same run folder (accelerate does this with DeepSpeed on machines "
            "without a GPU: there, launch with --multi_gpu and ACCELERATE_USE_CPU=true)"
        )


def close_process_group() -> None:
    """Destroy the default process group, if one is up, once every process is done with it. A group left
    alive can abort the interpreter at exit after a finished run ("terminate called without an active
    exception", seen with gloo on 2 CPU processes); torch asks programs to destroy it. Not on a crash: with
    NCCL, destroying a group that a failed collective still holds can hang. A vLLM engine built on the
    group is closed first (its exit hook would fail on the destroyed group)."""
    from pods.rollout.vllm import close_live_engine

    close_live_engine()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def local_processes(accelerator: Any) -> int:
    """The processes of this launch on this machine (torchrun's LOCAL_WORLD_SIZE; all of them without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))


def weights_are_sharded(accelerator: Any) -> bool:
    """Whether each process holds a shard of every parameter (DeepSpeed ZeRO-3, FSDP), not the whole weights."""
    plugin = accelerator.state.deepspeed_plugin
    zero3 = plugin is not None and plugin.deepspeed_config.get("zero_optimization", {}).get("stage") == 3
    return zero3 or accelerator.distributed_type.value == "FSDP"


def gather(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """Every process's ``values`` (equal shapes), concatenated along the first dimension, on ``values``' device."""
    if accelerator.num_processes == 1:
        return values
    return accelerator.gather(values.to(accelerator.device)).to(values.device)


def every_process(accelerator: Any, value: Any) -> list[Any]:
    """Every process's ``value`` (any picklable object), in process order, on each process (through the
    accelerator's own ``every_process`` where it has one: the rollout workers' :class:`GroupCollectives`)."""
    if accelerator.num_processes == 1:
        return [value]
    if hasattr(accelerator, "every_process"):
        return accelerator.every_process(value)
    from accelerate.utils import gather_object

    return gather_object([value])


def failure_of(
    action: Callable[[], Any], catch: type[BaseException] | tuple, alone: bool
) -> tuple[Any, str | None]:
    """``(action(), None)``, or with other processes to tell (``alone`` false) ``(None, its error in one line)``
    when it raises one of ``catch``; alone, the error is raised as it is."""
    if alone:
        return action(), None
    try:
        return action(), None
    except catch as error:
        text = str(error).splitlines()[0] if str(error) else ""
        return None, f"{type(error).__name__}: {text}"


def raise_any_failure(
    every_process: Callable[[Any], list[Any]],
    failure: str | None,
    error: Callable[[str], Exception],
    extra: Any = None,
    prefix: str = "",
) -> list[Any]:
    """Every process's ``extra``, unless a process reports a ``failure``: then ``error`` is raised on every process
    alike, naming each failing process (one line each, after ``prefix``), so that none waits for another in a
    later collective. A collective: every process calls it at the same point."""
    reports = every_process((failure, extra))
    failures = [(rank, text) for rank, (text, _) in enumerate(reports) if text]
    if failures:
        if len(reports) == 1:
            raise error(prefix + failures[0][1])
        raise error(prefix + "; ".join(f"process {rank}: {text}" for rank, text in failures))
    return [value for _, value in reports]


def synced_max(accelerator: Any, value: float) -> float:
    """The largest ``value`` over processes (e.g. the slowest process's seconds), so all decide alike."""
    if accelerator.num_processes == 1:
        return value
    tensor = torch.tensor(value, dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(tensor, "max"))


def synced_counts(accelerator: Any, counts: list[int]) -> list[int]:
    """Each of ``counts`` at its largest over processes (equal lengths on every process), e.g. the forwards of
    each micro-batch, so that every process runs as many collectives as the busiest."""
    if accelerator.num_processes == 1:
        return list(counts)
    tensor = torch.tensor(counts, dtype=torch.long, device=accelerator.device)
    return [int(count) for count in accelerator.reduce(tensor, "max").tolist()]


def synced_any(accelerator: Any, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(int(flag), device=accelerator.device), "max"))


def synced_sum(accelerator: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over processes (on the accelerator's device with several processes)."""
    if accelerator.num_processes == 1:
        return values
    return accelerator.reduce(values.to(accelerator.device), "sum")


def synced_mean(accelerator: Any, value: float) -> float:
    """The mean of a scalar over processes."""
    total = synced_sum(accelerator, torch.tensor(value, dtype=torch.float64))
    return float(total) / accelerator.num_processes


@contextlib.contextmanager
def gradients_kept_local(accelerator: Any, model: Any) -> Iterator[None]:
    """Backward passes inside add to this process's gradients only: no gradient sync (DDP's and FSDP's
    ``no_sync``) and, under DeepSpeed, no accumulation boundary (it would step in backward). For every
    forward of a micro-batch that runs as several but its last; inside an accumulating micro-batch it
    changes nothing."""
    if not accelerator.sync_gradients:
        yield
        return
    accelerator.sync_gradients = False  # accelerate's switch: DeepSpeed's backward reads it as the boundary
    try:
        with accelerator.no_sync(model):
            yield
    finally:
        accelerator.sync_gradients = True


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
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:  # the exported model/ folder needs the gathered weights (exported_state_dict)
        zero["stage3_gather_16bit_weights_on_model_save"] = True


def exported_state_dict(accelerator: Any, model: Any) -> dict[str, torch.Tensor] | None:
    """The model's full weights for an export, gathered from every process under DeepSpeed ZeRO-3 or FSDP2 (a
    collective: call on every process; the main process gets them); None elsewhere, where
    ``save_pretrained`` reads the model itself. Without it, the export would hold each parameter's local
    shard. A tied weight keeps its first name only: gathered copies no longer share storage, so
    ``save_pretrained`` would write both."""
    plugin = accelerator.state.deepspeed_plugin
    zero3 = plugin is not None and plugin.deepspeed_config.get("zero_optimization", {}).get("stage") == 3
    if not (zero3 or accelerator.is_fsdp2):
        return None
    weights = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    aliases = {name for name, _ in unwrapped.named_parameters(remove_duplicate=False)}
    aliases -= {name for name, _ in unwrapped.named_parameters()}
    return {name: value for name, value in weights.items() if name not in aliases}


def deepspeed_guards_non_finite_steps(model: Any) -> None:
    """Make a DeepSpeed engine skip any optimizer step whose gradients hold NaN/inf, as pods' guard does.

    DeepSpeed steps inside ``backward``, before pods sees the gradients, so the skip has to be DeepSpeed's:
    its ZeRO optimizers check the partitioned gradients (across ranks) when ``check_grad_overflow`` is on,
    which a bf16 config may turn off and which fp32 only does through the gradient norm; pods turns it on.
    Without a ZeRO optimizer (stage 0) DeepSpeed has no such check: refused. No-op for other models.
    """
    optimizer = getattr(model, "optimizer", None)
    if not hasattr(model, "was_step_applied") or optimizer is None:
        return
    if not hasattr(optimizer, "overflow"):
        from pods.errors import ConfigError

        raise ConfigError(
            "DeepSpeed without ZeRO (zero_stage 0) applies optimizer steps with NaN/inf gradients, past pods' "
            "non-finite guard; use zero_stage 1, 2 or 3 in the accelerate config"
        )
    if hasattr(optimizer, "check_grad_overflow"):
        optimizer.check_grad_overflow = True


def step_was_applied(model: Any) -> bool:
    """Whether the optimizer step DeepSpeed took inside the last boundary ``backward`` was applied (it skips
    one with NaN/inf gradients); True for any other model, whose step pods takes itself."""
    applied = getattr(model, "was_step_applied", None)
    return True if applied is None else bool(applied())
