"""Memory of the most loaded device for Megatron training at a parallel layout (bytes).

Weights, gradients and optimizer state follow Megatron's distributed optimizer
(NVIDIA/Megatron-LM docs/source/api-guide/dist_optimizer.md: bytes per parameter 18 -> 6 + 12/d
for bf16 parameters with fp32 gradients, 20 -> 4 + 16/d for fp16, 16 -> 8 + 8/d for fp32, where
d is the data-parallel size). Dense parameters shard their optimizer state over the data-parallel
group, routed experts over the expert-data-parallel group (devices / (PP x EP x ETP)).

Activations are the tensors one transformer layer keeps for its backward pass, per token, with
flash attention (no score matrix), no dropout masks (dropout 0, as in MoE LLM recipes) and
sequence parallelism when TP > 1 (so every tensor is divided by TP), in the spirit of
Korthikanti et al. 2022 (Megatron-LM megatron/training/theoretical_memory_usage.py) but counted
per tensor so that GQA, MLA, SwiGLU, top-k routing and shared experts show (and, at the same
grain, Gated DeltaNet layers, gated attention, DeepSeek-V4's attention and its hyper-connection
streams, whose mappings keep their n x H input per sublayer). Under the 1F1B
schedule stage s holds PP - s micro-batches in flight; the last stage adds the fp32 logits.
`recompute="full"` keeps only each layer's input plus one layer's working set.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.mcore.spec import ModelSpec
from mcore_proxy.estimate.model import (
    Params,
    all_mtp_params,
    embedding_params,
    final_params,
    gated_linear_unit,
    is_moe,
    compress_ratio,
    layer_params,
    tied,
)

# bytes per parameter: (weight, gradient, optimizer state = fp32 main weights and grads + moments)
_PRECISION = {"bf16": (2, 4, 4), "fp16": (2, 2, 8), "fp32": (4, 4, 0)}
_MOMENTS = {"adam": 8, "sgd": 4}  # fp32 exp_avg + exp_avg_sq; SGD momentum
PRECISIONS, OPTIMIZERS, RECOMPUTE = tuple(_PRECISION), tuple(_MOMENTS), ("none", "full")


@dataclass(frozen=True)
class Training:
    """What a training step holds besides the model: precision, optimizer, batch, recompute."""

    micro_batch: int = 1
    seq_len: int = 4096
    precision: str = "bf16"
    optimizer: str = "adam"
    recompute: str = "none"

    def __post_init__(self):
        if self.precision not in _PRECISION:
            raise ProxyError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.optimizer not in _MOMENTS:
            raise ProxyError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.recompute not in RECOMPUTE:
            raise ProxyError(f"--recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.micro_batch < 1 or self.seq_len < 1:
            raise ProxyError(f"--micro-batch {self.micro_batch} and --seq-len {self.seq_len} must be >= 1")

    @property
    def bytes_per_param(self) -> tuple[int, int, int]:
        weight, grad, master = _PRECISION[self.precision]
        return weight, grad, master + _MOMENTS[self.optimizer]


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout: devices = TP x PP x DP, and TP x DP = EP x ETP x EDP."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    stages: tuple[int, ...]  # decoder layers per pipeline stage

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.ep * self.etp)

    def describe(self) -> str:
        text = f"TP={self.tp} PP={self.pp} EP={self.ep} ETP={self.etp} DP={self.dp}"
        if len(set(self.stages)) == 1:
            return text
        head = self.stages[:-1]  # Megatron's uneven split: equal stages and a smaller last one
        equal = f"{head[0]}x{len(head)}" if len(set(head)) == 1 else "+".join(map(str, head))
        return f"{text} stages={equal}+{self.stages[-1]}"

    def to_dict(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "etp": self.etp,
            "dp": self.dp,
            "devices": self.devices,
            "stage_layers": list(self.stages),
        }


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...] | None:
    """Layers per stage as Megatron splits them: evenly when PP divides the layers, else equal
    stages of ceil(L/PP) and a smaller last stage (--decoder-last-pipeline-num-layers); None
    when no split leaves every stage a layer."""
    if pp < 1 or pp > num_layers:
        return None
    if num_layers % pp == 0:
        return (num_layers // pp,) * pp
    per = -(-num_layers // pp)
    last = num_layers - per * (pp - 1)
    return (per,) * (pp - 1) + (last,) if last >= 1 else None


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on the most loaded device (the pipeline stage whose total is largest)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    stage: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def to_dict(self) -> dict:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "stage": self.stage,
        }


@lru_cache(maxsize=1024)
def stage_params(a: ModelSpec, stages: tuple[int, ...]) -> tuple[Params, ...]:
    """Parameters each pipeline stage builds: its layers; the first stage the embedding; the last
    the final norm, the output layer and the MTP layers, plus a copy of the word embedding when
    PP > 1 and the output layer is tied to it or MTP layers need it (megatron-core builds both)."""
    out, start = [], 0
    for s, n in enumerate(stages):
        p = Params()
        for layer in range(start, start + n):
            p += layer_params(a, layer)
        start += n
        if s == 0:
            p += embedding_params(a)
        if s == len(stages) - 1:
            p += final_params(a) + all_mtp_params(a)
            if len(stages) > 1 and (tied(a) or a.mtp_layers):
                p += embedding_params(a)
        out.append(p)
    return tuple(out)


def device_params(p: Params, layout: Layout) -> tuple[int, int, int]:
    """(dense, expert, buffer) elements one device of a stage holds."""
    return p.tp // layout.tp + p.replicated, p.expert // (layout.ep * layout.etp), p.buffers


def _attention_activations(a: ModelSpec, layer: int) -> int:
    """Elements per token the token mixer of `layer` keeps (norm input and output included)."""
    h = a.hidden_size
    if a.v4_attention is not None:
        v, nh = a.v4_attention, a.num_attention_heads
        ratio = compress_ratio(a, layer)
        # norm in; wq_a in and q_norm in/out; q, the shared kv; core out = wo_a in; wo_a out = wo_b in
        kept = 2 * h + 2 * v.q_lora_rank + 2 * nh * v.head_dim + 2 * v.head_dim + v.o_groups * v.o_lora_rank
        if ratio:  # the compressor's kv and gate series
            kept += 2 * (2 if ratio == 4 else 1) * v.head_dim
        if ratio == 4:  # the indexer's queries, its compressor and head weights
            kept += v.index_n_heads * v.index_head_dim + 4 * v.index_head_dim + v.index_n_heads
        return kept
    if layer in a.linear_layers:
        g = a.linear_attention
        kd, vd = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
        # norm in, in_proj in; q k v z b a out; conv out; core out; gated norm out = out_proj in
        return 2 * h + (2 * kd + vd) + vd + 2 * g.num_value_heads + (2 * kd + vd) + 2 * vd
    if a.mla is not None:
        m, nh = a.mla, a.num_attention_heads
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        latents = 2 * (m.q_lora_rank or 0) + (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank
        return 2 * h + latents + 2 * nh * qk + 2 * nh * m.v_head_dim  # q, k; v, proj in
    q, kv = a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
    gate = 2 * q if a.attention_output_gate else 0  # the gate, and the gated output
    return 2 * h + q + 2 * kv + q + gate  # norm in, qkv in, q k v, proj in


def layer_activations(a: ModelSpec, layer: int, tokens: int, tp: int, etp: int) -> tuple[int, int]:
    """(elements in the training dtype, fp32 elements) one layer (num_layers + k: MTP layer k)
    keeps per micro-batch on one device (see the module docstring)."""
    h = a.hidden_size
    attention = _attention_activations(a, layer)
    fp32 = a.num_attention_heads  # flash attention's log-sum-exp
    if a.hyper_connections:  # each mHC mapping keeps its n x H input (fp32)
        fp32 += 2 * a.hyper_connections * h
    glu = 2 if gated_linear_unit(a) else 1
    if is_moe(a, layer):
        f, k = a.moe_ffn_hidden_size, a.topk
        mlp = 2 * h + k * (etp * 2 * h + (glu + 1) * f) + (glu + 1) * a.shared_expert_size
        fp32 += 2 * a.num_experts  # router logits and scores
    else:
        mlp = 2 * h + (glu + 1) * a.ffn_hidden_size  # norm in, fc1 in; fc1 out, fc2 in
    return tokens * (attention + mlp) // tp, tokens * fp32 // tp


def stage_activations(a: ModelSpec, layout: Layout, train: Training) -> list[int]:
    """Activation bytes per stage: in-flight micro-batches x layers, plus the last stage's logits."""
    tokens = train.micro_batch * train.seq_len
    item = 4 if train.precision == "fp32" else 2
    out, start = [], 0
    streams = max(1, a.hyper_connections)  # a layer's input: the residual's streams
    for s, n in enumerate(layout.stages):
        layers = list(range(start, start + n))
        start += n
        last = s == len(layout.stages) - 1
        layers += [a.num_layers + k for k in range(a.mtp_layers)] if last else []
        per_layer = [layer_activations(a, layer, tokens, layout.tp, layout.etp) for layer in layers]
        per_layer = [item * e + 4 * f for e, f in per_layer]
        if train.recompute == "full":  # each layer's input, plus one layer rebuilt at a time
            kept = len(per_layer) * item * tokens * streams * a.hidden_size // layout.tp + max(per_layer)
        else:
            kept = sum(per_layer)
        total = (len(layout.stages) - s) * kept  # 1F1B: PP - s micro-batches in flight
        if last:  # fp32 logits of one micro-batch for the main head and each MTP depth
            total += (1 + a.mtp_layers) * 4 * tokens * a.vocab_size // layout.tp
        out.append(total)
    return out


def device_memory(a: ModelSpec, layout: Layout, train: Training) -> DeviceMemory:
    """Weights, gradients, distributed-optimizer state and activations of the most loaded device."""
    weight_b, grad_b, optim_b = train.bytes_per_param
    best = None
    acts = stage_activations(a, layout, train)
    for s, p in enumerate(stage_params(a, layout.stages)):
        dense, expert, buffers = device_params(p, layout)
        mem = DeviceMemory(
            weights=(dense + expert) * weight_b + 4 * buffers,
            gradients=(dense + expert) * grad_b,
            optimizer=-(-dense * optim_b // layout.dp) + -(-expert * optim_b // layout.edp),
            activations=acts[s],
            stage=s,
        )
        if best is None or mem.total > best.total:
            best = mem
    return best
