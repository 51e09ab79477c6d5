"""What a sweep trains: its arms (a grid over one or two keys, or named arms), each arm's configuration per
seed, and which arm each is compared with."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pods.config import TrainConfig, parse_overrides
from pods.errors import ConfigError

SWEEP_SETS = ("output_dir", "seed", "resume_from")  # keys the sweep sets for every run itself


@dataclass
class Arm:
    """One setting of the experiment: a name and the configuration keys it changes."""

    name: str
    overrides: dict[str, Any]

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9._=+-]", "_", self.name.replace(",", "+"))


def parse_grid(spec: str) -> tuple[str, list[str]]:
    """``"num_generations=4,8,16"`` -> ``("num_generations", ["4", "8", "16"])`` (values as written)."""
    key, sep, values = spec.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ConfigError(
            f"--grid {spec!r}: write KEY=VALUE1,VALUE2,... (e.g. --grid num_generations=4,8,16)"
        )
    return key.strip().replace("-", "_"), [v.strip() for v in values.split(",") if v.strip()]


def _value(key: str, raw: str) -> Any:
    """A value as the command line reads it (YAML, plus numbers such as 1e-4)."""
    return parse_overrides([f"{key}={raw}"])[key]


def _parse_settings(body: str) -> dict[str, Any] | None:
    """``"KEY=VALUE,KEY=VALUE"`` -> ``{key: value}`` (values as the command line reads them), or None when
    it is not of that form."""
    pairs = [item.partition("=") for item in body.split(",") if item.strip()]
    if not pairs or any(not eq for _, eq, _ in pairs):
        return None
    keys = [(k.strip().replace("-", "_"), v.strip()) for k, _, v in pairs]
    return {key: _value(key, raw) for key, raw in keys}


def parse_arm(spec: str) -> Arm:
    """``"grpo:num_generations=4,selection_rule=all"`` -> a named arm with those keys."""
    name, sep, body = spec.partition(":")
    settings = _parse_settings(body)
    if not sep or not name.strip() or settings is None:
        raise ConfigError(
            f"--arm {spec!r}: write NAME:KEY=VALUE,KEY=VALUE (e.g. --arm grpo:num_generations=4,selection_rule=all)"
        )
    return Arm(name.strip(), settings)


def grid_arms(grid: Sequence[tuple[str, list[str]]]) -> list[Arm]:
    """The cartesian product of one or two keys' values (as written), named ``key=value[,key=value]``."""
    if len(grid) > 2:
        raise ConfigError("--grid: at most two keys (a sweep over more is better split into several)")
    keys = [key for key, _ in grid]
    arms = []
    for combo in itertools.product(*(values for _, values in grid)):
        pairs = list(zip(keys, combo, strict=True))
        arms.append(Arm(",".join(f"{k}={v}" for k, v in pairs), {k: _value(k, v) for k, v in pairs}))
    return arms


def resolve_baselines(arms: Sequence[Arm], baseline: str) -> dict[str, str]:
    """Each arm's baseline arm. ``baseline`` is an arm's name (one baseline for all), or ``KEY=VALUE[,...]``
    naming some of the swept keys: each arm is then compared with the arm that has those values and the
    arm's own values of the other keys (in a learning-rate x n grid, ``num_generations=4`` compares each n
    with n = 4 at the same learning rate)."""
    names = [arm.name for arm in arms]
    if baseline in names:
        return {name: baseline for name in names}
    wanted = _parse_settings(baseline)
    if wanted is None:
        raise ConfigError(f"--baseline {baseline!r} is not an arm; arms: {', '.join(names)}")
    by_keys = {tuple(sorted(arm.overrides.items(), key=str)): arm.name for arm in arms}
    mapping = {}
    for arm in arms:
        match = by_keys.get(tuple(sorted({**arm.overrides, **wanted}.items(), key=str)))
        if match is not None:
            mapping[arm.name] = match
    if not mapping:
        raise ConfigError(
            f"--baseline {baseline!r} is not an arm and no arm has those values; arms: {', '.join(names)}"
        )
    return mapping


def arm_config(base: TrainConfig, arm: Arm, seed: int, run_dir: Path, resume: bool) -> TrainConfig:
    """The base configuration with the arm's keys, the seed, its run folder, and evaluation at the start."""
    for key in arm.overrides:
        if key in SWEEP_SETS:
            raise ConfigError(f"arm {arm.name!r}: the sweep sets {key} itself; give seeds with --seeds")
    values = {**base.to_dict(), **arm.overrides}
    values.update(seed=seed, output_dir=str(run_dir), resume_from="auto" if resume else None)
    values["eval_at_start"] = True  # every curve starts at the base model's accuracy
    try:
        return TrainConfig.from_dict(values)
    except ConfigError as error:
        raise ConfigError(f"arm {arm.name!r}: {error}") from None


def check_plan(
    base: TrainConfig, arms: Sequence[Arm], seeds: Sequence[int], output_dir: Path, baseline: str | None
) -> str:
    """Every check a sweep makes before hours of training (distinct arm names, a baseline that names arms,
    every arm's configuration for every seed); returns the baseline. Trains and writes nothing."""
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"arms: names must be distinct, got {names}")
    if not arms or not seeds:
        raise ConfigError("a sweep needs at least one arm and one seed")
    baseline = baseline or arms[0].name
    resolve_baselines(arms, baseline)
    for arm in arms:
        for seed in seeds:
            arm_config(base, arm, seed, output_dir / arm.folder / f"seed{seed}", resume=False)
    return baseline
