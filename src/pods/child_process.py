"""What pods' own child processes (the rollout worker, a vLLM server pods starts) share: they never outlive the
process that started them."""

from __future__ import annotations

import contextlib
import os
import signal

__all__ = ["die_with_parent"]


def die_with_parent() -> None:
    """Linux, in the child: the kernel kills this process when its parent dies, even by SIGKILL (no orphan).
    Elsewhere it does nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)
