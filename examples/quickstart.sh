#!/usr/bin/env bash
# The main job end to end on a small embedded default, on CPU:
#   1. build a real Megatron MoE checkpoint with megatron-core (DeepSeek-like: 16 experts in
#      4 groups, top-4 sigmoid with expert bias, shared expert, dense first layer, TP=1 PP=2 EP=2),
#   2. collect routing statistics with an unmodified evaluation launch under torchrun, the
#      trace activated by the environment only,
#   3. merge them, 4. select 8 of 16 experts per layer (multi-view), 5. convert to EP=1,
#   6. verify: bit-exact tensors, args, manifest, and the proxy's outputs in megatron-core.
#
#   bash examples/quickstart.sh [WORKDIR]      (default: out/quickstart; must not exist)
#   bash examples/quickstart.sh --setup-only   set up the environment, show it, and stop
#
# Set-up: tools/install.sh (the active environment, else the project venv .venv); every step
# then runs with the interpreter it set up.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
WORK="${1:-out/quickstart}"
if [ "$WORK" != --setup-only ] && [ -e "$WORK" ]; then
  echo "quickstart: $WORK exists; pass a new folder or remove it" >&2; exit 2
fi
PY="$(bash tools/install.sh)"
mcore-proxy() { "$PY" -m mcore_proxy "$@"; }
echo "== environment: $("$PY" -c 'import sys, torch; print(f"python {sys.executable}, torch {torch.__version__} ({torch.__file__})")')"
if [ "$WORK" = --setup-only ]; then exit 0; fi
mkdir -p "$WORK"
export PYTHONWARNINGS=ignore

echo "== 1. a real Megatron checkpoint, saved by megatron-core on 4 CPU ranks"
"$PY" -m mcore_proxy.testing.make_checkpoint deepseek_like_pp2_uneven "$WORK/original"
mcore-proxy inspect "$WORK/original"

echo "== 2. routing statistics from an evaluation launch (trace activated by environment only)"
"$PY" -c "import numpy as np, sys; np.save(sys.argv[1], np.random.default_rng(0).integers(0, 128, 32768))" "$WORK/tokens.npy"
PYTHONPATH="$REPO/patches${PYTHONPATH:+:$PYTHONPATH}" MCORE_PROXY_TRACE_DIR="$WORK/trace" \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 \
    examples/eval_checkpoint_cpu.py --ckpt "$WORK/original" --tokens "$WORK/tokens.npy"

echo "== 3. merge the per-rank statistics"
mcore-proxy stats merge "$WORK/trace" -o "$WORK/routing_stats.safetensors"
mcore-proxy stats show "$WORK/routing_stats.safetensors" --png "$WORK/stats_png" | head -20

echo "== 4. select 8 of 16 experts per MoE layer (multi-view, frequency-aware)"
mcore-proxy select --ckpt "$WORK/original" --stats "$WORK/routing_stats.safetensors" \
    --num-experts 8 --target-ep 1 --report "$WORK/report" -o "$WORK/plan.json"

echo "== 5. convert to the proxy at EP=1 (half the expert-parallel degree)"
mcore-proxy convert "$WORK/original" --plan "$WORK/plan.json" -o "$WORK/proxy" --target-ep 1
mcore-proxy inspect "$WORK/proxy"

echo "== 6. verify (bit-exact, args, manifest, and megatron-core outputs)"
mcore-proxy verify --orig "$WORK/original" --proxy "$WORK/proxy" --plan "$WORK/plan.json" --functional

echo "done: $WORK/proxy (plan $WORK/plan.json, report $WORK/report, statistics $WORK/routing_stats.safetensors)"
