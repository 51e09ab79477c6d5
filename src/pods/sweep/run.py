"""Running a sweep: every arm x seed trained one after the other under the same budget, finished runs reused,
an unfinished one resumed, then summarised (:mod:`pods.sweep.summary`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pods.config import TrainConfig
from pods.errors import ConfigError
from pods.interrupts import TrainingStopped
from pods.sweep.plan import Arm, arm_config, check_plan
from pods.sweep.summary import SeedRun, budget_text, load_seed_run, summarise_and_write

IGNORED_WHEN_MATCHING = ("output_dir", "resume_from", "progress")


class SweepInterrupted(Exception):
    """A run was stopped (signal or Ctrl-C); finished runs are kept and the message says how to go on."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_sweep(
    base: TrainConfig,
    arms: list[Arm],
    seeds: list[int],
    output_dir: Path,
    *,
    baseline: str | None = None,
    target: float | None = None,
    swept_keys: Sequence[str] = (),
    resume_command: str | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    reuse_from: Sequence[Path] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train every arm for every seed (one after the other, so each has the whole machine) and summarise.

    ``trainer_kwargs`` go to every :class:`pods.trainer.PODSTrainer` (your own ``reward_funcs``,
    ``train_dataset``, ``eval_dataset``).

    Finished runs (``done.json``) are reused when their settings match; an unfinished one is resumed. A run
    not yet started here is linked to a finished run of other experiment folders (``reuse_from``) trained
    with the same settings and seed, if there is one, instead of being trained again.
    Raises :class:`SweepInterrupted` (after writing the summary of what finished) when a run is stopped.
    """
    from pods.trainer import PODSTrainer

    baseline = check_plan(base, arms, seeds, output_dir, baseline)  # before any training
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "sweep.json").write_text(
        json.dumps(
            {
                "base": base.to_dict(),
                "arms": [{"name": a.name, "overrides": a.overrides} for a in arms],
                "seeds": seeds,
                "baseline": baseline,
                "target": target,
                "swept_keys": list(swept_keys),
            },
            indent=2,
        )
    )
    runs: list[SeedRun] = []
    jobs = [(seed, arm) for seed in seeds for arm in arms]
    for index, (seed, arm) in enumerate(jobs):
        run_dir = output_dir / arm.folder / f"seed{seed}"
        prefix = f"[{index + 1}/{len(jobs)}] {arm.name}, seed {seed}"
        if (run_dir / "done.json").is_file():
            _check_same_settings(run_dir, arm_config(base, arm, seed, run_dir, resume=False))
            runs.append(load_seed_run(arm.name, seed, run_dir))
            log(f"{prefix}: already finished, reused ({run_dir})")
            continue
        wanted = arm_config(base, arm, seed, run_dir, resume=False)
        found = None if run_dir.exists() else find_finished_run(reuse_from, seed, wanted)
        if found is not None:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            run_dir.symlink_to(found.resolve(), target_is_directory=True)
            runs.append(load_seed_run(arm.name, seed, run_dir))
            log(f"{prefix}: the same settings finished in {found}, reused (linked as {run_dir})")
            continue
        resume = _prepare_run_dir(run_dir)
        config = arm_config(base, arm, seed, run_dir, resume)
        if resume:
            _check_same_settings(run_dir, config)
        log(
            f"{prefix}: n={config.num_generations}, m={config.num_generations_kept}, rule={config.selection_rule}, "
            f"{budget_text(config)}{' (resuming)' if resume else ''} -> {run_dir}"
        )
        try:
            result = PODSTrainer(config, **(trainer_kwargs or {})).train()
        except (TrainingStopped, KeyboardInterrupt) as stop:  # a graceful stop, or a second Ctrl-C
            finished = summarise_and_write(runs, arms, baseline, target, swept_keys, output_dir, base)
            signal_name = stop.signal_name if isinstance(stop, TrainingStopped) else "SIGINT"
            again = resume_command or f"the same command with the same output folder ({output_dir})"
            raise SweepInterrupted(
                f"stopped by {signal_name} during {arm.name}, seed {seed}; {len(runs)} of {len(jobs)} runs are "
                f"finished and kept{' (summary written)' if finished else ''}. To continue, run {again}: "
                "finished runs are skipped and this one resumes from its latest checkpoint.",
                exit_code=stop.exit_code if isinstance(stop, TrainingStopped) else 130,
            ) from None
        (run_dir / "done.json").write_text(
            json.dumps({"steps": result.steps, "train_seconds": result.train_seconds})
        )
        runs.append(load_seed_run(arm.name, seed, run_dir))
        log(f"    best accuracy {max(runs[-1].accuracy):.1%} after {result.steps} steps")
    summary = summarise_and_write(runs, arms, baseline, target, swept_keys, output_dir, base)
    assert summary is not None
    return summary


def _prepare_run_dir(run_dir: Path) -> bool:
    """Whether an unfinished run can resume from a checkpoint; a run with none starts again from scratch."""
    from pods.checkpoint import latest_checkpoint

    if latest_checkpoint(run_dir / "checkpoints") is not None:
        return True
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a run stopped before its first checkpoint: nothing to keep
    return False


def find_finished_run(folders: Sequence[Path], seed: int, wanted: TrainConfig) -> Path | None:
    """A finished run (``done.json``) of ``seed`` in one of the experiment ``folders`` (any arm's folder),
    trained with the settings ``wanted``; the first found, folders in the order given."""
    for folder in folders:
        for done in sorted(folder.glob(f"*/seed{seed}/done.json")):
            if _setting_differences(done.parent, wanted) == []:
                return done.parent
    return None


def _setting_differences(run_dir: Path, wanted: TrainConfig) -> list[str] | None:
    """How the run's saved settings (``config.yaml``) differ from ``wanted``; None when it saved none."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    saved = yaml.safe_load(path.read_text()) or {}
    defaults = TrainConfig().to_dict()  # a key the run's pods did not have yet: it ran as that key's default
    return [
        f"{key}: {saved.get(key)!r} then, {value!r} now"
        for key, value in wanted.to_dict().items()
        if key not in IGNORED_WHEN_MATCHING
        and saved.get(key, defaults[key]) != value
        and not (key == "rollout_engine" and value == "auto")  # config.yaml holds what auto chose
    ]


def _check_same_settings(run_dir: Path, wanted: TrainConfig) -> None:
    """A reused run must have been trained with the settings asked for now."""
    differ = _setting_differences(run_dir, wanted)
    if differ:
        raise ConfigError(
            f"{run_dir} was trained with other settings ({'; '.join(differ[:4])}); "
            "choose another --output_dir for a different experiment"
        )
