"""What pods' own child processes (the rollout worker, a vLLM server pods starts) share: they never outlive the
process that started them.

A vLLM server has processes of its own (its engine core, its workers) that the kernel does not stop when the
server dies, so pods runs it under a guard (``python -m pods.child_process COMMAND ...``): the guard leads the
server's process group and stops the whole group (SIGTERM, SIGKILL after ``GRACE_SECONDS``) when the process that
started it asks (SIGTERM from that process) or dies (SIGTERM, by PR_SET_PDEATHSIG); it kills what the server
leaves behind when the server exits by itself. A SIGTERM, SIGINT or SIGHUP from anyone else (a scheduler or
systemd signalling every process of a job) is ignored while that process lives: it decides when the server
stops, after saving what it must.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

__all__ = ["die_with_parent", "guarded"]

GRACE_SECONDS = 2.0  # how long the guarded command may take to stop on SIGTERM before its group is killed (a
# vLLM server on the CPU did not stop in 15 s; it holds nothing that needs a graceful stop)


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Linux, in the child: the kernel sends this process ``signum`` when its parent dies, even by SIGKILL (no
    orphan). Elsewhere it does nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)


def guarded(command: list[str]) -> list[str]:
    """``command`` run under the guard (see the module's text); start it with ``start_new_session=True`` so that
    the guard leads a process group of its own."""
    import sys

    return [sys.executable, "-m", "pods.child_process", *command]


STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})  # what the guard waits for
POLL_SECONDS = 0.5  # how often the guard looks whether its command has ended by itself


def _guard(command: list[str]) -> int:
    """Run ``command`` in this process group until it ends or this process's parent asks it to stop or dies; then
    stop every other process of the group. The command's exit status (128 + signal when a signal ended it)."""
    import subprocess

    parent = os.getppid()
    # Stop signals wait for sigtimedwait (which names their sender), never for a handler: a handler would run
    # inside Popen.wait, whose lock a poll() in the handler cannot take.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    die_with_parent(signal.SIGTERM)  # after the mask: a parent that dies from here on is seen below
    child = subprocess.Popen(command, preexec_fn=_unblock_stop_signals)  # (this process has one thread)
    if _stop_asked(child, parent):
        _signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(GRACE_SECONDS)
    _signal_group(signal.SIGKILL)  # what is left: the command if it did not stop in time, its children
    code = child.wait()
    return code if code >= 0 else 128 - code


def _unblock_stop_signals() -> None:
    """In the command's process, before it starts: the stop signals reach it as usual."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _stop_asked(child: Any, parent: int) -> bool:
    """Wait until ``child`` ends (False) or a stop is asked (True): a stop signal sent by ``parent``, or any stop
    signal once ``parent`` is gone (its death signal). The others are ignored, with a line on stderr."""
    while child.poll() is None:
        info = signal.sigtimedwait(STOP_SIGNALS, POLL_SECONDS)
        if info is None:
            continue
        if info.si_pid == parent or os.getppid() != parent:
            return True
        os.write(
            2,
            f"pods: {signal.Signals(info.si_signo).name} from pid {info.si_pid} ignored: the process that "
            f"started this one (pid {parent}) decides when it stops\n".encode(),
        )
    return False


def _signal_group(signum: int) -> None:
    """Send ``signum`` to every other process of this process group (this guard stays to report the command's
    exit status); where /proc cannot be read, to the whole group, this guard included."""
    group, me = os.getpgrp(), os.getpid()
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signum)
        return
    for pid in pids:
        if pid != me and _process_group(pid) == group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def _process_group(pid: int) -> int | None:
    """The process group of ``pid`` (from /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[2])  # state, ppid, pgrp


if __name__ == "__main__":
    import sys

    sys.exit(_guard(sys.argv[1:]))
