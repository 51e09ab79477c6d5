"""A DeepSpeed ZeRO-3 model's weights pushed into the vLLM engine, one gathered layer at a time, in one
CPU process; used by tests/test_vllm.py as a subprocess (DeepSpeed and vLLM keep process-wide state).

    python tests/scripts/zero3_vllm.py MODEL_DIR [full] [lora]

Each case in turn, in this one process (one start-up for both): ``full`` fine-tunes the whole model, ``lora``
a peft LoRA model (base frozen, adapters trained), partitioned like the rest. Prints, per case,
``<case> PARTITIONED <n>`` (parameters whose local tensor is an empty shard), ``<case> CHANGED <bool>`` (the
AdamW step moved the trained weights away from their start) and ``<case> SAME <bool>`` (the engine's greedy
completions equal HF ``generate``'s on the full, unpartitioned model after that step).
"""

from __future__ import annotations

import os
import socket
import sys

import torch

from pods.process_exit import exit_process


def main() -> None:
    model_dir, cases = sys.argv[1], sys.argv[2:] or ["full"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import deepspeed

    from pods.testing import use_torch_collectives_under_deepspeed

    use_torch_collectives_under_deepspeed()
    for case in cases:
        deepspeed.init_distributed(dist_backend="gloo")
        run_case(model_dir, lora=case == "lora", case=case)  # closing its vLLM engine ends the process group
        # DeepSpeed still caches groups on it; forget them (no public call does) so the next case starts anew
        deepspeed.utils.groups._release_process_group_references()


def run_case(model_dir: str, *, lora: bool, case: str) -> None:
    import deepspeed
    from transformers import AutoModelForCausalLM

    from pods.models import load_tokenizer
    from pods.rollout import HFGenerateEngine, SamplingParams
    from pods.rollout.vllm import VLLMEngine

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    torch.manual_seed(0)

    def fresh_model():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        return model

    model = fresh_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trained)
    tokenizer = load_tokenizer(model_dir)
    batch = tokenizer(["Tom has 5 apples and 3 pears."], return_tensors="pt")
    loss = engine(**batch, labels=batch["input_ids"]).loss
    engine.backward(loss)
    engine.step()  # the weights now differ from the checkpoint's
    partitioned = sum(p.numel() == 0 for p in engine.module.parameters())
    print(f"{case} PARTITIONED {partitioned}", flush=True)

    vllm_engine = VLLMEngine(engine.module, tokenizer, kv_cache_gb=0.05)
    prompts = ["Tom has 5 apples.", "A box holds 7 pens.", "Mia has 12 cards."]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    sampled = vllm_engine.generate(prompts, 1, greedy)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    full = fresh_model()  # the same architecture, unpartitioned, holding the trained weights
    full.load_state_dict(weights)
    reference = HFGenerateEngine(full.eval(), tokenizer).generate(prompts, 1, greedy)
    changed = any(not torch.equal(weights[k], start[k]) for k in start)
    print(f"{case} CHANGED {changed}", flush=True)
    same = sampled.texts == reference.texts and torch.equal(sampled.completion_ids, reference.completion_ids)
    print(f"{case} SAME {same}", flush=True)
    vllm_engine.close()


if __name__ == "__main__":
    main()
    exit_process(0)
