"""pods' own exceptions, at the bottom of the import graph: every module may raise them, none is imported here.

The command line turns each into one line naming the problem and the fix (exit status 2); anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the fix."""


class DamagedCheckpointError(ConfigError):
    """A checkpoint's files do not match its manifest (or it has none); the message names the file."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions); the earlier checkpoints are intact."""


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; names the function and the sample."""


class NonFiniteError(RuntimeError):
    """``max_consecutive_skips`` optimizer steps in a row had a non-finite loss or gradient norm."""


class RolloutWorkerError(RuntimeError):
    """``async_generation``: the rollout worker died or failed; names how, with the worker's traceback."""


class VLLMServerError(RuntimeError):
    """``vllm_mode: server``: the vLLM server is down, too slow, or refused a request; names the server and the
    fix."""


class PromptFilterExhausted(RuntimeError):
    """``prompt_filter_exhausted: error``: a step's last generation round left it short of groups that pass."""


# The errors `pods` reports as one line: bad input, or a run that cannot go on.
USER_ERRORS = (
    ConfigError,
    RewardFunctionError,
    NonFiniteError,
    CheckpointWriteError,
    PromptFilterExhausted,
    RolloutWorkerError,
    VLLMServerError,
)
