#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extras. Used by the quick start and by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Install torch first, pinned, so that pip never resolves a different (CUDA) build on its own.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test]"
