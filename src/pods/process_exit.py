"""Ending a pods process once its work is done, without the interpreter's teardown.

After a run, Python would tear down every module and collect every object of torch, transformers and vLLM
one by one: 0.5 to 2 CPU-seconds a process, which decide nothing. :func:`exit_process` does what that exit
must still do (threading's exit hooks, wait for the threads that are not daemons, run the ``atexit`` handlers: logging, multiprocessing,
``weakref.finalize``, vLLM's and pods's own child processes; flush the standard streams), then ends at once."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(code: int | None) -> NoReturn:
    """End this process with ``code`` (None: 0) after its threads, exit handlers and standard streams."""
    # What the interpreter does first at exit: threading's own exit hooks (concurrent.futures wakes its idle pool
    # workers there, e.g. a model loader's pool that was never shut down), then a join of every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()  # what a normal exit runs before the teardown it skips
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more reaches it
            stream.flush()
    os._exit(code or 0)
