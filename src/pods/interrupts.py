"""Graceful stop: SIGTERM or SIGINT asks the trainer to stop after the step in flight.

The first signal only records a request; the trainer checks it between steps (all processes agree through
one all-reduce per step), saves a checkpoint at the last completed step and raises :class:`TrainingStopped`.
A second SIGINT (Ctrl-C pressed again) raises ``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A launcher (torchrun, accelerate launch) forwards the terminal's Ctrl-C to workers that already got it
# from the terminal: a repeat this close to the first is the same interrupt, not a second press.
SAME_INTERRUPT_SECONDS = 1.0


class TrainingStopped(Exception):
    """Training stopped on a signal after saving a checkpoint at the last completed step; resume continues it."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path, output_dir: Path) -> None:
        self.signal_name, self.step = signal_name, step
        self.checkpoint, self.output_dir = Path(checkpoint), Path(output_dir)
        super().__init__(
            f"{signal_name} received: stopped after step {step} with a checkpoint at {checkpoint}; "
            f"continue with output_dir: {output_dir} and resume_from: auto"
        )

    def __reduce__(self):  # picklable, for runs in worker processes
        return type(self), (self.signal_name, self.step, self.checkpoint, self.output_dir)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as shells report a process ended by that signal (SIGTERM 143, SIGINT 130)."""
        return 128 + signal.Signals[self.signal_name].value


class StopRequests:
    """Context manager that turns SIGTERM/SIGINT into a stop request (main thread only; else a no-op)."""

    def __init__(self, reduce_max: Callable[[int], int] | None = None) -> None:
        self.reduce_max = reduce_max  # all-reduce (max) over processes, so every rank stops at the same step
        self.received: int = 0  # signal number received by this process, 0 for none
        self.agreed_signal: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self._first_at = signum, now
            name = signal.Signals(signum).name
            # os.write, not print: a handler may run in the middle of another write to the same stream.
            os.write(
                2,
                f"\npods: {name} received: finishing the step in flight, then saving a checkpoint "
                "(Ctrl-C again aborts at once)\n".encode(),
            )
        elif signum == signal.SIGINT and now - self._first_at > SAME_INTERRUPT_SECONDS:
            raise KeyboardInterrupt

    def agreed(self) -> bool:
        """True once any process received a signal; a collective when ``reduce_max`` is set (call on every rank)."""
        signum = self.reduce_max(self.received) if self.reduce_max else self.received
        if signum:
            self.agreed_signal = signal.Signals(signum).name
        return bool(signum)
