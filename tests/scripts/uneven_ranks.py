"""The policy update on two CPU processes whose rows plan different numbers of forwards, under DeepSpeed ZeRO-2,
ZeRO-3 and FSDP2, each built from the repo's accelerate configs (mixed precision off), all in one launch:

    ACCELERATE_USE_CPU=true CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 \\
        tests/scripts/uneven_ranks.py MODEL_DIR zero2 zero3 fsdp2

Process 0's completions are 2 tokens long, process 1's 14, so that with a small ``token_budget`` process 1 plans
more packed forwards per micro-batch than process 0. Each case runs the update (2 micro-batches, 2 passes, so
old log-probs too) twice from the same weights, with a small budget and with one large enough for a single
forward per micro-batch, and prints per process ``CASE <case> RANK <r> <distributed type> PLANNED <small> <large>
FORWARDS <small> <large>`` (forwards planned from its own rows, and forwards its model ran) and, from process 0,
``CASE <case> DIFFERENCE <max abs> MOVED <max abs>``: how far the weights after the two updates are apart, and
how far the update moved them (SGD, learning rate 1: the step is the gradient). Case ``generation``: HF
``generate`` and a greedy evaluation under ZeRO-3 (:func:`generation`), printing ``CASE generation RANK <r>
FORWARDS <n> ROWS <generated> ACCURACY <evaluated>``.
"""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

from pods.checkpoint import TrainerState
from pods.config import TrainConfig
from pods.distributed import deepspeed_batch_settings, deepspeed_guards_non_finite_steps
from pods.loss import plan_forwards
from pods.process_exit import exit_process
from pods.rollout import Rollouts
from pods.testing import use_torch_collectives_under_deepspeed
from pods.update import NonFiniteGuard, policy_update, split_evenly

CONFIGS = Path(__file__).resolve().parents[2] / "src" / "pods" / "configs" / "accelerate"
PROMPTS, KEPT, MICRO_BATCH, PROMPT_LENGTH, SMALL_BUDGET, LARGE_BUDGET = 2, 4, 4, 6, 16, 4096
COMPLETION_LENGTH = {0: 2, 1: 14}  # per process


def plugins(case: str) -> dict:
    """The accelerate plugin of ``case``, from the repo's YAML (ZeRO-3 is the ZeRO-2 file at stage 3)."""
    if case == "fsdp2":
        # as `accelerate launch --config_file fsdp2.yaml` passes them: FSDP_VERSION=2 and so on
        fsdp = yaml.safe_load((CONFIGS / "fsdp2.yaml").read_text())["fsdp_config"]
        variables = {key.upper(): str(value) for key, value in fsdp.items()}
        os.environ.update(variables)
        plugin = FullyShardedDataParallelPlugin()
        for key in variables:
            os.environ.pop(key)
        return {"fsdp_plugin": plugin}
    deepspeed = yaml.safe_load((CONFIGS / "deepspeed_zero2.yaml").read_text())["deepspeed_config"]
    deepspeed.pop("deepspeed_multinode_launcher")  # the launcher's, not the plugin's
    plugin = DeepSpeedPlugin(**{**deepspeed, "zero_stage": 3 if case == "zero3" else 2})
    if case == "zero3":  # partition even the tiny model's parameters, so that every forward gathers them
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return {"deepspeed_plugin": plugin}


def uneven_rows(rank: int, vocab: int) -> Rollouts:
    """PROMPTS x KEPT rows whose completions are COMPLETION_LENGTH[rank] tokens long."""
    generator = torch.Generator().manual_seed(rank)
    rows, length = PROMPTS * KEPT, COMPLETION_LENGTH[rank]
    prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_LENGTH), generator=generator)
    return Rollouts(
        prompt_ids=prompts.repeat_interleave(KEPT, dim=0),
        prompt_mask=torch.ones(rows, PROMPT_LENGTH, dtype=torch.long),
        completion_ids=torch.randint(3, vocab, (rows, length), generator=generator),
        completion_mask=torch.ones(rows, length, dtype=torch.long),
        texts=[""] * rows,
        truncated=torch.zeros(rows, dtype=torch.bool),
        num_prompts=PROMPTS,
        num_generations=KEPT,
    )


def settings(budget: int) -> TrainConfig:
    return TrainConfig(
        num_generations=KEPT, num_generations_kept=KEPT, prompts_per_step=PROMPTS, micro_batch_size=MICRO_BATCH,
        max_completion_length=16, loss_type="dapo", num_iterations=2, packing=True, token_budget=budget,
        temperature=1.0, learning_rate=1.0,
    )  # fmt: skip


def planned(model: torch.nn.Module, batch: Rollouts, config: TrainConfig) -> int:
    """Forwards this process's own rows plan for one pass (what each process ran before the fix)."""
    rows = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    parts = split_evenly(len(batch), len(batch) // MICRO_BATCH)
    return sum(
        len(plan_forwards(model, *[t[p] for t in rows], packing=True, token_budget=config.token_budget))
        for p in parts
    )


def prepared(case: str, model: torch.nn.Module, config: TrainConfig, micro_batches: int) -> tuple:
    """(accelerator, prepared model, optimizer, forwards counter) for ``case``, as the trainer prepares them."""
    AcceleratorState._reset_state(reset_partial_state=False)  # the process group stays
    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):  # set by the previous case's Accelerator
        os.environ.pop(key, None)
    gate = DistributedType.MULTI_GPU if case == "fsdp2" else DistributedType.MULTI_CPU
    PartialState._shared_state["distributed_type"] = gate  # accelerate applies FSDP only past this gate
    accelerator = Accelerator(
        mixed_precision="no", gradient_accumulation_steps=micro_batches, **plugins(case)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    deepspeed_batch_settings(accelerator, MICRO_BATCH, micro_batches, config.max_grad_norm)
    model, optimizer = accelerator.prepare(model, optimizer)
    deepspeed_guards_non_finite_steps(model)
    forwards = [0]
    accelerator.unwrap_model(model).register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1)
    )
    return accelerator, model, optimizer, forwards


def update(case: str, initial: torch.nn.Module, batch: Rollouts, budget: int) -> tuple[dict, int, int, str]:
    """(the full weights after one update, on process 0; forwards planned; forwards the model ran; the
    distributed type that ran it)."""
    config = settings(budget)
    micro_batches = len(batch) // MICRO_BATCH
    model = copy.deepcopy(initial)
    count = planned(model, batch, config)
    accelerator, model, optimizer, forwards = prepared(case, model, config, micro_batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    advantages = torch.linspace(-1.0, 1.0, len(batch))
    guard = NonFiniteGuard(TrainerState(), 3, Path("unused"))
    policy_update(accelerator, model, optimizer, scheduler, batch, advantages, config, guard)
    gathered = accelerator.get_state_dict(model) or {}  # a collective; ZeRO-3 gives process 0 alone its dict
    weights = {name: value.detach().clone() for name, value in gathered.items()}
    return weights, count, forwards[0], accelerator.distributed_type.value


def answer_is_a(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """1 for the rows whose answer is "a", whatever the completion: the accuracy counts the rows scored."""
    return [float(answer == "a") for answer in columns["answer"]]


def generation(model_dir: str, initial: torch.nn.Module) -> None:
    """HF generation on a model ZeRO-3 partitions over the processes (every forward gathers it): 2 prompts each,
    repeated on process 1 alone (a shared prefill would be its forward alone), then a greedy evaluation of 3
    problems, one per batch (2 on process 0, 1 on process 1 before the fix)."""
    from transformers import AutoTokenizer

    from pods.evaluation import evaluate
    from pods.rollout import HFGenerateEngine, SamplingParams

    accelerator, model, _, forwards = prepared("zero3", copy.deepcopy(initial), settings(LARGE_BUDGET), 1)
    rank, policy = accelerator.process_index, accelerator.unwrap_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFGenerateEngine(policy, tokenizer)
    torch.manual_seed(rank)  # different draws on each process
    prompts = ["say a", "say b"] if rank == 0 else ["say a", "say a"]
    rollouts = engine.generate(prompts, 1, SamplingParams(max_new_tokens=12, temperature=1.5))
    problems = [{"prompt": f"say {letter}", "answer": letter} for letter in "abc"]
    result = evaluate(
        policy, tokenizer, problems, answer_is_a, max_new_tokens=4, batch_size=1, accelerator=accelerator,
        engine=engine,
    )  # fmt: skip
    rows = len(rollouts)
    say(f"CASE generation RANK {rank} FORWARDS {forwards[0]} ROWS {rows} ACCURACY {result.accuracy:.6f}")


def main() -> None:
    from transformers import AutoModelForCausalLM

    model_dir, cases = sys.argv[1], sys.argv[2:]
    if os.environ.get("ACCELERATE_USE_CPU") != "true":
        raise SystemExit("launch with ACCELERATE_USE_CPU=true (gloo over CPU processes)")
    state = PartialState(
        cpu=True, timeout=timedelta(seconds=60)
    )  # a collective mismatch fails within a minute
    os.environ.pop("ACCELERATE_USE_CPU")  # else accelerate ignores the DeepSpeed plugin
    use_torch_collectives_under_deepspeed()
    rank = state.process_index
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = uneven_rows(rank, initial.config.vocab_size)
    for case in cases:
        if case == "generation":
            generation(model_dir, initial)
            continue
        small, planned_small, ran_small, kind = update(case, initial, batch, SMALL_BUDGET)
        large, planned_large, ran_large, _ = update(case, initial, batch, LARGE_BUDGET)
        counts = f"PLANNED {planned_small} {planned_large} FORWARDS {ran_small} {ran_large}"
        say(f"CASE {case} RANK {rank} {kind} {counts}")
        if rank == 0:
            start = initial.state_dict()
            difference = max(float((small[k] - large[k]).abs().max()) for k in start)
            moved = max(float((large[k] - start[k]).abs().max()) for k in start)
            say(f"CASE {case} DIFFERENCE {difference:.3e} MOVED {moved:.3e}")
    torch.distributed.destroy_process_group()


def say(line: str) -> None:
    """One line in one write (the processes share a pipe)."""
    os.write(1, f"{line}\n".encode())


if __name__ == "__main__":
    main()
    exit_process(0)
