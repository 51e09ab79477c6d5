"""pods: reinforcement learning with verifiable rewards, with PODS down-sampling of rollouts."""

import os
from importlib.metadata import PackageNotFoundError, version

# OpenMP threads that wait at a barrier sleep instead of spinning, unless the user chose: with torch's spinning
# default a step ran 3.1x slower while another process held one of 2 cores, with passive waiting 1.4x (13%
# slower on a quiet machine; benchmarks/threads.py, docs/benchmarks.md). Read when torch first loads OpenMP,
# so it holds for `pods` commands and for `import pods` before `import torch`.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

try:
    __version__ = version("pods")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
