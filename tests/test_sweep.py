"""`pods sweep` and `pods compare` on the tiny model, as real subprocesses: the files they write, reuse of
finished runs, and an interrupted sweep that continues where it stopped."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pods.config import ConfigError, TrainConfig
from pods.sweep import (
    Arm,
    SeedRun,
    arm_config,
    format_summary,
    grid_arms,
    parse_arm,
    parse_grid,
    resolve_baselines,
    summarise,
)


def run_pods(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pods", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny_sweep_config(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model on the generated arithmetic task: 2 prompts x n, m = 2, a few steps, 8 test problems."""
    path = tmp_path_factory.mktemp("sweep") / "tiny.yaml"
    settings = {
        "model": str(tiny_model_dir),
        "task": "arith",
        "train_limit": 32,
        "eval_limit": 8,
        "max_prompt_length": None,
        "num_generations": 4,
        "num_generations_kept": 2,
        "prompts_per_step": 2,
        "micro_batch_size": 4,
        "max_completion_length": 6,
        "eval_batch_size": 8,
        "max_time": None,
        "max_steps": 2,
        "eval_every_seconds": 0.01,
        "save_every_seconds": None,
        "save_final": False,
        "torch_threads": 1,
        "progress": False,
    }
    path.write_text(yaml.safe_dump(settings))
    return path


def test_grid_and_arm_specs() -> None:
    assert parse_grid("num_generations=4,8, 16") == ("num_generations", ["4", "8", "16"])
    arms = grid_arms([parse_grid("learning-rate=2e-5,1e-4"), parse_grid("num_generations=4,auto")])
    assert [a.name for a in arms] == [
        "learning_rate=2e-5,num_generations=4",
        "learning_rate=2e-5,num_generations=auto",
        "learning_rate=1e-4,num_generations=4",
        "learning_rate=1e-4,num_generations=auto",
    ]
    assert arms[3].overrides == {"learning_rate": 1e-4, "num_generations": "auto"}
    assert arms[0].folder == "learning_rate=2e-5+num_generations=4"
    grpo = parse_arm("grpo:num_generations=4,selection_rule=all")
    assert grpo == Arm("grpo", {"num_generations": 4, "selection_rule": "all"})
    for bad in ("num_generations", "=4,8"):
        with pytest.raises(ConfigError, match="KEY=VALUE1"):
            parse_grid(bad)
    with pytest.raises(ConfigError, match="NAME:KEY=VALUE"):
        parse_arm("grpo")
    with pytest.raises(ConfigError, match="at most two keys"):
        grid_arms([("a", ["1"]), ("b", ["1"]), ("c", ["1"])])


def test_arm_settings_are_checked_before_any_training(tmp_path: Path) -> None:
    base = TrainConfig()
    with pytest.raises(ConfigError, match=r"arm 'grpo'.*selection_rule"):
        arm_config(base, Arm("grpo", {"selection_rule": "all"}), 0, tmp_path, resume=False)  # n=16 != m=4
    with pytest.raises(ConfigError, match="sets seed itself"):
        arm_config(base, Arm("x", {"seed": 3}), 0, tmp_path, resume=False)
    config = arm_config(base, Arm("x", {"num_generations": 8}), 5, tmp_path / "r", resume=True)
    assert (config.num_generations, config.seed, config.resume_from, config.eval_at_start) == (
        8,
        5,
        "auto",
        True,
    )


def test_summary_of_known_curves() -> None:
    """Three seeds per arm with known curves: the numbers in the summary are the curves' own."""

    def run(arm: str, seed: int, accuracy: list[float]) -> SeedRun:
        seconds = [0.0, 10.0, 20.0, 30.0, 40.0]
        steps = [0, 5, 10, 15, 20]
        return SeedRun(arm, seed, Path("."), steps, seconds, accuracy, [100] * 5, 20, 2.0, 1.5, 0.5, 4)

    runs = [
        run("slow", 0, [0.2, 0.3, 0.6, 0.6, 0.6]),
        run("slow", 1, [0.2, 0.4, 0.6, 0.6, 0.6]),
        run("slow", 2, [0.2, 0.35, 0.6, 0.6, 0.6]),
        run("fast", 0, [0.2, 0.6, 0.6, 0.6, 0.6]),
        run("fast", 1, [0.2, 0.6, 0.6, 0.6, 0.6]),
        run("fast", 2, [0.2, 0.6, 0.6, 0.6, 0.6]),
    ]
    summary = summarise(runs, [Arm("slow", {}), Arm("fast", {})], baseline="slow")
    slow, fast = summary["arms"]["slow"], summary["arms"]["fast"]
    assert slow["accuracy_at_budget"]["value"] == pytest.approx(0.6)
    assert slow["accuracy_at_budget_se_over_problems"] == pytest.approx((0.24 / 100) ** 0.5 / 3**0.5)
    assert fast["best_accuracy"]["value"] == pytest.approx(0.6)
    assert "speedup" not in slow and fast["speedup"]["gain_50"]["verdict"] == "faster"
    # to 40%: slow at 13.3, 10 and 12 s, fast at 5 s in every seed: the ratio of geometric means
    assert fast["speedup"]["gain_50"]["baseline_seconds_per_seed"] == [13.333, 10.0, 12.0]
    assert fast["speedup"]["gain_50"]["arm_seconds_per_seed"] == [5.0, 5.0, 5.0]
    assert fast["speedup"]["gain_50"]["value"] == pytest.approx((13.333 * 10 * 12) ** (1 / 3) / 5, rel=1e-3)
    assert fast["speedup_per_step"]["gain_50"]["value"] == pytest.approx(fast["speedup"]["gain_50"]["value"])
    assert summary["target_accuracy"] == pytest.approx(0.99 * 0.6)
    assert fast["speedup"]["paper"]["level"] == summary["target_accuracy"]  # one level for both
    assert fast["seconds_to_target"]["value"] == pytest.approx(10 * 0.394 / 0.4)  # 20% -> 60% in 10 s
    text = format_summary(summary)
    assert "fast vs slow" in text and "to 40.0% (50% of the gain) 2.3" in text and "faster" in text
    assert summary["baselines_still_climbing"] == {}  # slow is flat from 20 s
    assert "still climbing" not in text

    late = [run("late", seed, [0.2, 0.2, 0.25, 0.4, 0.6]) for seed in range(3)]  # at 60% only at its end
    summary = summarise(late + runs[3:], [Arm("late", {}), Arm("fast", {})], baseline="late")
    assert summary["baselines_still_climbing"] == {"late": pytest.approx(0.5)}  # its mean at 30 and 40 s
    assert "the baseline late is still climbing at the end of its budget" in format_summary(summary)


def test_a_baseline_naming_one_key_compares_each_arm_within_its_row_of_the_grid() -> None:
    """--baseline num_generations=4 in a learning_rate x n grid: each n against n=4 at the same learning
    rate (and the auto arm against n=4 with its own other keys); one target per baseline."""
    arms = grid_arms([("learning_rate", ["1e-5", "1e-4"]), ("num_generations", ["4", "16"])])
    arms.append(Arm("auto", {"learning_rate": 1e-4, "num_generations": "auto"}))
    mapping = resolve_baselines(arms, "num_generations=4")
    assert mapping == {
        "learning_rate=1e-5,num_generations=4": "learning_rate=1e-5,num_generations=4",
        "learning_rate=1e-5,num_generations=16": "learning_rate=1e-5,num_generations=4",
        "learning_rate=1e-4,num_generations=4": "learning_rate=1e-4,num_generations=4",
        "learning_rate=1e-4,num_generations=16": "learning_rate=1e-4,num_generations=4",
        "auto": "learning_rate=1e-4,num_generations=4",
    }
    assert set(resolve_baselines(arms, "auto").values()) == {"auto"}  # an arm's name: one baseline for all
    with pytest.raises(ConfigError, match="no arm has those values"):
        resolve_baselines(arms, "num_generations=8")
    with pytest.raises(ConfigError, match="is not an arm"):
        resolve_baselines(arms, "nope")

    def run(arm: str, seed: int, accuracy: list[float]) -> SeedRun:
        seconds = [0.0, 10.0, 20.0, 30.0, 40.0]
        return SeedRun(
            arm, seed, Path("."), [0, 5, 10, 15, 20], seconds, accuracy, [100] * 5, 20, 2.0, 1.5, 0.5, 4
        )

    low_lr, high_lr = arms[0].name, arms[2].name
    runs = []
    for seed in (0, 1):  # at 1e-5, n=16 climbs faster than n=4; at 1e-4 slower; plateaus differ by row
        runs += [
            run(low_lr, seed, [0.2, 0.3, 0.5, 0.5, 0.5]),
            run(arms[1].name, seed, [0.2, 0.5, 0.5, 0.5, 0.5]),
        ]
        runs += [
            run(high_lr, seed, [0.2, 0.8, 0.8, 0.8, 0.8]),
            run(arms[3].name, seed, [0.2, 0.4, 0.6, 0.8, 0.8]),
        ]
    summary = summarise(runs, arms[:4], baseline="num_generations=4")
    rows = summary["arms"]
    assert rows[arms[1].name]["baseline"] == low_lr and rows[arms[3].name]["baseline"] == high_lr
    assert rows[arms[1].name]["speedup"]["gain_50"]["verdict"] == "faster"
    assert rows[arms[3].name]["speedup"]["gain_50"]["verdict"] == "slower"
    assert "speedup" not in rows[low_lr] and "speedup" not in rows[high_lr]
    assert rows[arms[1].name]["target_accuracy"] == pytest.approx(0.99 * 0.5)
    assert rows[arms[3].name]["target_accuracy"] == pytest.approx(0.99 * 0.8)
    assert "target_accuracy" not in summary  # two baselines, two targets
    text = format_summary(summary)
    assert f"{arms[3].name} vs {high_lr}" in text and f"{arms[1].name} vs {low_lr}" in text
    assert "(to 79.2%)" in text and "(to 49.5%)" in text


@pytest.mark.slow
def test_sweep_writes_everything_and_reuses_finished_runs(tiny_sweep_config: Path, tmp_path: Path) -> None:
    output = tmp_path / "sweep"
    args = ("sweep", "--config", str(tiny_sweep_config), "--grid", "num_generations=2,4", "--seeds", "0,1",
            "--output_dir", str(output))  # fmt: skip
    result = run_pods(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((output / "summary.json").read_text())
    assert list(summary["arms"]) == ["num_generations=2", "num_generations=4"]
    assert summary["baseline"] == "num_generations=2"
    assert summary["arms"]["num_generations=4"]["seeds"] == [0, 1]
    assert "speedup" in summary["arms"]["num_generations=4"]
    rows = list(csv.DictReader((output / "evaluations.csv").open()))
    assert {(r["arm"], r["num_generations"], r["seed"]) for r in rows} == {
        (f"num_generations={n}", str(n), str(s)) for n in (2, 4) for s in (0, 1)
    }
    assert all(0 <= float(r["accuracy_se"]) <= 0.5 and r["num_problems"] == "8" for r in rows)
    for name in ("accuracy_vs_time.png", "accuracy_vs_num_generations.png", "sweep.json"):
        assert (output / name).stat().st_size > 0, name
    run_dir = output / "num_generations=4" / "seed1"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (config["num_generations"], config["seed"], config["eval_at_start"]) == (4, 1, True)
    assert "| num_generations=4 |" in result.stdout

    stamp = (run_dir / "done.json").stat().st_mtime_ns
    again = run_pods(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already finished, reused") == 4
    assert (run_dir / "done.json").stat().st_mtime_ns == stamp

    changed = run_pods(*args, "--learning_rate", "0.5")
    assert changed.returncode == 2 and "trained with other settings" in changed.stderr
    assert "learning_rate" in changed.stderr and "Traceback" not in changed.stderr

    # another experiment reuses the finished runs of this one that have its settings, whatever their arm's name
    other = tmp_path / "other"
    extended = run_pods("sweep", "--config", str(tiny_sweep_config), "--arm", "two:num_generations=2", "--arm",
                        "three:num_generations=3", "--seeds", "1", "--output_dir", str(other),
                        "--reuse_from", str(output))  # fmt: skip
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert (
        extended.stdout.count("reused") == 1
        and "1/2] two, seed 1: the same settings finished in" in extended.stdout
    )
    assert (other / "two" / "seed1").resolve() == (output / "num_generations=2" / "seed1").resolve()
    assert (other / "three" / "seed1" / "done.json").is_file()  # no run of n = 3 to reuse: trained
    first, second = (json.loads((folder / "summary.json").read_text())["arms"] for folder in (output, other))
    assert (
        second["two"]["accuracy_at_budget_per_seed"]
        == first["num_generations=2"]["accuracy_at_budget_per_seed"][1:]
    )
    missing = run_pods(*args, "--reuse_from", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "--reuse_from" in missing.stderr and "no such folder" in missing.stderr


@pytest.mark.slow
def test_an_interrupted_sweep_continues_where_it_stopped(tiny_sweep_config: Path, tmp_path: Path) -> None:
    output = tmp_path / "sweep"
    args = ["sweep", "--config", str(tiny_sweep_config), "--arm", "a:num_generations=2", "--arm",
            "b:num_generations=4", "--seeds", "0", "--output_dir", str(output), "--max_steps", "16",
            "--save_every_steps", "1", "--eval_every_seconds", "null", "--eval_at_seconds", "[]"]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "pods", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    second = output / "b" / "seed0" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (second.is_dir() and any(p.name.startswith("step-") for p in second.iterdir())):
        assert process.poll() is None and time.monotonic() < deadline, "the second run never checkpointed"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # as a scheduler ends a job
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-3000:]
    assert (
        "stopped by SIGTERM during b, seed 0" in stderr
        and "To continue, run pods sweep" in stderr
        and "Traceback" not in stderr
    )
    assert (output / "a" / "seed0" / "done.json").is_file() and not (
        output / "b" / "seed0" / "done.json"
    ).exists()
    assert (
        json.loads((output / "summary.json").read_text())["runs_finished"] == 1
    )  # what finished is summarised

    result = run_pods(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a, seed 0: already finished, reused" in result.stdout and "(resuming)" in result.stdout
    steps = [row["step"] for row in map(json.loads, (output / "b" / "seed0" / "metrics.jsonl").open())]
    assert steps == list(range(1, 17))  # resumed: no step repeated, none missing
    assert set(json.loads((output / "summary.json").read_text())["arms"]) == {"a", "b"}


@pytest.mark.slow
def test_compare_is_a_sweep_against_grpo(tiny_sweep_config: Path, tmp_path: Path) -> None:
    output = tmp_path / "compare"
    result = run_pods(
        "compare", "--config", str(tiny_sweep_config), "--arms", "grpo,pods", "--seeds", "0",
        "--output-dir", str(output),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pods vs grpo" in result.stdout and "per second:" in result.stdout
    summary = json.loads((output / "summary.json").read_text())
    assert summary["baseline"] == "grpo" and set(summary["arms"]) == {"grpo", "pods"}
    grpo = yaml.safe_load((output / "grpo" / "seed0" / "config.yaml").read_text())
    pods = yaml.safe_load((output / "pods" / "seed0" / "config.yaml").read_text())
    assert (grpo["num_generations"], grpo["selection_rule"]) == (2, "all")
    assert (pods["num_generations"], pods["num_generations_kept"], pods["selection_rule"]) == (
        8,
        2,
        "max_variance",
    )
    assert (output / "accuracy_vs_time.png").is_file()
    assert os.path.getsize(output / "evaluations.csv") > 0


def test_sweep_command_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from pods.cli import main

    for args, message in [
        (
            ["sweep", "--grid", "num_generations=4,8", "--num_generations", "16"],
            "--num_generations is set per arm",
        ),
        (["sweep", "--grid", "num_generations=4", "--seed", "1"], "use --seeds"),
        (["sweep", "--grid", "num_generations=4", "--seeds", "0,x"], "comma-separated integers"),
        (
            ["sweep", "--grid", "num_generations=4", "--baseline", "nope", "--output_dir", "/tmp/x"],
            "is not an arm",
        ),
        (["sweep", "--arm", "a:num_generations=4", "--arm", "a:num_generations=8"], "must be distinct"),
    ]:
        assert main(args) == 2, args
        assert message in capsys.readouterr().err, args


def test_auto_is_set_against_the_best_fixed_n_with_the_same_other_keys() -> None:
    from pods.sweep import auto_against_best_fixed

    def row(overrides: dict, value: float, low: float, high: float) -> dict:
        return {"overrides": overrides, "accuracy_at_budget": {"value": value, "low": low, "high": high}}

    rows = {
        "n4": row({"num_generations": 4, "learning_rate": 1e-4}, 0.70, 0.68, 0.72),
        "n16": row({"num_generations": 16, "learning_rate": 1e-4}, 0.76, 0.74, 0.78),
        "n16-other-lr": row({"num_generations": 16, "learning_rate": 2e-5}, 0.90, 0.89, 0.91),
        "auto": row({"num_generations": "auto", "learning_rate": 1e-4}, 0.745, 0.70, 0.79),
    }
    (result,) = auto_against_best_fixed(rows)
    assert result["best_fixed"] == "n16" and result["within_or_better"]
    rows["auto"]["accuracy_at_budget"]["value"] = 0.73
    assert not auto_against_best_fixed(rows)[0]["within_or_better"]


def test_rollouts_per_step_and_per_useful_group_come_from_the_runs_counts() -> None:
    """Each seed's rollouts over its steps and over its groups trained with a signal, then the mean over seeds;
    a run that did not log the counts leaves them out (an older run folder)."""

    def run(seed: int, generated: int | None, useful: int | None) -> SeedRun:
        curve = [0.2, 0.4, 0.6, 0.6, 0.6]
        return SeedRun(
            "a", seed, Path("."), [0, 5, 10, 15, 20], [0.0, 10.0, 20.0, 30.0, 40.0], curve, [100] * 5, 20,
            2.0, 1.5, 0.5, 4, rollouts_generated=generated, groups_with_signal=useful,
        )  # fmt: skip

    summary = summarise([run(0, 2000, 100), run(1, 1000, 25)], [Arm("a", {})], baseline="a")
    row = summary["arms"]["a"]
    assert row["rollouts_per_step"] == pytest.approx((100 + 50) / 2)  # 2000 / 20 and 1000 / 20 steps
    assert row["rollouts_per_useful_group"] == pytest.approx((20 + 40) / 2)
    assert "| 75 (30.0) |" in format_summary(summary)
    older = summarise([run(0, None, None), run(1, 1000, 25)], [Arm("a", {})], baseline="a")
    assert "rollouts_per_step" not in older["arms"]["a"] and "| - |" in format_summary(older)


def test_a_run_saved_before_a_key_existed_matches_that_keys_default(tmp_path: Path) -> None:
    """A finished run's config.yaml written by an older pods lacks the keys added since: it ran as their
    defaults, so it still matches settings that keep them (and not settings that change them)."""
    import yaml

    from pods.sweep.run import _setting_differences

    wanted = TrainConfig(max_steps=2, max_time=None)
    saved = wanted.to_dict()
    del saved["prompt_filter_exhausted"], saved["async_generation"]  # keys newer than the run
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert _setting_differences(tmp_path, wanted) == []
    changed = TrainConfig(max_steps=2, max_time=None, async_generation=True)
    assert _setting_differences(tmp_path, changed) == ["async_generation: None then, True now"]
