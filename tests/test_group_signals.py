"""A signal to the whole process group (Ctrl-C in a terminal, ``kill -TERM -PGID``, a scheduler's stop) ends a run as
a signal to the trainer alone does: the rollout worker and the vLLM server's guard leave the stop to the trainer,
which finishes its step, saves a checkpoint with the batches in flight, prints the resume command and exits with
128 + the signal. Each run here leads a process group of its own (``start_new_session``) and gets ``os.killpg``
once it has logged a step. Also: the guard stops promptly, and a checkpoint while an async step runs out of
groups (``prompt_filter_exhausted: error``) does not wait for a batch already taken."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pods.checkpoint import checkpoint_problem, checkpoint_step, list_checkpoints
from pods.child_process import GRACE_SECONDS, guarded
from pods.metrics import read_jsonl
from pods.rollout.vllm_server import _stop
from pods.rollout_worker import load_in_flight

sys.path.insert(0, str(Path(__file__).parent))
from test_reliability import CLI_ENV, PATIENCE_S, finish, outputs, pods_train, start, wait_for_step

ASYNC = {"async_generation": "true", "rollout_engine": "hf", "rollout_worker_threads": 1, "torch_threads": 1}

# ------------------------------------------------------------------------------------- the vLLM server's guard

# A command that stops promptly on SIGTERM (exit status 0), after saying it is ready.
PROMPT_STOPPER = """
import pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    (folder / "stopped").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(folder / "ready").write_text("")
time.sleep(300)
"""


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def start_guarded(folder: Path) -> subprocess.Popen:
    """The guard over :data:`PROMPT_STOPPER`, started as pods starts a vLLM server (this process its parent)."""
    command = guarded([sys.executable, "-c", PROMPT_STOPPER, str(folder)])
    guard = start(command, folder / "guard", {**CLI_ENV}, start_new_session=True)
    wait_for(lambda: (folder / "ready").exists(), "the guarded command never started")
    return guard


def test_the_guard_stops_a_command_that_stops_promptly_without_sigkill(tmp_path: Path) -> None:
    """pods's stop (SIGTERM to the server's group): the command's own exit status comes back (0), not the guard's
    SIGKILL of its group after GRACE_SECONDS (what a poll() inside the guard's signal handler, blocked by the
    wait() it interrupted, ended in)."""
    guard = start_guarded(tmp_path)
    began = time.monotonic()
    _stop(guard, str(tmp_path / "server-files"))
    took = time.monotonic() - began
    assert finish(guard, 10) == 0, outputs(guard)
    assert (tmp_path / "stopped").read_text() == "SIGTERM"
    assert took < GRACE_SECONDS + 5  # generous: the status above is the measure


def test_the_guard_leaves_the_stop_to_the_process_that_started_it(tmp_path: Path) -> None:
    """SIGTERM, SIGINT and SIGHUP from another process (a scheduler signalling every process of a job) are
    ignored, each with a line, while the guard's parent lives; its parent's stop then works as usual."""
    guard = start_guarded(tmp_path)
    try:
        for name in ("SIGTERM", "SIGINT", "SIGHUP"):
            subprocess.run(["kill", f"-{name.removeprefix('SIG')}", str(guard.pid)], check=True)
            wait_for(lambda name=name: f"{name} from pid" in outputs(guard)[1], f"{name} was not ignored", 30)
        assert guard.poll() is None and not (tmp_path / "stopped").exists()
        _stop(guard, str(tmp_path / "server-files"))
        assert finish(guard, 10) == 0, outputs(guard)
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ async: a step runs out of groups

FIRST_ROUND_VARIES = '''
calls = 0


def first_round_varies(prompts, completions, **columns):
    """The worker's first round (step 0) has a spread in every group; every later round none (1 everywhere)."""
    global calls
    calls += 1
    return [float(i % 2) if calls == 1 else 1.0 for i in range(len(completions))]
'''


def test_an_async_step_that_runs_out_of_groups_saves_its_batch_instead_of_waiting_for_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """prompt_filter_exhausted: error at step 1: the checkpoint of the last completed step (1) holds step 1's
    batch, which the trainer has taken already (it waited for the worker to send it again, for good)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(FIRST_ROUND_VARIES)
    output = tmp_path / "run"
    command = pods_train(
        tiny_model_dir, output, **ASYNC, max_steps=4, prompt_filter="nonzero_std", max_num_gen_batches=1,
        prompt_filter_exhausted="error", reward_funcs=f"{rewards}:first_round_varies",
    )  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=CLI_ENV, timeout=PATIENCE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the run did not end within {PATIENCE_S} s: its checkpoint waits for a batch taken already"
        )
    assert result.returncode == 2, result.stderr
    assert "prompt_filter_exhausted" in result.stderr and "step-0000001" in result.stderr, result.stderr
    [checkpoint] = list_checkpoints(output / "checkpoints")
    assert checkpoint_step(checkpoint) == 1 and checkpoint_problem(checkpoint) is None
    assert [batch.step for batch in load_in_flight(checkpoint)] == [1]


# ------------------------------------------------------------------------------------ a signal to the whole group


def signal_group_after_step(process: subprocess.Popen, metrics: Path, signum: int, step: int = 1) -> int:
    """Send ``signum`` to the run's whole process group once it has logged ``step``; its exit status."""
    try:
        wait_for_step(process, metrics, step)
        os.killpg(process.pid, signum)
        return finish(process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def assert_stopped_with_resume_command(code: int, signum: int, output: Path, stderr: str) -> list[str]:
    """Exit 128 + signal, no traceback, one sound checkpoint of the last logged step; the printed command."""
    name = signal.Signals(signum).name
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr and "rollout worker" not in stderr, stderr
    stopped_at = read_jsonl(output / "metrics.jsonl")[-1]["step"]
    checkpoints = list_checkpoints(output / "checkpoints")
    assert [checkpoint_step(p) for p in checkpoints] == [stopped_at], stderr
    assert checkpoint_problem(checkpoints[-1]) is None
    assert f"stopped by {name} after step {stopped_at}" in stderr, stderr
    return shlex.split(stderr.split("Continue this run with:")[1].strip().splitlines()[0])


def tagged_env(tag: str) -> dict[str, str]:
    """The environment of a run whose processes (a vLLM server in a session of its own too) carry ``tag``."""
    return {**CLI_ENV, "PODS_TEST_TAG": tag}


def processes_left(tag: str) -> list[str]:
    """The command lines of a run's processes still alive (they inherit its environment's tag)."""
    left = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PODS_TEST_TAG") == tag and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()))
        except (psutil.Error, OSError):
            continue
    return left


@pytest.mark.slow
def test_a_group_sigterm_to_an_async_run_checkpoints_its_batches_in_flight_and_the_resume_trains_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What `kill -TERM -PGID` (SLURM's scancel and time limit, systemd) does to an async run: the worker does not
    end at once (the trainer reported it "died with exit code 0" and exited 2); the checkpoint holds the batch in
    flight (max_staleness 1: the batch of the next step, sampled by older weights); the printed command resumes
    from it and trains on."""
    output, tag = tmp_path / "run", f"async-sigterm-{tmp_path.name}"
    command = pods_train(tiny_model_dir, output, **ASYNC, max_steps=30)
    process = start(command, output, tagged_env(tag), start_new_session=True)
    code = signal_group_after_step(process, output / "metrics.jsonl", signal.SIGTERM)
    _, stderr = outputs(process)
    command = assert_stopped_with_resume_command(code, signal.SIGTERM, output, stderr)
    stopped_at = read_jsonl(output / "metrics.jsonl")[-1]["step"]
    [checkpoint] = list_checkpoints(output / "checkpoints")
    assert [batch.step for batch in load_in_flight(checkpoint)] == [stopped_at]
    wait_for(lambda: not processes_left(tag), f"processes left: {processes_left(tag)}", 30)
    assert command[:2] == ["pods", "train"] and command[-2:] == ["--resume_from", "auto"]
    resumed = [sys.executable, "-m", "pods", *command[1:], f"--max_steps={stopped_at + 2}"]
    result = subprocess.run(resumed, capture_output=True, text=True, env=CLI_ENV, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr
    assert [row["step"] for row in read_jsonl(output / "metrics.jsonl")][-2:] == [
        stopped_at + 1,
        stopped_at + 2,
    ]


@pytest.mark.slow
def test_a_group_sigint_to_a_sync_run_stops_it_after_the_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C in a terminal (SIGINT to the foreground group) on `pods train` without a worker."""
    output = tmp_path / "run"
    process = start(pods_train(tiny_model_dir, output, max_steps=30), output, CLI_ENV, start_new_session=True)
    code = signal_group_after_step(process, output / "metrics.jsonl", signal.SIGINT)
    assert_stopped_with_resume_command(code, signal.SIGINT, output, outputs(process)[1])


@pytest.fixture(scope="module")
def tiny_vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random test model with head size 32 (vLLM's CPU attention has no kernel for size 8)."""
    from pods.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-model"), hidden_size=64, num_heads=2)


@pytest.mark.slow
def test_a_group_sigint_to_an_async_run_with_a_vllm_server_stops_it_and_the_server(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    """Ctrl-C on an async run in server mode (the worker starts the server, in a session of its own): the same
    stop, with the batch in flight in the checkpoint, and no process of the run left, the server's included."""
    output, tag = tmp_path / "run", f"server-sigint-{tmp_path.name}"
    settings = {**ASYNC, "rollout_engine": "vllm", "vllm_mode": "server", "vllm_cpu_kv_cache_gb": 0.25}
    command = pods_train(tiny_vllm_model_dir, output, **settings, max_steps=30)
    process = start(command, output, tagged_env(tag), start_new_session=True)
    code = signal_group_after_step(process, output / "metrics.jsonl", signal.SIGINT)
    assert_stopped_with_resume_command(code, signal.SIGINT, output, outputs(process)[1])
    [checkpoint] = list_checkpoints(output / "checkpoints")
    assert [batch.step for batch in load_in_flight(checkpoint)] == [checkpoint_step(checkpoint)]
    wait_for(lambda: not processes_left(tag), f"processes left: {processes_left(tag)}", 30)
