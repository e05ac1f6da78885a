#!/bin/bash
# Train the proxy of a MoE checkpoint from a launch script shaped like MindSpeed-LLM's
# (examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh, examples/mcore/qwen3_moe/*_ptd.sh):
# the original model's argument blocks stay as they are; two things are added,
#   1. `mcore-proxy convert` writes the proxy and prints the launch flags that must change,
#   2. those flags go last on the torchrun line (argparse keeps the last value of a flag).
#
#   bash examples/train_proxy_mindspeed_ptd.sh [CKPT [PLAN [WORKDIR]]]
#       default: the quickstart's out/quickstart/original and plan.json, WORKDIR out/proxy_train
#   LAUNCHER=mindspeed MINDSPEED_LLM=/path/to/MindSpeed-LLM bash examples/train_proxy_mindspeed_ptd.sh ...
#
# LAUNCHER=cpu (default) runs here: megatron-core on gloo CPU ranks, with examples/pretrain_gpt_cpu.py
# in place of MindSpeed-LLM's pretrain_gpt.py (it takes the same argument names used below).
# LAUNCHER=mindspeed is the same launch on Ascend NPUs with MindSpeed-LLM; it cannot run here.
# The blocks describe the quickstart's model (a tiny DeepSeek-like MoE: 16 experts in 4 groups,
# top-4 sigmoid with expert bias, a shared expert, a dense first layer, TP=1 PP=2 EP=2 with
# stages of 1 and 3 layers); for your model, paste your own script's blocks.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CKPT_LOAD_DIR="${1:-$REPO/out/quickstart/original}"
PLAN="${2:-$REPO/out/quickstart/plan.json}"
WORK="${3:-$REPO/out/proxy_train}"
LAUNCHER="${LAUNCHER:-cpu}"
# the interpreter the README's commands set up (tools/install.sh --dry-run only reports it)
PY="${PYTHON:-$(bash "$REPO/tools/install.sh" --dry-run 2>/dev/null)}"
"$PY" -c "import mcore_proxy" 2>/dev/null \
  || { echo "train_proxy: $PY cannot import mcore_proxy; run 'bash tools/install.sh' first or set PYTHON" >&2; exit 2; }
for f in "$CKPT_LOAD_DIR" "$PLAN"; do
  [ -e "$f" ] || { echo "train_proxy: $f does not exist; run 'bash examples/quickstart.sh' first or pass CKPT PLAN" >&2; exit 2; }
done
mkdir -p "$WORK"

NPUS_PER_NODE=2          # CPU ranks here; 8 (or 16 on A3) NPUs per node on Ascend
MASTER_ADDR=localhost
MASTER_PORT="${MASTER_PORT:-6000}"
NNODES=1
NODE_RANK=0
WORLD_SIZE=$((NPUS_PER_NODE * NNODES))

PROXY_DIR="$WORK/proxy"
CKPT_SAVE_DIR="$WORK/save"
DATA_PATH="your data path"
TOKENIZER_PATH="your tokenizer path"

# the proxy's layout: expert parallelism halved (2 -> 1), everything else as the original
TP=1
PP=2
EP=1

# 1. the proxy checkpoint, and the flags that change for it
"$PY" -m mcore_proxy convert "$CKPT_LOAD_DIR" --plan "$PLAN" -o "$PROXY_DIR" \
    --target-tp "$TP" --target-pp "$PP" --target-ep "$EP" | tee "$WORK/convert.log"
PROXY_ARGS="$(sed -n '/with these flags changed:$/{n;s/^ *//;p;}' "$WORK/convert.log")"
[ -n "$PROXY_ARGS" ] || { echo "train_proxy: no launch flags in $WORK/convert.log" >&2; exit 1; }
echo "proxy launch flags: $PROXY_ARGS"
flag_value() { sed -n "s/.*$1 \([^ ]*\).*/\1/p" <<< "$PROXY_ARGS"; }

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

# the original model, as its own launch script has it
MOE_ARGS="
    --num-experts 16 \
    --moe-router-topk 4 \
    --moe-ffn-hidden-size 16 \
    --moe-layer-freq [0,1,1,1] \
    --moe-shared-expert-intermediate-size 24 \
    --moe-shared-expert-gate \
    --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias \
    --moe-router-num-groups 4 \
    --moe-router-group-topk 2
"

GPT_ARGS="
    --num-layers 4 \
    --hidden-size 32 \
    --ffn-hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 16 \
    --max-position-embeddings 16 \
    --make-vocab-size-divisible-by 1 \
    --padded-vocab-size 128 \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --swiglu
"

MODEL_PARALLEL_ARGS="
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 2 \
    --expert-model-parallel-size 2 \
    --decoder-first-pipeline-num-layers 1
"

TRAIN_ARGS="
    --micro-batch-size 2 \
    --global-batch-size 4 \
    --train-iters 6 \
    --lr 1.0e-2 \
    --seed 42
"

OUTPUT_ARGS="
    --log-interval 1
"

if [ "$LAUNCHER" = mindspeed ]; then
    # 2. MindSpeed-LLM on Ascend NPUs. Its own group-limited router (noaux_tc) reads --n-group and
    #    --topk-group: they get the proxy's groups, or routing over fewer experts silently changes.
    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
    MINDSPEED_ARGS="
        --use-mcore-models \
        --use-flash-attn \
        --use-fused-rmsnorm \
        --use-fused-swiglu \
        --use-fused-rotary-pos-emb \
        --use-distributed-optimizer \
        --moe-token-dispatcher-type alltoall_seq \
        --moe-router-load-balancing-type noaux_tc \
        --n-group $(flag_value --moe-router-num-groups) \
        --topk-group $(flag_value --moe-router-group-topk) \
        --bf16 \
        --tokenizer-type PretrainedFromHF \
        --tokenizer-name-or-path $TOKENIZER_PATH \
        --data-path $DATA_PATH \
        --split 100,0,0 \
        --save-interval 2000 \
        --eval-iters 0 \
        --distributed-backend nccl
    "
    cd "${MINDSPEED_LLM:?set MINDSPEED_LLM to your MindSpeed-LLM checkout}"
    mkdir -p logs
    torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
        $GPT_ARGS \
        $MOE_ARGS \
        $MODEL_PARALLEL_ARGS \
        $TRAIN_ARGS \
        $OUTPUT_ARGS \
        $MINDSPEED_ARGS \
        $PROXY_ARGS \
        --load "$PROXY_DIR" \
        --save "$CKPT_SAVE_DIR" \
        | tee logs/train_proxy_ptd.log
else
    # 2. the same launch on CPU: megatron-core in gloo ranks. megatron-core wraps its fused ops in
    #    torch.compile; on CPU their first call compiles C++ kernels, which costs more than these
    #    few iterations (same losses without it)
    export PYTHONWARNINGS=ignore TORCHDYNAMO_DISABLE=1
    "$PY" -m torch.distributed.run $DISTRIBUTED_ARGS "$REPO/examples/pretrain_gpt_cpu.py" \
        $GPT_ARGS \
        $MOE_ARGS \
        $MODEL_PARALLEL_ARGS \
        $TRAIN_ARGS \
        $OUTPUT_ARGS \
        --mock-data \
        $PROXY_ARGS \
        --load "$PROXY_DIR" \
        --distributed-backend gloo \
        | tee "$WORK/train.log"
fi
