"""The TRL drop-in with TRL's tools and environments, m < n, offline: a tiny random Qwen2 with the Qwen2.5
tokenizer and chat template (which renders tools; TRL parses its calls), overfitted for a few seconds to call a
tool, then trained by ``PODSTrainer`` with real generation and real tool calls. The kept rows must carry their
own ``tool_mask`` (0 exactly on the tool's answer), advantages and prompts; TRL's tool metrics survive."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from tool_model import QUESTIONS, tool_value  # the fixture tool_model_dir (tests/conftest.py) fits the model

from pods.integrations.trl import PODSConfig, PODSTrainer

N, M = 4, 2
PROMPTS = 1  # per step


def tool_args(output_dir: Path, **overrides) -> PODSConfig:
    """n = 4, m = 2, one prompt per step (4 rows generated, 2 kept), 2 steps."""
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        max_completion_length=64,
        num_generations=N,
        num_generations_kept=M,
        selection_rule="max_variance",
        per_device_train_batch_size=PROMPTS * N,
        max_tool_calling_iterations=2,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        temperature=0.3,
        seed=0,
    )
    settings.update(overrides)
    return PODSConfig(**settings)


def questions() -> Dataset:
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "pair": [a, b]}
            for a, b in QUESTIONS
        ]
    )


class KeptBatches(PODSTrainer):
    """PODSTrainer that keeps a copy of every training batch it hands to TRL's loss."""

    def _generate_and_score_completions(self, inputs):  # type: ignore[override]
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.kept_batches.append(
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            )
        return batch


def tool_span(
    tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tool_mask: torch.Tensor
):
    """The tool answer of one kept row as the mask says (decoded 0-positions) and as the text says (what follows
    the model's tool call up to the next assistant turn), and whether the 0s form one block."""
    ids = completion_ids[completion_mask.bool()].tolist()
    mask = tool_mask[: len(ids)].tolist()
    zeros = [i for i, bit in enumerate(mask) if bit == 0]
    contiguous = bool(zeros) and zeros == list(range(zeros[0], zeros[-1] + 1))
    masked = tokenizer.decode([ids[i] for i in zeros])
    end_of_call = ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>")) + 1
    return masked, tokenizer.decode(ids[:end_of_call]), tokenizer.decode(ids[end_of_call:]), contiguous


EXPECTED_SUFFIX = (
    "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def check_kept_rows(
    trainer: KeptBatches,
    answers: dict[str, float],
    generated: list[float],
    prompts_of: dict[str, str] | None = None,
):
    """Every kept row: its tool_mask is 0 exactly on the tool's answer (the text between its call and the next
    assistant turn, which is its own answer), it is 1 on the model's tokens; the group keeps the answers with
    the highest and lowest reward (max_variance with m = 2) and the higher gets advantage +1/sqrt(2)."""
    tokenizer = trainer.processing_class
    assert len(trainer.kept_batches) == 2
    for step, batch in enumerate(trainer.kept_batches):
        assert batch["tool_mask"].shape == batch["completion_ids"].shape
        assert batch["completion_ids"].shape[0] == PROMPTS * M
        kept = []
        for row in range(batch["completion_ids"].shape[0]):
            masked, call, after, contiguous = tool_span(
                tokenizer,
                batch["completion_ids"][row],
                batch["completion_mask"][row],
                batch["tool_mask"][row],
            )
            assert call.startswith("<tool_call>\n") and call.endswith("</tool_call><|im_end|>"), call
            answer = re.match(r"\n<\|im_start\|>user\n<tool_response>\n(.*?)\n</tool_response>", after, re.S)
            assert answer is not None, after
            assert contiguous and masked == EXPECTED_SUFFIX.format(answer.group(1)), (masked, after)
            assert answer.group(1) in answers, answer.group(1)
            kept.append(answer.group(1))
            if prompts_of is not None:  # the environment that gave this answer was reset with this prompt
                prompt = tokenizer.decode(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()])
                assert prompts_of[answer.group(1)] in prompt
        for group in range(len(kept) // M):
            rows = range(group * M, (group + 1) * M)
            rewards = [answers[kept[row]] for row in rows]
            advantages = batch["advantages"][list(rows)].tolist()
            first = (step * PROMPTS + group) * N
            group_rewards = generated[first : first + N]
            assert sorted(rewards) == [min(group_rewards), max(group_rewards)]  # max_variance, m = 2
            for reward, advantage in zip(rewards, advantages, strict=True):
                expected = 1 / math.sqrt(2) if reward == max(rewards) else -1 / math.sqrt(2)
                assert advantage == pytest.approx(expected, abs=1e-5)


def generated_groups(calls: list[dict]) -> list[list[dict]]:
    return [calls[start : start + N] for start in range(0, len(calls), N)]


def test_tools_with_down_sampling(tool_model_dir: Path, tmp_path: Path):
    """tools=[fn] with n = 4, m = 2: real generated tool calls, a tool that raises on every 4th call; the kept
    rows keep their own tool_mask and advantages; TRL's call and failure counts are logged unchanged."""
    serials = itertools.count(1)
    log: list[tuple[int, bool]] = []  # (serial, raised) per call, in call order

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        serial = next(serials)
        log.append((serial, serial % 4 == 0))
        if serial % 4 == 0:
            raise ValueError(f"no answer {tool_value(serial)}")
        return str(tool_value(serial))

    answers: dict[str, float] = {}  # the tool's answer as the model saw it -> the reward of its row
    seen: list[float] = []

    def answer_reward(completions, **kwargs) -> list[float]:
        """The number in the row's tool answer (negative for an error): a distinct reward for every rollout."""
        rewards = []
        for index, completion in enumerate(completions):
            tool = [message["content"] for message in completion if message["role"] == "tool"]
            if not tool:
                rewards.append(-1000.0 - index)
                continue
            value = float(re.search(r"\d+", tool[0]).group())
            rewards.append(-value if "error" in tool[0] else value)
            answers[tool[0]] = rewards[-1]
        seen.extend(rewards)
        return rewards

    trainer = KeptBatches(
        model=str(tool_model_dir),
        reward_funcs=[answer_reward],
        args=tool_args(tmp_path),
        train_dataset=questions(),
        tools=[multiply],
    )
    trainer.kept_batches = []
    trainer.train()

    steps = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert len(steps) == 2 and len(seen) == 2 * PROMPTS * N
    calls_per_generation = len(log) / 2
    assert all(entry["tools/call_frequency"] > 0 for entry in steps)
    assert sum(entry["tools/call_frequency"] for entry in steps) * PROMPTS * N == pytest.approx(len(log))
    assert calls_per_generation == PROMPTS * N  # every rollout called the tool once (the model was fitted to)
    for step, entry in enumerate(steps):
        calls = log[step * PROMPTS * N : (step + 1) * PROMPTS * N]
        assert entry["tools/failure_frequency"] == pytest.approx(
            sum(raised for _, raised in calls) / len(calls)
        )
    assert sum(raised for _, raised in log) == len(log) // 4 > 0
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    check_kept_rows(trainer, answers, seen)
    # some kept rows answered with the tool's error (the lowest reward of a group): the error text is masked too
    assert any(
        "error" in text
        for batch in trainer.kept_batches
        for text in [
            trainer.processing_class.decode(batch["completion_ids"][(batch["tool_mask"] == 0)].tolist())
        ]
    )


class Calculator:
    """An environment in TRL's shape: one per rollout, reset with the dataset row, its public method a tool."""

    serials = itertools.count(1)

    def reset(self, pair: list[int], **row) -> None:
        self.question = f"What is {pair[0]} times {pair[1]}?"
        self.answer: int | None = None

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        self.answer = tool_value(next(self.serials))
        return str(self.answer)


def test_environment_with_down_sampling(tool_model_dir: Path, tmp_path: Path):
    """environment_factory with n = 4, m = 2: the rewards read the environments; every kept row's tool answer is
    the one its own environment gave, for its own prompt, and the kept rows' advantages follow those rewards."""
    answers: dict[str, float] = {}
    prompts_of: dict[str, str] = {}
    seen: list[float] = []

    def environment_reward(environments, completions, **kwargs) -> list[float]:
        rewards = []
        for index, (environment, completion) in enumerate(zip(environments, completions, strict=True)):
            if environment.answer is None:
                rewards.append(-1000.0 - index)
                continue
            tool = [message["content"] for message in completion if message["role"] == "tool"]
            assert tool == [str(environment.answer)]  # TRL's own pairing of environments and rows
            answers[tool[0]] = float(environment.answer)
            prompts_of[tool[0]] = environment.question
            rewards.append(float(environment.answer))
        seen.extend(rewards)
        return rewards

    trainer = KeptBatches(
        model=str(tool_model_dir),
        reward_funcs=[environment_reward],
        args=tool_args(tmp_path),
        train_dataset=questions(),
        environment_factory=Calculator,
    )
    trainer.kept_batches = []
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert len(steps) == 2 and all(entry["tools/call_frequency"] == 1.0 for entry in steps)
    assert all(entry["tools/failure_frequency"] == 0.0 for entry in steps)
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    assert len(answers) == 2 * PROMPTS * N
    check_kept_rows(trainer, answers, seen, prompts_of)
