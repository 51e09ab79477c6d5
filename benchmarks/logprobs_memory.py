"""Peak extra memory of chosen-token log-probs: pods' chunked version against a full log_softmax.

    python benchmarks/logprobs_memory.py                      # [8, 256, 32000] float32 logits
    python benchmarks/logprobs_memory.py --vocab 151665 --dtype bfloat16
    python benchmarks/logprobs_memory.py --smoke              # [1, 8, 512]: that it runs

Each measurement runs in a fresh process, after the logits exist. On CUDA the figure is
``max_memory_allocated`` above the baseline. On CPU it is the process's peak resident set (VmHWM,
reset first) above its resident set before the call, with glibc's mmap threshold pinned so that freed
scratch buffers go back to the OS (its dynamic threshold would keep them in the heap, counting dead
memory). "forward" runs under ``torch.no_grad`` (old/ref log-probs); "backward" also computes the
gradient with respect to the logits (that [B, L, V] gradient is counted: both methods need it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

METHODS = ("full_log_softmax", "pods_chunked")
MODES = ("forward", "backward")


def _full(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _pods(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    from pods.loss import selected_token_logprobs

    return selected_token_logprobs(logits, ids)


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def measure(method: str, mode: str, shape: tuple[int, int, int], dtype: torch.dtype, device: str) -> int:
    """Peak bytes allocated beyond the logits (and their ids) while computing the log-probs once."""
    batch, length, vocab = shape
    fn = _full if method == "full_log_softmax" else _pods
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, length, vocab, generator=gen, device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (batch, length), generator=gen, device=device)
    _pods(logits[:1, :2], ids[:1, :2])  # warm up kernels and lazy imports outside the measurement
    _full(logits[:1, :2], ids[:1, :2])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _status_bytes("VmRSS")
    if mode == "forward":
        with torch.no_grad():
            out = fn(logits, ids)
    else:
        logits.requires_grad_(True)
        out = fn(logits, ids)
        out.sum().backward()
    del out
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _status_bytes("VmHWM") - base


def warm_seconds(
    method: str, mode: str, shape: tuple[int, int, int], dtype: torch.dtype, device: str
) -> float:
    """Median of 3 timed calls after one warm-up, in this process (memory reuse as in a training loop)."""
    fn = _full if method == "full_log_softmax" else _pods
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(*shape, generator=gen, device=device, dtype=dtype, requires_grad=mode == "backward")
    ids = torch.randint(0, shape[-1], shape[:2], generator=gen, device=device)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        if mode == "forward":
            with torch.no_grad():
                fn(logits, ids)
        else:
            fn(logits, ids).sum().backward()
            logits.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="smallest size, a few seconds: that it runs")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.length, args.vocab = 1, 8, 512
    shape, dtype = (args.batch, args.length, args.vocab), getattr(torch, args.dtype)
    if args.worker:
        print(json.dumps(measure(*args.worker, shape, dtype, args.device)))
        return

    logits_mib = args.batch * args.length * args.vocab * dtype.itemsize / 2**20
    print(
        f"logits {list(shape)} {args.dtype} on {args.device}: {logits_mib:.0f} MiB; peak extra memory (MiB):"
    )
    print(f"{'mode':<10}" + "".join(f"{m:>20}" for m in METHODS) + f"{'ratio':>10}")
    base_cmd = [sys.executable, __file__, *sys.argv[1:]]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for mode in MODES:
        peaks = []
        for method in METHODS:
            if args.smoke:  # in this process: whether it runs, not what it measures
                peaks.append(measure(method, mode, shape, dtype, args.device) / 2**20)
                continue
            result = subprocess.run(
                [*base_cmd, "--worker", method, mode], capture_output=True, text=True, check=True, env=env
            )
            peaks.append(json.loads(result.stdout.strip().splitlines()[-1]) / 2**20)
        print(f"{mode:<10}" + "".join(f"{p:>20.1f}" for p in peaks) + f"{_ratio(peaks[1], peaks[0]):>10.3f}")
    print("seconds per call (warm, median of 3):")
    for mode in MODES:
        seconds = [warm_seconds(method, mode, shape, dtype, args.device) for method in METHODS]
        print(
            f"{mode:<10}"
            + "".join(f"{t:>20.3f}" for t in seconds)
            + f"{_ratio(seconds[1], seconds[0]):>10.3f}"
        )


def _ratio(a: float, b: float) -> float:
    """a / b; NaN when b is 0 (a --smoke size can peak at no measurable memory)."""
    return a / b if b else float("nan")


if __name__ == "__main__":
    main()
