#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extras (`.[test]`: the engine, Triton serving,
# the OpenAI front, ONNX export and the test tools). Used by the quick start and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
log=$(mktemp)
quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }; }
quiet python -m pip install --upgrade pip
# Install torch first, pinned, so that pip never resolves a different (CUDA) build on its own.
python -c "import torch" 2>/dev/null || quiet python -m pip install "torch==${TORCH_VERSION:-2.13.0}"
quiet python -m pip install -e ".[test]"
rm -f "$log"
