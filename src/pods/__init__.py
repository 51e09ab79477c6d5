"""pods: reinforcement learning with verifiable rewards, with PODS down-sampling of rollouts."""

import logging
import os
from importlib.metadata import PackageNotFoundError, version

# OpenMP threads that wait at a barrier sleep instead of spinning, unless the user chose: with torch's spinning
# default a step ran 3.1x slower while another process held one of 2 cores, with passive waiting 1.4x (13%
# slower on a quiet machine; benchmarks/threads.py, docs/benchmarks.md). Read when torch first loads OpenMP,
# so it holds for `pods` commands and for `import pods` before `import torch`.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _without_deepspeed_cpu_notice(record: logging.LogRecord) -> bool:
    """False for DeepSpeed's "Setting accelerator to CPU" notice, which its import logs on every machine without a
    GPU (accelerate imports it in ``unwrap_model``); every other record of its logger passes."""
    return not str(record.msg).startswith("Setting accelerator to CPU")


# on the logger before DeepSpeed creates it (it keeps the filters), so that every pods process is free of it
logging.getLogger("DeepSpeed").addFilter(_without_deepspeed_cpu_notice)

try:
    __version__ = version("pods")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
