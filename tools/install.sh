#!/usr/bin/env bash
# Install mcore-proxy with its test extras. torch first: where `import torch` works (an Ascend
# or CUDA stack) it is left alone; elsewhere the CPU-capable 2.13.0 wheel is installed so pip
# does not resolve a bare `torch` requirement to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"
