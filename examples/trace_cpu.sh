#!/usr/bin/env bash
# Collect routing statistics from an unmodified megatron-core launch on CPU, then merge them.
#
#   examples/trace_cpu.sh [WORKDIR]        (default: a fresh temporary folder)
#
# 1. writes a small token file (random ids: a stand-in for a tokenised corpus),
# 2. runs examples/train_step_cpu.py under torchrun on 2 CPU ranks (expert parallel 2, data
#    parallel 2). The script knows nothing about tracing: activation is the environment only,
#    PYTHONPATH=<repo>/patches (its sitecustomize.py) plus MCORE_PROXY_TRACE_DIR,
# 3. merges the per-rank files and prints the per-layer summary (and heatmaps).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d -t mcore-proxy-trace-XXXXXX)}"
mkdir -p "$WORK"
STATS="$WORK/stats"
rm -rf "$STATS"

python - "$WORK/tokens.npy" <<'PY'
import sys
import numpy as np
np.save(sys.argv[1], np.random.default_rng(0).integers(0, 256, 20_000).astype(np.int32))
PY

PYTHONPATH="$REPO/patches${PYTHONPATH:+:$PYTHONPATH}" \
MCORE_PROXY_TRACE_DIR="$STATS" \
MCORE_PROXY_TRACE_FLUSH_STEPS=4 \
    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        "$REPO/examples/train_step_cpu.py" --tokens "$WORK/tokens.npy" --ep 2 --steps 8

ls -l "$STATS"
python -m mcore_proxy stats merge "$STATS" -o "$WORK/routing_stats.safetensors"
python -m mcore_proxy stats show "$WORK/routing_stats.safetensors" --png "$WORK/png"
echo "statistics: $WORK/routing_stats.safetensors (+ .json); heatmaps: $WORK/png"
