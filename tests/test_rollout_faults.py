"""The rollout side holds up: the rollout worker killed (SIGKILL) at each point where it or the trainer waits on the
other, reached by the code's own fault points (pods.faults, PODS_FAULT), not by a timer. Each run of `pods train`
ends within seconds with one line naming the worker, exit status 2, a loadable checkpoint of the last completed step
and no process left; resumed from it, the run trains on. Also: signals while the trainer waits on the worker,
publishes or saves; the trainer itself killed (its worker goes with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pods import faults
from pods.checkpoint import checkpoint_problem, checkpoint_step, list_checkpoints
from pods.cli import main
from pods.metrics import read_jsonl
from pods.pipes import Link, PeerGone, link_pair

TINY = {
    "max_time": "null", "eval_at_start": "false", "eval_every_seconds": "null", "eval_at_seconds": "[]",
    "save_every_seconds": "null", "progress": "false", "prompts_per_step": 2, "num_generations": 4,
    "num_generations_kept": 2, "micro_batch_size": 4, "max_completion_length": 8, "rollout_engine": "hf",
    "async_generation": "true", "rollout_worker_threads": 1, "torch_threads": 1, "max_steps": 3,
    "train_limit": 64,  # tokenizing the whole arith train set took 3-4 s of each run
}  # fmt: skip
# a batch far larger than a pipe's 64 KiB: the worker's send blocks until the trainer reads
LARGE_BATCH = {
    "prompts_per_step": 8,
    "num_generations": 16,
    "num_generations_kept": 4,
    "max_completion_length": 24,
}
POINTS = {  # point -> the settings that reach it
    "worker_start": {},
    "worker_waiting_for_weights": {},
    "worker_generating": {},
    "worker_scoring": {},
    "worker_queue_full": LARGE_BATCH,
    "trainer_publishing": {"weight_sync_backend": "gloo"},  # the gloo weights path; the others share memory
    "trainer_checkpointing": {"save_every_steps": 1},
    "trainer_final_evaluation": {"eval_at_start": "true", "eval_limit": 2},
}

# resumed from (the others' checkpoints are of the same kind): one written during the kill, one after the end
RESUMED = ("trainer_checkpointing", "trainer_final_evaluation")


def arguments(model_dir: Path, output: Path, **options) -> list[str]:
    settings = {"model": model_dir, "output_dir": output, **TINY, **options}
    return ["train", *(f"--{key}={value}" for key, value in settings.items())]


def processes_started_here(before: set[int] = frozenset()) -> list[psutil.Process]:
    """This process's live descendants not in ``before`` (those earlier tests left, e.g. a reward-timeout worker),
    but for multiprocessing's resource tracker (it lives as long as this process)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if (
                child.pid not in before
                and child.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(child.cmdline())
            ):
                found.append(child)
        except psutil.Error:
            continue
    return found


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def last_step(output: Path) -> int:
    path = output / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    return rows[-1]["step"] if rows else 0


@pytest.mark.parametrize("point", POINTS)
def test_a_worker_killed_at_each_fault_point_ends_the_run_cleanly_and_it_resumes(
    point: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    output, mark = tmp_path / "run", tmp_path / "fired"
    monkeypatch.setenv(faults.FAULT_ENV, point)
    monkeypatch.setenv(faults.FAULT_MARK_ENV, str(mark))
    faults.reset()
    before = children()
    code = main(arguments(tiny_model_dir, output, **POINTS[point]))
    ended = time.time()
    err = capsys.readouterr().err.strip()
    assert mark.read_text() == point  # the fault fired where it should, not some other failure
    assert code == 2, err
    assert ended - mark.stat().st_mtime < 15  # within seconds of the kill, never a hang
    [line] = err.splitlines()  # one line: no traceback
    assert line.startswith("pods train: error: ") and "rollout worker" in line and "SIGKILL" in line, line
    assert "resume_from: auto" in line
    done = last_step(output)
    checkpoints = list_checkpoints(output / "checkpoints")
    assert checkpoints and checkpoint_step(checkpoints[-1]) == done, (done, checkpoints)
    assert checkpoint_problem(checkpoints[-1]) is None
    assert not processes_started_here(before)
    if point not in RESUMED:
        return
    monkeypatch.delenv(faults.FAULT_ENV)
    faults.reset()
    resumed = {**POINTS[point], "max_steps": done + 1, "resume_from": "auto"}
    assert main(arguments(tiny_model_dir, output, **resumed)) == 0, capsys.readouterr().err
    assert last_step(output) == done + 1


@pytest.mark.parametrize(
    ("point", "signal_name"),
    [
        ("trainer_waiting_for_rollouts", "SIGTERM"),
        ("trainer_publishing", "SIGINT"),
        ("trainer_checkpointing", "SIGTERM"),
    ],
)
def test_a_signal_while_the_trainer_waits_on_publishes_to_or_saves_for_the_worker_stops_the_run(
    point: str,
    signal_name: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
) -> None:
    """As in sync mode: the step in flight finishes, a checkpoint of it, the resume command, exit 128 + signal."""
    output = tmp_path / "run"
    monkeypatch.setenv(faults.FAULT_ENV, f"{point}:{signal_name}")
    faults.reset()
    before = children()
    code = main(arguments(tiny_model_dir, output, max_steps=20, save_every_steps=1))
    err = capsys.readouterr().err
    assert code == 128 + signal.Signals[signal_name], err
    done = last_step(output)
    assert done < 20 and checkpoint_step(list_checkpoints(output / "checkpoints")[-1]) == done
    assert "resume_from auto" in err and "Traceback" not in err
    assert not processes_started_here(before)


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` (every descendant of a run inherits it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PODS_TEST_TAG") == tag and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def run_pods(args: list[str], tag: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
        "PODS_TEST_TAG": tag,
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "pods", *args], capture_output=True, text=True, timeout=300, env=environment
    )


@pytest.mark.slow
def test_pods_train_says_one_line_when_its_worker_dies_and_leaves_nothing_behind(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real command: stderr is the one line (no leaked-semaphore warning from multiprocessing's resource
    tracker at exit, no traceback), and no process of the run outlives it."""
    tag = f"worker-{os.getpid()}-{time.time()}"
    result = run_pods(arguments(tiny_model_dir, tmp_path / "run"), tag, PODS_FAULT="worker_generating")
    assert result.returncode == 2, result.stderr
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and "Setting accelerator to CPU" not in line
    ]
    assert len(lines) == 1 and "rollout worker" in lines[0], result.stderr
    time.sleep(0.5)  # the resource tracker leaves after its parent
    assert not tagged(tag)


@pytest.mark.slow
def test_a_killed_trainer_takes_its_worker_with_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    tag = f"trainer-{os.getpid()}-{time.time()}"
    result = run_pods(
        arguments(tiny_model_dir, tmp_path / "run", max_steps=20),
        tag,
        PODS_FAULT="trainer_waiting_for_rollouts@2:SIGKILL",
    )
    assert result.returncode == -signal.SIGKILL
    deadline = time.time() + 10
    while tagged(tag) and time.time() < deadline:
        time.sleep(0.1)
    assert not tagged(tag), [p.cmdline() for p in tagged(tag)]


SLEEPER = "import time; time.sleep(120)"
WITH_A_CHILD = (
    f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); time.sleep(120)"
)
PARENT = (
    "import subprocess, sys; from pods.child_process import guarded; "
    f"subprocess.Popen(guarded([sys.executable, '-c', {WITH_A_CHILD!r}]), start_new_session=True); "
    f"exec({SLEEPER!r})"
)


def test_a_vllm_servers_guard_stops_its_whole_group_when_the_process_that_started_it_dies(
    tmp_path: Path,
) -> None:
    """What a vLLM server pods starts runs under (its engine core and workers are the server's own children, which
    PR_SET_PDEATHSIG alone leaves behind): a parent starts the guard over a command with a child of its own; the
    parent SIGKILLed, the guard, the command and the command's child are all gone."""
    tag = f"guard-{os.getpid()}-{time.time()}"
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "PODS_TEST_TAG": tag}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=environment)
    try:
        deadline = time.time() + 60
        while len(tagged(tag)) < 4 and time.time() < deadline:  # parent, guard, command, its child
            time.sleep(0.1)
        assert len(tagged(tag)) == 4
        parent.kill()
        parent.wait()
        deadline = time.time() + 10
        while tagged(tag) and time.time() < deadline:
            time.sleep(0.1)
        assert not tagged(tag), [p.cmdline() for p in tagged(tag)]
    finally:
        for process in tagged(tag):
            process.kill()


# ---------------------------------------------------------------------------------------------------- pipes


def _write_half_a_message_then_die(incoming, outgoing) -> None:
    link = Link(incoming, outgoing)
    link.send(("hello",))
    os.write(
        outgoing.fileno(), (1000).to_bytes(8, "little") + b"x" * 10
    )  # a header, and 10 of its 1000 bytes
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_peer_that_dies_half_way_through_a_message_is_an_end_not_a_hang() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    link, ends = link_pair(context)
    child = context.Process(target=_write_half_a_message_then_die, args=ends)
    child.start()
    for end in ends:
        end.close()
    started = time.monotonic()
    assert link.receive(30) == ("hello",)
    with pytest.raises(PeerGone):
        while True:
            link.receive(0.5)
    assert time.monotonic() - started < 20
    child.join()  # a dying process closes its pipes one by one: after it is gone, writing fails too
    assert child.exitcode == -signal.SIGKILL
    with pytest.raises(PeerGone):
        link.send("anyone?")
