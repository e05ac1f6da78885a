#!/usr/bin/env bash
# A short smoke of the checkpoint and convert tests under a second Python interpreter, when the
# machine has one: Pythons differ in how they pickle enums (Debian 12's 3.11.2 by name, 3.11.7+ by
# value; docs/safe-loading.md), and checkpoints come from both kinds.
#
#   bash tools/smoke_other_python.sh MAIN_PYTHON
#
# The second interpreter: $MCORE_PROXY_SECOND_PYTHON if set, else /usr/bin/python3 when its version
# differs from MAIN_PYTHON's; none -> a line saying so, exit 0. It gets a venv of its own
# ($MCORE_PROXY_SECOND_VENV, default <repo>/.venv-second), set up by tools/install.sh.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN="${1:?usage: bash tools/smoke_other_python.sh MAIN_PYTHON}"
say() { echo "smoke: $*" >&2; }

version() { "$1" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || true; }
SECOND="${MCORE_PROXY_SECOND_PYTHON:-}"
if [ -z "$SECOND" ] && [ -x /usr/bin/python3 ] && [ "$(version /usr/bin/python3)" != "$(version "$MAIN")" ]; then
  SECOND=/usr/bin/python3
fi
if [ -z "$SECOND" ]; then
  say "no second Python interpreter here (set MCORE_PROXY_SECOND_PYTHON to name one): skipped"
  exit 0
fi
VENV="${MCORE_PROXY_SECOND_VENV:-$REPO/.venv-second}"
say "second interpreter $SECOND (Python $(version "$SECOND")), venv $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$SECOND" -m venv "$VENV" >&2; then
    rm -rf "$VENV"; say "$SECOND -m venv failed (Debian: install python3-venv)"; exit 2
  fi
fi
# only what these tests need (torch, megatron-core, psutil, pytest): the full test extras took minutes of CI
PY="$(VIRTUAL_ENV="$VENV" CONDA_PREFIX="" PYTHON="" MCORE_PROXY_EXTRAS=smoke bash "$REPO/tools/install.sh")"
cd "$REPO"
# reading and writing both enum forms, a real megatron-core round trip, hostile pickles, and the
# whole CLI path (inspect, select, convert, verify --functional) on by-name and by-value fixtures
exec "$PY" -m pytest -q -p no:warnings \
  tests/checkpoint/test_enum_forms.py tests/checkpoint/test_torchfile.py \
  tests/checkpoint/test_legacy_roundtrip.py tests/convert/test_convert_enum_forms.py \
  tests/convert/test_hostile.py
