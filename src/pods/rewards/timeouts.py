"""Hard time limits that work anywhere: on any thread, in worker processes, in daemons.

``signal.alarm`` (what math-verify uses) only works on the main thread, and cannot interrupt a long
C-level operation (a huge integer power holds the interpreter). Instead, :class:`WorkerProcess`
runs the work in a persistent child Python process (started with ``subprocess``, so it also works
inside daemonic multiprocessing workers), talks to it with JSON lines, and kills and replaces it when
a call misses its deadline. One child per parent process (re-created after a ``fork``); calls from
several threads are serialised by a lock.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["WorkerProcess", "WorkerTimeout"]


class WorkerTimeout(TimeoutError):
    """A call to the child process did not answer in time (the child was killed)."""


class WorkerProcess:
    """A child process running ``python -m <module>``, which must answer each JSON line on stdin with
    one JSON line on stdout, after first printing ``{"ready": true}`` (or ``{"error": "..."}``)."""

    def __init__(self, module: str, *, startup_timeout: float = 120.0) -> None:
        self.module = module
        self.startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._owner_pid = -1
        atexit.register(self.close)

    def _start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        # A process group of its own: a signal to the run's group (Ctrl-C, scancel) reaches the trainer, which
        # stops after its step, and not this child, which would fail the check in flight. It still ends with
        # its parent: its stdin closes.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            process_group=0,
        )
        self._owner_pid = os.getpid()
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True).start()
        reply = self._read(self.startup_timeout)
        if reply is None or "error" in reply:
            self._kill()
            detail = reply["error"] if reply else f"no answer within {self.startup_timeout:.0f} s"
            raise RuntimeError(f"the worker process `python -m {self.module}` failed to start: {detail}")

    def _read(self, timeout: float) -> dict[str, Any] | None:
        try:
            line = self._lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if not line:  # end of file: the child died
            return None
        return json.loads(line)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and self._owner_pid == os.getpid():
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and return the reply; raise :class:`WorkerTimeout` past ``timeout``
        seconds (counted after the child has started), restarting the child for the next call."""
        with self._lock:
            if self._proc is None or self._owner_pid != os.getpid() or self._proc.poll() is not None:
                if self._owner_pid != os.getpid():
                    self._proc = None  # inherited through fork: that child belongs to our parent
                self._kill()
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            deadline = time.monotonic() + timeout
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self._kill()
                raise WorkerTimeout(f"the worker process `{self.module}` died") from None
            reply = self._read(deadline - time.monotonic())
            if reply is None:
                self._kill()
                raise WorkerTimeout(f"no answer from `{self.module}` within {timeout} s")
            return reply

    def close(self) -> None:
        """Stop the child process (also registered with ``atexit``)."""
        with self._lock:
            self._kill()


def _pump(stream: Any, lines: queue.Queue[bytes]) -> None:
    for line in iter(stream.readline, b""):
        lines.put(line)
    lines.put(b"")
