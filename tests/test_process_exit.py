"""A pods process ends without the interpreter's teardown, but only after what a normal exit must still do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, sys, threading, time
from pods.process_exit import exit_process

atexit.register(lambda: open(sys.argv[1], "a").write("atexit ran\\n"))
def slow_writer():
    time.sleep(0.3)
    open(sys.argv[1], "a").write("thread finished\\n")
threading.Thread(target=slow_writer).start()  # not a daemon: exit waits for it
sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
exit_process(7)
"""


def test_exit_process_waits_for_threads_runs_exit_handlers_and_flushes(tmp_path: Path) -> None:
    record = tmp_path / "record.txt"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(record)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 7, result.stderr
    assert result.stdout == "buffered, no newline"
    assert record.read_text() == "thread finished\natexit ran\n"  # the thread before the handlers


POOL_SCRIPT = """
import concurrent.futures, sys
from pods.process_exit import exit_process

pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)  # never shut down, as a library may leave one
pool.submit(sum, [1, 2]).result()  # its worker now waits for more work, not a daemon
exit_process(3)
"""


def test_exit_process_ends_the_idle_workers_of_a_pool_nobody_shut_down() -> None:
    """A thread pool's idle workers only end when concurrent.futures' exit hook wakes them: joining them first
    would wait forever (a 180-s `pods train` hung so at its exit, after transformers had loaded a model)."""
    result = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr


def test_the_pods_command_exits_with_mains_status(tmp_path: Path) -> None:
    """`python -m pods` ends through exit_process with main's status (2: a user error, one line)."""
    result = subprocess.run(
        [sys.executable, "-m", "pods", "train", "--learning_rate", "-1", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "learning_rate" in result.stderr
