"""The architecture of a Megatron GPT MoE model and its parameters, counted module by module.

Counts are elements, as megatron-core builds the modules (local or Transformer Engine spec:
the same tensors, fused or not). Each module's parameters are tagged by how Megatron shards
them: split over tensor parallelism (column/row-parallel linears, the vocab-parallel
embedding), whole on every tensor-parallel rank (norms, router, MLA down-projections, the
DeepSeek-V3.2 indexer), routed experts (split by expert over EP, then over ETP), or buffers
(the router's fp32 expert bias, a hash-routed layer's token-to-expert table: saved, not trained).

Beyond GQA and MLA, a layer's token mixer may be Gated DeltaNet linear attention (Qwen3-Next,
Qwen3.5: `LinearAttention`, in `linear_layers`) or DeepSeek-V4's attention (`V4Attention`: one
shared key/value head, a grouped low-rank output projection and per layer a KV compressor of
ratio 4 with a lightning indexer, of ratio 128, or none). Full attention may carry an output gate
(Qwen3-Next, Qwen3.5) and per-head sinks (gpt-oss, DeepSeek-V4); DeepSeek-V4 also widens the
residual stream into `hyper_connections` streams (mHC) and routes its first MoE layers by a
token-id table (`hash_layers`). These tensors are those of transformers' modeling files and the
released checkpoints. Gated DeltaNet shards as megatron-core's (in_proj, conv1d, dt_bias, A_log
and out_proj over TP, the norm whole); DeepSeek-V4's attention as DeepSeek's inference code
splits it over model-parallel ranks (wq_b, wo_a, wo_b, the sinks and the indexer's wq_b and
weights_proj over TP; wq_a, wkv, the compressors, norms and the mHC mappings whole).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.mcore.spec import MLA


# The largest size or count taken from any source (2^31 - 1): far beyond any model's width, expert
# count or vocabulary, and small enough that products of a few of them stay exact in float64-based
# reports and in int64 tensors.
MAX_SIZE = 2**31 - 1


@dataclass(frozen=True)
class Indexer:
    """DeepSeek-V3.2's sparse-attention indexer in every layer: wq_b, wk, k_norm, weights_proj."""

    n_heads: int
    head_dim: int


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (transformers' config names in brackets): in_proj of q, k, v, the output
    gate z and the per-head beta and alpha, a depthwise causal conv over q, k, v, per-head
    dt_bias and A_log, a gated RMSNorm over the value head dim, out_proj."""

    num_key_heads: int  # [linear_num_key_heads]
    num_value_heads: int  # [linear_num_value_heads]
    key_head_dim: int  # [linear_key_head_dim]
    value_head_dim: int  # [linear_value_head_dim]
    conv_kernel: int  # [linear_conv_kernel_dim]


@dataclass(frozen=True)
class V4Attention:
    """DeepSeek-V4's attention: q through a low-rank q_lora_rank (wq_a, q_norm, wq_b), one shared
    key/value head of head_dim (wkv, kv_norm), heads in o_groups groups each projected to
    o_lora_rank (wo_a) and mixed to the hidden size (wo_b), per-head sinks. A layer of compress
    ratio r > 0 adds a KV compressor (wkv, wgate of c*head_dim with c = 2 when r = 4, whose windows
    overlap, else 1; ape [r, c*head_dim]; norm), and r = 4 (compressed sparse attention) a
    lightning indexer (its own compressor at index_head_dim, wq_b, weights_proj)."""

    head_dim: int  # [head_dim]
    q_lora_rank: int  # [q_lora_rank]
    o_groups: int  # [o_groups]
    o_lora_rank: int  # [o_lora_rank]
    index_n_heads: int  # [index_n_heads]
    index_head_dim: int  # [index_head_dim]
    compress_ratios: tuple[int, ...]  # [compress_ratios]: per decoder layer, then per MTP layer


@dataclass(frozen=True)
class Architecture:
    """What fixes the parameter count and the activation size of a GPT MoE model."""

    name: str
    num_layers: int  # decoder layers (MTP layers not included)
    hidden_size: int
    vocab_size: int  # the embedding's rows (Megatron's padded_vocab_size)
    num_attention_heads: int
    num_query_groups: int  # key/value heads (GQA); equal to the heads for MHA
    kv_channels: int  # head dimension of q, k, v (not used with MLA)
    ffn_hidden_size: int  # dense layers' MLP width
    num_experts: int  # routed experts per MoE layer
    moe_ffn_hidden_size: int
    topk: int
    moe_layers: tuple[int, ...]  # 0-based decoder layers with MoE
    shared_expert_size: int = 0  # moe_shared_expert_intermediate_size (all shared experts)
    shared_expert_gate: bool = False
    mtp_layers: int = 0
    tied_embeddings: bool = False
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    gated_linear_unit: bool = True  # SwiGLU: fc1 holds gate and up
    layernorm_bias: bool = False  # LayerNorm (weight and bias) instead of RMSNorm
    expert_bias: bool = False  # aux-loss-free routing: an fp32 bias per expert
    num_groups: int | None = None  # group-limited routing
    group_topk: int | None = None
    score_function: str = "softmax"
    mla: MLA | None = None
    indexer: Indexer | None = None
    linear_attention: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()  # 0-based decoder layers with linear attention (MTP: full)
    attention_output_gate: bool = False  # gated attention: q_proj also yields a per-channel gate
    attention_sinks: bool = False  # a learnable softmax sink per head
    v4_attention: V4Attention | None = None
    hyper_connections: int = 0  # mHC residual streams (hc_mult); 0: a plain residual
    hash_layers: tuple[int, ...] = ()  # MoE layers routed by a [vocab, top-k] token-id table
    source: str = ""  # where these numbers come from

    def __post_init__(self):
        for f in (
            "num_layers",
            "hidden_size",
            "vocab_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "ffn_hidden_size",
            "num_experts",
            "moe_ffn_hidden_size",
            "topk",
        ):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
                shown = repr(value) if len(repr(value)) <= 20 else f"a {len(repr(value))}-character value"
                raise ProxyError(
                    f"{self.source or self.name}: {f} is {shown}, expected an integer in 1..{MAX_SIZE}; "
                    "give a complete model configuration"
                )
        if not self.moe_layers or not all(0 <= L < self.num_layers for L in self.moe_layers):
            raise ProxyError(
                f"{self.source or self.name}: MoE layers {list(self.moe_layers)} are not a "
                f"non-empty subset of 0..{self.num_layers - 1}; estimate needs a MoE model"
            )
        if self.topk > self.num_experts:
            raise ProxyError(f"{self.source or self.name}: top-k {self.topk} exceeds the {self.num_experts} experts")
        where = self.source or self.name
        if self.linear_layers and (
            self.linear_attention is None or not all(0 <= L < self.num_layers for L in self.linear_layers)
        ):
            raise ProxyError(
                f"{where}: linear-attention layers {list(self.linear_layers)} need the linear_* "
                f"head sizes and must lie in 0..{self.num_layers - 1}"
            )
        if not set(self.hash_layers) <= set(self.moe_layers):
            raise ProxyError(f"{where}: hash-routed layers {list(self.hash_layers)} are not all MoE layers")
        if self.v4_attention is not None and len(self.v4_attention.compress_ratios) < self.num_layers:
            raise ProxyError(
                f"{where}: {len(self.v4_attention.compress_ratios)} compress ratios for "
                f"{self.num_layers} layers; give one per decoder layer"
            )

    def with_experts(self, k: int) -> "Architecture":
        """The proxy: the same model with K routed experts per MoE layer."""
        return dataclasses.replace(self, num_experts=k)

    @property
    def mtp_is_moe(self) -> bool:
        """Megatron builds MTP layers with the last decoder layer's spec."""
        return (self.num_layers - 1) in self.moe_layers

    def is_moe(self, layer: int) -> bool:
        """Layer `layer` (0-based; num_layers + k is MTP layer k) has a MoE block."""
        return self.mtp_is_moe if layer >= self.num_layers else layer in self.moe_layers

    def compress_ratio(self, layer: int) -> int:
        """DeepSeek-V4: the layer's KV compress ratio; an MTP layer without its own ratio takes the
        last decoder layer's (Megatron's MTP spec is the last layer's)."""
        ratios = self.v4_attention.compress_ratios
        return ratios[layer] if layer < len(ratios) else ratios[self.num_layers - 1]

    @property
    def attention_kind(self) -> str:
        if self.v4_attention is not None:
            return "V4 (CSA/HCA)"
        kind = "MLA" if self.mla else "GQA" if self.num_query_groups < self.num_attention_heads else "MHA"
        return f"{kind} + linear (Gated DeltaNet)" if self.linear_layers else kind


@dataclass(frozen=True)
class Params:
    """Parameter elements grouped by how Megatron shards them."""

    tp: int = 0  # split over tensor-parallel ranks
    replicated: int = 0  # whole on every tensor-parallel rank
    expert: int = 0  # routed experts: split over EP (by expert) x ETP
    buffers: int = 0  # not trained (router expert bias, fp32)

    def __add__(self, other: "Params") -> "Params":
        return Params(
            self.tp + other.tp,
            self.replicated + other.replicated,
            self.expert + other.expert,
            self.buffers + other.buffers,
        )

    def times(self, n: int) -> "Params":
        return Params(self.tp * n, self.replicated * n, self.expert * n, self.buffers * n)

    @property
    def trained(self) -> int:
        return self.tp + self.replicated + self.expert

    @property
    def total(self) -> int:
        return self.trained + self.buffers


def _norm(a: Architecture, width: int) -> int:
    return width * (2 if a.layernorm_bias else 1)


def _hyper_connection(a: Architecture) -> int:
    """One mHC mapping: fn [(2 + n) n, n H], base [(2 + n) n], scale [3] (pre, post, comb)."""
    n = a.hyper_connections
    return (2 + n) * n * n * a.hidden_size + (2 + n) * n + 3 if n else 0


def _hyper_head(a: Architecture) -> int:
    """The final collapse of the n streams: hc_head fn [n, n H], base [n], scale [1]."""
    n = a.hyper_connections
    return n * n * a.hidden_size + n + 1 if n else 0


def _v4_attention(a: Architecture, layer: int) -> Params:
    v, h, nh = a.v4_attention, a.hidden_size, a.num_attention_heads
    replicated = v.q_lora_rank * h + v.q_lora_rank + v.head_dim * h + v.head_dim  # wq_a, q_norm, wkv, kv_norm
    tp = nh * v.head_dim * v.q_lora_rank  # wq_b
    tp += v.o_groups * v.o_lora_rank * (nh * v.head_dim // v.o_groups) + h * v.o_groups * v.o_lora_rank  # wo_a, wo_b
    ratio = a.compress_ratio(layer)

    def compressor(dim: int) -> int:
        c = 2 if ratio == 4 else 1  # ratio 4 windows overlap: two series per token
        return ratio * c * dim + 2 * c * dim * h + dim  # ape, wkv, wgate, norm

    if ratio:
        replicated += compressor(v.head_dim)
    if ratio == 4:  # compressed sparse attention: the lightning indexer
        replicated += compressor(v.index_head_dim)
        tp += v.index_n_heads * v.index_head_dim * v.q_lora_rank + v.index_n_heads * h  # wq_b, weights_proj
    return Params(tp=tp, replicated=replicated)


def _linear_attention(a: Architecture) -> Params:
    g, h = a.linear_attention, a.hidden_size
    kd, vd = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    conv = 2 * kd + vd  # the channels the causal conv runs over: q, k, v
    tp = h * (conv + vd + 2 * g.num_value_heads)  # in_proj: q, k, v, z (gate), b (beta), a (alpha)
    tp += conv * g.conv_kernel + 2 * g.num_value_heads + vd * h  # conv1d, dt_bias, A_log, out_proj
    return Params(tp=tp, replicated=g.value_head_dim)  # the gated RMSNorm over a value head


def attention_params(a: Architecture, layer: int = 0) -> Params:
    """Input norm and token mixer of layer `layer` (num_layers + k: MTP layer k), with its mHC
    mappings when the residual has several streams."""
    h = a.hidden_size
    replicated = _norm(a, h) + 2 * _hyper_connection(a)  # mHC before attention and before the MLP
    tp = 0
    if a.v4_attention is not None:
        p = _v4_attention(a, layer)
        tp, replicated = tp + p.tp, replicated + p.replicated
    elif layer in a.linear_layers:
        p = _linear_attention(a)
        tp, replicated = tp + p.tp, replicated + p.replicated
    elif a.mla is not None:
        m, nh = a.mla, a.num_attention_heads
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank:  # down-projections are replicated (TE spec, MindSpeed's LinearNoTP)
            replicated += m.q_lora_rank * h + (_norm(a, m.q_lora_rank) if a.qk_layernorm else 0)
            tp = nh * qk * m.q_lora_rank
        else:
            tp = nh * qk * h
        replicated += (m.kv_lora_rank + m.qk_pos_emb_head_dim) * h
        replicated += _norm(a, m.kv_lora_rank) if a.qk_layernorm else 0
        tp += nh * (m.qk_head_dim + m.v_head_dim) * m.kv_lora_rank + h * nh * m.v_head_dim
    else:
        q, kv = a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
        qkv = q * (2 if a.attention_output_gate else 1) + 2 * kv  # the gate rides in linear_qkv
        tp = qkv * h + q * h
        tp += qkv if (a.add_bias_linear or a.add_qkv_bias) else 0
        replicated += 2 * _norm(a, a.kv_channels) if a.qk_layernorm else 0
    if a.attention_sinks or a.v4_attention is not None:
        tp += a.num_attention_heads
    if a.v4_attention is None and layer not in a.linear_layers:
        replicated += h if a.add_bias_linear else 0  # linear_proj bias
    if a.indexer is not None:
        i, q_rank = a.indexer, (a.mla.q_lora_rank if a.mla and a.mla.q_lora_rank else h)
        replicated += i.n_heads * i.head_dim * q_rank + i.head_dim * h + 2 * i.head_dim + i.n_heads * h
    return Params(tp=tp, replicated=replicated)


def _mlp(a: Architecture, width: int, bias: bool) -> int:
    """fc1 (gate and up with GLU) and fc2 of an MLP of `width`, with their biases."""
    fc1 = (2 if a.gated_linear_unit else 1) * width
    return (fc1 + width) * a.hidden_size + ((fc1 + a.hidden_size) if bias else 0)


def mlp_params(a: Architecture, moe: bool, hashed: bool = False) -> Params:
    """Pre-MLP norm and the dense MLP, or the MoE block (router, routed and shared experts). A
    hash-routed block keeps a [vocab, top-k] token-to-expert table instead of an expert bias."""
    h = a.hidden_size
    norm = Params(replicated=_norm(a, h))
    if not moe:
        bias_fc2 = h if a.add_bias_linear else 0  # the row-parallel bias is replicated
        return norm + Params(tp=_mlp(a, a.ffn_hidden_size, a.add_bias_linear) - bias_fc2, replicated=bias_fc2)
    router = a.num_experts * (h + (1 if a.add_bias_linear else 0))
    buffers = a.vocab_size * a.topk if hashed else a.num_experts if a.expert_bias else 0
    block = Params(
        replicated=router, expert=a.num_experts * _mlp(a, a.moe_ffn_hidden_size, a.add_bias_linear), buffers=buffers
    )
    if a.shared_expert_size:  # megatron-core refuses biases in shared experts
        block += Params(tp=_mlp(a, a.shared_expert_size, False), replicated=h if a.shared_expert_gate else 0)
    return norm + block


def layer_params(a: Architecture, layer: int) -> Params:
    """One decoder layer (0-based; num_layers + k: MTP layer k's transformer layer)."""
    return attention_params(a, layer) + mlp_params(a, a.is_moe(layer), layer in a.hash_layers)


def mtp_params(a: Architecture, depth: int = 0) -> Params:
    """One MTP layer: enorm, hnorm, eh_proj [H, 2H] (column-parallel; DeepSeek-V4 splits it into
    e_proj and h_proj of [H, H]), a transformer layer, final norm, and with mHC its own hc_head."""
    h = a.hidden_size
    layer = layer_params(a, a.num_layers + depth)
    return layer + Params(tp=2 * h * h, replicated=3 * _norm(a, h) + _hyper_head(a))


def all_mtp_params(a: Architecture) -> Params:
    p = Params()
    for depth in range(a.mtp_layers):
        p += mtp_params(a, depth)
    return p


def embedding_params(a: Architecture) -> Params:
    return Params(tp=a.vocab_size * a.hidden_size)


def final_params(a: Architecture) -> Params:
    """Final norm (after the mHC head collapses the streams) and the output layer (absent when
    tied to the embedding)."""
    out = Params(replicated=_norm(a, a.hidden_size) + _hyper_head(a))
    return out if a.tied_embeddings else out + Params(tp=a.vocab_size * a.hidden_size)


@dataclass(frozen=True)
class ParameterCount:
    """Unique parameters of a model (embedding counted once), in elements."""

    total: int  # everything a checkpoint stores, buffers included
    experts: int  # routed experts
    non_expert: int  # everything else (attention, norms, router, shared experts, embeddings, MTP)
    buffers: int  # of non_expert: not trained (router expert bias)


def count_parameters(a: Architecture) -> ParameterCount:
    p = embedding_params(a) + final_params(a) + all_mtp_params(a)
    for layer in range(a.num_layers):
        p += layer_params(a, layer)
    return ParameterCount(total=p.total, experts=p.expert, non_expert=p.total - p.expert, buffers=p.buffers)


def activated_parameters(a: Architecture) -> int:
    """Trained parameters one token of the main model goes through: every layer, its top-k routed
    experts, the final norm and the output layer; not the embedding table (a row lookup, no
    product) nor the MTP layers. The count model cards publish as "activated" (DeepSeek-V3's
    37 B, gpt-oss-120b's 5.13 B)."""
    active = final_params(a).trained
    for layer in range(a.num_layers):
        p = layer_params(a, layer)
        active += p.trained - p.expert + (p.expert * a.topk // a.num_experts if a.is_moe(layer) else 0)
    return active


def expert_flops_per_token(a: Architecture) -> int:
    """Forward FLOPs of the routed experts per token (2 per multiply-add): top-k experts of
    fc1 + fc2 in every MoE layer, MTP included. Does not depend on the number of experts."""
    per_expert = 2 * _mlp(a, a.moe_ffn_hidden_size, False)
    moe_layers = len(a.moe_layers) + (a.mtp_layers if a.mtp_is_moe else 0)
    return a.topk * per_expert * moe_layers
