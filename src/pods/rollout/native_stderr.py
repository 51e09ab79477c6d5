"""Filtering what native code (C++ extensions) writes straight to file descriptor 2, below Python's
``warnings`` and ``logging``: vLLM's CPU worker prints a NUMA notice there each time an engine starts."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def native_stderr_without(pattern: str) -> Iterator[None]:
    """Inside the block, file descriptor 2 goes to a temporary file; on leaving it, an exception included,
    every line written there goes to the real stderr except those matching ``pattern``. Nothing else is hidden:
    an error or traceback printed in the block appears right after it. Meant for short, single-threaded
    stretches (another thread's output is held back until the block ends)."""
    drop = re.compile(pattern.encode())
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured if not drop.search(line))
            while kept:
                kept = kept[os.write(2, kept) :]
