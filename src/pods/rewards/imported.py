"""Reward functions named in a configuration: a built-in name (``accuracy``), a function in a file
(``my_rewards.py:brevity``), in a module (``my_package.checks:exact``, or TRL's dotted ``my_package.checks.exact``),
or a reward model (a sequence-classification checkpoint's folder or Hub id, :mod:`pods.rewards.reward_model`).

An imported function is wrapped so that it pickles as its path: a rollout worker or another process imports it
itself, so anything a module can define works there (closures, lambdas, objects that do not pickle).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from pods.errors import ConfigError

__all__ = ["ImportedReward", "RewardImportError", "import_function", "is_builtin_name", "resolve_reward"]


class RewardImportError(ConfigError):
    """A reward function that cannot be imported: the file or module, and the error."""


def is_builtin_name(spec: str) -> bool:
    """True for a plain name (``accuracy``); False for a path, a module or a model."""
    return not any(mark in spec for mark in (":", ".", "/", os.sep))


def import_function(spec: str, key: str = "reward_funcs") -> Any:
    """The callable a ``file.py:function``, ``module:function`` or ``module.function`` spec names (a module is
    looked up from the current folder first, as TRL's script does)."""
    where, sep, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not where or not name or spec.endswith(".py"):
        raise RewardImportError(
            f"{key}: cannot read {spec!r}; write file.py:function, package.module:function or a built-in name"
        )
    module = _load_file(where, spec, key) if where.endswith(".py") else _load_module(where, spec, key)
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardImportError(
            f"{key}: {where} has no {name!r}; it defines {', '.join(defined) or 'no function'}"
        )
    function = getattr(module, name)
    if not callable(function):
        raise RewardImportError(f"{key}: {spec} is a {type(function).__name__}, not a function")
    return function


def _load_module(where: str, spec: str, key: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except Exception as error:
        raise RewardImportError(
            f"{key}: cannot import module {where!r} for {spec} ({type(error).__name__}: {_first_line(error)}); "
            "check the name, and that it lies in the current folder or is installed"
        ) from error


def _load_file(where: str, spec: str, key: str) -> Any:
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise RewardImportError(
            f"{key}: {spec}: no such file {path}; give a path to a .py file (relative to the current folder)"
        )
    name = f"pods_user_rewards.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it: dataclasses and pickle look the module up by name
    if str(path.parent) not in sys.path:  # its neighbours importable, also inside the function when it scores
        sys.path.insert(0, str(path.parent))  # (TRL's script likewise keeps the current folder on the path)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise RewardImportError(
            f"{key}: importing {path} failed ({type(error).__name__}: {_first_line(error)}); fix the file"
        ) from error
    return module


class ImportedReward:
    """A reward function imported by path; pickles as its path (another process imports it again). Conversational
    prompts get their completions as TRL passes them, ``[{"role": "assistant", "content": text}]``."""

    def __init__(self, spec: str, key: str = "reward_funcs") -> None:
        where, sep, name = spec.rpartition(":")
        if sep and where.endswith(".py"):  # an absolute path, so that another process finds the same file
            spec = f"{Path(where).expanduser().resolve()}:{name}"
        self.spec = spec
        self.function = import_function(spec, key)
        self.__name__ = getattr(self.function, "__name__", type(self.function).__name__)

    @property
    def qualified_name(self) -> str:
        """The module and the function, as TRL's dotted spelling writes them: ``a.reward`` for ``a.py:reward``."""
        where, _, name = self.spec.rpartition(":") if ":" in self.spec else self.spec.rpartition(".")
        module = Path(where).stem if where.endswith(".py") else where
        return f"{module}.{name}"

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> Any:
        if prompts and isinstance(prompts[0], list):
            completions = [
                c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions
            ]
        return self.function(prompts=prompts, completions=completions, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ImportedReward, (self.spec,))

    def __repr__(self) -> str:
        return f"ImportedReward({self.spec!r})"


def resolve_reward(spec: str, key: str = "reward_funcs") -> Any:
    """One configured reward: a built-in by name, a reward model (a folder with a config.json, or a Hub id
    ``owner/name``), or a function by import path."""
    from pods.rewards import REWARD_FUNCTIONS, get_reward_functions

    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{key}: each entry must be a name or an import path, got {spec!r}")
    if is_builtin_name(spec):
        if spec not in REWARD_FUNCTIONS:
            raise ConfigError(
                f"{key}: unknown reward function {spec!r}; built in: {', '.join(sorted(REWARD_FUNCTIONS))}; "
                "or your own as file.py:function or package.module:function"
            )
        return get_reward_functions([spec])[0]
    if _is_model(spec):
        from pods.rewards.reward_model import RewardModel

        return RewardModel(spec, key=key)
    return ImportedReward(spec, key)


def _is_model(spec: str) -> bool:
    path = Path(spec).expanduser()
    if path.is_dir():
        return True
    return ":" not in spec and not spec.endswith(".py") and spec.count("/") == 1 and not path.exists()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"
