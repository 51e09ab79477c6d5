"""Your own data and rewards (docs/tasks.md "Your own data and rewards"): datasets by name or path, reward
functions by import path, reward models, and the errors that name the fix; then the example in
examples/own-task/ run as a user would, from a folder outside the repository."""

from __future__ import annotations

import csv
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from pods.cli import main
from pods.config import TrainConfig
from pods.data import TaskDataError, load_task
from pods.data.user import dataset_splits, load_dataset_rows
from pods.errors import ConfigError, RewardFunctionError
from pods.rewards.imported import ImportedReward, RewardImportError, resolve_reward
from pods.rollout_worker import check_picklable
from pods.run_inputs import accuracy_function, check_reward_columns, reward_functions
from pods.scoring import score_completions

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own-task"

REWARDS = """
import os

def exact(prompts, completions, target, **kwargs):
    return [1.0 if c.strip() == str(t) else 0.0 for c, t in zip(completions, target)]

def make_shout():
    suffix = "!"  # a closure: pickle cannot send it by value, only by the path it was imported from
    def shout(prompts, completions, **kwargs):
        return [float(c.endswith(suffix)) for c in completions]
    return shout

shout = make_shout()

def seen(prompts, completions, **kwargs):
    return [float(level) for level in kwargs["level"]]

def raises_on_b(prompts, completions, **kwargs):
    return [1 / 0 if c == "b" else 0.0 for c in completions]

def one_short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def words(prompts, completions, **kwargs):
    return ["yes" if c else 0.0 for c in completions]

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def conversation(prompts, completions, **kwargs):
    return [float(c[0]["role"] == "assistant" and p[-1]["role"] == "user") for p, c in zip(prompts, completions)]

NOT_A_FUNCTION = 3
"""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


# ---------------------------------------------------------------------------------------------- datasets
def test_trl_standard_and_conversational_rows_work_as_they_are(tmp_path: Path) -> None:
    standard = write_jsonl(
        tmp_path / "standard.jsonl", [{"prompt": "2+2=", "level": 1}, {"prompt": "3+3=", "level": 2}]
    )
    rows = load_dataset_rows(str(standard), "train")
    assert [(r["prompt"], r["level"]) for r in rows] == [
        ("2+2=", 1),
        ("3+3=", 2),
    ]  # text stays text; columns stay
    chat = [{"role": "user", "content": "2+2?"}]
    write_jsonl(tmp_path / "chat" / "train.jsonl", [{"prompt": chat, "solution": "4"}])
    write_jsonl(tmp_path / "chat" / "validation.jsonl", [{"prompt": chat, "solution": "4"}])
    assert dataset_splits(str(tmp_path / "chat")) == ["train", "validation"]
    row = load_dataset_rows(str(tmp_path / "chat"), "validation", system_prompt="Be brief.")[0]
    assert row["prompt"] == [{"role": "system", "content": "Be brief."}, *chat] and row["solution"] == "4"
    wrapped = load_dataset_rows(str(standard), "train", prompt_style="chat")[0]["prompt"]
    assert wrapped == [{"role": "user", "content": "2+2="}]  # prompt_style chat: the text is the user message
    with pytest.raises(TaskDataError, match="has a text prompt: set prompt_style: chat"):
        load_dataset_rows(str(standard), "train", system_prompt="Be brief.")


def test_other_layouts_through_a_template_an_answer_column_and_csv(tmp_path: Path) -> None:
    path = tmp_path / "problems.csv"
    path.write_text('problem,target\n"Tom has {braces}, 3 + 4",7\nwhat is 2 - 5,-3\n')
    rows = load_dataset_rows(
        str(path), "train", prompt_template="Q: {problem}\n{{A}}:", answer_column="target"
    )
    assert rows[0]["prompt"] == "Q: Tom has {braces}, 3 + 4\n{A}:"  # a value's braces are not fields
    assert [(r["answer"], r["target"]) for r in rows] == [
        ("7", 7),
        ("-3", -3),
    ]  # answer as text, target as read


def test_a_template_on_the_command_line_stays_text() -> None:
    """YAML would read `Question: {problem}` as a mapping; a text key takes the value as written, or as YAML text
    when quoted (escapes), and null stays null."""
    from pods.config import parse_overrides

    overrides = parse_overrides(["--prompt_template", "Question: {problem}", "--system_prompt", '"a\\nb"'])
    assert overrides == {"prompt_template": "Question: {problem}", "system_prompt": "a\nb"}
    assert parse_overrides(["--dataset_name", "null", "--max_time", "5"]) == {
        "dataset_name": None,
        "max_time": 5,
    }


def test_the_built_in_tasks_keep_their_names_and_rows() -> None:
    config = TrainConfig(task="arith", reward_funcs=None)
    assert [f.__name__ for f in reward_functions(config)] == ["accuracy_reward"]
    assert load_task("arith", "test", prompt_style="plain", num_problems=2)[0]["prompt"].startswith(
        "Question: "
    )


# ---------------------------------------------------------------------------------------------- rewards
def test_reward_funcs_by_file_module_and_dotted_path_with_their_columns(
    rewards_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a module is looked up in the current folder first, as TRL's script does
    config = TrainConfig(
        dataset_name="data.jsonl",
        reward_funcs=["accuracy", "my_rewards.py:exact", "my_rewards:shout", "my_rewards.seen"],
        reward_weights=[1.0, 2.0, 0.5, 0.0],
    )
    functions = reward_functions(config)
    assert [getattr(f, "__name__", "") for f in functions] == ["accuracy_reward", "exact", "shout", "seen"]
    total, per_function = score_completions(
        functions,
        config.reward_weights,
        ["p", "p"],
        ["7", "8!"],
        [[1], [2]],
        {"answer": ["7", "7"], "target": [7, 7], "level": [3, 3]},  # every column reaches every function
    )
    assert per_function["exact"].tolist() == [1.0, 0.0] and per_function["seen"].tolist() == [3.0, 3.0]
    assert total.tolist() == [1.0 + 2.0, 0.5]
    assert accuracy_function(config, functions) is functions[0]  # default: the first of reward_funcs
    config.accuracy_reward = "exact"
    assert accuracy_function(config, functions) is functions[1]  # by name, the same object


def test_imported_rewards_travel_to_other_processes_by_path(rewards_file: Path, tmp_path: Path) -> None:
    """A closure cannot be pickled by value (the async worker's pickling limit); imported by path it can, and
    another process, in another folder, imports it again from the absolute path and scores the same."""
    shout = ImportedReward(f"{rewards_file}:shout")
    with pytest.raises(ConfigError, match="cannot be sent to the rollout worker"):
        check_picklable([shout.function])
    check_picklable([shout])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f(['p', 'p'], ['a!', 'b']))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(shout),
        capture_output=True,
        cwd=elsewhere,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().strip() == "[1.0, 0.0]"


def test_conversational_prompts_give_rewards_conversational_completions(rewards_file: Path) -> None:
    fn = resolve_reward(f"{rewards_file}:conversation")
    assert fn(prompts=[[{"role": "user", "content": "hi"}]], completions=["hello"]) == [
        1.0
    ]  # as TRL passes them


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random sequence-classification checkpoint (one label) with the tiny chat tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from pods.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("reward-models") / "tiny-reward-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reward_model_scores_prompt_and_completion_in_batches(reward_model_dir: Path) -> None:
    """The batched, right-padded scores equal each text scored alone and the model's own forward, for texts of
    different lengths; it pickles as its path; a conversation goes through the chat template."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pods.rewards.reward_model import RewardModel

    config = TrainConfig(
        dataset_name="x.jsonl", reward_model_name_or_path=str(reward_model_dir), reward_funcs=["accuracy"]
    )
    reward = reward_functions(config)[0]  # TRL's script puts the reward model first
    assert isinstance(reward, RewardModel) and reward.__name__ == "tiny-reward-model"
    prompts, completions = ["Question: 2 + 2", "Q"], [" = 4 and some more words here", "!"]
    together = reward(prompts=prompts, completions=completions)
    alone = [reward(prompts=[p], completions=[c])[0] for p, c in zip(prompts, completions, strict=True)]
    assert together == pytest.approx(alone, abs=1e-5) and together[0] != pytest.approx(together[1])
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    with torch.no_grad():
        ids = AutoTokenizer.from_pretrained(reward_model_dir)(
            prompts[0] + completions[0], return_tensors="pt"
        )
        assert together[0] == pytest.approx(model(**ids).logits[0, 0].item(), abs=1e-5)
    again = pickle.loads(pickle.dumps(reward))
    assert again(prompts=prompts, completions=completions) == pytest.approx(together)
    chat = reward.texts([[{"role": "user", "content": "hi"}]], ["yo"])
    assert chat == ["<|user|>hi<|end|><|assistant|>yo<|end|>"]


def test_a_run_trains_on_a_reward_model_alone(
    reward_model_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """dataset_name + reward_model_name_or_path and no reward_funcs: a step scores with the model (its rewards
    logged under its name, the scores it gives those completions)."""
    from pods.trainer import PODSTrainer

    data = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"Question: {i} + {i}", "level": i} for i in range(8)]
    )
    config = TrainConfig(
        model=str(tiny_model_dir), dataset_name=str(data), reward_model_name_or_path=str(reward_model_dir),
        num_generations=4, num_generations_kept=2, prompts_per_step=2, micro_batch_size=2, max_completion_length=4,
        max_time=None, max_steps=1, eval_at_start=False, eval_every_seconds=None, eval_at_seconds=[],
        save_every_seconds=None, save_final=False, progress=False, rollout_engine="hf", output_dir=str(tmp_path / "run"),
    )  # fmt: skip
    trainer = PODSTrainer(config)
    assert trainer.accuracy_fn is trainer.reward_funcs[0]  # the only reward: what evaluation would report
    trainer.train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward"] == pytest.approx(row["rewards/tiny-reward-model/mean"]) and row["reward_std"] > 0


# ---------------------------------------------------------------------------------------------- errors
def test_a_missing_column_names_the_columns_the_file_has(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "target": 2}])
    with pytest.raises(
        TaskDataError, match=r"d.jsonl:1: no column 'prompt'; the columns are \['problem', 'target'\]"
    ):
        load_dataset_rows(str(path), "train")
    with pytest.raises(TaskDataError, match=r"no column 'solution' \(answer_column\); the columns are"):
        load_dataset_rows(str(path), "train", prompt_column="problem", answer_column="solution")
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"prompt": "1+1", "completions": 2}])
    with pytest.raises(TaskDataError, match=r"column\(s\) \['completions'\] would clash.*rename them"):
        load_dataset_rows(str(clash), "train")
    rows = load_dataset_rows(str(path), "train", prompt_column="problem")
    with pytest.raises(ConfigError, match=r"lacks.*columns: problem, target.*set answer_column"):
        check_reward_columns(
            reward_functions(TrainConfig(dataset_name="d", reward_funcs=["accuracy"])), rows, "d"
        )


def test_a_template_field_that_no_column_fills_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "target": 2}])
    with pytest.raises(
        TaskDataError, match=r"field \{question\} names no column; the columns are \['problem', 'target'\]"
    ):
        load_dataset_rows(str(path), "train", prompt_template="Q: {question}")


def test_a_split_the_source_lacks_names_the_splits_it_has(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "train.jsonl", [{"prompt": "x"}])
    write_jsonl(tmp_path / "d" / "dev.jsonl", [{"prompt": "x"}])
    with pytest.raises(TaskDataError, match=r"no split 'test' \(it has \['dev', 'train'\]\)"):
        load_dataset_rows(str(tmp_path / "d"), "test")
    with pytest.raises(TaskDataError, match=r"no split 'test' \(a single file holds the one split 'train'"):
        load_dataset_rows(str(tmp_path / "d" / "dev.jsonl"), "test")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing.py:f", r"no such file .*missing.py"),
        ("broken.py:f", r"importing .*broken.py failed \(NameError: name 'undefined_name' is not defined\)"),
        ("no_such_module_37:f", r"cannot import module 'no_such_module_37' .*ModuleNotFoundError"),
        ("my_rewards.py:nope", r"my_rewards.py has no 'nope'; it defines .*exact"),
        ("my_rewards.py:NOT_A_FUNCTION", r"is a int, not a function"),
        ("acuracy", r"unknown reward function 'acuracy'; built in: accuracy.*file.py:function"),
        ("my_rewards.py", r"cannot read 'my_rewards.py'; write file.py:function"),
    ],
)
def test_an_import_that_fails_names_the_file_or_module_and_the_error(
    spec: str, message: str, rewards_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("x = undefined_name\n")
    with pytest.raises(ConfigError, match=message) as raised:
        resolve_reward(spec)
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, RewardImportError) or spec == "acuracy"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("raises_on_b", r"'raises_on_b' raised ZeroDivisionError: division by zero \(on completion 1: 'b'"),
        ("one_short", r"'one_short' must return one score per completion \(3\), got 2"),
        ("words", r"'words' returned 'yes' for completion 0 \('a'\); scores must be numbers or None"),
    ],
)
def test_a_reward_that_fails_names_the_function_and_the_first_bad_row(
    name: str, message: str, rewards_file: Path
) -> None:
    fn = resolve_reward(f"{rewards_file}:{name}")
    with pytest.raises(RewardFunctionError, match=message):
        score_completions([fn], None, ["p"] * 3, ["a", "b", "c"], [[1]] * 3, {"target": [1, 2, 3]})


def test_a_reward_without_kwargs_is_caught_before_training(rewards_file: Path) -> None:
    fn = resolve_reward(f"{rewards_file}:no_kwargs")
    with pytest.raises(
        ConfigError, match=r"'no_kwargs' does not accept completion_ids, target; .*add \*\*kwargs"
    ):
        check_reward_columns([fn], [{"prompt": "p", "target": 1}], "d")


def test_configuration_errors_are_one_line_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for split in ("train", "test"):
        write_jsonl(tmp_path / "data" / f"{split}.jsonl", [{"problem": "1+1", "target": 2}])
    with pytest.raises(ConfigError, match="your dataset_name needs rewards"):
        TrainConfig(dataset_name="data")
    with pytest.raises(
        ConfigError, match="reward_weights: has 1 weights for 1 reward_funcs and the reward model"
    ):
        TrainConfig(reward_funcs=["accuracy"], reward_model_name_or_path="m", reward_weights=[1.0])
    for args, message in [
        (["train", "--dataset_name", "data", "--reward_funcs", "nothere.py:f"], "no such file"),
        (["train", "--dataset_name", "data", "--reward_funcs", "accuracy", "--prompt_column", "problem",
          "--output_dir", "run"], "set answer_column"),
        (["eval", "--model", "embedded", "--dataset_name", "data", "--prompt_column", "problem", "--split", "dev"],
         "no split 'dev'"),
        (["eval", "--model", "embedded"], "name one dataset"),
    ]:  # fmt: skip
        assert main(args) == 2, args
        error = capsys.readouterr().err.strip()
        assert message in error and "\n" not in error and "Traceback" not in error, error


# ---------------------------------------------------------------------------------------------- as a user would
def export_arith(folder: Path, split: str, count: int) -> None:
    """The embedded arithmetic task in the example's layout (CSV, columns problem and target)."""
    rows = load_task("arith", split, prompt_style="raw", num_problems=count, seed=11)
    with (folder / f"{split}.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["problem", "target"])
        writer.writerows([row["question"], row["answer"]] for row in rows)


def record_calls(rewards: Path) -> None:
    """Make the user's `exact` also write, at each call, the process's rank and pid to pids.txt beside it."""
    rewards.write_text(
        rewards.read_text()
        + textwrap.dedent("""
            import os
            _exact = exact
            def exact(prompts, completions, target, **kwargs):
                with open("pids.txt", "a") as f:
                    f.write(f"{os.environ.get('RANK', '-')} {os.getpid()}\\n")
                return _exact(prompts, completions, target, **kwargs)
            """)
    )


@pytest.mark.slow
def test_the_own_task_example_trains_and_evaluates_from_a_folder_outside_the_repository(
    tmp_path: Path,
) -> None:
    """The user's folder holds a data file per split, a reward file and a YAML; the installed `pods` trains on it
    with a rollout worker (async: the rewards reach that process by their path; each call is recorded with the
    pid that made it) and accuracy rises; `pods eval --config` scores the run as the last evaluation did."""
    folder = tmp_path / "my-task"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("runs"))
    with (folder / "data" / "train.csv").open() as file:
        assert next(csv.reader(file)) == [
            "problem",
            "target",
        ]  # the example ships this layout; the test exports to it
    export_arith(folder / "data", "train", 400)
    export_arith(folder / "data", "test", 40)
    record_calls(folder / "rewards.py")
    settings = ["--max_time", "null", "--max_steps", "4", "--eval_at_seconds", "[]", "--eval_every_seconds", "null",
                "--eval_limit", "40", "--rollout_engine", "hf", "--async_generation", "true", "--progress", "false",
                "--save_every_seconds", "null"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "pods", "train", "--config", "train.yaml", *settings],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    evals = [
        json.loads(line) for line in (folder / "runs" / "own-task" / "eval.jsonl").read_text().splitlines()
    ]
    assert [e["step"] for e in evals] == [0, 4]
    assert evals[-1]["accuracy"] >= evals[0]["accuracy"] + 0.1, evals
    metrics = [
        json.loads(line) for line in (folder / "runs" / "own-task" / "metrics.jsonl").read_text().splitlines()
    ]
    assert {"rewards/exact/mean", "rewards/stated/mean"} <= set(metrics[-1])
    pids = {line.split()[1] for line in (folder / "pids.txt").read_text().splitlines()}
    assert len(pids) == 2  # the trainer (evaluation) and its rollout worker (training rewards) each import it

    report = folder / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pods", "eval", "--model", "runs/own-task", "--dataset_name", "data",
         "--prompt_template", "Question: {problem}\nAnswer:", "--accuracy_reward", "rewards.py:exact",
         "--max_new_tokens", "32", "--rollout_engine", "hf", "--limit", "40", "--output", str(report)],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    scored = json.loads(report.read_text())
    assert (scored["dataset"], scored["accuracy_reward"], scored["num_problems"]) == ("data", "exact", 40)
    assert scored["accuracy"] == pytest.approx(evals[-1]["accuracy"])
    run_config = yaml.safe_load((folder / "runs" / "own-task" / "config.yaml").read_text())
    assert run_config["dataset_name"] == "data"


@pytest.mark.slow
def test_two_processes_under_accelerate_launch_each_import_the_rewards(tmp_path: Path) -> None:
    """`accelerate launch` of the example (2 CPU processes, one step): both ranks score with the user's file."""
    import os

    folder = tmp_path / "my-task"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("runs"))
    record_calls(folder / "rewards.py")
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        "0",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    settings = ["--max_time", "null", "--max_steps", "1", "--eval_at_start", "false", "--eval_every_seconds", "null",
                "--eval_at_seconds", "[]", "--save_final", "false", "--save_every_seconds", "null", "--rollout_engine",
                "hf", "--progress", "false", "--prompts_per_step", "4", "--micro_batch_size", "16", "--output_dir",
                "runs/two"]  # fmt: skip
    launcher_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k not in launcher_keys}
    env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [*launch, "-m", "pods", "train", "--dataset_name", "data", "--reward_funcs", "rewards.py:exact",
         "--prompt_template", '"Question: {problem}\\nAnswer:"', *settings],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    calls = {tuple(line.split()) for line in (folder / "pids.txt").read_text().splitlines()}
    assert sorted(rank for rank, _ in calls) == ["0", "1"]  # one call per rank (one step), two processes
    assert len({pid for _, pid in calls}) == 2
    config = yaml.safe_load((folder / "runs" / "two" / "config.yaml").read_text())
    # quoted on the command line, the value is YAML text: its \n is a newline
    assert config["prompt_template"] == "Question: {problem}\nAnswer:"


def test_compare_and_sweep_take_the_same_keys(tmp_path: Path) -> None:
    """Every arm of `pods compare` / `pods sweep` trains on the dataset and rewards the options name."""
    from pods.cli import build_parser
    from pods.cli.experiments import compare_plan, sweep_plan

    data = [
        "--dataset_name",
        "data/",
        "--prompt_template",
        "Q: {problem}",
        "--reward_funcs",
        "rewards.py:exact",
    ]
    for words, plan in (
        (["compare", "--output", str(tmp_path / "c"), *data], compare_plan),
        (["sweep", "--grid", "num_generations=4,8", "--output", str(tmp_path / "s"), *data], sweep_plan),
    ):
        args, extra = build_parser().parse_known_args(words)
        base = plan(args, extra)["base"]
        assert (base.dataset_name, base.prompt_template, base.reward_funcs) == (
            "data/",
            "Q: {problem}",
            ["rewards.py:exact"],
        )


def test_a_hub_dataset_that_is_not_cached_offline_says_to_give_a_local_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pods.data import HubUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        HubUnavailableError, match=r"dataset_name 'no-such-owner/no-such-set' .*offline.*local file or folder"
    ):
        dataset_splits("no-such-owner/no-such-set")


def test_eval_takes_a_training_yaml_s_data_keys_and_accuracy_reward() -> None:
    """`pods eval --config train.yaml`: the example's dataset, template, split, completion length, and its
    accuracy_reward `exact` as the reward_funcs entry that defines it; options given win."""
    from pods.cli import build_parser
    from pods.cli.evaluate import with_defaults

    args, _ = build_parser().parse_known_args(
        ["eval", "--model", "m", "--config", str(EXAMPLE / "train.yaml")]
    )
    with_defaults(args)
    assert (args.dataset, args.dataset_name, args.split, args.max_new_tokens) == (None, "data", "test", 32)
    assert args.prompt_template == "Question: {problem}\nAnswer:"
    assert args.accuracy_reward == "rewards.py:exact"
    words = [
        "eval",
        "--model",
        "m",
        "--config",
        str(EXAMPLE / "train.yaml"),
        "--dataset",
        "arith",
        "--split",
        "x",
    ]
    args, _ = build_parser().parse_known_args(words)
    with_defaults(args)
    assert (args.dataset, args.dataset_name, args.prompt_template, args.split) == ("arith", None, None, "x")


def test_evaluation_passes_every_column_and_names_a_failing_accuracy_reward(
    rewards_file: Path, tiny_model_dir: Path
) -> None:
    """The accuracy reward gets the rows' columns (`level`) at evaluation too, and one that raises is named, with
    the completion, as in training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pods.evaluation import evaluate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "a", "level": 1}, {"prompt": "b", "level": 0}]
    options = {"max_new_tokens": 2, "prompt_style": "raw"}
    result = evaluate(model, tokenizer, rows, resolve_reward(f"{rewards_file}:seen"), **options)
    assert result.accuracy == 0.5  # level 1 scores 1.0 (right), level 0 scores 0.0
    with pytest.raises(RewardFunctionError, match=r"'no_kwargs' raised TypeError.*on completion 0"):
        evaluate(model, tokenizer, rows, resolve_reward(f"{rewards_file}:no_kwargs"), **options)


def test_dataset_config_picks_a_local_folder_s_sub_folder(tmp_path: Path) -> None:
    for config in ("main", "socratic"):
        write_jsonl(tmp_path / "d" / config / "train.jsonl", [{"prompt": config}])
    assert [r["prompt"] for r in load_dataset_rows(str(tmp_path / "d"), "train", config="socratic")] == [
        "socratic"
    ]
    with pytest.raises(TaskDataError, match=r"no sub-folder 'other' \(it has \['main', 'socratic'\]\)"):
        load_dataset_rows(str(tmp_path / "d"), "train", config="other")
