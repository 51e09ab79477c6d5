"""pods: reinforcement learning with verifiable rewards, with PODS down-sampling of rollouts."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pods")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
