"""The parameters of a Megatron GPT MoE model, counted module by module from its ModelSpec
(`mcore/spec.py`; `architecture` checks it holds every size a count needs).

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
from mcore_proxy.mcore.spec import MAX_SIZE, ModelSpec


# the sizes and counts every estimate needs, each an integer in 1..MAX_SIZE
_SIZES = (
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
)


def architecture(**fields) -> ModelSpec:
    """The ModelSpec `estimate` counts, from its fields, once they are complete: every size of
    `_SIZES` an integer in 1..MAX_SIZE, a non-empty set of MoE layers, linear-attention layers with
    their head sizes, hash-routed layers among the MoE ones, a compress ratio per layer. ProxyError
    naming the source and the field otherwise. Layers are real ones (MindSpeed's no-op layers
    taken out), 0-based."""
    where = fields.get("source") or fields.get("name") or "model"
    for f in _SIZES:
        value = fields.get(f)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            shown = repr(value) if len(repr(value)) <= 20 else f"a {len(repr(value))}-character value"
            raise ProxyError(
                f"{where}: {f} is {shown}, expected an integer in 1..{MAX_SIZE}; give a complete model configuration"
            )
    layers, moe = fields["num_layers"], tuple(fields.get("moe_layers") or ())
    if not moe or not all(0 <= L < layers for L in moe):
        raise ProxyError(
            f"{where}: MoE layers {list(moe)} are not a non-empty subset of 0..{layers - 1}; estimate needs a MoE model"
        )
    if fields["topk"] > fields["num_experts"]:
        raise ProxyError(f"{where}: top-k {fields['topk']} exceeds the {fields['num_experts']} experts")
    linear = fields.get("linear_layers") or ()
    if linear and (fields.get("linear_attention") is None or not all(0 <= L < layers for L in linear)):
        raise ProxyError(
            f"{where}: linear-attention layers {list(linear)} need the linear_* "
            f"head sizes and must lie in 0..{layers - 1}"
        )
    if not set(fields.get("hash_layers") or ()) <= set(moe):
        raise ProxyError(f"{where}: hash-routed layers {list(fields['hash_layers'])} are not all MoE layers")
    v4 = fields.get("v4_attention")
    if v4 is not None and len(v4.compress_ratios) < layers:
        raise ProxyError(
            f"{where}: {len(v4.compress_ratios)} compress ratios for {layers} layers; give one per decoder layer"
        )
    # a width estimate multiplies: no shared experts is 0 (ModelSpec's None: the args did not say)
    return ModelSpec(**{**fields, "shared_expert_size": fields.get("shared_expert_size") or 0})


def with_experts(a: ModelSpec, k: int) -> ModelSpec:
    """The proxy: the same model with K routed experts per MoE layer."""
    return dataclasses.replace(a, num_experts=k)


def tied(a: ModelSpec) -> bool:
    """The output layer is the word embedding: only where the source says so."""
    return a.untie_embeddings is False


def is_moe(a: ModelSpec, layer: int) -> bool:
    """Layer `layer` (0-based; num_layers + k is MTP layer k) has a MoE block."""
    return a.mtp_is_moe if layer >= a.num_layers else layer in a.moe_layers


def compress_ratio(a: ModelSpec, layer: int) -> int:
    """DeepSeek-V4: the layer's KV compress ratio; an MTP layer without its own ratio takes the
    last decoder layer's (Megatron's MTP spec is the last layer's)."""
    ratios = a.v4_attention.compress_ratios
    return ratios[layer] if layer < len(ratios) else ratios[a.num_layers - 1]


def attention_kind(a: ModelSpec) -> str:
    if a.v4_attention is not None:
        return "V4 (CSA/HCA)"
    kind = "MLA" if a.mla else "GQA" if a.num_query_groups < a.num_attention_heads else "MHA"
    return f"{kind} + linear (Gated DeltaNet)" if a.linear_layers else kind


def gated_linear_unit(a: ModelSpec) -> bool:
    """fc1 holds gate and up (SwiGLU, GeGLU)."""
    return a.activation != "gelu"


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


def _norm(a: ModelSpec, width: int) -> int:
    return width * (2 if a.normalization == "LayerNorm" else 1)


def _hyper_connection(a: ModelSpec) -> int:
    """One mHC mapping: fn [(2 + n) n, n H], base [(2 + n) n], scale [3] (pre, post, comb)."""
    n = a.hyper_connections
    return (2 + n) * n * n * a.hidden_size + (2 + n) * n + 3 if n else 0


def _hyper_head(a: ModelSpec) -> int:
    """The final collapse of the n streams: hc_head fn [n, n H], base [n], scale [1]."""
    n = a.hyper_connections
    return n * n * a.hidden_size + n + 1 if n else 0


def _v4_attention(a: ModelSpec, layer: int) -> Params:
    v, h, nh = a.v4_attention, a.hidden_size, a.num_attention_heads
    replicated = v.q_lora_rank * h + v.q_lora_rank + v.head_dim * h + v.head_dim  # wq_a, q_norm, wkv, kv_norm
    tp = nh * v.head_dim * v.q_lora_rank  # wq_b
    tp += v.o_groups * v.o_lora_rank * (nh * v.head_dim // v.o_groups) + h * v.o_groups * v.o_lora_rank  # wo_a, wo_b
    ratio = compress_ratio(a, layer)

    def compressor(dim: int) -> int:
        c = 2 if ratio == 4 else 1  # ratio 4 windows overlap: two series per token
        return ratio * c * dim + 2 * c * dim * h + dim  # ape, wkv, wgate, norm

    if ratio:
        replicated += compressor(v.head_dim)
    if ratio == 4:  # compressed sparse attention: the lightning indexer
        replicated += compressor(v.index_head_dim)
        tp += v.index_n_heads * v.index_head_dim * v.q_lora_rank + v.index_n_heads * h  # wq_b, weights_proj
    return Params(tp=tp, replicated=replicated)


def _linear_attention(a: ModelSpec) -> Params:
    g, h = a.linear_attention, a.hidden_size
    kd, vd = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    conv = 2 * kd + vd  # the channels the causal conv runs over: q, k, v
    tp = h * (conv + vd + 2 * g.num_value_heads)  # in_proj: q, k, v, z (gate), b (beta), a (alpha)
    tp += conv * g.conv_kernel + 2 * g.num_value_heads + vd * h  # conv1d, dt_bias, A_log, out_proj
    return Params(tp=tp, replicated=g.value_head_dim)  # the gated RMSNorm over a value head


def attention_params(a: ModelSpec, layer: int = 0) -> Params:
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


def _mlp(a: ModelSpec, width: int, bias: bool) -> int:
    """fc1 (gate and up with GLU) and fc2 of an MLP of `width`, with their biases."""
    fc1 = (2 if gated_linear_unit(a) else 1) * width
    return (fc1 + width) * a.hidden_size + ((fc1 + a.hidden_size) if bias else 0)


def mlp_params(a: ModelSpec, moe: bool, hashed: bool = False) -> Params:
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


def layer_params(a: ModelSpec, layer: int) -> Params:
    """One decoder layer (0-based; num_layers + k: MTP layer k's transformer layer)."""
    return attention_params(a, layer) + mlp_params(a, is_moe(a, layer), layer in a.hash_layers)


def mtp_params(a: ModelSpec, depth: int = 0) -> Params:
    """One MTP layer: enorm, hnorm, eh_proj [H, 2H] (column-parallel; DeepSeek-V4 splits it into
    e_proj and h_proj of [H, H]), a transformer layer, final norm, and with mHC its own hc_head."""
    h = a.hidden_size
    layer = layer_params(a, a.num_layers + depth)
    return layer + Params(tp=2 * h * h, replicated=3 * _norm(a, h) + _hyper_head(a))


def all_mtp_params(a: ModelSpec) -> Params:
    p = Params()
    for depth in range(a.mtp_layers):
        p += mtp_params(a, depth)
    return p


def embedding_params(a: ModelSpec) -> Params:
    return Params(tp=a.vocab_size * a.hidden_size)


def final_params(a: ModelSpec) -> Params:
    """Final norm (after the mHC head collapses the streams) and the output layer (absent when
    tied to the embedding)."""
    out = Params(replicated=_norm(a, a.hidden_size) + _hyper_head(a))
    return out if tied(a) else out + Params(tp=a.vocab_size * a.hidden_size)


@dataclass(frozen=True)
class ParameterCount:
    """Unique parameters of a model (embedding counted once), in elements."""

    total: int  # everything a checkpoint stores, buffers included
    experts: int  # routed experts
    non_expert: int  # everything else (attention, norms, router, shared experts, embeddings, MTP)
    buffers: int  # of non_expert: not trained (router expert bias)


def count_parameters(a: ModelSpec) -> ParameterCount:
    p = embedding_params(a) + final_params(a) + all_mtp_params(a)
    for layer in range(a.num_layers):
        p += layer_params(a, layer)
    return ParameterCount(total=p.total, experts=p.expert, non_expert=p.total - p.expert, buffers=p.buffers)


def activated_parameters(a: ModelSpec) -> int:
    """Trained parameters one token of the main model goes through: every layer, its top-k routed
    experts, the final norm and the output layer; not the embedding table (a row lookup, no
    product) nor the MTP layers. The count model cards publish as "activated" (DeepSeek-V3's
    37 B, gpt-oss-120b's 5.13 B)."""
    active = final_params(a).trained
    for layer in range(a.num_layers):
        p = layer_params(a, layer)
        active += p.trained - p.expert + (p.expert * a.topk // a.num_experts if is_moe(a, layer) else 0)
    return active


def expert_flops_per_token(a: ModelSpec) -> int:
    """Forward FLOPs of the routed experts per token (2 per multiply-add): top-k experts of
    fc1 + fc2 in every MoE layer, MTP included. Does not depend on the number of experts."""
    per_expert = 2 * _mlp(a, a.moe_ffn_hidden_size, False)
    moe_layers = len(a.moe_layers) + (a.mtp_layers if a.mtp_is_moe else 0)
    return a.topk * per_expert * moe_layers
