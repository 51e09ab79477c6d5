"""Kill the rollout worker of real async `pods train` runs at random moments and check that every run ends
cleanly: exit status 2 within seconds, one line on stderr naming the worker, a checkpoint of the last completed
step, no process of the run left. The check behind docs/async.md's "never a hang", from outside the code (the
tests reach each moment through fault points instead).

    python scripts/kill_harness.py [--runs 10] [--earliest 13] [--latest 22] [--config embedded-hard]

Each run: `pods train --config CONFIG --async_generation true --max_time 60 --save_every_steps 5`, its worker
SIGKILLed at a uniformly random time between EARLIEST and LATEST seconds after the start (seeded: --seed).
On a slow machine the first step may end after LATEST (the checkpoints it reports are then all step 0): move
the window later (say --earliest 28 --latest 50) so that the kills land in training.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HANG_SECONDS = 60.0  # a run that has not ended this long after its worker was killed counts as a hang


def worker_of(trainer: psutil.Process) -> psutil.Process | None:
    """The trainer's rollout worker: its child started by multiprocessing's spawn (not the resource tracker)."""
    for child in trainer.children():
        command = " ".join(child.cmdline())
        if "multiprocessing" in command and "resource_tracker" not in command:
            return child
    return None


def run_once(config: str, kill_at: float, folder: Path, tag: str) -> dict:
    """One run, its worker killed ``kill_at`` seconds after the start: how it ended."""
    command = [sys.executable, "-m", "pods", "train", "--config", config, "--async_generation", "true",
               "--max_time", "60", "--save_every_steps", "5", "--output_dir", str(folder), "--progress", "false"]  # fmt: skip
    started = time.monotonic()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PODS_HARNESS_TAG": tag}
    trainer = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
    )
    killed_at, worker = None, None
    try:
        while trainer.poll() is None and time.monotonic() - started < kill_at:
            time.sleep(0.05)
        worker = worker_of(psutil.Process(trainer.pid)) if trainer.poll() is None else None
        if worker is not None:
            worker.send_signal(signal.SIGKILL)
            killed_at = time.monotonic() - started
        try:
            _, stderr = trainer.communicate(timeout=HANG_SECONDS)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            trainer.kill()
            _, stderr = trainer.communicate()
    finally:
        if trainer.poll() is None:
            trainer.kill()
    ended = time.monotonic() - started
    lines = [line for line in stderr.splitlines() if line.startswith("pods train")]
    left = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PODS_HARNESS_TAG") == tag and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process.pid)
        except (psutil.Error, OSError):
            continue
    checkpoints = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.is_dir() else []
    return {
        "kill_at": kill_at,
        "killed_at": killed_at,
        "hung": hung,
        "exit": trainer.returncode,
        "seconds_to_end": None if killed_at is None else round(ended - killed_at, 1),
        "error_lines": len(lines),
        "names_worker": any("rollout worker" in line for line in lines),
        "checkpoint": checkpoints[-1] if checkpoints else None,
        "left": left,
        "last_line": lines[-1][:160] if lines else stderr.strip().splitlines()[-1:] or "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--earliest", type=float, default=13.0)
    parser.add_argument("--latest", type=float, default=22.0)
    parser.add_argument("--config", default="embedded-hard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="pods-kill-harness-"))
    results = []
    for index in range(args.runs):
        kill_at = rng.uniform(args.earliest, args.latest)
        result = run_once(args.config, kill_at, work / f"run{index}", f"harness-{os.getpid()}-{index}")
        results.append(result)
        print(
            f"run {index}: worker killed at {result['killed_at'] or float('nan'):.1f} s; "
            f"{'HUNG' if result['hung'] else 'exit ' + str(result['exit'])} "
            f"{result['seconds_to_end']} s later; one line naming the worker: "
            f"{result['error_lines'] == 1 and result['names_worker']}; checkpoint {result['checkpoint']}; "
            f"processes left: {len(result['left'])}",
            flush=True,
        )
    hangs = sum(r["hung"] for r in results)
    clean = sum(
        not r["hung"] and r["exit"] == 2 and r["error_lines"] == 1 and r["names_worker"] and r["checkpoint"]
        and not r["left"]
        for r in results
    )  # fmt: skip
    print(
        f"{hangs} hang(s) in {len(results)} runs; {clean} ended cleanly (exit 2, one line, a checkpoint, nothing left)"
    )
    return 0 if hangs == 0 and clean == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
