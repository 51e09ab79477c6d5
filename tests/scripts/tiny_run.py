"""Train the tiny test model for a few steps; used by the tests as a real subprocess (crashes, 2 processes).

    python tests/scripts/tiny_run.py MODEL_DIR OUTPUT_DIR '{"max_steps": 4, ...}'
    accelerate launch --cpu --num_processes 2 tests/scripts/tiny_run.py MODEL_DIR OUTPUT_DIR '{...}'

Prints one line per process: ``RESULT <rank> <steps> <parameter checksum> <first prompt of step 0>``, or
``STOPPED <rank> <signal> <step> <checkpoint>`` after a graceful stop (exit status 128 + the signal's number).
``TINY_RUN_REWARD=half_constant`` trains on :func:`half_constant` instead of :func:`count_of_a`, and
``TINY_RUN_DATASET_SIZE=K`` on K prompts instead of 64.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from pods.config import TrainConfig
from pods.distributed import close_process_group
from pods.process_exit import exit_process
from pods.testing import use_torch_collectives_under_deepspeed
from pods.trainer import PODSTrainer, TrainingStopped

# A few-second run of the tiny test model: 2 prompts x n=4, m=2 kept, 8 new tokens, 2 steps, no eval.
TINY_SETTINGS = {
    "num_generations": 4,
    "num_generations_kept": 2,
    "prompts_per_step": 2,
    "micro_batch_size": 2,
    "max_completion_length": 8,
    "learning_rate": 1e-3,
    "max_time": None,
    "max_steps": 2,
    "eval_at_start": False,
    "eval_every_seconds": None,
    "eval_at_seconds": [],
    "save_every_seconds": None,
    "progress": False,
    "rollout_engine": "hf",  # tests/test_vllm.py covers the vLLM engine
}


def count_of_a(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """A reward the tiny model can learn: the fraction of characters that are 'a'."""
    return [text.count("a") / max(len(text), 1) for text in completions]


def half_constant(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """Even-numbered questions always score 1 (every group zero-variance, "solved"); odd ones score like
    :func:`count_of_a` (usually a spread; all 0, "failed", when no completion has an 'a')."""
    return [
        1.0 if int(answer) % 2 == 0 else text.count("a") / max(len(text), 1)
        for answer, text in zip(columns["answer"], completions, strict=True)
    ]


def slow_count_of_a(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """:func:`count_of_a`, 0.3 s a call: a step long enough to signal or kill a process mid-run (and picklable:
    the asynchronous tests send it to the rollout worker)."""
    time.sleep(0.3)
    return count_of_a(prompts, completions)


def always_fails(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """A reward function that raises (picklable: it fails inside the rollout worker)."""
    raise RuntimeError("this reward always fails")


REWARDS = {
    "count_of_a": count_of_a,
    "half_constant": half_constant,
    "slow_count_of_a": slow_count_of_a,
}


def low_token_ids(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """A token-level reward a random tiny model learns in a few dozen steps: share of ids below 160."""
    return [sum(token < 160 for token in ids) / max(len(ids), 1) for ids in completion_ids]


class RecordingTrainer(PODSTrainer):
    """The real trainer, recording what each step scored and what it updated on (for the tests' own checks)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scored: list[dict] = []  # per scoring: the prompts, texts and summed rewards of all n rollouts
        self.updates: list[dict] = []  # per step: the texts and advantages of the rows the update used
        if "TINY_RUN_NAN_FORWARDS" in os.environ:  # e.g. "3": the 3rd training forward gives NaN logits
            poisoned = {int(call) for call in os.environ["TINY_RUN_NAN_FORWARDS"].split(",")}
            self.accelerator.unwrap_model(self.model).lm_head.register_forward_hook(nan_on(poisoned))

    def _score(self, batch, rollouts, environments=None):
        if "TINY_RUN_REWARD_SLEEP" in os.environ:  # a scoring phase long enough to signal mid-step
            print("REWARD CALL", flush=True)
            time.sleep(float(os.environ["TINY_RUN_REWARD_SLEEP"]))
        rewards, per_function = super()._score(batch, rollouts, environments)
        self.scored.append(  # step: the update this scoring feeds (a refill round scores again before it)
            {
                "step": len(self.updates),
                "questions": [row["question"] for row in batch],
                "texts": list(rollouts.texts),
                "rewards": rewards.tolist(),
            }
        )
        return rewards, per_function

    def _update(self, state, batch, advantages, trained):
        self.updates.append(
            {"texts": list(batch.texts), "advantages": advantages.tolist(), "trained": trained.tolist()}
        )
        return super()._update(state, batch, advantages, trained)

    def first_prompts(self) -> list[dict]:
        """The rows of the first step's first round (the stream's first draw)."""
        return [self.train_rows[i] for i in self.prompts.draw(0, self.config.prompts_per_step)]


def nan_on(calls: set[int]):
    """A forward hook that makes the output NaN on the given training forwards (1-based, with gradients)."""
    counter = [0]

    def hook(module, inputs, output):
        if not torch.is_grad_enabled():
            return None  # generation, evaluation and the no-grad log-prob forwards stay intact
        counter[0] += 1
        return output * float("nan") if counter[0] in calls else None

    return hook


def tiny_dataset(size: int = 64) -> list[dict[str, str]]:
    """Rows as the trainer reads them (by index, with a length): a list, so that a training process does not
    import ``datasets`` (about a second of every start on 2 CPU cores)."""
    questions = [f"Question {i}: say a{'b' * (i % 5)}" for i in range(size)]
    return [{"prompt": q, "question": q, "answer": str(i)} for i, q in enumerate(questions)]


def main() -> None:
    model_dir, output_dir, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        use_torch_collectives_under_deepspeed()
    settings = {"model": model_dir, "output_dir": output_dir, **TINY_SETTINGS, **overrides}
    trainer = RecordingTrainer(
        TrainConfig.from_dict(settings),
        reward_funcs=[REWARDS[os.environ.get("TINY_RUN_REWARD", "count_of_a")]],
        train_dataset=tiny_dataset(int(os.environ.get("TINY_RUN_DATASET_SIZE", "64"))),
    )
    first_prompt = trainer.first_prompts()[0]["question"]
    print(f"distributed: {trainer.accelerator.distributed_type.value}", flush=True)
    if hasattr(trainer.engine, "base_url"):  # vllm_mode: server: its URL, and whether this process started it
        started = int(trainer.engine.process is not None)
        say(f"SERVER {trainer.accelerator.process_index} {trainer.engine.base_url} {started}")
    try:
        result = trainer.train()
    except TrainingStopped as stopped:
        rank = trainer.accelerator.process_index
        say(f"STOPPED {rank} {stopped.signal_name} {stopped.step} {stopped.checkpoint}")
        save_weights(trainer, output_dir)
        close_process_group()
        sys.exit(stopped.exit_code)
    model = trainer.accelerator.unwrap_model(trainer.model)
    checksum = sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(model.parameters()))
    say(f"RESULT {trainer.accelerator.process_index} {result.steps} {checksum:.12e} {first_prompt!r}")
    save_weights(trainer, output_dir)
    close_process_group()


def say(line: str) -> None:
    """One line in one write: the ranks share a pipe, and the launcher's unbuffered print writes the text and
    its newline separately, so two ranks' lines could interleave."""
    os.write(1, f"{line}\n".encode())


def save_weights(trainer: RecordingTrainer, output_dir: str) -> None:
    model = trainer.accelerator.unwrap_model(trainer.model)
    rank = trainer.accelerator.process_index
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, f"{output_dir}/weights-rank{rank}.pt"
    )
    with open(f"{output_dir}/record-rank{rank}.json", "w") as handle:
        json.dump({"scored": trainer.scored, "updates": trainer.updates}, handle)


if __name__ == "__main__":
    main()
    exit_process(0)
