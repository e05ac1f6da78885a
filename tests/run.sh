#!/usr/bin/env bash
# The test command of the README: set up (tools/install.sh: the active environment, else the
# project venv .venv), then the whole suite with the interpreter it set up.
#
#   bash tests/run.sh [pytest arguments]
#
# Tests run in pytest-xdist workers (MCORE_PROXY_TEST_WORKERS, default one per core, at most 4),
# one test folder per worker at a time (tests/conftest.py schedules them), sharing one fixture folder.
# MCORE_PROXY_TEST_WORKERS=0 runs them in this process. The vLLM tier needs vLLM's environment:
# built here once per machine (a few minutes), or given as $MCORE_PROXY_VLLM_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(bash tools/install.sh)"
# the vLLM tier (tests/rollout): vLLM's own environment, built once per machine and reused
# (tools/vllm_env.sh); MCORE_PROXY_VLLM=0 skips it, a failed build skips it with a warning
if [ -z "${MCORE_PROXY_VLLM_PYTHON:-}" ] && [ "${MCORE_PROXY_VLLM:-1}" != 0 ]; then
  if VLLM_PY="$(bash tools/vllm_env.sh)"; then
    export MCORE_PROXY_VLLM_PYTHON="$VLLM_PY"
  else
    echo "tests/run.sh: warning: the vLLM environment could not be built; tests/rollout is skipped" >&2
  fi
fi
exec "$PY" -m pytest -q -n "${MCORE_PROXY_TEST_WORKERS:-auto}" --maxprocesses 4 "$@"
