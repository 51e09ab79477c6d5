"""Rewards: answer extraction and equivalence, the paper's format/tag rewards, math-verify with a hard
time limit that works off the main thread and in worker processes, and the GSM8K / MATH-500 bars."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pods.rewards import (
    REWARD_FUNCTIONS,
    accuracy_reward,
    answers_match,
    extract_answer,
    find_boxed,
    format_reward,
    get_reward_functions,
    math_accuracy_reward,
    tag_reward,
)
from pods.rewards.symbolic import MATH_VERIFY_TIMEOUT_S, verify_with_math_verify
from pods.rewards.timeouts import WorkerProcess, WorkerTimeout


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- extraction and equivalence


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think> 2 + 2 </think> <answer> 4 </answer> then 7", "4"),
        ("so 3 + 4 = 7\n#### 7\nmore text 9", "7"),
        ("the answer is \\boxed{\\frac{1}{2}} and 3", "\\frac{1}{2}"),
        ("numbers 1, 2 and finally -3.5 apples", "-3.5"),
        ("<answer> unclosed 12", "unclosed 12"),
        ("no answer here", "no answer here"),
        ("", None),
    ],
)
def test_extract_answer_prefers_the_most_explicit_view(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_find_boxed_handles_nesting_and_unbalanced_braces() -> None:
    assert find_boxed("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"
    assert find_boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert find_boxed("\\boxed{1} then \\boxed{2") == "1"  # the unbalanced last one is skipped
    assert find_boxed("\\boxed 5.") == "5"
    assert find_boxed("nothing") is None


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("18", "18"),
        ("18.00", "18"),
        ("$1,000", "1000"),
        ("1000", "1,000"),
        ("18 dollars", "18"),
        ("50%", "50"),
        ("-3", "-3"),
        ("\u22123", "-3"),
        ("3/4", "0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("-\\frac{1}{2}", "-0.5"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("x = 5", "5"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left(3,\\frac{\\pi}{2}\\right)"),
    ],
)
def test_answers_match_equivalent(predicted: str, gold: str) -> None:
    assert answers_match(predicted, gold)


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("18.5", "18"),
        ("180", "18"),
        ("1,000", "100"),
        ("3", "-3"),
        ("16 - 3", "-3"),  # a subtraction is not a negative number
        (None, "18"),
        ("", "18"),
        ("no number", "18"),
        ("1/0", "0"),
        ("(3, 5)", "(3, 4)"),
    ],
)
def test_answers_match_different(predicted: str | None, gold: str) -> None:
    assert not answers_match(predicted, gold)


def test_accuracy_reward_accepts_any_view_and_conversational_completions() -> None:
    completions = [
        "<think>16 - 3 - 4 = 9, 9 * 2 = 18</think><answer>$18</answer>",
        [{"role": "assistant", "content": "She makes 18 dollars.\n#### 18"}],
        "I think it is \\boxed{18}.",
        "The answer is 17.",
        "18",
    ]
    assert accuracy_reward(None, completions, answer=["18"] * 5) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_rewards_accept_trls_keyword_call() -> None:
    """TRL 1.16 calls f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...)."""
    columns = {"answer": ["4", "4"], "question": ["2+2?", "2+2?"], "trainer_state": None, "log_extra": print}
    completions = [
        [{"role": "assistant", "content": "<think>2+2</think><answer>4</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>5</answer>"}]}],
    ]
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    for fn, expected in [
        (accuracy_reward, [1.0, 0.0]),
        (format_reward, [0.1, 0.0]),
        (tag_reward, [0.1, 0.05]),
    ]:
        scores = fn(prompts=prompts, completions=completions, completion_ids=[[1, 2], [3]], **columns)
        assert scores == pytest.approx(expected)


def test_accuracy_reward_rejects_a_missing_or_misshaped_answer_column() -> None:
    with pytest.raises(ValueError, match="'answer' column"):
        accuracy_reward(None, ["1"])
    with pytest.raises(ValueError, match="one gold answer per completion"):
        accuracy_reward(None, ["1", "2"], answer=["1"])


# ---------------------------------------------------------------- format and tags


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think> a </think>\n<answer> 4 </answer>", 0.1),
        ("  <think>a</think> <answer>4</answer>\n", 0.1),
        ("Sure!<think>a</think><answer>4</answer>", 0.1 * (1 - 0.05)),  # 5 characters outside
        ("<think>a</think> so <answer>4</answer> ok", 0.1 * (1 - 0.04)),
        ("<think>a</think><answer>4</answer>" + "x" * 150, 0.0),
        ("<answer>4</answer><think>a</think>", 0.0),  # wrong order
        ("<think>a</think> 4", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward_follows_the_paper(text: str, expected: float) -> None:
    assert format_reward(None, [text]) == [pytest.approx(expected)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>a</think><answer>4</answer>", 0.1),
        ("<think>a</think>", 0.05),
        ("<think><think>a</think><answer>4</answer>", 0.075),  # <think> twice: it does not count
        ("nothing", 0.0),
    ],
)
def test_tag_reward_counts_tags_that_appear_exactly_once(text: str, expected: float) -> None:
    assert tag_reward(None, [[{"role": "assistant", "content": text}]]) == [pytest.approx(expected)]


def test_reward_registry() -> None:
    assert get_reward_functions(["accuracy", "format", "tag"]) == [accuracy_reward, format_reward, tag_reward]
    assert REWARD_FUNCTIONS["math_accuracy"] is math_accuracy_reward
    with pytest.raises(ValueError, match=r"unknown reward function.*known: \['accuracy'"):
        get_reward_functions(["accuracy", "nope"])
    with pytest.raises(ValueError, match="list of names"):
        get_reward_functions("accuracy")  # type: ignore[arg-type]


def test_math_accuracy_reward_names_the_extra_when_math_verify_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the package unimportable
    with pytest.raises(ImportError, match=r"pip install 'pods\[math\]'"):
        math_accuracy_reward(None, ["\\boxed{1}"], answer=["1"])
    with pytest.raises(ImportError, match=r"pods\[math\]"):
        get_reward_functions(["math_accuracy"])


# ---------------------------------------------------------------- the bars


def test_gsm8k_gold_solutions_score_one_and_another_answer_scores_zero(shared_data: Path) -> None:
    rows = _jsonl(shared_data / "gsm8k" / "test.jsonl")
    solutions = [r["answer"] for r in rows]
    golds = [s.rsplit("####", 1)[1].strip().replace(",", "") for s in solutions]
    assert len(rows) == 1319
    assert accuracy_reward(None, solutions, answer=golds) == [1.0] * len(rows)
    others = [golds[(i + 1) % len(golds)] for i in range(len(golds))]
    scores = accuracy_reward(None, solutions, answer=others)
    different = [i for i in range(len(rows)) if float(others[i]) != float(golds[i])]
    assert len(different) > 1300
    assert [scores[i] for i in different] == [0.0] * len(different)


@pytest.fixture(scope="module")
def math500(shared_data: Path) -> list[dict]:
    pytest.importorskip("math_verify")
    return _jsonl(shared_data / "math500" / "test.jsonl")


@pytest.mark.slow
def test_math500_solutions_score_one_with_math_accuracy_reward(math500: list[dict]) -> None:
    scores = math_accuracy_reward(
        None, [r["solution"] for r in math500], answer=[r["answer"] for r in math500]
    )
    assert scores == [1.0] * 500


@pytest.fixture
def patient_math_verify(monkeypatch: pytest.MonkeyPatch):
    """A math-verify worker of its own with 30 s instead of 1 s per parse and comparison: the first parse of a
    form (an interval, a tuple with pi) warms sympy up, which can take over 1 s on a busy machine."""
    from pods.rewards import symbolic

    monkeypatch.setenv("PODS_MATH_VERIFY_INNER_TIMEOUT", "30")
    monkeypatch.setattr(symbolic, "_worker", None)  # the shared one is put back afterwards
    yield
    if symbolic._worker is not None:
        symbolic._worker.close()


@pytest.mark.slow
@pytest.mark.usefixtures("patient_math_verify")
def test_math500_solutions_verify_through_math_verify_itself(math500: list[dict]) -> None:
    """The same bar without the fast textual path: every solution goes through math-verify (with time to spare:
    a busy machine must not turn a slow verification into a failure)."""
    failures = [
        r["unique_id"] for r in math500 if not verify_with_math_verify(r["solution"], r["answer"], timeout=60)
    ]
    assert failures == []


def test_math_verify_checks_symbolic_equivalence() -> None:
    pytest.importorskip("math_verify")
    completions = [
        "<think>rationalise</think><answer>\\frac{1}{\\sqrt{2}}</answer>",
        "so the result is $\\boxed{2\\sqrt{2}/4}$",
        "<answer>\\frac{\\sqrt{3}}{2}</answer>",
        "\x00\xff junk",
    ]
    gold = "\\frac{\\sqrt{2}}{2}"
    assert math_accuracy_reward(None, completions, answer=[gold] * 4) == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- time limits anywhere


def test_math_accuracy_reward_works_off_the_main_thread() -> None:
    pytest.importorskip("math_verify")
    results: list[list[float]] = []
    thread = threading.Thread(
        target=lambda: results.append(
            math_accuracy_reward(None, ["\\boxed{\\frac{2}{4}}", "\\boxed{3}"], answer=["1/2"] * 2)
        )
    )
    thread.start()
    thread.join(timeout=60)
    assert results == [[1.0, 0.0]]


def _score_in_child(_: int) -> list[float]:
    return math_accuracy_reward(None, ["$x = \\sqrt{4}$", "\\boxed{\\pi}"], answer=["2", "\\pi"])


def test_math_accuracy_reward_works_in_a_daemonic_worker_process() -> None:
    pytest.importorskip("math_verify")
    with multiprocessing.get_context("fork").Pool(1) as pool:  # pool workers are daemonic
        assert pool.map(_score_in_child, [0]) == [[1.0, 1.0]]


def test_worker_process_kills_a_call_past_its_deadline_and_recovers(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "sleepy_worker.py").write_text(
        "import json, sys, time\n"
        "print(json.dumps({'ready': True}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    request = json.loads(line)\n"
        "    time.sleep(request['sleep'])\n"
        "    print(json.dumps({'echo': request['sleep']}), flush=True)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    worker = WorkerProcess("sleepy_worker")
    try:
        assert worker.call({"sleep": 0}, timeout=10) == {"echo": 0}
        start = time.monotonic()
        with pytest.raises(WorkerTimeout):
            worker.call({"sleep": 30}, timeout=0.5)
        assert time.monotonic() - start < 5
        assert worker.call({"sleep": 0.01}, timeout=10) == {"echo": 0.01}  # a fresh child answers
    finally:
        worker.close()


def test_worker_process_outlives_a_signal_to_the_runs_process_group(tmp_path: Path) -> None:
    """Ctrl-C or scancel signals the run's whole process group: the trainer stops after its step, and the
    checker child (math-verify's) must still answer for that step, not die with a check in flight."""
    (tmp_path / "echo_worker.py").write_text(
        "import json, sys\n"
        "print(json.dumps({'ready': True}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    print(line.strip(), flush=True)\n"
    )
    (tmp_path / "owner.py").write_text(
        "import signal, sys\n"
        "from pods.rewards.timeouts import WorkerProcess\n"
        "for stop in (signal.SIGINT, signal.SIGTERM):\n"
        "    signal.signal(stop, lambda *_: print('stop asked', flush=True))  # a handler: children get the default\n"
        "worker = WorkerProcess('echo_worker')\n"
        "print(worker.call({'n': 1}, timeout=30), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(worker.call({'n': 2}, timeout=30), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen(
        [sys.executable, str(tmp_path / "owner.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert owner.stdout.readline().strip() == "{'n': 1}"
        for stop in (signal.SIGINT, signal.SIGTERM):
            os.killpg(owner.pid, stop)
            assert owner.stdout.readline().strip() == "stop asked"
        out, _ = owner.communicate("go\n", timeout=60)
        assert out.strip() == "{'n': 2}"  # the child answered after both signals
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)


def test_worker_process_reports_a_child_that_cannot_start() -> None:
    worker = WorkerProcess("pods_no_such_module_xyz", startup_timeout=30)
    with pytest.raises(RuntimeError, match="failed to start"):
        worker.call({}, timeout=1)


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{10^{10^{10^{10^{10}}}}}",
        "\\boxed{9^{9^{9^{9^{9}}}}!}",
        "$" + "\\sqrt{" * 400 + "2" + "}" * 400 + "$",
        "\\boxed{" + "(" * 5000 + "}",
    ],
)
def test_math_accuracy_reward_stays_within_its_time_bound_on_hostile_latex(text: str) -> None:
    pytest.importorskip("math_verify")
    math_accuracy_reward(None, ["\\boxed{1}"], answer=["1"])  # start the child outside the timing
    start = time.monotonic()
    assert math_accuracy_reward(None, [text], answer=["7"]) == [0.0]
    assert time.monotonic() - start < MATH_VERIFY_TIMEOUT_S + 1.0
