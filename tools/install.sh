#!/usr/bin/env bash
# Set up mcore-proxy with its test extras; the README's two commands start with this.
#
#   PY="$(bash tools/install.sh)"       install (or reuse); prints the interpreter to use on stdout
#   bash tools/install.sh --dry-run     print the decisions only, change nothing
#
# Decisions go to stderr, one line each. The interpreter:
#   $PYTHON if set; else the active virtual environment ($VIRTUAL_ENV) or conda environment
#   ($CONDA_PREFIX); else the project venv $MCORE_PROXY_VENV (default <repo>/.venv), created with
#   python3 when missing: with --system-site-packages when python3 already imports torch (so an
#   Ascend torch_npu or CUDA stack installed there stays visible), isolated otherwise. A venv is
#   also what Debian-style system Pythons require (pip refuses them: externally-managed-environment).
# torch (tools/install_plan.py decides, without network):
#   `import torch` works -> left alone, and pinned while the rest installs so pip cannot replace
#   it; else a local CPU wheel of torch==$MCORE_PROXY_TORCH_VERSION (default 2.13.0) from pip's
#   find-links or file:// index; else, on Linux, PyTorch's CPU index ($MCORE_PROXY_TORCH_INDEX,
#   default https://download.pytorch.org/whl/cpu) instead of PyPI's Linux build, which pulls about
#   2.7 GB of CUDA libraries; on macOS and Windows PyPI (CPU builds there).
# Then `pip install -e ".[test]"` (megatron-core 0.16.1, pytest, matplotlib, psutil), or the extras
# named by $MCORE_PROXY_EXTRAS (tools/smoke_other_python.sh: `smoke`, what its few tests need).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash tools/install.sh [--dry-run]" >&2; exit 2 ;;
esac
TORCH_VERSION="${MCORE_PROXY_TORCH_VERSION:-2.13.0}"
EXTRAS="${MCORE_PROXY_EXTRAS:-test}"
PLAN_PY="$REPO/tools/install_plan.py"

say() { echo "install: $*" >&2; }
if [ "$DRY" = 1 ]; then INSTALLING="would install"; CREATING="would create"; else INSTALLING="installing"; CREATING="creating"; fi
fail() { echo "install: error: $*" >&2; exit 2; }
# run CMD...: pip's output goes to stderr, stdout carries only the interpreter path
run() { if [ "$DRY" = 1 ]; then say "would run: $*"; else "$@" >&2; fi; }

# probe PYTHON: read install_plan.py's key=value facts into P_* variables
probe() {
  local out key value
  out="$("$1" "$PLAN_PY" --torch-version "$TORCH_VERSION")" \
    || fail "$1 could not run $PLAN_PY; check that $1 is a working Python"
  while IFS='=' read -r key value; do
    case "$key" in
      python) P_PYTHON=$value ;; version) P_VERSION=$value ;; supported) P_SUPPORTED=$value ;;
      venv) P_VENV=$value ;; externally_managed) P_EXTERNAL=$value ;; torch) P_TORCH=$value ;;
      torch_file) P_TORCH_FILE=$value ;; torch_error) P_TORCH_ERROR=$value ;;
      torch_action) P_ACTION=$value ;; torch_source) P_SOURCE=$value ;;
    esac
  done <<< "$out"
  [ "$P_SUPPORTED" = 1 ] || fail "$P_PYTHON is Python $P_VERSION; mcore-proxy needs Python >= 3.10 (install one, or set PYTHON=/path/to/python3.10+)"
}

# 1. the interpreter
if [ -n "${PYTHON:-}" ]; then
  PY="$(command -v "$PYTHON" || echo "$PYTHON")"; WHERE="PYTHON=$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"; WHERE="the active virtual environment $VIRTUAL_ENV"
elif [ -n "${CONDA_PREFIX:-}" ]; then
  PY="$CONDA_PREFIX/bin/python"; WHERE="the active conda environment $CONDA_PREFIX"
else
  VENV="${MCORE_PROXY_VENV:-$REPO/.venv}"
  PY="$VENV/bin/python"
  if [ -x "$PY" ]; then
    WHERE="the project venv $VENV (no environment active)"
  else
    BASE="$(command -v python3 || command -v python || true)"
    [ -n "$BASE" ] || fail "no python3 on PATH; install Python >= 3.10 or set PYTHON=/path/to/python"
    probe "$BASE"
    if [ -n "$P_TORCH" ]; then
      OPTS=(--system-site-packages); KIND="seeing $BASE's torch $P_TORCH"
    else
      OPTS=(); KIND="isolated"
    fi
    say "no environment active: $CREATING the project venv $VENV ($KIND; activate it with '. $VENV/bin/activate')"
    if [ "$DRY" = 1 ]; then
      say "would run: $BASE -m venv ${OPTS[*]} $VENV"
    elif ! "$BASE" -m venv "${OPTS[@]}" "$VENV" >&2; then
      rm -rf "$VENV"
      fail "$BASE -m venv $VENV failed (on Debian/Ubuntu install the python3-venv package), or activate an environment, or set PYTHON"
    fi
    WHERE="the project venv $VENV, new"
  fi
fi

# 2. facts about it (a dry run for a venv not yet created keeps its base interpreter's: the
#    same Python, and the same torch when the venv would see the base's site-packages)
if [ "$DRY" = 1 ] && [ ! -x "$PY" ]; then
  PY_SHOWN="$PY"
else
  [ -x "$PY" ] || fail "$PY does not exist or is not executable; fix $WHERE"
  probe "$PY"
  PY_SHOWN="$P_PYTHON"
  if [ "$P_VENV" = 0 ] && [ "$P_EXTERNAL" = 1 ] && [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ]; then
    fail "$PY is an externally-managed system Python (PEP 668): pip refuses to install into it; unset PYTHON so that install.sh creates the project venv, or point PYTHON at a virtual environment"
  fi
fi
say "python: $PY_SHOWN ($WHERE)"

# 3. torch
PIP=("$PY" -m pip install -q)
case "$P_ACTION" in
  keep) say "torch $P_TORCH already imports ($P_TORCH_FILE): left alone" ;;
  wheel) say "torch: $INSTALLING the local CPU wheel $P_SOURCE"; run "${PIP[@]}" "$P_SOURCE" ;;
  index) say "torch: $INSTALLING torch==$TORCH_VERSION from PyTorch's CPU index $P_SOURCE (no CUDA libraries)"
         run "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$P_SOURCE" \
           || fail "could not install torch from $P_SOURCE; set MCORE_PROXY_TORCH_INDEX to a mirror of PyTorch's CPU wheel index, or install any torch build first (it is then left alone)" ;;
  pypi) say "torch: $INSTALLING torch==$TORCH_VERSION from pip's index"; run "${PIP[@]}" "torch==$TORCH_VERSION" ;;
  *) fail "no torch decision from $PLAN_PY (got '$P_ACTION')" ;;
esac

# 4. the package and its extras (test unless MCORE_PROXY_EXTRAS says), with torch pinned to what is there now
if [ "$DRY" = 1 ]; then
  say "would run: ${PIP[*]} -e $REPO[$EXTRAS] (torch pinned to the version above)"
else
  TORCH_NOW="$P_TORCH"
  [ "$P_ACTION" = keep ] || TORCH_NOW="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    || fail "torch is installed in $PY but 'import torch' fails (${P_TORCH_ERROR:-see above}); repair that environment, or unset PYTHON/VIRTUAL_ENV to use a fresh project venv"
  PIN="$(mktemp)"; trap 'rm -f "$PIN"' EXIT
  echo "torch==$TORCH_NOW" > "$PIN"
  say "pip install -e .[$EXTRAS] (megatron-core 0.16.1, pytest, ...), torch pinned to $TORCH_NOW"
  run "${PIP[@]}" -e "$REPO[$EXTRAS]" -c "$PIN" \
    || fail "pip could not install .[$EXTRAS] next to torch $TORCH_NOW (megatron-core 0.16.1 needs torch >= 2.6); see pip's message above"
fi
echo "$PY"
