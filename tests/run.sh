#!/usr/bin/env bash
# The test command of the README: set up (tools/install.sh: the active environment, else the
# project venv .venv), then the whole suite with the interpreter it set up.
#
#   bash tests/run.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(bash tools/install.sh)"
exec "$PY" -m pytest -q "$@"
