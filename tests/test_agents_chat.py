"""Multi-turn rollouts in TRL's shape on a real chat model (docs/agents.md): a tiny Qwen2 fitted in seconds to call
a tool through the Qwen2.5 chat template (tests/tool_model.py), run turn by turn by ``pods.agents.MultiTurnEngine``
on HF ``generate`` and vLLM. The episodes are token for token the conversation the chat template renders, the tool
mask is 0 exactly on its tool messages; rounds and length are bounded; tools that raise, hang, take other
arguments or do not exist are answered with their error and counted; a user's environment, rewards and tools in a
folder outside the repository train with ``pods train`` (HF, vLLM colocated, vLLM served); mistakes are one line."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")  # the fitted model's chat template is TRL's

from tool_model import AGAIN, multiply  # the fixture tool_vllm_model_dir (tests/conftest.py) fits the model
from transformers import AutoModelForCausalLM, AutoTokenizer

from pods.agents import MultiTurnEngine, call_tools, make_format
from pods.agents.tools import Toolbox, ToolCall
from pods.rollout import HFGenerateEngine, SamplingParams

pytestmark = pytest.mark.xdist_group("tool-model")  # one worker fits the model (tests/conftest.py) for all
GREEDY = SamplingParams(max_new_tokens=200, temperature=0.0)
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
SUFFIX = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ["What is 3 times 4?", "What is 7 times 8?"]
MULTIPLY_DOC = '''"""Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """'''  # the fitted model calls the tool its prompt describes with exactly this schema


@pytest.fixture(scope="module")
def model_and_tokenizer(tool_vllm_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(tool_vllm_model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tool_vllm_model_dir)


def chat_rows(questions: list[str] = QUESTIONS, **columns) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": q}], **columns} for q in questions]


def run_episodes(engine, rows, n: int, sampling: SamplingParams = GREEDY, **options):
    """Episodes of ``rows`` by ``engine`` turn by turn; ``tool_format: auto`` with the task's prompt style
    ``plain`` (a ``dataset_name`` run's): the chat prompts themselves choose the chat template's format."""
    tokenizer = engine.tokenizer
    settings = {"max_tool_calling_iterations": 2, "max_completion_length": 96, **options}
    multi = MultiTurnEngine(engine, make_format("auto", tokenizer, "plain"), **settings)
    return multi.episodes(rows, n, sampling)


def rendered(tokenizer, messages: list[dict], generation: bool = False) -> list[int]:
    """The chat template's tokens for a conversation (the tools described as the fitted model saw them)."""
    return list(
        tokenizer.apply_chat_template(
            messages, tools=[multiply], add_generation_prompt=generation, tokenize=True, return_dict=False
        )
    )


def row_tokens(rollouts, row: int) -> tuple[list[int], list[int], list[int]]:
    """One rollout's prompt ids, completion ids and tool mask, without padding."""
    prompt = rollouts.prompt_ids[row][rollouts.prompt_mask[row].bool()].tolist()
    mask = rollouts.completion_mask[row].bool()
    return prompt, rollouts.completion_ids[row][mask].tolist(), rollouts.tool_mask[row][mask].tolist()


def tool_answers(text: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)


def check_conversation(tokenizer, rollouts, row: int, question: str, answers: list[str], end: str = "Done."):
    """The rollout is token for token the chat template's conversation: the question, a call of multiply(3, 4)
    per answer, each answer as the template's tool message, the model's last turn ``end``; its tool mask is 0
    exactly on the tool messages' tokens (from after the call's EOS to the next assistant header) and 1 on every
    token the model sampled."""
    prompt, completion, mask = row_tokens(rollouts, row)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    messages = [{"role": "user", "content": question}]
    assert prompt == rendered(tokenizer, messages, generation=True)
    expected_mask: list[int] = []
    for answer in answers:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        called = len(rendered(tokenizer, messages)) - 1  # the call's turn ends at its EOS, before the "\n"
        messages.append({"role": "tool", "name": "multiply", "content": answer})
        answered = len(rendered(tokenizer, messages, generation=True))
        expected_mask += [1] * (called - len(prompt) - len(expected_mask))
        expected_mask += [0] * (answered - called)
    messages.append({"role": "assistant", "content": end})
    whole = rendered(tokenizer, messages)[:-1]  # the last turn ends at its EOS
    assert prompt + completion == whole, tokenizer.decode(completion)
    assert mask == expected_mask + [1] * (len(completion) - len(expected_mask))
    zeros = [token for token, bit in zip(completion, mask, strict=True) if bit == 0]
    assert tokenizer.decode(zeros) == "".join(SUFFIX.format(answer) for answer in answers)


class TimedEngine(HFGenerateEngine):
    """HF ``generate`` that records when each of its calls (each turn of a batch) starts and ends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[float, float]] = []

    def generate_tokens(self, encoded, num_generations, sampling):
        start = time.monotonic()
        rollouts = super().generate_tokens(encoded, num_generations, sampling)
        self.calls.append((start, time.monotonic()))
        return rollouts


# ---------------------------------------------------------------------------------------------- episodes on HF
def test_chat_template_episodes_are_the_templates_conversation_with_tool_messages_masked(model_and_tokenizer):
    """2 questions x n = 2 on HF generate: every rollout calls the tool, gets its own answer (of its own length:
    the second turn runs the 4 rollouts in one batch from contexts of different lengths) and ends with Done."""
    model, tokenizer = model_and_tokenizer
    serials = itertools.count(1)

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        serial = next(serials)  # 100, 2000, 30, 400: the fitted model says Done after a round number
        return str(serial * 10 ** (serial % 3 + 1))

    episodes = run_episodes(HFGenerateEngine(model, tokenizer), chat_rows(), 2, tools=[multiply])
    rollouts = episodes.rollouts
    assert episodes.environments is None and rollouts.sampling_logprobs is None  # HF: no sampler log-probs
    assert (rollouts.num_prompts, rollouts.num_generations) == (2, 2)
    answers = []
    for row in range(4):
        text = rollouts.texts[row]
        (answer,) = tool_answers(text)
        answers.append(answer)
        check_conversation(tokenizer, rollouts, row, QUESTIONS[row // 2], [answer])
        assert text == (
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\nuser\n'
            f"<tool_response>\n{answer}\n</tool_response>\nassistant\nDone."
        )
    assert len(set(answers)) == 4 and len({len(a) for a in answers}) > 1  # each call answered in its own row
    assert rollouts.episode_stats.tolist() == [[1, 0, 2]] * 4  # calls, errors, turns
    assert not rollouts.truncated.any()
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    assert rollouts.messages == [  # TRL's shape of the conversation, what rewards imported by path get
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": answer},
            {"role": "assistant", "content": "Done."},
        ]
        for answer in answers
    ]


REWARD_FILE = """
def reward(prompts, completions, **kwargs):
    return [len([m for m in c if m["role"] == "tool"]) + ("tool_calls" in c[0]) for c in completions]
"""


def test_rewards_imported_by_path_get_the_episode_as_trls_messages(model_and_tokenizer, tmp_path):
    """A reward function imported by path gets each chat episode as TRL hands it over: the assistant turns and
    the tool messages (here: an assistant turn with its call, one tool message); one from the Python API the
    text."""
    from pods.config import TrainConfig
    from pods.producer import score_batch
    from pods.rewards.imported import ImportedReward

    model, tokenizer = model_and_tokenizer
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    rows = chat_rows()
    rollouts = run_episodes(HFGenerateEngine(model, tokenizer), rows, 2, tools=[multiply]).rollouts

    def text(prompts, completions, **kwargs):
        return [float(isinstance(c, str) and "<tool_response>" in c) for c in completions]

    funcs = [ImportedReward(f"{tmp_path / 'rewards.py'}:reward"), text]
    _, per_function = score_batch(funcs, TrainConfig(), rows, rollouts)
    assert (
        per_function["reward"].tolist() == [[2.0, 2.0]] * 2
        and per_function["text"].tolist() == [[1.0, 1.0]] * 2
    )


def test_max_tool_calling_iterations_bounds_the_rounds(model_and_tokenizer):
    """A tool answering "again" makes the model call once more: with one round the second call stays unanswered
    (the episode ends on it, sampled); without a bound it is answered, and the model then stops by itself."""
    model, tokenizer = model_and_tokenizer

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return AGAIN

    engine = HFGenerateEngine(model, tokenizer)
    one = run_episodes(engine, chat_rows(QUESTIONS[:1]), 2, tools=[multiply], max_tool_calling_iterations=1)
    call = len(tokenizer(CALL, add_special_tokens=False)["input_ids"])
    answer = len(tokenizer(SUFFIX.format(AGAIN), add_special_tokens=False)["input_ids"])
    for row in range(2):
        _, completion, mask = row_tokens(one.rollouts, row)
        # the second call, sampled and not answered
        assert tokenizer.decode(completion) == CALL + SUFFIX.format(AGAIN) + CALL
        assert mask == [1] * call + [0] * answer + [1] * call
    assert one.rollouts.episode_stats.tolist() == [[1, 0, 2]] * 2
    unbounded = run_episodes(
        engine, chat_rows(QUESTIONS[:1]), 2, tools=[multiply], max_tool_calling_iterations=None
    )
    for row in range(2):
        assert tool_answers(unbounded.rollouts.texts[row]) == [AGAIN, AGAIN]
        assert unbounded.rollouts.episode_stats[row].tolist()[:2] == [2, 0]
        assert unbounded.rollouts.episode_stats[row, 2] == 3


def test_max_completion_length_bounds_the_whole_episode(model_and_tokenizer):
    """Turns and answers together stay within max_completion_length: an answer that leaves no room for a turn
    after it is not appended (the tool still ran: counted), a turn is cut at the limit; the row is truncated."""
    model, tokenizer = model_and_tokenizer

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return "120"

    engine = HFGenerateEngine(model, tokenizer)
    rows = chat_rows(QUESTIONS[:1])
    whole = run_episodes(engine, rows, 1, tools=[multiply], max_completion_length=200).rollouts
    _, completion, _ = row_tokens(whole, 0)
    call = len(tokenizer(CALL, add_special_tokens=False)["input_ids"])
    answer = len(tokenizer(SUFFIX.format("120"), add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(completion) == CALL + SUFFIX.format("120") + "Done.<|im_end|>"
    assert not whole.truncated.any() and whole.episode_stats.tolist() == [[1, 0, 2]]

    cases = {  # max_completion_length: (tokens kept, calls, turns)
        call + answer: (call, 1, 1),  # the answer would fill the budget: not appended
        call + answer + 1: (call + answer + 1, 1, 2),  # appended; the next turn cut after 1 token
        call - 4: (call - 4, 0, 1),  # the call itself cut: nothing to run
    }
    for limit, (kept, calls, turns) in cases.items():
        rollouts = run_episodes(engine, rows, 1, tools=[multiply], max_completion_length=limit).rollouts
        _, cut, mask = row_tokens(rollouts, 0)
        assert cut == completion[:kept], limit
        assert rollouts.completion_ids.shape[1] <= limit and bool(rollouts.truncated[0]), limit
        assert rollouts.episode_stats.tolist() == [[calls, 0, turns]], limit
        assert mask.count(0) == (answer if kept > call + answer else 0), limit


# ---------------------------------------------------------------------------------------------- failing tools
def raising(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    raise ArithmeticError("no products today")


def other_arguments(x: int, y: int) -> str:
    """Multiply two integers.

    Args:
        x: The first factor.
        y: The second factor.
    """
    return str(x * y)


def times(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def hanging(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    time.sleep(20)  # a daemon thread left behind; the test process does not wait for it
    return str(a * b)


raising.__name__ = other_arguments.__name__ = hanging.__name__ = "multiply"  # the name the model calls
FAILURES = {
    "raises": (raising, "error: ArithmeticError: no products today"),
    "other arguments": (
        other_arguments,
        "error: bad arguments for multiply: missing a required argument: 'x'",
    ),
    "unknown tool": (times, "error: no tool named 'multiply' (tools: times)"),
    "hangs": (hanging, "error: multiply did not answer within 0.5 s"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failing_tool_is_answered_with_its_error_counted_and_the_episode_goes_on(model_and_tokenizer, case):
    """4 rollouts call the tool in one turn; each gets the error as its tool message (masked as any answer),
    counted in episode_stats, and the model takes its next turn. 4 hanging calls cost one tool_timeout together."""
    model, tokenizer = model_and_tokenizer
    tool, error = FAILURES[case]
    engine = TimedEngine(model, tokenizer)
    rows = chat_rows(QUESTIONS[:1])
    rollouts = run_episodes(
        engine,
        rows,
        4,
        tools=[tool],
        tool_timeout=0.5,
        max_tool_calling_iterations=1,
        max_completion_length=72,
    ).rollouts
    for row in range(4):
        _, completion, mask = row_tokens(rollouts, row)
        assert tool_answers(rollouts.texts[row]) == [error]
        text = tokenizer.decode(completion)
        assert text.startswith(CALL + SUFFIX.format(error)), text
        assert len(completion) > mask.index(0) + mask.count(0)  # the model's next turn
        zeros = [token for token, bit in zip(completion, mask, strict=True) if bit == 0]
        assert tokenizer.decode(zeros) == SUFFIX.format(error) and all(mask[: mask.index(0)])
    assert rollouts.episode_stats.tolist() == [[1, 1, 2]] * 4
    (_, first_turn_end), (second_turn_start, _) = engine.calls
    waited = second_turn_start - first_turn_end  # the turn's 4 calls, run at once
    if case == "hangs":
        assert 0.5 <= waited < 2 * 0.5, waited  # one timeout for the turn, not one per call (4 x 0.5 s)


def test_tool_calls_of_one_turn_share_one_timeout():
    """call_tools itself: 4 rollouts x 2 hanging calls and a quick one, 0.3 s: every hanging call is answered
    with the timeout after one wait of 0.3 s; the quick one with its result."""
    boxes = [Toolbox([hanging, times]) for _ in range(4)]
    calls = [
        [ToolCall("multiply", {"a": 1, "b": 2}), ToolCall("multiply", {"a": 3, "b": 4})] for _ in range(4)
    ]
    calls[0].append(ToolCall("times", {"a": 3, "b": 4}))
    started = time.monotonic()
    answers = call_tools(boxes, calls, 0.3)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 2 * 0.3, elapsed
    assert [[(a.text, a.failed) for a in row] for row in answers] == [
        [("error: multiply did not answer within 0.3 s", True)] * 2 + [("12", False)],
        *[[("error: multiply did not answer within 0.3 s", True)] * 2] * 3,
    ]


# ---------------------------------------------------------------------------------------------- pods train
ENV_PY = f'''"""A user's environment in TRL's shape, in a folder outside the repository."""

import itertools


class Env:
    """A calculator: one instance per rollout, reset with its row; its public method is a tool."""

    serials = itertools.count(1)

    def __init__(self):
        self.serial = next(self.serials)  # every rollout's environment answers differently

    def reset(self, pair, **row):
        self.pair = pair
        self.answers = []
        return f" {{pair[0]}} times {{pair[1]}}?"  # the end of the question (the data's prompt is "What is")

    def multiply(self, a: int, b: int) -> str:
        {textwrap.indent(MULTIPLY_DOC, "    ").strip()}
        self.answers.append(a * b * 10 * self.pair[0] + 10 * self.serial)  # its row's and its own
        return str(self.answers[-1])
'''
REWARDS_PY = '''"""A user's rewards: one reads the environments' state, one the completions; each call is logged."""

import json


def text_of(completion):
    """A chat completion's messages as one text."""
    return completion if isinstance(completion, str) else "\\n".join(str(m.get("content")) for m in completion)


def from_environment(completions, environments, pair, **kwargs):
    rewards = [float(sum(environment.answers)) for environment in environments]
    with open("scored.jsonl", "a") as log:  # the run's own folder (its current directory)
        for environment, row, completion, reward in zip(environments, pair, completions, rewards, strict=True):
            seen = {"reset_with": environment.pair, "row": row, "serial": environment.serial}
            seen.update(answers=environment.answers, completion=text_of(completion), reward=reward)
            log.write(json.dumps(seen) + "\\n")
    return rewards


def answered(completions, **kwargs):
    return [float("120" in text_of(completion)) for completion in completions]
'''
TOOLS_PY = f'''"""A user's tool, in a folder outside the repository: every second call fails."""

import itertools

_calls = itertools.count(1)


def multiply(a: int, b: int) -> str:
    {MULTIPLY_DOC}
    if next(_calls) % 2 == 0:
        raise ArithmeticError("every second call fails")
    return str(a * b * 10)
'''
TRAIN = {
    "max_time": "null", "eval_at_start": "false", "eval_every_seconds": "null", "eval_at_seconds": "[]",
    "save_every_seconds": "null", "save_final": "false", "progress": "false", "prompts_per_step": 1,
    "num_generations": 4, "num_generations_kept": 2, "micro_batch_size": 2, "max_completion_length": 64,
    "temperature": 0.3, "max_tool_calling_iterations": 2, "output_dir": "out",
}  # fmt: skip
VLLM = {"rollout_engine": "vllm", "vllm_cpu_kv_cache_gb": 0.05}
SERVER = {"rollout_engine": "vllm", "vllm_mode": "server", "vllm_cpu_kv_cache_gb": 0.25}


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    """Environment, rewards, tool and data files in a folder outside the repository."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "env.py").write_text(ENV_PY)
    (folder / "rewards.py").write_text(REWARDS_PY)
    (folder / "tools.py").write_text(TOOLS_PY)
    with (folder / "halves.jsonl").open("w") as file:  # the environment's reset completes each question
        for a, b in [(3, 4), (5, 6), (7, 8), (2, 9)]:
            file.write(
                json.dumps({"prompt": [{"role": "user", "content": "What is"}], "pair": [a, b]}) + "\n"
            )
    with (folder / "questions.jsonl").open("w") as file:
        for question in QUESTIONS:
            file.write(json.dumps({"prompt": [{"role": "user", "content": question}]}) + "\n")
    with (folder / "text.jsonl").open("w") as file:
        file.write(json.dumps({"prompt": QUESTIONS[0]}) + "\n")
    return folder


def train_arguments(model: Path, folder: Path, kind: str, steps: int, **settings) -> list[str]:
    """`pods train` on the user's files: ``env`` (the environment and its reward), ``tools`` (the tool file)."""
    if kind == "env":
        files = {"dataset_name": folder / "halves.jsonl", "environment_factory": f"{folder / 'env.py'}:Env",
                 "reward_funcs": f"{folder / 'rewards.py'}:from_environment"}  # fmt: skip
    else:
        files = {"dataset_name": folder / "questions.jsonl", "tools": f"{folder / 'tools.py'}:multiply",
                 "reward_funcs": f"{folder / 'rewards.py'}:answered"}  # fmt: skip
    options = {"model": model, **files, **TRAIN, "rollout_engine": "hf", "max_steps": steps, **settings}
    return ["train", *itertools.chain.from_iterable((f"--{k}", str(v)) for k, v in options.items())]


def start(arguments: list[str], cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "pods", *arguments], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip


def finish(runs: dict[str, subprocess.Popen], timeout: float) -> None:
    """Wait for every run; on a failure or past ``timeout``, stop the others (their process groups) and say why."""
    deadline = time.monotonic() + timeout
    try:
        for name, run in runs.items():
            output, _ = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert run.returncode == 0, f"{name}: exit {run.returncode}\n{output[-3000:]}"
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "out" / "metrics.jsonl").read_text().splitlines()]


def check_environment_run(run: Path, steps: int) -> None:
    """Every rollout called the environment's tool; the reward read each environment's state: the answer it gave
    (12 x 10 x the first number of the row it was reset with, plus 10 x its own serial number), shown in that very
    rollout's tool message (a reward given another rollout's environment would show)."""
    metrics = metrics_of(run)
    assert [row["step"] for row in metrics] == list(range(1, steps + 1))
    scored = [json.loads(line) for line in (run / "scored.jsonl").read_text().splitlines()]
    assert len(scored) == steps * 4 and len({entry["serial"] for entry in scored}) == steps * 4
    for entry in scored:
        assert entry["reset_with"] == entry["row"], entry
        assert entry["answers"] == [120 * entry["row"][0] + 10 * entry["serial"]], entry
        assert str(entry["answers"][0]) in entry["completion"], entry  # the tool message of this very rollout
        assert entry["reward"] == entry["answers"][0]
    for step, row in enumerate(metrics):
        assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.0
        assert (
            row["tools/mean_turns"] == 2.0
            and row["completions/mean_sampled_length"] < row["completions/mean_length"]
        )
        rewards = [entry["reward"] for entry in scored[4 * step : 4 * step + 4]]
        assert row["rewards/from_environment/mean"] == pytest.approx(sum(rewards) / 4)


def check_tools_run(run: Path, steps: int) -> None:
    """The tool file's function answered every call, failing every second one: half the calls are errors, every
    rollout got its answer or its error, and went on to a second turn."""
    metrics = metrics_of(run)
    assert [row["step"] for row in metrics] == list(range(1, steps + 1))
    for row in metrics:
        assert row["tools/call_frequency"] == 1.0 and row["tools/calling_share"] == 1.0
        assert row["tools/failure_frequency"] == 0.5 and row["tools/errors_per_rollout"] == 0.5
        assert row["tools/mean_turns"] == 2.0 and row["rewards/answered/mean"] == 0.5


@pytest.mark.slow
def test_pods_train_with_a_users_environment_and_tools_from_outside_the_repository(
    tool_vllm_model_dir: Path, user_folder: Path, tmp_path: Path
):
    """`pods train --environment_factory env.py:Env --reward_funcs rewards.py:from_environment` for 3 steps on HF
    generate and on vLLM (colocated); `--tools tools.py:multiply` for 2 steps on a vLLM server pods starts
    (`vllm_mode: server`, each turn a request from token ids; tests/test_agents.py runs `--tools` on HF). Three
    runs at once (their start-up is most of it)."""
    model, folder = tool_vllm_model_dir, user_folder
    runs = {
        "hf": start(train_arguments(model, folder, "env", 3), tmp_path / "hf"),
        "vllm": start(train_arguments(model, folder, "env", 3, **VLLM), tmp_path / "vllm"),
        "server": start(train_arguments(model, folder, "tools", 2, **SERVER), tmp_path / "server"),
    }
    finish(runs, timeout=500)
    check_environment_run(tmp_path / "hf", 3)
    check_environment_run(tmp_path / "vllm", 3)
    check_tools_run(tmp_path / "server", 2)
    for name in ("vllm", "server"):  # the sampler's log-probs of the sampled tokens are the trainer's
        assert all(
            row["sampling/sampling_logp_difference/mean"] < 1e-3 for row in metrics_of(tmp_path / name)
        )


# ---------------------------------------------------------------------------------------------- vLLM's log-probs
class Calculator:
    """tests' copy of the user's environment (ENV_PY): reset completes the question, multiply answers by row."""

    def reset(self, pair, **row):
        self.pair = pair
        return f" {pair[0]} times {pair[1]}?"

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return str(a * b * 10 * self.pair[0])


@pytest.mark.slow
def test_vllm_episodes_carry_the_samplers_logprobs_on_sampled_tokens_and_0_on_tool_tokens(
    model_and_tokenizer,
):
    """Colocated vLLM from token ids, turn by turn, with an environment: the rollouts are the template's
    conversation (reset's text at the end of the user message), the sampler's log-probs of every sampled token are
    the trainer's (both turns: a shift by one token would show), and 0 on every tool token."""
    from pods.loss import completion_logprobs
    from pods.rollout.vllm import VLLMEngine

    model, tokenizer = model_and_tokenizer
    engine = VLLMEngine(model, tokenizer, kv_cache_gb=0.05)
    try:
        torch.manual_seed(0)
        rows = [
            {"prompt": [{"role": "user", "content": "What is"}], "pair": pair} for pair in ([3, 4], [7, 8])
        ]
        sampling = SamplingParams(max_new_tokens=96, temperature=1.0)
        episodes = run_episodes(engine, rows, 2, sampling, environment_factory=Calculator)
    finally:
        engine.close()
    rollouts = episodes.rollouts
    assert [env.pair for env in episodes.environments] == [[3, 4], [3, 4], [7, 8], [7, 8]]
    for row, answer in enumerate(["360", "360", "840", "840"]):
        check_conversation(tokenizer, rollouts, row, QUESTIONS[row // 2], [answer])
    assert rollouts.episode_stats.tolist() == [[1, 0, 2]] * 4
    sampler, tool = rollouts.sampling_logprobs, rollouts.tool_mask
    answered = rollouts.completion_mask.bool() & (tool == 0)
    sampled = rollouts.completion_mask.bool() & (tool == 1)
    assert answered.sum() == 4 * len(tokenizer(SUFFIX.format("360"), add_special_tokens=False)["input_ids"])
    assert torch.all(sampler[answered] == 0)
    with torch.no_grad():
        ours = completion_logprobs(
            model,
            rollouts.prompt_ids,
            rollouts.prompt_mask,
            rollouts.completion_ids,
            rollouts.completion_mask,
        )
    assert (ours[sampled] - sampler[sampled]).abs().max() < 1e-5
    shifted = sampled[:, 1:] & sampled[:, :-1]
    assert (ours[:, 1:][shifted] - sampler[:, :-1][shifted]).abs().max() > 1e-4  # the check can tell a shift


# ---------------------------------------------------------------------------------------------- one-line errors
NO_RESET_PY = f"""class Env:
    def multiply(self, a: int, b: int) -> str:
        {textwrap.indent(MULTIPLY_DOC, "    ").strip()}
        return str(a * b)
"""
RESET_BY_ROLLOUT_PY = f"""import itertools

_serials = itertools.count()


class Env:
    def reset(self, **row):
        return f" (attempt {{next(_serials)}})"

    def multiply(self, a: int, b: int) -> str:
        {textwrap.indent(MULTIPLY_DOC, "    ").strip()}
        return str(a * b)
"""
MISTAKES = {  # what is wrong: (settings, what the one line says)
    "no tool file": (
        {"tools": "{folder}/missing.py:multiply"},
        r"tools: \S+missing\.py:multiply: no such file \S+missing\.py; give a path to a \.py file",
    ),
    "no such tool": ({"tools": "{folder}/tools.py:divide"}, r"tools: \S+tools\.py has no 'divide'; it defines multiply"),
    "chat_template on text": (
        {"tools": "{folder}/tools.py:multiply", "tool_format": "chat_template", "dataset_name": "{folder}/text.jsonl"},
        r"tool_format: chat_template renders the tools into chat prompts, but this prompt is text",
    ),
    "no reset": (
        {"environment_factory": "{folder}/no_reset.py:Env"},
        r"environment_factory: Env has no reset method; an environment defines reset\(\*\*row\)",
    ),
    "reset by rollout": (
        {"environment_factory": "{folder}/by_rollout.py:Env"},
        r"environment_factory: reset\(\*\*row\) returned different texts for rollouts of one row",
    ),
}  # fmt: skip


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_mistake_in_tools_or_environments_is_one_line(
    mistake, tool_vllm_model_dir: Path, user_folder: Path, tmp_path: Path, capsys
):
    from pods.cli import main

    (user_folder / "no_reset.py").write_text(NO_RESET_PY)
    (user_folder / "by_rollout.py").write_text(RESET_BY_ROLLOUT_PY)
    settings, message = MISTAKES[mistake]
    settings = {key: value.format(folder=user_folder) for key, value in settings.items()}
    options = {
        "model": tool_vllm_model_dir, "dataset_name": user_folder / "questions.jsonl",
        "reward_funcs": f"{user_folder / 'rewards.py'}:answered", **TRAIN, "output_dir": tmp_path / "out",
        "rollout_engine": "hf", "max_steps": 1, **settings,
    }  # fmt: skip
    code = main(["train", *itertools.chain.from_iterable((f"--{k}", str(v)) for k, v in options.items())])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("pods train: error: ")]
    assert len(errors) == 1 and re.match(r"pods train: error: " + message, errors[0]), err[-3000:]
