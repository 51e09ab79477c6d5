"""Training that survives preemption and bad luck, tested for real: real signals to real training
processes, real damaged files, writes that really fail, NaNs that really reach the optimizer step."""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pods.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    TrainerState,
    checkpoint_problem,
    checkpoint_step,
    checkpoint_to_resume,
    list_checkpoints,
    save_checkpoint,
)
from pods.cli import main
from pods.config import ConfigError
from pods.metrics import read_jsonl
from pods.scoring import RewardFunctionError
from pods.trainer import NonFiniteError, PODSTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import SCRIPT, learning_metrics, tiny_config, two_process_launch
from tiny_run import count_of_a, tiny_dataset

# ------------------------------------------------------------------------------------------ helpers


def start(command: list[str], logs: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    """``command`` in the background, stdout and stderr to files named after ``logs`` (read them with
    :func:`outputs` at any time; unlike a pipe, a file never fills up and blocks the process)."""
    logs.parent.mkdir(parents=True, exist_ok=True)
    log = logs.parent / f"{logs.name}-{time.monotonic_ns()}"
    handles = open(f"{log}.out", "w"), open(f"{log}.err", "w")  # noqa: SIM115 - closed in finish()
    process = subprocess.Popen(command, stdout=handles[0], stderr=handles[1], env=env, **popen)
    process.logs = handles
    return process


def start_script(
    model_dir: Path, output: Path, settings: dict, env: dict | None = None, **popen
) -> subprocess.Popen:
    """tiny_run.py as a background process (stdout and stderr to files in ``output``'s parent)."""
    command = [sys.executable, str(SCRIPT), str(model_dir), str(output), json.dumps(settings)]
    return start(command, output, env={**os.environ, **(env or {})}, **popen)


def outputs(process: subprocess.Popen) -> tuple[str, str]:
    return tuple(Path(handle.name).read_text() for handle in process.logs)


# Deadlines for what should take seconds: generous, since starting a run on a busy 2-core machine can take
# minutes; they only matter when something hangs.
PATIENCE_S = 300


def wait_for_step(process: subprocess.Popen, metrics: Path, step: int, timeout: float = PATIENCE_S) -> None:
    """Wait until ``metrics`` logs ``step`` (the run is then in the middle of training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended early: {outputs(process)[1][-2000:]}"
        if metrics.is_file() and any(row.get("step", 0) >= step for row in read_jsonl(metrics)):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} never logged")


def finish(process: subprocess.Popen, timeout: float = PATIENCE_S) -> int:
    code = process.wait(timeout=timeout)
    for handle in process.logs:
        handle.close()
    return code


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "the weights differ"


def stopped_line(stdout: str) -> list[str]:
    lines = [line.split(" ", 4) for line in stdout.splitlines() if line.startswith("STOPPED ")]
    assert len(lines) == 1, stdout
    return lines[0]


def damage(file: Path, how: str) -> None:
    """A real damaged file: cut in half, or one byte flipped in the middle (same size)."""
    data = bytearray(file.read_bytes())
    if how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(data)


def trainer_for(model_dir: Path, output: Path, reward=count_of_a, **overrides) -> PODSTrainer:
    return PODSTrainer(
        tiny_config(model_dir, output, **overrides), reward_funcs=[reward], train_dataset=tiny_dataset()
    )


CLI_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}


def pods_train(model_dir: Path, output: Path, **options) -> list[str]:
    """A `pods train` command line for a few-second run of the tiny model on the arithmetic task."""
    settings = {
        "model": model_dir, "max_time": "null", "eval_at_start": "false", "eval_every_seconds": "null",
        "eval_at_seconds": "[]",
        "save_every_seconds": "null", "progress": "false", "prompts_per_step": 2, "num_generations": 4,
        "num_generations_kept": 2, "micro_batch_size": 4, "max_completion_length": 8, "output_dir": output,
        "train_limit": 64,  # not the whole arith train set tokenized at every start
        **options,
    }  # fmt: skip
    return [sys.executable, "-m", "pods", "train", *(f"--{k}={v}" for k, v in settings.items())]


def small_files(limit: int):
    """A child-process hook: files may not grow past ``limit`` bytes (RLIMIT_FSIZE binds root too)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# ------------------------------------------------------------------------------------------ graceful stop


@pytest.mark.slow
def test_sigterm_stops_after_the_step_with_a_checkpoint_and_the_printed_command_resumes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`pods train` itself: SIGTERM mid-run saves the last completed step, prints the resume command, exits 143;
    the printed command (run in this process) continues the run to its end."""
    output = tmp_path / "run"
    process = start(pods_train(tiny_model_dir, output, max_steps=8, report_to="tensorboard"), output, CLI_ENV)
    try:
        wait_for_step(process, output / "metrics.jsonl", 2)
        process.send_signal(signal.SIGTERM)
        code = finish(process)
    finally:
        process.kill()
    _, stderr = outputs(process)
    assert code == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    stopped_at = read_jsonl(output / "metrics.jsonl")[-1]["step"]
    assert 2 <= stopped_at < 8
    assert [checkpoint_step(p) for p in list_checkpoints(output / "checkpoints")] == [stopped_at]
    assert checkpoint_problem(list_checkpoints(output / "checkpoints")[-1]) is None
    assert f"stopped by SIGTERM after step {stopped_at}" in stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output / "pods")).Reload()  # the tracker was flushed and closed
    assert [event.step for event in events.Scalars("reward")] == list(range(1, stopped_at + 1))
    command = shlex.split(stderr.split("Continue this run with:")[1].strip().splitlines()[0])
    assert command[:2] == ["pods", "train"] and command[-4:] == [
        "--output_dir",
        str(output),
        "--resume_from",
        "auto",
    ]
    assert main(command[1:]) == 0
    assert [row["step"] for row in read_jsonl(output / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.slow
def test_a_second_sigint_aborts_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C twice: the second one interrupts even a reward function in the middle of a 100 s call."""
    process = start_script(
        tiny_model_dir, tmp_path / "run", {"max_steps": 50}, env={"TINY_RUN_REWARD_SLEEP": "100"}
    )
    deadline = time.monotonic() + PATIENCE_S
    while "REWARD CALL" not in outputs(process)[0]:
        assert process.poll() is None and time.monotonic() < deadline, outputs(process)[1][-2000:]
        time.sleep(0.05)
    time.sleep(0.5)  # inside the first 100 s reward call
    process.send_signal(signal.SIGINT)
    time.sleep(1.5)  # longer than a launcher's forwarded copy of the same Ctrl-C
    assert process.poll() is None, "the first SIGINT did not wait for the step in flight"
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    code = finish(process)
    # well before the reward call's end, even when a busy machine slows the process's exit
    assert time.monotonic() - sent < 40, "the second SIGINT did not abort at once"
    stdout, stderr = outputs(process)
    assert code != 0 and "KeyboardInterrupt" in stderr and "STOPPED" not in stdout
    assert "SIGINT received" in stderr


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_both_ranks_at_the_same_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """2 processes under `accelerate launch`: SIGTERM to rank 1 alone stops both at one step with one checkpoint;
    then, resumed, a terminal's Ctrl-C (SIGINT to the launcher and both workers, which the launcher forwards
    again) is one graceful stop, not a second press."""
    import psutil

    def launch_and_stop(settings: dict, stop) -> tuple[int, list[list[str]], str]:
        command, env = two_process_launch(tiny_model_dir, tmp_path, settings)
        launcher = start(command, tmp_path / "launch", env, start_new_session=True)
        try:
            wait_for_step(launcher, tmp_path / "metrics.jsonl", highest + 2)
            stop(launcher)
            code = finish(launcher)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)  # the workers too, should the test fail
        stdout, stderr = outputs(launcher)
        lines = sorted(line.split(" ", 4) for line in stdout.splitlines() if line.startswith("STOPPED "))
        assert [line[1] for line in lines] == ["0", "1"], stderr[-3000:]
        assert lines[0][2:4] == lines[1][2:4], lines  # same signal, same step
        step = int(lines[0][3])
        assert highest + 2 <= step < 200
        assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["step"] == step
        checkpoint = list_checkpoints(tmp_path / "checkpoints")[-1]
        assert checkpoint_step(checkpoint) == step and checkpoint_problem(checkpoint) is None
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in checkpoint.iterdir()}
        assert_same_weights(weights(tmp_path / "weights-rank0.pt"), weights(tmp_path / "weights-rank1.pt"))
        return code, lines, stderr

    def sigterm_to_rank_1(launcher: subprocess.Popen) -> None:
        workers = psutil.Process(launcher.pid).children(recursive=True)
        rank1 = [p for p in workers if "tiny_run" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"]
        assert len(rank1) == 1, [p.cmdline() for p in workers]
        rank1[0].send_signal(signal.SIGTERM)  # only rank 1 hears it

    settings = {"max_steps": 200, "save_every_steps": None}
    highest = 0
    _, lines, _ = launch_and_stop(settings, sigterm_to_rank_1)
    assert lines[0][2] == "SIGTERM"
    highest = int(lines[0][3])
    code, lines, stderr = launch_and_stop(
        {**settings, "resume_from": "auto"}, lambda launcher: os.killpg(launcher.pid, signal.SIGINT)
    )
    assert lines[0][2] == "SIGINT" and "KeyboardInterrupt" not in stderr
    assert code == 128 + signal.SIGINT


# ------------------------------------------------------------------------------------------ fault injection


@pytest.mark.slow
def test_fault_injection_crashes_signals_and_a_damaged_checkpoint_resume_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Seeded random stops (a crash half-way through writing a checkpoint, SIGTERM, SIGKILL then the newest
    checkpoint damaged, SIGTERM), each followed by --resume_from auto: the end weights and every step's rewards
    equal an uninterrupted run's (two optimizer passes per generation, so the old log-probs resume too)."""
    steps = 20
    settings = {
        "max_steps": steps,
        "save_every_steps": 1,
        "selection_rule": "random",
        "num_iterations": 2,
        "torch_threads": 1,
    }
    straight = trainer_for(tiny_model_dir, tmp_path / "straight", **settings)  # in-process: same threads
    straight.train()

    rng = random.Random(11)
    output, metrics = tmp_path / "interrupted", tmp_path / "interrupted" / "metrics.jsonl"
    highest, resume, damaged = 0, {}, None
    for event in ("crash while saving", "SIGTERM", "SIGKILL+damage", "SIGTERM"):
        # Steps of at least 0.1 s (the reward pauses; same values), so a stop point cannot run away to the end
        # on a fast, idle machine.
        env = {"TINY_RUN_REWARD_SLEEP": "0.1"}
        if event == "crash while saving":  # os._exit(17) after the model is written, before the manifest
            crash_at = highest + rng.randint(2, 3)
            env["PODS_CRASH_DURING_SAVE"] = str(crash_at)
        process = start_script(tiny_model_dir, output, {**settings, **resume}, env=env)
        if event != "crash while saving":
            wait_for_step(process, metrics, highest + rng.randint(1, 2))
            time.sleep(rng.uniform(0.0, 0.25))  # anywhere in a step: generating, updating or saving
            process.send_signal(signal.SIGKILL if event.startswith("SIGKILL") else signal.SIGTERM)
        code = finish(process)
        stdout, stderr = outputs(process)
        if damaged is not None:  # this run started after the newest checkpoint was damaged
            assert f"skipping checkpoint {damaged}" in stderr and "model.safetensors has" in stderr, stderr
        highest = max(row["step"] for row in read_jsonl(metrics))
        assert highest < steps, f"the run ended before the {event}: lower the stop points\n{stderr[-3000:]}"
        newest = list_checkpoints(output / "checkpoints")[-1]
        if event == "crash while saving":  # the step was logged, its checkpoint never completed
            assert code == 17 and highest == crash_at == checkpoint_step(newest) + 1, stderr[-3000:]
            assert (output / "checkpoints" / f".partial-step-{crash_at:07d}").is_dir()
        elif event == "SIGTERM":
            assert code == 128 + signal.SIGTERM, stderr
            assert int(stopped_line(stdout)[3]) == highest == checkpoint_step(newest)
        else:
            assert code == -signal.SIGKILL
        damaged = newest if event.endswith("damage") else None
        if damaged:
            damage(newest / "model.safetensors", "truncate")
        resume = {"resume_from": "auto"}

    resumed = trainer_for(tiny_model_dir, output, **settings, **resume)  # in-process, like the straight run
    assert resumed.train().steps == steps
    assert_same_weights(
        *(run.accelerator.unwrap_model(run.model).state_dict() for run in (straight, resumed))
    )
    straight_rows, resumed_rows = (
        learning_metrics(tmp_path / "straight" / "metrics.jsonl"),
        learning_metrics(metrics),
    )
    assert [row["step"] for row in resumed_rows] == list(range(1, steps + 1))
    assert straight_rows == resumed_rows
    assert not list((output / "checkpoints").glob(".partial-*"))


# ------------------------------------------------------------------------------------------ verified checkpoints


def test_damaged_checkpoints_are_named_skipped_by_auto_and_refused_when_explicit(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    trainer_for(tiny_model_dir, tmp_path, max_steps=3, save_every_steps=1, save_total_limit=3).train()
    step1, step2, step3 = list_checkpoints(tmp_path / "checkpoints")
    assert all(checkpoint_problem(p) is None for p in (step1, step2, step3))
    damage(step3 / "model.safetensors", "truncate")
    damage(step2 / "optimizer.bin", "flip")  # same size: only the sha256 can tell
    assert "model.safetensors has" in checkpoint_problem(step3)
    assert "optimizer.bin does not match its sha256" in checkpoint_problem(step2)

    with pytest.raises(ConfigError, match=r"step-0000003 is damaged: model\.safetensors has \d+ bytes"):
        trainer_for(tiny_model_dir, tmp_path, max_steps=4, resume_from=str(step3)).train()
    capfd.readouterr()
    result = trainer_for(tiny_model_dir, tmp_path, max_steps=4, resume_from="auto").train()
    warnings = capfd.readouterr().err
    assert f"skipping checkpoint {step3}" in warnings and f"skipping checkpoint {step2}" in warnings
    assert result.steps == 4
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [
        1,
        2,
        3,
        4,
    ]  # 2-3 redone from step 1
    # Rotation keeps the newest checkpoints at or before the current step, never the one just written.
    assert checkpoint_step(list_checkpoints(tmp_path / "checkpoints")[-1]) == 4


def test_pods_eval_on_damaged_models_is_a_clear_error(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import shutil

    from pods.cli import main

    trainer_for(tiny_model_dir, tmp_path / "run", max_steps=1).train()
    checkpoint = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    damage(checkpoint / "model" / "model.safetensors", "flip")
    plain = tmp_path / "plain-model"
    shutil.copytree(tiny_model_dir, plain)
    damage(plain / "model.safetensors", "truncate")
    for target, expected in [
        (checkpoint, "model/model.safetensors does not match its sha256"),
        (checkpoint / "model", "model/model.safetensors does not match its sha256"),
        (tmp_path / "run", "no intact checkpoint"),
        (plain, "cannot load the model (SafetensorError"),
    ]:
        report = ["--output", str(tmp_path / "report.json")]
        assert main(["eval", "--model", str(target), "--dataset", "arith", "--limit", "2", *report]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err


def test_pods_eval_never_runs_a_models_own_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    from pods.cli import main

    model = tmp_path / "remote-code-model"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "code-ran"
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
        "AutoConfig": "modeling_evil.EvilConfig",
    }
    (model / "config.json").write_text(json.dumps(config))
    report = tmp_path / "report.json"
    assert (
        main(["eval", "--model", str(model), "--dataset", "arith", "--limit", "2", "--output", str(report)])
        == 0
    )
    assert report.is_file() and not marker.exists(), "the model folder's own code was imported"


def test_resume_never_unpickles_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose optimizer.bin is a pickle that would run code (manifest updated to match) is refused."""
    import hashlib

    trainer_for(tiny_model_dir, tmp_path, max_steps=1).train()
    checkpoint = list_checkpoints(tmp_path / "checkpoints")[-1]
    marker = tmp_path / "pickle-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for name in ("optimizer.bin", "lr_scheduler.pt"):
        original, original_manifest = (
            (checkpoint / name).read_bytes(),
            (checkpoint / MANIFEST_FILE).read_text(),
        )
        torch.save({"state": Payload()}, checkpoint / name)
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
        with pytest.raises(
            ConfigError, match=r"could not load checkpoint .* only resume checkpoints you trust"
        ):
            trainer_for(tiny_model_dir, tmp_path, max_steps=2, resume_from="auto").train()
        assert not marker.exists(), f"{name} was unpickled with code execution"
        (checkpoint / name).write_bytes(original)
        (checkpoint / MANIFEST_FILE).write_text(original_manifest)


def test_re_saving_a_step_keeps_one_complete_copy_wherever_it_is_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3 saved again (as after resuming past damaged checkpoints): a second Ctrl-C between moving the old
    copy aside and renaming the new one in leaves the old copy, put back at the next start; a crash after
    the new copy is in place leaves the new one, and the old copy is deleted at the next start."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    root = tmp_path / "checkpoints"

    def save(seconds: float) -> Path:
        return save_checkpoint(accelerator, root, TrainerState(step=3, train_seconds=seconds), keep=2)

    def saved_seconds(folder: Path) -> float:
        assert checkpoint_problem(folder) is None
        return json.loads((folder / STATE_FILE).read_text())["train_seconds"]

    step3 = save(1.0)
    with torch.no_grad():
        model.weight.add_(1.0)
    monkeypatch.setenv("PODS_INTERRUPT_DURING_SAVE", "3:replace")
    with pytest.raises(KeyboardInterrupt):
        save(2.0)
    monkeypatch.delenv("PODS_INTERRUPT_DURING_SAVE")
    assert list_checkpoints(root) == [] and (root / ".replaced-step-0000003").is_dir()  # only aside now
    assert checkpoint_to_resume(accelerator, "auto", root) == step3 and saved_seconds(step3) == 1.0
    assert sorted(p.name for p in root.iterdir()) == ["step-0000003"]

    assert save(2.0) == step3 and saved_seconds(step3) == 2.0
    assert sorted(p.name for p in root.iterdir()) == ["step-0000003"]
    old_copy = root / ".replaced-step-0000003"  # what a crash right after the second rename leaves
    save_checkpoint(accelerator, tmp_path / "elsewhere", TrainerState(step=3, train_seconds=1.0), keep=1)
    (tmp_path / "elsewhere" / "step-0000003").rename(old_copy)
    assert checkpoint_to_resume(accelerator, "auto", root) == step3 and saved_seconds(step3) == 2.0
    assert not old_copy.exists()


def test_an_explicit_resume_from_an_older_step_sets_the_newer_history_aside(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """Resuming from step 1 of a run that reached step 3 abandons steps 2-3: they are moved out of the way
    (named in a warning), so a later resume_from: auto continues the new history, not the abandoned one."""
    root = tmp_path / "checkpoints"
    trainer_for(tiny_model_dir, tmp_path, max_steps=3, save_every_steps=1, save_total_limit=3).train()
    step1, _, old_step3 = list_checkpoints(root)
    old_state = (old_step3 / STATE_FILE).read_text()
    capfd.readouterr()
    trainer_for(tiny_model_dir, tmp_path, max_steps=2, save_every_steps=1, resume_from=str(step1)).train()
    abandoned = root / "abandoned-after-step-0000001"
    assert (
        f"resuming from step 1: moved the newer checkpoints of the abandoned history (step-0000002, "
        f"step-0000003) to {abandoned}" in capfd.readouterr().err
    )
    assert [checkpoint_step(p) for p in list_checkpoints(root)] == [1, 2]
    assert sorted(p.name for p in abandoned.iterdir()) == ["step-0000002", "step-0000003"]
    assert (abandoned / "step-0000003" / STATE_FILE).read_text() == old_state

    assert trainer_for(tiny_model_dir, tmp_path, max_steps=3, resume_from="auto").train().steps == 3
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]  # step 3 redone
    newest = list_checkpoints(root)[-1]
    assert checkpoint_step(newest) == 3 and checkpoint_problem(newest) is None


# ------------------------------------------------------------------------------------------ write failures


@pytest.mark.slow
def test_a_checkpoint_write_that_fails_leaves_earlier_ones_intact(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A real EFBIG (a file-size limit on the process, which binds root too) while `pods train` writes step 3's
    checkpoint: a one-line error, the earlier checkpoints intact, and the run continues once writes work."""
    output = tmp_path / "run"
    trainer_for(tiny_model_dir, output, max_steps=2, save_every_steps=1).train()
    before = list_checkpoints(output / "checkpoints")
    failed = subprocess.run(
        pods_train(tiny_model_dir, output, max_steps=4, save_every_steps=1, resume_from="auto"),
        capture_output=True,
        text=True,
        timeout=300,
        env=CLI_ENV,
        preexec_fn=small_files(64 * 1024),  # metrics and JSON files fit; model.safetensors (~115 KB) does not
    )
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    assert (
        f"pods train: error: could not write checkpoint {output / 'checkpoints' / 'step-0000003'}"
        in failed.stderr
    )
    assert (
        "File too large" in failed.stderr
        and f"Earlier checkpoints are intact (latest: {before[-1]})" in failed.stderr
    )
    assert list_checkpoints(output / "checkpoints") == before
    assert all(checkpoint_problem(p) is None for p in before)
    assert not list((output / "checkpoints").glob(".partial-*"))
    assert (
        trainer_for(tiny_model_dir, output, max_steps=4, save_every_steps=1, resume_from="auto").train().steps
        == 4
    )
    assert [row["step"] for row in read_jsonl(output / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_failed_checkpoint_write_on_one_rank_ends_both_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    """2 processes: rank 0 cannot write model.safetensors (EFBIG); both ranks raise, none waits forever."""
    command, env = two_process_launch(tiny_model_dir, tmp_path, {"max_steps": 4, "save_every_steps": 1})
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=env, preexec_fn=small_files(64 * 1024)
    )
    assert result.returncode != 0
    assert "could not write checkpoint" in result.stderr and "File too large" in result.stderr
    assert "it failed on another process" in result.stderr, result.stderr[-3000:]  # rank 1 raised too
    assert list_checkpoints(tmp_path / "checkpoints") == []
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))


# ------------------------------------------------------------------------------------------ non-finite guard


def poison_training_forwards(trainer: PODSTrainer, calls: set[int] | None) -> list[int]:
    """Make the logits NaN on the given training forward passes (1-based; None = all of them)."""
    counter = [0]
    model = trainer.accelerator.unwrap_model(trainer.model)

    def hook(module, inputs, output):
        if not torch.is_grad_enabled():
            return None  # generation and evaluation stay intact
        counter[0] += 1
        if calls is None or counter[0] in calls:
            return output * float("nan")
        return None

    model.lm_head.register_forward_hook(hook)
    return counter


def optimizer_state(trainer: PODSTrainer) -> dict[str, torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return {f"{i}.{k}": torch.as_tensor(v).clone() for i, values in state.items() for k, v in values.items()}


def test_a_non_finite_step_is_skipped_leaving_weights_and_optimizer_unchanged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    reference = trainer_for(tiny_model_dir, tmp_path / "one", max_steps=1, save_final=False)
    reference.train()
    # 4 kept rows per step in micro-batches of 2: step 2 is training forwards 3 and 4; poison one of them.
    guarded = trainer_for(tiny_model_dir, tmp_path / "two", max_steps=2, save_final=False)
    poison_training_forwards(guarded, {3})
    guarded.train()
    after_one = {k: v for k, v in reference.accelerator.unwrap_model(reference.model).state_dict().items()}
    after_two = {k: v for k, v in guarded.accelerator.unwrap_model(guarded.model).state_dict().items()}
    assert_same_weights(after_one, after_two)
    assert optimizer_state(reference).keys() == optimizer_state(guarded).keys()
    assert all(
        torch.equal(a, b)
        for a, b in zip(optimizer_state(reference).values(), optimizer_state(guarded).values(), strict=True)
    )
    assert guarded.scheduler.state_dict()["last_epoch"] == reference.scheduler.state_dict()["last_epoch"]
    rows = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [row["skipped_steps"] for row in rows] == [0, 1]
    assert rows[1]["loss"] is None and all(torch.isfinite(v).all() for v in after_two.values())


def test_consecutive_non_finite_steps_stop_the_run_with_its_checkpoint_intact(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = trainer_for(tiny_model_dir, tmp_path, max_steps=10, save_every_steps=1, max_consecutive_skips=3)
    counter = poison_training_forwards(trainer, set(range(3, 100)))  # from step 2 on
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row .* at training step 4"):
        trainer.train()
    assert counter[0] == 8
    checkpoints = list_checkpoints(tmp_path / "checkpoints")
    assert [checkpoint_step(p) for p in checkpoints] == [
        2,
        3,
    ]  # written after skipped steps: still step 1's weights
    assert all(checkpoint_problem(p) is None for p in checkpoints)
    from safetensors.torch import load_file

    saved = load_file(checkpoints[-1] / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values())
    assert [row["skipped_steps"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_non_finite_rewards_name_the_function_and_the_sample(tiny_model_dir: Path, tmp_path: Path) -> None:
    def unstable_reward(prompts, completions, **columns):
        return [float("inf") if i == 5 else 0.5 for i in range(len(completions))]

    with pytest.raises(RewardFunctionError, match="'unstable_reward' returned inf for completion 5"):
        trainer_for(tiny_model_dir, tmp_path, reward=unstable_reward).train()


# ------------------------------------------------------------------------------------------ hanging rewards


def test_a_hanging_reward_function_ends_the_run_after_reward_timeout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    release = threading.Event()

    def hanging_reward(prompts, completions, **columns):
        release.wait(120)
        return [0.0] * len(completions)

    trainer = trainer_for(tiny_model_dir, tmp_path, reward=hanging_reward, reward_timeout=0.5)
    start = time.monotonic()
    try:
        with pytest.raises(
            RewardFunctionError, match=r"'hanging_reward' did not return within reward_timeout = 0\.5 s"
        ):
            trainer.train()
    finally:
        release.set()
    assert time.monotonic() - start < 30
