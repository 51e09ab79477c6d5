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
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import qwen2_5_chat_template

from pods.integrations.trl import PODSConfig, PODSTrainer

QUESTIONS = [(3, 4), (5, 6), (7, 8), (2, 9)]
N, M = 4, 2
PROMPTS = 1  # per step


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def tool_value(serial: int) -> int:
    """The answer of the ``serial``-th tool call: distinct for every call, 1 to 3 more digits from one call to the
    next, so that rows of a group differ in length and a misplaced mask shows."""
    return serial * 10 ** (serial % 3)


@pytest.fixture(scope="module")
def tool_model_dir(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 (hidden 32) on the Qwen2.5 vocabulary that answers each question with a call of
    ``multiply(3, 4)`` and, after any tool answer, with ``Done.``. Tokens the conversations never use keep a zero
    embedding (their logit is exactly 0), so the full-vocabulary loss is computed over the used tokens plus
    one constant term: a few seconds of Adam on a CPU."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "qwen2.5")
    tokenizer.chat_template = qwen2_5_chat_template
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    rows, labels = [], []
    for index, (a, b) in enumerate(QUESTIONS):
        prompt = [{"role": "user", "content": f"What is {a} times {b}?"}]
        turn = [*prompt, {"role": "assistant", "content": "", "tool_calls": [call]}]
        answered = [*turn, {"role": "tool", "name": "multiply", "content": str(tool_value(index + 7))}]

        def render(messages: list[dict], generation: bool = False) -> list[int]:
            return tokenizer.apply_chat_template(
                messages, tools=[multiply], add_generation_prompt=generation, tokenize=True, return_dict=False
            )

        ids = render([*answered, {"role": "assistant", "content": "Done."}])[:-1]  # ends at <|im_end|>
        learn = torch.zeros(
            len(ids), dtype=torch.bool
        )  # the model's own tokens: its call and its last answer
        learn[len(render(prompt, True)) : len(render(turn)) - 1] = True
        learn[len(render(answered, True)) :] = True
        rows.append(torch.tensor(ids))
        labels.append(learn)
    width = max(len(row) for row in rows)
    ids = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])
    attention = torch.stack(
        [torch.nn.functional.pad(torch.ones_like(row), (0, width - len(row))) for row in rows]
    )
    learn = torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in labels])

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    used = torch.unique(ids)
    index = torch.full((len(tokenizer),), -1)
    index[used] = torch.arange(len(used))
    embedding = torch.nn.Parameter(model.get_input_embeddings().weight.detach()[used].clone())
    unused = math.log(len(tokenizer) - len(used))  # logsumexp of the unused tokens' logits, all 0
    body = [param for name, param in model.named_parameters() if "embed_tokens" not in name]
    optimizer = torch.optim.Adam([*body, embedding], lr=3e-2)
    targets = index[ids[:, 1:]][learn[:, 1:]]
    for _ in range(300):
        hidden = model.model(inputs_embeds=embedding[index[ids]], attention_mask=attention).last_hidden_state
        logits = hidden[:, :-1][learn[:, 1:]] @ embedding.T
        logits = torch.cat([logits, torch.full((logits.shape[0], 1), unused)], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 2e-3:
            break
    assert loss.item() < 0.05, f"the tool-calling model did not fit: loss {loss.item()}"
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight.zero_()
        weight[used] = embedding.detach()
    folder = tmp_path_factory.mktemp("tool-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


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
