"""The architecture of a Megatron GPT MoE model and its parameters, counted module by module.

Counts are elements, as megatron-core builds the modules (local or Transformer Engine spec:
the same tensors, fused or not). Each module's parameters are tagged by how Megatron shards
them: split over tensor parallelism (column/row-parallel linears, the vocab-parallel
embedding), whole on every tensor-parallel rank (norms, router, MLA down-projections, the
DeepSeek-V3.2 indexer), routed experts (split by expert over EP, then over ETP), or buffers
(the router's fp32 expert bias: saved, not trained).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcore_proxy.errors import ProxyError


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention sizes (Megatron argument names; DeepSeek's config names in brackets)."""

    q_lora_rank: int | None      # [q_lora_rank]; None: no query compression (linear_q_proj)
    kv_lora_rank: int            # [kv_lora_rank]
    qk_head_dim: int             # [qk_nope_head_dim]
    qk_pos_emb_head_dim: int     # [qk_rope_head_dim]
    v_head_dim: int              # [v_head_dim]


@dataclass(frozen=True)
class Indexer:
    """DeepSeek-V3.2's sparse-attention indexer in every layer: wq_b, wk, k_norm, weights_proj."""

    n_heads: int
    head_dim: int


@dataclass(frozen=True)
class Architecture:
    """What fixes the parameter count and the activation size of a GPT MoE model."""

    name: str
    num_layers: int                  # decoder layers (MTP layers not included)
    hidden_size: int
    vocab_size: int                  # the embedding's rows (Megatron's padded_vocab_size)
    num_attention_heads: int
    num_query_groups: int            # key/value heads (GQA); equal to the heads for MHA
    kv_channels: int                 # head dimension of q, k, v (not used with MLA)
    ffn_hidden_size: int             # dense layers' MLP width
    num_experts: int                 # routed experts per MoE layer
    moe_ffn_hidden_size: int
    topk: int
    moe_layers: tuple[int, ...]      # 0-based decoder layers with MoE
    shared_expert_size: int = 0      # moe_shared_expert_intermediate_size (all shared experts)
    shared_expert_gate: bool = False
    mtp_layers: int = 0
    tied_embeddings: bool = False
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    gated_linear_unit: bool = True   # SwiGLU: fc1 holds gate and up
    layernorm_bias: bool = False     # LayerNorm (weight and bias) instead of RMSNorm
    expert_bias: bool = False        # aux-loss-free routing: an fp32 bias per expert
    num_groups: int | None = None    # group-limited routing
    group_topk: int | None = None
    score_function: str = "softmax"
    mla: MLA | None = None
    indexer: Indexer | None = None
    source: str = ""                 # where these numbers come from

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size", "topk"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ProxyError(f"{self.source or self.name}: {f} is {getattr(self, f)!r}, expected a "
                                 "positive integer; give a complete model configuration")
        if not self.moe_layers or not all(0 <= L < self.num_layers for L in self.moe_layers):
            raise ProxyError(f"{self.source or self.name}: MoE layers {list(self.moe_layers)} are not a "
                             f"non-empty subset of 0..{self.num_layers - 1}; estimate needs a MoE model")
        if self.topk > self.num_experts:
            raise ProxyError(f"{self.source or self.name}: top-k {self.topk} exceeds the "
                             f"{self.num_experts} experts")

    def with_experts(self, k: int) -> "Architecture":
        """The proxy: the same model with K routed experts per MoE layer."""
        return dataclasses.replace(self, num_experts=k)

    @property
    def mtp_is_moe(self) -> bool:
        """Megatron builds MTP layers with the last decoder layer's spec."""
        return (self.num_layers - 1) in self.moe_layers


@dataclass(frozen=True)
class Params:
    """Parameter elements grouped by how Megatron shards them."""

    tp: int = 0           # split over tensor-parallel ranks
    replicated: int = 0   # whole on every tensor-parallel rank
    expert: int = 0       # routed experts: split over EP (by expert) x ETP
    buffers: int = 0      # not trained (router expert bias, fp32)

    def __add__(self, other: "Params") -> "Params":
        return Params(self.tp + other.tp, self.replicated + other.replicated,
                      self.expert + other.expert, self.buffers + other.buffers)

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


def attention_params(a: Architecture) -> Params:
    """Input norm and self-attention of one layer."""
    h = a.hidden_size
    replicated = _norm(a, h)
    if a.mla is not None:
        m, nh = a.mla, a.num_attention_heads
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank:      # down-projections are replicated (TE spec, MindSpeed's LinearNoTP)
            replicated += m.q_lora_rank * h + (_norm(a, m.q_lora_rank) if a.qk_layernorm else 0)
            tp = nh * qk * m.q_lora_rank
        else:
            tp = nh * qk * h
        replicated += (m.kv_lora_rank + m.qk_pos_emb_head_dim) * h
        replicated += _norm(a, m.kv_lora_rank) if a.qk_layernorm else 0
        tp += nh * (m.qk_head_dim + m.v_head_dim) * m.kv_lora_rank + h * nh * m.v_head_dim
    else:
        q, kv = a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
        tp = (q + 2 * kv) * h + q * h
        tp += (q + 2 * kv) if (a.add_bias_linear or a.add_qkv_bias) else 0
        replicated += 2 * _norm(a, a.kv_channels) if a.qk_layernorm else 0
    replicated += h if a.add_bias_linear else 0                     # linear_proj bias
    if a.indexer is not None:
        i, q_rank = a.indexer, (a.mla.q_lora_rank if a.mla and a.mla.q_lora_rank else h)
        replicated += i.n_heads * i.head_dim * q_rank + i.head_dim * h + 2 * i.head_dim + i.n_heads * h
    return Params(tp=tp, replicated=replicated)


def _mlp(a: Architecture, width: int, bias: bool) -> int:
    """fc1 (gate and up with GLU) and fc2 of an MLP of `width`, with their biases."""
    fc1 = (2 if a.gated_linear_unit else 1) * width
    return (fc1 + width) * a.hidden_size + ((fc1 + a.hidden_size) if bias else 0)


def mlp_params(a: Architecture, moe: bool) -> Params:
    """Pre-MLP norm and the dense MLP, or the MoE block (router, routed and shared experts)."""
    h = a.hidden_size
    norm = Params(replicated=_norm(a, h))
    if not moe:
        bias_fc2 = h if a.add_bias_linear else 0   # the row-parallel bias is replicated
        return norm + Params(tp=_mlp(a, a.ffn_hidden_size, a.add_bias_linear) - bias_fc2, replicated=bias_fc2)
    router = a.num_experts * (h + (1 if a.add_bias_linear else 0))
    block = Params(replicated=router,
                   expert=a.num_experts * _mlp(a, a.moe_ffn_hidden_size, a.add_bias_linear),
                   buffers=a.num_experts if a.expert_bias else 0)
    if a.shared_expert_size:   # megatron-core refuses biases in shared experts
        block += Params(tp=_mlp(a, a.shared_expert_size, False), replicated=h if a.shared_expert_gate else 0)
    return norm + block


def layer_params(a: Architecture, layer: int) -> Params:
    """One decoder layer (0-based)."""
    return attention_params(a) + mlp_params(a, layer in a.moe_layers)


def mtp_params(a: Architecture) -> Params:
    """One MTP layer: enorm, hnorm, eh_proj [H, 2H] (column-parallel), a transformer layer, final norm."""
    h = a.hidden_size
    layer = attention_params(a) + mlp_params(a, a.mtp_is_moe)
    return layer + Params(tp=2 * h * h, replicated=3 * _norm(a, h))


def embedding_params(a: Architecture) -> Params:
    return Params(tp=a.vocab_size * a.hidden_size)


def final_params(a: Architecture) -> Params:
    """Final norm and the output layer (absent when tied to the embedding)."""
    out = Params(replicated=_norm(a, a.hidden_size))
    return out if a.tied_embeddings else out + Params(tp=a.vocab_size * a.hidden_size)


@dataclass(frozen=True)
class ParameterCount:
    """Unique parameters of a model (embedding counted once), in elements."""

    total: int        # everything a checkpoint stores, buffers included
    experts: int      # routed experts
    non_expert: int   # everything else (attention, norms, router, shared experts, embeddings, MTP)
    buffers: int      # of non_expert: not trained (router expert bias)


def count_parameters(a: Architecture) -> ParameterCount:
    p = embedding_params(a) + final_params(a) + mtp_params(a).times(a.mtp_layers)
    for layer in range(a.num_layers):
        p += layer_params(a, layer)
    return ParameterCount(total=p.total, experts=p.expert, non_expert=p.total - p.expert, buffers=p.buffers)


def expert_flops_per_token(a: Architecture) -> int:
    """Forward FLOPs of the routed experts per token (2 per multiply-add): top-k experts of
    fc1 + fc2 in every MoE layer, MTP included. Does not depend on the number of experts."""
    per_expert = 2 * _mlp(a, a.moe_ffn_hidden_size, False)
    moe_layers = len(a.moe_layers) + (a.mtp_layers if a.mtp_is_moe else 0)
    return a.topk * per_expert * moe_layers
