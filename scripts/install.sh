#!/usr/bin/env bash
# Set up pods in ./.venv: `bash scripts/install.sh` for users, `bash scripts/install.sh dev` for the
# test suite. Where no NVIDIA GPU is present it installs the CPU build of torch first (pinned), so
# that pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
py=.venv/bin/python
$py -m pip install --quiet --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
    $py -m pip install --quiet "torch==2.13.0"
fi
if [ -n "$extras" ]; then
    $py -m pip install --quiet -e ".[$extras]"
else
    $py -m pip install --quiet -e .
fi
echo "pods installed in .venv ($($py -c 'import pods; print(pods.__version__)'))"
