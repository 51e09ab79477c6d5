"""What every ``pods`` sub-command shares: presets, configuration loading, option spellings, quiet libraries."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pods.errors import ConfigError

PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs"


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def resolve_config_path(name: str) -> Path:
    """A preset name (``pods train --config gsm8k-pods``) or a YAML file's path."""
    path = Path(name)
    if path.is_file():
        return path
    preset = PRESETS_DIR / f"{name}.yaml"
    if preset.is_file():
        return preset
    raise ConfigError(f"--config {name}: no such file or preset; presets: {', '.join(preset_names())}")


def load_train_config(config: str | None, overrides: list[str]):
    from pods.config import TrainConfig, load_yaml_mapping, parse_overrides

    values = load_yaml_mapping(resolve_config_path(config)) if config else {}
    return TrainConfig.from_dict({**values, **parse_overrides(overrides)})


def option(parser: argparse.ArgumentParser, name: str, *more: str, **kwargs) -> None:
    """Add ``--name`` under both spellings, ``--max_new_tokens`` and ``--max-new-tokens``, as for
    configuration keys (the docs write underscores)."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, *more, dest=name, **kwargs)


def quiet_libraries() -> None:
    """Quiet the libraries' own chatter (weight-loading bars, save notices) so the run's output reads."""
    import logging

    import transformers

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no details"


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"
