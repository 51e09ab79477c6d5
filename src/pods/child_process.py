"""What pods' own child processes (the rollout worker, a vLLM server pods starts) share: they never outlive the
process that started them.

A vLLM server has processes of its own (its engine core, its workers) that the kernel does not stop when the
server dies, so pods runs it under a guard (``python -m pods.child_process COMMAND ...``): the guard leads the
server's process group, gets SIGTERM when its parent dies, and then stops the whole group (SIGTERM, SIGKILL after
``GRACE_SECONDS``); it does the same when the server exits by itself, leaving nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import signal

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


def _guard(command: list[str]) -> int:
    """Run ``command`` in this process group; when this process's parent dies (SIGTERM, by PR_SET_PDEATHSIG), when
    it is asked to stop (SIGTERM) or when ``command`` ends, stop every process of the group."""
    import subprocess
    import time

    die_with_parent(signal.SIGTERM)
    child = subprocess.Popen(command)

    def stop_group(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(0, signal.SIGKILL)  # what is left, this guard included

    signal.signal(signal.SIGTERM, stop_group)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when the server stops
    code = child.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGKILL if code < 0 else signal.SIGTERM)  # what the command left behind
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    import sys

    sys.exit(_guard(sys.argv[1:]))
