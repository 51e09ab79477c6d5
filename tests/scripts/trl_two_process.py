"""Two-process PODS-in-TRL check, run by tests/test_trl.py as:
``accelerate launch --multi_gpu --num_processes 2 tests/scripts/trl_two_process.py MODEL_DIR OUTPUT_DIR MODES``,
MODES being ``plain``, ``stages``, ``masked_chunk`` or several, comma-separated (one after the other in the same
processes: one launch).

Each mode trains 2 steps and asserts, on every process and step, that each group of n inputs is one prompt
(groups are process-local), that the processes hold different prompts, and that m of each n rows come back.
With ``stages``, the prompt filter and GRESO are on and half the prompts give all-equal rewards: both
processes run the same number of generation rounds and each trains on its own groups that passed.
With ``masked_chunk``, the kept rows' packed log-probs (:func:`pods.integrations.trl.fused_packed_logps`) of a model
that FSDP2 shards over the two processes, whose chunk weighs nothing on process 0 alone: both run one forward
(each gathers the parameters with the other; on 845c824 gloo aborts with a collective mismatch).
Prints ``PODS-TWO-PROCESS-OK rank=R mode=MODE checks=K`` for each mode that passed.
"""

from __future__ import annotations

import sys

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from datasets import Dataset

from pods.advantages import group_advantages, zero_variance_groups
from pods.architectures import row_plan
from pods.distributed import close_process_group
from pods.integrations.trl import PODSConfig, PODSTrainer, fused_packed_logps
from pods.process_exit import exit_process
from pods.prompt_filter import fill_groups
from pods.selection import select

SEEN: list[list[int]] = []  # this process's completions, in the order the reward function saw them
STAGES = False  # the mode being run: with the prompt filter and GRESO


def score(ids: list[int], number: int) -> float:
    """The completion's token-id sum modulo 4; with STAGES, 1 for even-numbered prompts (all-equal groups)."""
    return 1.0 if STAGES and number % 2 == 0 else float(sum(ids) % 4)


def token_sum_reward(completion_ids: list[list[int]], number: list[int], **kwargs) -> list[float]:
    SEEN.extend(zip(completion_ids, number, strict=True))
    return [score(ids, k) for ids, k in zip(completion_ids, number, strict=True)]


class CheckedPODSTrainer(PODSTrainer):
    """PODSTrainer that checks the group layout it receives and returns."""

    checks = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[int] = []  # generation rounds of each generation batch

    def _generate_and_score_completions(self, inputs):
        n, m = self.num_generations, self.num_generations_kept
        prompts = [example["prompt"][0]["content"] for example in inputs]
        groups = [prompts[i : i + n] for i in range(0, len(prompts), n)]
        assert len(prompts) % n == 0, f"{len(prompts)} local inputs are not whole groups of n={n}"
        assert all(len(set(group)) == 1 for group in groups), f"a group mixes prompts: {groups}"
        everyone = gather_object([sorted({group[0] for group in groups})])
        assert len(everyone) == 2 and not set(everyone[0]) & set(everyone[1]), (
            f"processes share a group: {everyone}"
        )
        SEEN.clear()
        batch = super()._generate_and_score_completions(inputs)
        assert batch["completion_ids"].shape[0] == len(groups) * m, "selection did not keep m rows per group"
        # The kept rows are this process's own completions: the groups that passed (STAGES) or all of them,
        # then the max-variance m of each.
        rewards = torch.tensor([score(ids, k) for ids, k in SEEN]).view(-1, n)
        rounds = gather_object([rewards.shape[0] // len(groups)])
        assert rounds[0] == rounds[1], f"the processes ran different numbers of generation rounds: {rounds}"
        taken = fill_groups(~zero_variance_groups(rewards), len(groups), "train_fewer")
        trained = taken.positions if STAGES else torch.arange(len(groups))
        weighs = taken.trained if STAGES else torch.ones(len(groups), dtype=torch.bool)
        kept = select(rewards[trained], m, "max_variance")
        expected = [
            SEEN[row][0]
            if weighs[slot]
            else []  # a group trained without (train_fewer): no tokens in the loss
            for slot, group_rows in enumerate((kept + n * trained.unsqueeze(1)).tolist())
            for row in group_rows
        ]
        rows = zip(batch["completion_ids"], batch["completion_mask"], strict=True)
        assert [ids[mask.bool()].tolist() for ids, mask in rows] == expected, (
            "kept rows are not the local selection"
        )
        advantages = group_advantages(rewards[trained].gather(1, kept)) * weighs.unsqueeze(1)
        assert torch.equal(batch["advantages"], advantages.view(-1))
        assert batch["num_items_in_batch"].item() == sum(
            gather_object([batch["completion_mask"].sum().item()])
        )
        self.rounds.append(rounds[0])
        self.checks += 1
        return batch


def main(model_dir: str, output_dir: str, modes: list[str]) -> None:
    global STAGES
    for mode in modes:
        STAGES = mode == "stages"
        if mode == "masked_chunk":
            rank, checks = masked_chunk_forwards(model_dir)
        else:
            rank, checks = train_two_steps(model_dir, f"{output_dir}/{mode}")
        print(f"PODS-TWO-PROCESS-OK rank={rank} mode={mode} checks={checks}", flush=True)
    close_process_group()


def train_two_steps(model_dir: str, output_dir: str) -> tuple[int, int]:
    """Two checked steps in the current mode; (this process's rank, checks passed)."""
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Question {i}: 3 + {i}"}], "number": i} for i in range(32)]
    )
    args = PODSConfig(
        output_dir=output_dir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_completion_length=8,
        num_generations=4,
        num_generations_kept=2,
        per_device_train_batch_size=8,
        max_steps=2,
        logging_steps=1,
        seed=0,
        **(
            {"prompt_filter": "nonzero_std", "prompt_skip": "greso", "max_num_gen_batches": 3}
            if STAGES
            else {}
        ),
    )
    trainer = CheckedPODSTrainer(
        model=model_dir, reward_funcs=token_sum_reward, args=args, train_dataset=dataset
    )
    assert trainer.accelerator.num_processes == 2, "run me with accelerate launch --num_processes 2"
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.checks == 2, (trainer.state.global_step, trainer.checks)
    assert any("pods/reward_kept" in log for log in trainer.state.log_history)
    assert not STAGES or max(trainer.rounds) > 1, f"no refill round ran: {trainer.rounds}"
    return trainer.accelerator.process_index, trainer.checks


def masked_chunk_forwards(model_dir: str) -> tuple[int, int]:
    """One chunk's packed log-probs under FSDP2, all its rows weighing nothing on process 0 only; (rank, 1) once
    both processes ran one forward and process 1's log-probs are real (0 where nothing weighs)."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    rank = PartialState(cpu=True).process_index  # the process group (up already after another mode)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    add_fused_lm_head(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    row_plan(model)  # the model's self-check (same forwards on both processes) before counting
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, model.config.vocab_size, (4, 5), generator=generator)
    completion_ids = torch.randint(3, model.config.vocab_size, (4, 6), generator=generator)
    weighs = torch.full((4, 6), rank, dtype=torch.long)  # process 0: a chunk of rows trained without
    with torch.no_grad():
        logps = fused_packed_logps(
            model, [prompt_ids, torch.ones_like(prompt_ids), completion_ids, weighs], 64
        )
    counts = gather_object([forwards[0]])
    assert counts == [1, 1], f"forwards per process: {counts}"
    assert bool((logps != 0).all()) == bool(rank) and not bool(logps[weighs == 0].any()), logps
    return rank, 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
    exit_process(0)
