#!/usr/bin/env bash
# The test command of the README: set up (tools/install.sh: the active environment, else the
# project venv .venv), then the whole suite with the interpreter it set up.
#
#   bash tests/run.sh [pytest arguments]
#
# Tests run in pytest-xdist workers (MCORE_PROXY_TEST_WORKERS, default one per core, at most 4),
# one test folder per worker at a time (tests/conftest.py schedules them), sharing one fixture folder.
# MCORE_PROXY_TEST_WORKERS=0 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(bash tools/install.sh)"
exec "$PY" -m pytest -q -n "${MCORE_PROXY_TEST_WORKERS:-auto}" --maxprocesses 4 "$@"
