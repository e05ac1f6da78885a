"""Qwen3-MoE (`Qwen3MoeForCausalLM`, transformers 5): mapping table and config translations.

Checked against transformers 5.24 `models/qwen3_moe` and megatron-core 0.16.1:
- attention is GQA with per-head RMSNorms on q and k (`q_norm`/`k_norm` [head_dim]) applied
  before RoPE, as megatron's `q_layernorm`/`k_layernorm` with `qk_layernorm`; q/k/v are
  interleaved per query group into `linear_qkv`; head dim `head_dim` may differ from H / heads
  (megatron `kv_channels`);
- the router is softmax over all experts, top-k, renormalised when `norm_topk_prob`: megatron's
  softmax router with `moe_router_pre_softmax=False` (softmax over the top-k logits) computes the
  same weights; without `norm_topk_prob` it is `moe_router_pre_softmax=True`;
- dense layers (`mlp_only_layers`, `decoder_sparse_step`) have `mlp.{gate,up,down}_proj` of
  `intermediate_size`; no shared expert, no expert bias, no attention bias;
- `save_pretrained` writes experts per expert (`mlp.experts.{e}.gate_proj.weight`, ...) although
  the model holds them fused (`experts.gate_up_proj` [E, 2F, H]); both spellings are read;
- config.json spells the expert count `num_experts` (Hub) or `num_local_experts` (transformers 5's
  `attribute_map` target, what its save_pretrained writes).
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf.descriptor import E_QWEN
from mcore_proxy.checkpoint.hf.gqa import QK_NORM_ROWS, QKV_ROW, ROPE_FREQUENCIES, qkv_groups
from mcore_proxy.checkpoint.hf.mapping import SHARED_ROWS
from mcore_proxy.checkpoint.hf.qwen2_moe import moe_pattern
from mcore_proxy.checkpoint.hf.megatron_mapping import (
    MegatronMapping,
    dtype_fields,
    dtype_name,
    local_spec_args,
    require,
)
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

NAME = "Qwen3-MoE"
ARCHITECTURE = "Qwen3MoeForCausalLM"


def args_from_config(config, mtp_layers: int = 0):
    """Megatron args of the model `config` (an HFConfig) describes; refuses what megatron-core
    would compute differently. Qwen3-MoE has no MTP layers (the reader refuses layers past
    num_hidden_layers)."""
    layers = config.int("num_hidden_layers", minimum=1)
    hidden = config.int("hidden_size", minimum=1)
    heads = config.int("num_attention_heads", minimum=1)
    groups = config.int("num_key_value_heads", heads, minimum=1)
    experts = config.first_int(*E_QWEN)
    rope = config.rope()
    for key, bad, why in (
        ("attention_bias", True, "q/k/v/o biases"),
        ("use_sliding_window", True, "sliding-window attention"),
        ("hidden_act", None, "an activation other than silu"),
    ):
        value = config.data.get(key)
        if (bad is not None and value == bad) or (bad is None and value not in (None, "silu")):
            raise CheckpointError(
                f"{config.path}: {key} is {value!r}: {why} are not supported for {NAME} "
                "(megatron-core's SwiGLU GQA without biases is the model mcore-proxy maps to)"
            )
    if rope["rope_type"] != "default":
        raise CheckpointError(
            f"{config.path}: rope type {rope['rope_type']!r} is not supported for {NAME} "
            "(plain RoPE only); use the model's original config.json"
        )
    if experts < 1:
        raise CheckpointError(f"{config.path}: {NAME} with {experts} experts is not a MoE model; fix config.json")
    if heads % groups:
        raise CheckpointError(
            f"{config.path}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {groups}; fix config.json"
        )
    vocab = config.int("vocab_size", minimum=1)
    positions = config.int("max_position_embeddings", 4096, minimum=1)
    return local_spec_args(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=config.int("head_dim", hidden // heads, minimum=1),
        qk_layernorm=True,
        ffn_hidden_size=config.int("intermediate_size", minimum=1),
        num_experts=experts,
        moe_ffn_hidden_size=config.int("moe_intermediate_size", minimum=1),
        moe_router_topk=config.int("num_experts_per_tok", minimum=1),
        moe_layer_freq=moe_pattern(config, layers, experts),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not config.bool("norm_topk_prob", False),
        moe_router_enable_expert_bias=False,
        moe_shared_expert_intermediate_size=None,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk_scaling_factor=None,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=config.float("router_aux_loss_coef", 0.0),
        norm_epsilon=config.float("rms_norm_eps", 1e-6),
        rotary_base=float(rope["rope_theta"]),
        untie_embeddings_and_output_weights=not config.bool("tie_word_embeddings", False),
        padded_vocab_size=vocab,
        vocab_size=vocab,
        seq_length=positions,
        max_position_embeddings=positions,
        multi_latent_attention=False,
        mtp_num_layers=None,
        **dtype_fields(config),
    )


def config_from_args(args, spec) -> dict:
    """A Qwen3-MoE config.json for a Megatron model (Megatron -> HF)."""
    require(
        args,
        [
            ("multi_latent_attention", ma.arg_bool(args, "multi_latent_attention"), False),
            ("qk_layernorm", ma.arg_bool(args, "qk_layernorm"), True),
            ("swiglu", ma.arg_bool(args, "swiglu"), True),
            ("add_bias_linear", ma.arg_bool(args, "add_bias_linear"), False),
            ("normalization", ma.arg_str(args, "normalization"), "RMSNorm"),
            ("position_embedding_type", ma.arg_str(args, "position_embedding_type"), "rope"),
            ("rotary_percent", ma.arg_float(args, "rotary_percent"), 1.0),
            ("moe_router_score_function", spec.score_function, "softmax"),
            ("moe_router_enable_expert_bias", spec.expert_bias, False),
            ("moe_shared_expert_intermediate_size", spec.shared_expert_size, None),
            ("moe_router_topk_scaling_factor", ma.arg_float(args, "moe_router_topk_scaling_factor"), None),
            ("mtp_num_layers", spec.mtp_layers, 0),
        ],
        NAME,
    )
    heads, groups, head_dim = qkv_groups(args)
    positions = ma.max_position_embeddings(args)
    dense = [i for i in range(spec.num_layers) if i not in spec.moe_layers]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_moe",
        "vocab_size": ma.arg_int(args, "padded_vocab_size", minimum=1),
        "hidden_size": spec.hidden_size,
        "intermediate_size": int(spec.ffn_hidden_size or spec.moe_ffn_hidden_size),
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": positions,
        "rms_norm_eps": ma.norm_epsilon(args),
        "rope_parameters": {"rope_type": "default", "rope_theta": ma.arg_float(args, "rotary_base")},
        "tie_word_embeddings": not ma.arg_bool(args, "untie_embeddings_and_output_weights"),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "moe_intermediate_size": int(spec.moe_ffn_hidden_size),
        "norm_topk_prob": not ma.arg_bool(args, "moe_router_pre_softmax"),
        "dtype": dtype_name(args),
    }


# the family a Megatron checkpoint no other mapping claims is written as (its checks say what it lacks)
MAPPING = MegatronMapping(
    (ARCHITECTURE,),
    SHARED_ROWS + (QKV_ROW, *QK_NORM_ROWS),
    args_from_config,
    config_from_args,
    ignored=(ROPE_FREQUENCIES,),
    qkv_groups=qkv_groups,
    default=True,
)
