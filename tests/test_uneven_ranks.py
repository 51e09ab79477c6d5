"""Every process runs the same collectives whatever its own rows: under DeepSpeed ZeRO-2/3 and FSDP each forward
gathers parameters and each backward reduces gradients with all processes at once, so a process whose longer
completions plan more forwards must not run them alone (on 845c824 gloo aborts with "Is there a distributed
collective mismatch in your code?"; NCCL hangs instead)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_multinode import kill_machine

SCRIPTS = Path(__file__).parent / "scripts"
CASES = {"zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp2": "FSDP"}


def launch_two_processes(script: Path, *args: str, timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``script`` as 2 CPU processes under `accelerate launch` (gloo), killed
    with its workers past ``timeout`` seconds (a collective mismatch may hang instead of failing)."""
    launcher_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k not in launcher_keys}
    env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(script), *args,
    ]  # fmt: skip
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_machine(launcher)
        out, err = launcher.communicate()
        err += f"\n[killed after {timeout} s]"
    return launcher.returncode, out, err


@pytest.mark.slow
def test_uneven_completion_lengths_run_the_same_forwards_on_every_process_under_zero2_zero3_and_fsdp2(
    tiny_model_dir: Path,
) -> None:
    """Process 1's completions are 7x longer than process 0's: with token_budget 16 its rows plan twice the packed
    forwards. Under each sharding (one launch for the three), every process runs as many forwards (old log-probs
    and both passes), and the weights after the update equal those of a budget large enough for one forward per
    micro-batch: the padding forwards add nothing to the gradient and the step comes after the last of them.

    In the same launch, HF generation under ZeRO-3: process 1's prompts repeat, process 0's do not, and an
    evaluation's 3 problems split 2 / 1 over the processes: both run the same forwards (no shared prefill of one
    process alone; one batch more on process 1, generated but not scored), and the accuracy counts each problem
    once (1 of the 3 has the answer "a")."""
    pytest.importorskip("deepspeed")
    cases = [*CASES, "generation"]  # one launch: each process start costs seconds
    code, out, err = launch_two_processes(
        SCRIPTS / "uneven_ranks.py", str(tiny_model_dir), *cases, timeout=240
    )
    assert code == 0, err[-3000:]
    lines = [line.split() for line in out.splitlines() if line.startswith("CASE ")]
    for case, kind in CASES.items():
        ranks = {int(w[3]): w[4:] for w in lines if w[1] == case and w[2] == "RANK"}
        assert {rank: words[0] for rank, words in ranks.items()} == {0: kind, 1: kind}, out
        planned = {rank: (int(words[2]), int(words[3])) for rank, words in ranks.items()}
        ran = {rank: (int(words[5]), int(words[6])) for rank, words in ranks.items()}
        assert planned[0][0] < planned[1][0], planned  # the processes' own rows plan different forwards
        assert planned[0][1] == planned[1][1], (
            planned
        )  # the large budget: one forward per micro-batch on each
        assert ran[0] == ran[1], ran
        ((difference, moved),) = [
            (float(w[3]), float(w[5])) for w in lines if w[1] == case and w[2] == "DIFFERENCE"
        ]
        assert moved > 1e-3 and difference < 1e-6, (case, difference, moved)
    generation = {int(w[3]): w[4:] for w in lines if w[1] == "generation"}
    assert generation[0][1] == generation[1][1] and int(generation[0][1]) > 0, generation
    assert [float(generation[rank][5]) for rank in (0, 1)] == [pytest.approx(1 / 3)] * 2, generation
