"""Your own data and rewards as a new user brings them (issue 43, review points 6-10): rows whose keys differ,
a folder of several configurations, a single data file, two rewards of one name, reward models with few positions
and on every rank's own GPU, a reward that imports its neighbour when it scores, and the command line a TRL user
writes, whose errors are one line."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pods.config import TrainConfig, parse_overrides
from pods.data import TaskDataError
from pods.data.user import load_dataset_rows
from pods.errors import ConfigError
from pods.producer import reward_components
from pods.rewards.imported import resolve_reward
from pods.run_inputs import accuracy_function, check_reward_columns, reward_functions
from pods.scoring import score_completions

HINTED_REWARD = """
def reward(completions, hint, **kwargs):
    return [1.0 if h else 0.0 for h in hint]
"""

SIBLING_REWARD = """
def reward(completions, **kwargs):
    import {sibling}  # at scoring time, from the folder beside this file

    return [{sibling}.score(c) for c in completions]
"""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def hinted_rows(count: int) -> list[dict]:
    """Rows whose odd lines (the first, the third, ...) carry a ``hint`` the others lack."""
    return [{"prompt": f"{i} + {i} =", **({"hint": f"h{i}"} if i % 2 == 0 else {})} for i in range(count)]


def write_rewards(folder: Path, sibling: str) -> None:
    """``a.py:reward`` reads the hint column; ``b.py:reward`` (the same name) imports ``sibling`` when it scores."""
    (folder / "a.py").write_text(HINTED_REWARD)
    (folder / "b.py").write_text(SIBLING_REWARD.format(sibling=sibling))
    (folder / f"{sibling}.py").write_text("def score(text):\n    return float(len(text) % 3)\n")


# ---------------------------------------------------------------------------------------------- 6: data
def test_rows_with_different_keys_give_every_reward_every_column(tmp_path: Path) -> None:
    """A JSONL whose odd rows carry a ``hint``: every row has the column (None where it lacks it, as ``datasets``
    fills it), so a batch whose first row has it scores, and a reward without ``**kwargs`` is caught before
    training even where the first row lacks it."""
    rows = load_dataset_rows(str(write_jsonl(tmp_path / "d.jsonl", hinted_rows(4))), "train")
    assert [row.get("hint", "missing") for row in rows] == ["h0", None, "h2", None]
    from pods.scoring import reward_columns

    assert reward_columns(rows[:2], 2) == {"hint": ["h0", "h0", None, None]}
    given = [{"prompt": "p"}, {"prompt": "q", "hint": "h"}]  # the Python API's rows, as they are
    assert reward_columns(given, 1) == {"hint": [None, "h"]}

    def no_kwargs(prompts, completions, completion_ids):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match=r"'no_kwargs' does not accept hint"):
        check_reward_columns([no_kwargs], given, "d")


def test_a_folder_of_several_configurations_needs_dataset_config(tmp_path: Path) -> None:
    """Sub-folders per configuration (a Hub snapshot's layout) are refused with one line naming them, as
    ``datasets`` refuses a dataset of several configurations without a name; one configuration loads."""
    for config in ("main", "socratic"):
        write_jsonl(tmp_path / "d" / config / "train.jsonl", [{"prompt": config}])
    with pytest.raises(TaskDataError) as refused:
        load_dataset_rows(str(tmp_path / "d"), "train")
    assert "configurations (main, socratic); pick one with dataset_config (--dataset_config main)" in str(
        refused.value
    )
    assert "\n" not in str(refused.value)
    write_jsonl(
        tmp_path / "one" / "data" / "train.jsonl", [{"prompt": "x"}]
    )  # a snapshot of one configuration
    assert [row["prompt"] for row in load_dataset_rows(str(tmp_path / "one"), "train")] == ["x"]


def test_a_hub_dataset_of_several_configurations_names_them(tmp_path: Path) -> None:
    """``datasets`` refuses a repository of several configurations, none the default, in three lines: one line
    names them and dataset_config instead of "the Hub is offline" (a local repository with the Hub's README)."""
    from pods.data.user import _hub_dataset

    configs = [
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl" for c in "xy"
    ]
    for config in ("x", "y"):
        write_jsonl(tmp_path / config / "train.jsonl", [{"prompt": config}])
    (tmp_path / "README.md").write_text("---\nconfigs:\n" + "\n".join(configs) + "\n---\n")
    with pytest.raises(
        TaskDataError, match=r"has several configurations \(\['x', 'y'\]\) and none is the default"
    ):
        _hub_dataset(str(tmp_path), None)


def test_a_single_file_trains_without_held_out_evaluation(tmp_path: Path) -> None:
    """A single file is the split ``train``: with ``dataset_test_split`` at its default, the run trains and says in
    one line that nothing is held out (TRL's script trains on it and evaluates on nothing); a test split that is
    named and missing stays an error, and a folder with ``test.jsonl`` evaluates on it."""
    from pods.run_inputs import no_held_out_evaluation

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    line = no_held_out_evaluation(TrainConfig(dataset_name=str(data), reward_funcs=["a.py:f"]))
    assert line is not None and line.startswith("no held-out evaluation: dataset_name") and "\n" not in line
    named = TrainConfig(dataset_name=str(data), reward_funcs=["a.py:f"], dataset_test_split="dev")
    assert no_held_out_evaluation(named) is None  # evaluation reads it, and names the splits the file has
    write_jsonl(tmp_path / "f" / "train.jsonl", [{"prompt": "x"}])
    write_jsonl(tmp_path / "f" / "test.jsonl", [{"prompt": "y"}])
    assert (
        no_held_out_evaluation(TrainConfig(dataset_name=str(tmp_path / "f"), reward_funcs=["a.py:f"])) is None
    )


# ---------------------------------------------------------------------------------------------- 7: names
def test_two_rewards_of_one_name_keep_a_column_and_a_weight_each(tmp_path: Path) -> None:
    """``a.py:reward b.py:reward``: each its own column (``a.reward``, ``b.reward``, also after pickling to a
    rollout worker), each its own weight in the sum and under ``normalize_then_sum``; each can be named."""
    (tmp_path / "a.py").write_text(
        "def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    (tmp_path / "b.py").write_text(
        "def reward(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    config = TrainConfig(
        dataset_name="x.jsonl", reward_funcs=[f"{tmp_path / 'a.py'}:reward", f"{tmp_path / 'b.py'}:reward"],
        reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum", accuracy_reward="b.reward",
    )  # fmt: skip
    funcs = reward_functions(config)
    total, per_function = score_completions(
        funcs, config.reward_weights, ["p", "p"], ["x", "yyy"], [[1], [1]], {}
    )
    assert {name: values.tolist() for name, values in per_function.items()} == {
        "a.reward": [1.0, 1.0],
        "b.reward": [1.0, 3.0],
    }
    assert total.tolist() == [1.5, 2.5]
    components, weights = reward_components(config, {k: v.view(1, 2) for k, v in per_function.items()})
    assert components.shape == (1, 2, 2) and weights.tolist() == [1.0, 0.5]
    assert accuracy_function(config, funcs) is funcs[1]
    from pods.scoring import reward_names

    assert reward_names(pickle.loads(pickle.dumps(funcs))) == ["a.reward", "b.reward"]  # a rollout worker's
    assert reward_names([len, len, max]) == ["builtins.len", "builtins.len_2", "max"]


# ---------------------------------------------------------------------------------------------- 8: reward models
@pytest.fixture(scope="module")
def short_reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 sequence classifier with 16 learned positions: a 17th token is past its embeddings."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from pods.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=16, n_layer=1, n_head=2, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    folder = tmp_path_factory.mktemp("reward-models") / "short-reward-model"
    GPT2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reward_model_reads_at_most_its_positions_keeping_the_completion(
    short_reward_model_dir: Path,
) -> None:
    """A prompt + completion longer than the model's 16 positions is scored on its last 16 tokens (the
    completion's end, where the score is read), in a batch with a short one, instead of crashing."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pods.rewards.reward_model import RewardModel

    reward = RewardModel(str(short_reward_model_dir))
    prompts, completions = ["Question: 2 + 2", "Q"], [" = 4, and then many more words than fit", "!"]
    scores = reward(prompts=prompts, completions=completions)
    tokenizer = AutoTokenizer.from_pretrained(short_reward_model_dir)
    ids = tokenizer(prompts[0] + completions[0], add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 16
    model = AutoModelForSequenceClassification.from_pretrained(short_reward_model_dir)
    with torch.no_grad():
        assert scores[0] == pytest.approx(model(input_ids=ids[:, -16:]).logits[0, 0].item(), abs=1e-5)


def test_each_process_s_reward_model_takes_its_own_gpu() -> None:
    """``cuda:LOCAL_RANK`` where a process sees several GPUs (not cuda:0 for every rank, which a scoring thread's
    ``current_device`` gives); a process that sees one GPU (a rollout worker) uses it; none: the CPU."""
    from pods.rewards.reward_model import process_device

    assert [process_device(4, rank) for rank in ("0", "1", "3")] == ["cuda:0", "cuda:1", "cuda:3"]
    assert process_device(1, "2") == "cuda:0"  # a rollout worker of rank 2 sees its GPU alone
    assert process_device(2, None) == "cuda:0" and process_device(0, "1") == "cpu"


# ---------------------------------------------------------------------------------------------- 9: imports
def test_a_reward_imports_its_neighbour_when_it_scores(tmp_path: Path) -> None:
    """A function that imports a module beside its file inside its body (at scoring time, long after the import)."""
    write_rewards(tmp_path, sibling="sibling_at_call_time")
    fn = resolve_reward(f"{tmp_path / 'b.py'}:reward")
    assert fn(prompts=["p", "p"], completions=["ab", "abc"]) == [2.0, 0.0]


# ---------------------------------------------------------------------------------------------- 10: the CLI
def test_a_list_option_takes_several_values_as_trl_writes_it() -> None:
    """``--reward_funcs a.py:f b.py:g`` (TRL's list) and ``--reward_weights 1 0.5``; other options keep one value,
    and each mistake is its own clear line."""
    assert parse_overrides(["--reward_funcs", "a.py:f", "b.py:g", "--max_steps", "1"]) == {
        "reward_funcs": ["a.py:f", "b.py:g"],
        "max_steps": 1,
    }
    assert parse_overrides(["--reward_weights", "1", "0.5", "seed=3"]) == {
        "reward_weights": [1, 0.5],
        "seed": 3,
    }
    assert parse_overrides(["--prompt_template", "Q={q}"]) == {"prompt_template": "Q={q}"}
    for items, message in [
        (["--learning_rate", "1e-5", "2e-5"], "option --learning_rate takes one value, got 2 (1e-5 2e-5)"),
        (["--max_steps"], "option --max_steps needs a value"),
        (["max_steps"], "cannot read override 'max_steps'"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_overrides(items)


def run_pods_train(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    small = ["--num_generations", "4", "--num_generations_kept", "2", "--prompts_per_step", "8",
             "--max_completion_length", "8", "--micro_batch_size", "16", "--max_time", "null", "--max_steps", "1", "--rollout_engine", "hf",
             "--save_final", "false", "--save_every_seconds", "null", "--output_dir", "run"]  # fmt: skip
    command = [sys.executable, "-m", "pods", "train", "--dataset_name", "d.jsonl", *small, *args]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)


def test_pods_train_on_a_single_file_with_two_rewards_of_one_name(tmp_path: Path) -> None:
    """The whole path as a user takes it: a single JSONL whose odd rows carry a hint, ``--reward_funcs a.py:reward
    b.py:reward`` (b's imports its neighbour when it scores): a step trains, each reward logged under its own
    name, the missing held-out split said in one line; nothing from DeepSpeed. A bad setting found after the model
    loads is exactly one line on stderr."""
    write_jsonl(tmp_path / "d.jsonl", hinted_rows(8))
    write_rewards(tmp_path, sibling="sibling_of_the_cli_run")
    result = run_pods_train(tmp_path, "--reward_funcs", "a.py:reward", "b.py:reward")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"rewards/a.reward/mean", "rewards/b.reward/mean"} <= set(metrics)
    assert metrics["rewards/a.reward/mean"] == 0.5  # all 8 rows in the step: every other one without its hint
    assert "no held-out evaluation: dataset_name 'd.jsonl' has no split 'test'" in result.stderr
    assert "Setting accelerator" not in result.stdout + result.stderr
    assert (
        "No artists with labels" not in result.stderr
    )  # the plot of a run without evaluations has no legend
    assert "(per step)\n" in result.stdout  # and its summary names no eval.jsonl

    failed = run_pods_train(tmp_path, "--reward_funcs", "a.py:reward", "b.py:reward", "--progress", "false",
                            "--prompt_filter_reward", "reward")  # fmt: skip
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert failed.stderr.splitlines() == [
        "pods train: error: prompt_filter_reward: 'reward' is not one of this run's reward functions (a.reward, "
        "b.reward); use total (what the rules rank) or one of those names"
    ]
    assert "Setting accelerator" not in failed.stdout
