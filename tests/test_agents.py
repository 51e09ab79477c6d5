"""Multi-turn rollouts with pods' text tool format on the shipped tool-calling model (``embedded-products``): each
episode's tool answer is masked exactly, tools that fail leave the run going with the failure counted, and a run
resumed from a checkpoint that holds a batch of episodes in flight (async) or stopped between steps (sync) is the
uninterrupted run, weights and metrics. The chat-template format and user environments: test_agents_chat.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pods.agents import MultiTurnEngine, TextFormat
from pods.checkpoint import checkpoint_dir
from pods.config import TrainConfig
from pods.data.products import calculator, generate_problems
from pods.embedded import model_path
from pods.metrics import TIMING_KEYS, read_jsonl
from pods.rollout import HFGenerateEngine, SamplingParams
from pods.rollout_worker import load_in_flight
from pods.trainer import PODSTrainer

PRODUCT = re.compile(r"<call>calculator\((\d+) \* (\d+)\)</call>")
TOOL_FILE = '''
import time

def calculator(expression: str) -> str:
    """A calculator that fails.

    Args:
        expression: What to compute.
    """
    {body}
'''


@pytest.fixture(scope="module")
def tool_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_path("products")
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def product_rows(count: int) -> list[dict]:
    return [
        {"prompt": f"Question: {p.question}\nAnswer:", "answer": str(p.answer)}
        for p in generate_problems(count, seed=3, split="test")
    ]


def episodes_of(model, tokenizer, tools, rows, n, **options):
    engine = MultiTurnEngine(
        HFGenerateEngine(model, tokenizer),
        TextFormat(tokenizer),
        tools=tools,
        max_completion_length=48,
        **options,
    )
    torch.manual_seed(0)
    return engine.episodes(rows, n, SamplingParams(max_new_tokens=48, temperature=1.0))


def tool_tokens(rollouts, row: int) -> list[int]:
    """The tokens of one episode under a 0 tool mask (what the tools answered)."""
    keep = rollouts.completion_mask[row].bool() & (rollouts.tool_mask[row] == 0)
    return rollouts.completion_ids[row][keep].tolist()


def test_the_tool_answer_and_only_it_is_masked(tool_model) -> None:
    """Every episode that calls the calculator has tool_mask 0 on exactly the tokens of ``<result>a*b</result>``
    right after its call (the product of the numbers it wrote), 1 on every token it sampled; its text is the whole
    episode; episode_stats counts its calls and turns. Episodes without a call are one turn, all sampled."""
    model, tokenizer = tool_model
    rollouts = episodes_of(
        model, tokenizer, [calculator], product_rows(6), 8, max_tool_calling_iterations=2
    ).rollouts
    calling = 0
    for row in range(len(rollouts)):
        length = int(rollouts.completion_mask[row].sum())
        ids = rollouts.completion_ids[row, :length].tolist()
        mask = rollouts.tool_mask[row, :length].tolist()
        calls, errors, turns = rollouts.episode_stats[row].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert rollouts.texts[row] == text
        tool_text = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
        written = PRODUCT.findall(text)
        assert calls == text.count("<call>") and errors == 0
        if calls == 0:
            assert mask == [1] * length and turns == 1 and tool_text == ""
            continue
        calling += 1
        assert turns == calls + 1 or rollouts.truncated[row]
        expected = "".join(f"<result>{int(a) * int(b)}</result>" for a, b in written)
        assert tool_text == expected, (text, tool_text)
        first_zero = mask.index(0)  # the answer starts right after the call's closing tag
        assert tokenizer.decode(ids[:first_zero]).endswith("</call>")
    assert 0 < calling < len(rollouts)  # the base model calls the tool in part of its episodes


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("raise RuntimeError('the calculator is broken')", "error: RuntimeError: the calculator is broken"),
        ("time.sleep(60)", "error: calculator did not answer within 0.5 s"),
    ],
)
def test_a_failing_tool_is_answered_with_its_error_and_counted(tool_model, tmp_path, body, error) -> None:
    """A tool that raises or hangs: the episode gets the error as the tool's answer and goes on (a turn after
    it); every call is counted as failed; eight hanging calls of one turn cost one timeout, not eight."""
    model, tokenizer = tool_model
    (tmp_path / "tools.py").write_text(TOOL_FILE.format(body=body))
    from pods.agents import load_tools

    tools = load_tools([f"{tmp_path / 'tools.py'}:calculator"])
    start = time.perf_counter()
    rollouts = episodes_of(
        model, tokenizer, tools, product_rows(2), 8, max_tool_calling_iterations=1, tool_timeout=0.5
    )
    elapsed = time.perf_counter() - start
    stats = rollouts.rollouts.episode_stats
    called = stats[:, 0] > 0
    assert called.any()
    assert torch.equal(stats[called, 1], stats[called, 0])  # every call failed
    answer = tokenizer(f"<result>{error}</result>", add_special_tokens=False)["input_ids"]
    for row in (
        called.nonzero().flatten().tolist()
    ):  # (the tokenizer knows few of the error's words: compare ids)
        assert tool_tokens(rollouts.rollouts, row) == answer
        assert stats[row, 2] == 2  # the model took its turn after the error
    if (
        "sleep" in body
    ):  # the turn's calls wait one timeout together: against the same episodes with a tool that
        (tmp_path / "fast.py").write_text(TOOL_FILE.format(body="raise ValueError('no')"))  # fails at once
        start = time.perf_counter()
        episodes_of(model, tokenizer, load_tools([f"{tmp_path / 'fast.py'}:calculator"]), product_rows(2), 8,
                    max_tool_calling_iterations=1, tool_timeout=0.5)  # fmt: skip
        waited = elapsed - (time.perf_counter() - start)
        assert int(stats[:, 0].sum()) >= 3 and waited < 0.5 * 2  # one at a time would wait 0.5 s per call


def test_bad_arguments_and_unknown_tools_are_answered_not_raised(tool_model) -> None:
    """A call the tool cannot take (``calculator(a, b)`` called with one expression) and a call of a tool that is
    not there (the model calls ``calculator``; the run offers ``adder``): error answers, counted."""
    model, tokenizer = tool_model

    def two_numbers(a: int, b: int) -> str:
        """Multiply.

        Args:
            a: one
            b: two
        """
        return str(a * b)

    two_numbers.__name__ = "calculator"

    def adder(expression: str) -> str:
        """Add.

        Args:
            expression: what
        """
        return "0"

    expected = (
        ([two_numbers], "error: bad arguments for calculator: calculator takes 2 arguments, got 1"),
        ([adder], "error: no tool named 'calculator' (tools: adder)"),
    )
    for tools, error in expected:
        rollouts = episodes_of(
            model, tokenizer, tools, product_rows(2), 8, max_tool_calling_iterations=1
        ).rollouts
        called = rollouts.episode_stats[:, 0] > 0
        assert called.any() and torch.equal(
            rollouts.episode_stats[called, 1], rollouts.episode_stats[called, 0]
        )
        answer = tokenizer(f"<result>{error}</result>", add_special_tokens=False)["input_ids"]
        assert all(tool_tokens(rollouts, row) == answer for row in called.nonzero().flatten().tolist())


SETTINGS = {
    "model": "embedded-products",
    "task": "products",
    "tools": ["pods.data.products:calculator"],
    "tool_format": "text",
    "num_generations": 8,
    "num_generations_kept": 4,
    "prompts_per_step": 4,
    "micro_batch_size": 16,
    "max_completion_length": 48,
    "max_time": None,
    "eval_at_start": False,
    "eval_every_seconds": None,
    "eval_at_seconds": [],
    "save_every_seconds": None,
    "progress": False,
    "rollout_engine": "hf",
    "learning_rate": 1e-4,
    "torch_threads": 1,
}


def learning_rows(path: Path) -> list[dict]:
    skip = set(TIMING_KEYS) | {"seconds_wait_for_rollouts"}
    return [
        {k: v for k, v in row.items() if k not in skip and not k.startswith("pods/async/worker")}
        for row in read_jsonl(path)
    ]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_run_resumed_mid_way_through_its_episodes_is_the_uninterrupted_run(tmp_path, asynchronous) -> None:
    """4 steps straight against 2 steps, a checkpoint, and 2 more resumed from it: the same weights and the same
    metrics, tool metrics included. Async, the checkpoint after step 2 holds step 3's batch of episodes (sampled by
    step 2's weights, tool masks and episode statistics with it), which the resumed run trains on as it was."""
    settings = {**SETTINGS, "async_generation": asynchronous, "save_every_steps": 2, "save_total_limit": 3}
    if asynchronous:
        settings["rollout_worker_threads"] = 1
    straight = PODSTrainer(
        TrainConfig.from_dict({**settings, "max_steps": 4, "output_dir": str(tmp_path / "a")})
    )
    straight.train()
    checkpoint = checkpoint_dir(tmp_path / "a" / "checkpoints", 2)
    if asynchronous:
        (batch,) = load_in_flight(checkpoint)
        rollouts = batch.sampled.rounds[0].rollouts
        assert batch.step == 2 and rollouts.tool_mask is not None and rollouts.episode_stats is not None
        assert (rollouts.tool_mask[rollouts.completion_mask.bool()] == 0).any()  # tool answers in flight
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(checkpoint_dir(tmp_path / "b" / "checkpoints", 4))
    resumed = PODSTrainer(
        TrainConfig.from_dict(
            {**settings, "max_steps": 4, "output_dir": str(tmp_path / "b"), "resume_from": "auto"}
        )
    )
    resumed.train()
    a, b = (
        {n: p.detach() for n, p in t.accelerator.unwrap_model(t.model).named_parameters()}
        for t in (straight, resumed)
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = learning_rows(tmp_path / "a" / "metrics.jsonl")
    assert rows == learning_rows(tmp_path / "b" / "metrics.jsonl")
    assert all(row["tools/call_frequency"] > 0 for row in rows)


def test_pods_train_with_a_failing_tool_by_import_path_goes_on(tmp_path) -> None:
    """`pods train --config embedded-tool --tools FILE:calculator` with a calculator that raises: 2 steps, exit 0,
    every call counted as failed in metrics.jsonl, the live line's tool figures in the log."""
    (tmp_path / "tools.py").write_text(TOOL_FILE.format(body="raise ValueError('no')"))
    command = [
        sys.executable, "-m", "pods", "train", "--config", "embedded-tool",
        "--tools", f"{tmp_path / 'tools.py'}:calculator",
        "--max_steps", "2", "--max_time", "null", "--output_dir", str(tmp_path / "run"),
        "--eval_at_start", "false", "--eval_every_seconds", "null", "--eval_at_seconds", "[]",
        "--save_final", "false", "--save_every_seconds", "null", "--prompts_per_step", "4", "--num_generations", "8",
        "--micro_batch_size", "16", "--rollout_engine", "hf", "--progress", "false",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2
    assert all(row["tools/failure_frequency"] == 1.0 and row["tools/call_frequency"] > 0 for row in rows)
    config = json.loads(json.dumps(TrainConfig.from_yaml(tmp_path / "run" / "config.yaml").tools))
    assert config == [f"{tmp_path / 'tools.py'}:calculator"]


def test_two_processes_run_their_episodes_turn_for_turn(tmp_path) -> None:
    """`accelerate launch`, 2 CPU processes, the tool task: each process's episodes end after their own number of
    turns, yet both run the same collectives (a turn count agreed per round) and finish 2 steps together; the
    tool metrics are gathered over both."""
    import os

    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "pods", "train", "--config", "embedded-tool", "--max_steps", "2", "--max_time", "null",
        "--output_dir", str(tmp_path / "run"), "--eval_at_start", "false", "--eval_every_seconds", "null",
        "--eval_at_seconds", "[]", "--save_final", "false", "--save_every_seconds", "null",
        "--prompts_per_step", "2", "--num_generations", "8", "--micro_batch_size", "8", "--rollout_engine", "hf",
        "--progress", "false",
    ]  # fmt: skip
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k not in launcher}
    env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(row["tools/call_frequency"] > 0 for row in rows)


def test_a_process_whose_episodes_ended_samples_in_step_with_the_others(tool_model) -> None:
    """With several processes, ``most`` (the largest count over processes) decides how many turns every process
    runs: here another process has episodes going for 3 rounds more than this one's, so this one runs 3 more
    one-token generations (discarded), and its episodes come out as they would alone."""
    model, tokenizer = tool_model
    calls = []

    class Counting(HFGenerateEngine):
        def generate_tokens(self, encoded, num_generations, sampling):
            calls.append((len(encoded), sampling.max_new_tokens))
            return super().generate_tokens(encoded, num_generations, sampling)

    engine = MultiTurnEngine(
        Counting(model, tokenizer), TextFormat(tokenizer), tools=[calculator], max_completion_length=48
    )
    rows, sampling = product_rows(2), SamplingParams(max_new_tokens=48, temperature=1.0)
    torch.manual_seed(0)
    alone = engine.episodes(rows, 4, sampling).rollouts
    alone_calls = list(calls)
    calls.clear()
    others = iter([3, 2, 1, 0])  # the other process's episodes still going, once this one's have ended
    torch.manual_seed(0)
    together = engine.episodes(rows, 4, sampling, most=lambda mine: mine or next(others)).rollouts
    assert together.texts == alone.texts and torch.equal(together.tool_mask, alone.tool_mask)
    assert calls == [*alone_calls, (1, 1), (1, 1), (1, 1)]  # its own turns, then 3 one-token ones


class CalculatorDesk:
    """An environment in TRL's shape: its calculator is its tool, and it owns a reward (``get_reward``): 1 for an
    episode that used the calculator."""

    def reset(self, **row) -> None:
        self.uses = 0

    def calculator(self, expression: str) -> str:
        """Compute an expression.

        Args:
            expression: What to compute.
        """
        self.uses += 1
        return calculator(expression)

    def get_reward(self) -> float:
        return float(self.uses > 0)


def test_an_environment_that_owns_a_reward_is_scored_by_it(tmp_path) -> None:
    """An environment factory whose environments define get_reward adds a reward named after the class, weighed
    1 next to the configured ones (TRL's rule): here its mean over every episode is exactly the share of episodes
    that called the environment's calculator."""
    settings = {**SETTINGS, "max_steps": 1, "output_dir": str(tmp_path), "reward_weights": [1.0]}
    trainer = PODSTrainer(TrainConfig.from_dict(settings), tools=[], environment_factory=CalculatorDesk)
    assert trainer.config.reward_weights == [1.0, 1.0]
    trainer.train()
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["rewards/CalculatorDesk/mean"] == pytest.approx(row["tools/calling_share"])
    assert 0 < row["tools/calling_share"] < 1
