"""Task data: GSM8K / MATH-500 / MATH from local files and folders (JSONL and Parquet), the registry,
prompt styles and length filtering, and the errors for missing files, malformed rows and the Hub
while offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pods.data import (
    HubUnavailableError,
    MissingDataError,
    TaskDataError,
    available_tasks,
    get_task,
    load_task,
    register_task,
)
from pods.prompts import THINK_SYSTEM_PROMPT, render_prompt


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def gsm8k_test(shared_data: Path):
    return load_task("gsm8k", "test", source=str(shared_data / "gsm8k"))


def test_gsm8k_test_split_from_a_local_folder(gsm8k_test, shared_data: Path) -> None:
    raw = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()]
    assert len(gsm8k_test) == len(raw) == 1319
    first = gsm8k_test[0]
    assert first["answer"] == "18" and first["solution"] == raw[0]["answer"]
    assert first["question"] == raw[0]["question"]
    assert first["prompt"] == [
        {"role": "system", "content": THINK_SYSTEM_PROMPT},
        {"role": "user", "content": raw[0]["question"]},
    ]
    answers = gsm8k_test["answer"]
    # Facts from data/README.md: 14 test answers carry thousands separators, 2 are negative, all integers.
    assert sum("," in r["answer"].rsplit("####", 1)[1] for r in raw) == 14
    assert all("," not in a for a in answers)
    assert sum(a.startswith("-") for a in answers) == 2
    assert all(a.lstrip("-").isdigit() for a in answers)


def test_gsm8k_train_split_and_single_file_source(shared_data: Path) -> None:
    train = load_task("gsm8k", "train", source=str(shared_data / "gsm8k"), prompt_style="raw")
    assert len(train) == 7473 and train[0]["prompt"] == train[0]["question"]
    one_file = load_task("gsm8k", source=str(shared_data / "gsm8k" / "test.jsonl"), limit=5)
    assert one_file["answer"] == ["18", "3", "70000", "540", "20"]


def test_gsm8k_from_hub_style_parquet_shards(shared_data: Path, gsm8k_test, tmp_path: Path) -> None:
    raw = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:30]]
    _write_parquet(tmp_path / "main" / "test-00000-of-00002.parquet", raw[:10])
    _write_parquet(tmp_path / "main" / "test-00001-of-00002.parquet", raw[10:])
    _write_parquet(tmp_path / "main" / "train-00000-of-00001.parquet", raw[:3])
    ds = load_task("gsm8k", "test", source=str(tmp_path), prompt_style="plain")
    assert ds["answer"] == gsm8k_test["answer"][:30]
    assert isinstance(ds[0]["prompt"], str) and ds[0]["prompt"].endswith(raw[0]["question"] + "\nAssistant:")


def test_limit_shuffle_and_prompt_length_filter(shared_data: Path, gsm8k_test) -> None:
    from pods.testing import build_tiny_tokenizer

    source = str(shared_data / "gsm8k" / "test.jsonl")
    assert load_task("gsm8k", source=source, limit=0)["answer"] == []
    a = load_task("gsm8k", source=source, shuffle=True, seed=1, limit=20)
    b = load_task("gsm8k", source=source, shuffle=True, seed=1, limit=20)
    c = load_task("gsm8k", source=source, shuffle=True, seed=2, limit=20)
    assert a["question"] == b["question"] != c["question"]
    assert a["question"] != gsm8k_test["question"][:20]

    tokenizer = build_tiny_tokenizer()
    lengths = [len(tokenizer(render_prompt(p, tokenizer))["input_ids"]) for p in gsm8k_test["prompt"][:200]]
    cap = sorted(lengths)[100]
    kept = load_task("gsm8k", source=source, tokenizer=tokenizer, max_prompt_tokens=cap, limit=40)
    expected = [q for q, n in zip(gsm8k_test["question"][:200], lengths, strict=True) if n <= cap][:40]
    assert kept["question"] == expected and len(expected) == 40
    # a limit whose rows lie past the first chunk of 1024 the loader tokenizes: the same first rows that fit
    every = [len(tokenizer(render_prompt(p, tokenizer))["input_ids"]) for p in gsm8k_test["prompt"]]
    tight = sorted(every)[len(every) // 10]
    fitting = [q for q, n in zip(gsm8k_test["question"], every, strict=True) if n <= tight]
    assert sum(n <= tight for n in every[:1024]) < 120 <= len(fitting)
    kept = load_task("gsm8k", source=source, tokenizer=tokenizer, max_prompt_tokens=tight, limit=120)
    assert kept["question"] == fitting[:120]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_task("gsm8k", source=source, max_prompt_tokens=100)


def test_math500_from_local_file(shared_data: Path) -> None:
    ds = load_task("math500", "test", source=str(shared_data / "math500" / "test.jsonl"))
    assert len(ds) == 500
    row = ds[0]
    assert row["question"] == row["problem"] and row["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert {"solution", "subject", "level", "unique_id", "prompt"} <= set(ds.column_names)
    with pytest.raises(TaskDataError, match="only a 'test' split"):
        load_task("math500", "train", source=str(shared_data / "math500"))


def test_math_train_from_a_hub_style_folder_extracts_boxed_answers(shared_data: Path, tmp_path: Path) -> None:
    """A folder laid out like EleutherAI/hendrycks_math (one sub-folder per subject, no answer column)."""
    rows = [
        json.loads(line) for line in (shared_data / "math500" / "test.jsonl").read_text().splitlines()[:40]
    ]
    subject_dirs = {"Algebra": "algebra", "Precalculus": "precalculus"}
    chosen = [r for r in rows if r["subject"] in subject_dirs]
    for subject, folder in subject_dirs.items():
        shard = [
            {
                "problem": r["problem"],
                "level": f"Level {r['level']}",
                "type": subject,
                "solution": r["solution"],
            }
            for r in chosen
            if r["subject"] == subject
        ]
        _write_parquet(tmp_path / folder / "train-00000-of-00001.parquet", shard)
    ds = load_task("math", "train", source=str(tmp_path))
    by_problem = {r["problem"]: r["answer"] for r in chosen}
    assert len(ds) == len(chosen) >= 5
    assert all(
        by_problem[q].replace(" ", "") == a.replace(" ", "")
        for q, a in zip(ds["question"], ds["answer"], strict=True)
    )
    algebra = load_task("math", "train", source=str(tmp_path), subjects=["algebra"])
    assert set(algebra["type"]) == {"Algebra"}
    with pytest.raises(ValueError, match="unknown MATH subject"):
        load_task("math", source=str(tmp_path), subjects=["poetry"])


# ---------------------------------------------------------------- registry


def test_registry_lists_tasks_and_rejects_unknown_names_and_options(shared_data: Path) -> None:
    assert {"gsm8k", "math500", "math", "arith"} <= set(available_tasks())
    with pytest.raises(ValueError, match=r"unknown task 'gsm9k'; known tasks: \[.*'gsm8k'"):
        load_task("gsm9k")
    with pytest.raises(ValueError, match=r"does not accept option\(s\) \['colour'\]"):
        load_task("gsm8k", source=str(shared_data / "gsm8k"), colour="red")


def test_each_task_owns_its_rewards_accuracy_and_prompt() -> None:
    from pods.rewards import accuracy_reward, math_accuracy_reward, tag_reward

    assert get_task("math500").accuracy_function() is math_accuracy_reward
    assert get_task("gsm8k").accuracy_function() is accuracy_reward
    assert get_task("gsm8k").reward_functions()[-1] is tag_reward
    arith = get_task("arith")
    assert arith.reward_functions() == [accuracy_reward] and arith.max_new_tokens == 32
    assert load_task("arith", "test", limit=1)["prompt"][0].startswith("Question: ")

    def read_tiny(split: str, *, source: str | None = None) -> list[dict]:
        return [{"question": "1+1?", "answer": "2", "where": source}]

    register_task("tiny-task-fields", read_tiny, accuracy="math_accuracy", prompt_style="raw")
    assert get_task("tiny-task-fields").accuracy_function() is math_accuracy_reward
    row = load_task("tiny-task-fields", "test", source="here")[0]
    assert (row["prompt"], row["where"]) == ("1+1?", "here")


def test_register_task_adds_a_loader() -> None:
    import datasets

    def tiny(split: str = "train", **options) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"question": ["1+1?"], "answer": ["2"], "split": [split]})

    register_task("tiny-test-task", tiny)
    assert "tiny-test-task" in available_tasks()
    assert load_task("tiny-test-task", "test")["split"] == ["test"]
    with pytest.raises(ValueError, match="must be callable"):
        register_task("broken", "not a function")  # type: ignore[arg-type]


def test_a_limit_draws_only_the_rows_it_keeps_from_a_lazy_reader() -> None:
    """A reader may yield rows as it makes them (the arith tasks do): a limit stops it, without the length filter
    after exactly ``limit`` rows, with it after the chunk that fills the limit; shuffling reads them all."""
    from pods.data.task import Task
    from pods.testing import build_tiny_tokenizer

    drawn = []

    def counting(split: str = "train", **options):
        for i in range(10_000):
            drawn.append(i)
            yield {"question": f"What is {i} + 1?", "answer": str(i + 1)}

    task = Task("counting", counting)
    rows = task.load("train", limit=5)
    assert rows["answer"] == ["1", "2", "3", "4", "5"] and len(drawn) == 5
    drawn.clear()
    rows = task.load("train", limit=5, tokenizer=build_tiny_tokenizer(), max_prompt_tokens=512)
    assert rows["answer"] == ["1", "2", "3", "4", "5"] and len(drawn) == 1024  # one chunk
    drawn.clear()
    assert len(task.load("train", limit=5, shuffle=True)) == 5 and len(drawn) == 10_000


# ---------------------------------------------------------------- errors


def test_missing_file_or_split_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "test.jsonl"
    with pytest.raises(MissingDataError, match=str(missing)) as info:
        load_task("gsm8k", "test", source=str(missing))
    assert isinstance(info.value, FileNotFoundError)
    _write_jsonl(tmp_path / "folder" / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(MissingDataError, match="no file for split 'test'"):
        load_task("gsm8k", "test", source=str(tmp_path / "folder"))


def test_malformed_rows_name_the_file_and_line(tmp_path: Path) -> None:
    good = {"question": "q", "answer": "so #### 4"}
    bad_json = tmp_path / "bad_json" / "test.jsonl"
    bad_json.parent.mkdir()
    bad_json.write_text(json.dumps(good) + "\n\n" + '{"question": "q", "answer": \n')
    with pytest.raises(TaskDataError, match=f"{bad_json}:3: malformed row, not valid JSON"):
        load_task("gsm8k", "test", source=str(bad_json))

    missing_field = _write_jsonl(tmp_path / "missing" / "test.jsonl", [good, {"question": "q"}])
    with pytest.raises(
        TaskDataError, match=rf"{missing_field}:2: malformed row, missing field\(s\) \['answer'\]"
    ):
        load_task("gsm8k", "test", source=str(missing_field))

    no_marker = _write_jsonl(
        tmp_path / "marker" / "test.jsonl", [good, good, {"question": "q", "answer": "4"}]
    )
    with pytest.raises(TaskDataError, match=f"{no_marker}:3: malformed row.*'#### <number>'"):
        load_task("gsm8k", "test", source=str(no_marker))

    not_object = _write_jsonl(tmp_path / "list" / "test.jsonl", [good, [1, 2]])  # type: ignore[list-item]
    with pytest.raises(TaskDataError, match=f"{not_object}:2: malformed row, expected a JSON object"):
        load_task("gsm8k", "test", source=str(not_object))


def test_hub_dataset_while_offline_says_how_to_use_a_local_copy(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError, match=r"offline.*source='/path/to/"):
        load_task("gsm8k", "test", source="pods-tests/no-such-dataset")
