"""Megatron-LM launch flags of a model from its args, for a source no Megatron launch saved (Hugging Face).

A Megatron checkpoint converted from HF has no launch script yet: these are the model-shape
flags its args hold, in Megatron-LM's argparse spelling (`--num-layers` for `num_layers`). The
parallel-layout flags are added by `convert` for the target layout.
"""

from __future__ import annotations

from mcore_proxy.mcore.megatron_args import arg_bool, rope_type

# (args field, flag, kind): "value" prints `--flag V` when set, "true" prints `--flag` when true,
# "list" prints a Python list (Megatron parses `--moe-layer-freq` as one), "spaced" a list as
# space-separated whole numbers (argparse `nargs="+"`), "int" a whole number;
# "gqa", "mla", "not_mla", "yarn": printed like "value" only for that kind of attention / RoPE;
# "partial": like "value" only below 1 (Megatron's default).
FLAGS = (
    ("num_layers", "--num-layers", "value"),
    ("hidden_size", "--hidden-size", "value"),
    ("ffn_hidden_size", "--ffn-hidden-size", "value"),
    ("num_attention_heads", "--num-attention-heads", "value"),
    ("group_query_attention", "--group-query-attention", "true"),
    ("num_query_groups", "--num-query-groups", "gqa"),
    ("kv_channels", "--kv-channels", "not_mla"),
    ("qk_layernorm", "--qk-layernorm", "true"),
    ("add_qkv_bias", "--add-qkv-bias", "true"),
    ("multi_latent_attention", "--multi-latent-attention", "true"),
    ("q_lora_rank", "--q-lora-rank", "value"),
    ("kv_lora_rank", "--kv-lora-rank", "mla"),
    ("qk_head_dim", "--qk-head-dim", "mla"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", "mla"),
    ("v_head_dim", "--v-head-dim", "mla"),
    ("rope_type", "--rope-type", "mla"),
    ("rotary_scaling_factor", "--rotary-scaling-factor", "yarn"),
    ("mscale", "--mscale", "yarn"),
    ("mscale_all_dim", "--mscale-all-dim", "yarn"),
    ("original_max_position_embeddings", "--original-max-position-embeddings", "yarn"),
    ("beta_fast", "--beta-fast", "yarn"),
    ("beta_slow", "--beta-slow", "yarn"),
    ("experimental_attention_variant", "--experimental-attention-variant", "value"),
    ("dsa_indexer_n_heads", "--dsa-indexer-n-heads", "value"),
    ("dsa_indexer_head_dim", "--dsa-indexer-head-dim", "value"),
    ("dsa_indexer_topk", "--dsa-indexer-topk", "value"),
    # DeepSeek-V4 (Megatron-LM dev: its TransformerConfig field names, --csa-compress-ratios as a list string)
    ("o_groups", "--o-groups", "value"),
    ("o_lora_rank", "--o-lora-rank", "value"),
    ("csa_window_size", "--csa-window-size", "value"),
    ("csa_compress_ratios", "--csa-compress-ratios", "list"),
    ("csa_compress_rotary_base", "--csa-compress-rotary-base", "int"),
    ("enable_hyper_connections", "--enable-hyper-connections", "true"),
    ("num_residual_streams", "--num-residual-streams", "value"),
    ("mhc_sinkhorn_iterations", "--mhc-sinkhorn-iterations", "value"),
    ("moe_n_hash_layers", "--moe-n-hash-layers", "value"),
    ("activation_func_clamp_value", "--activation-func-clamp-value", "value"),
    ("num_experts", "--num-experts", "value"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", "value"),
    ("moe_router_topk", "--moe-router-topk", "value"),
    ("moe_layer_freq", "--moe-layer-freq", "list"),
    ("moe_router_score_function", "--moe-router-score-function", "value"),
    ("moe_router_pre_softmax", "--moe-router-pre-softmax", "true"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", "true"),
    ("moe_router_num_groups", "--moe-router-num-groups", "value"),
    ("moe_router_group_topk", "--moe-router-group-topk", "value"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", "value"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", "value"),
    ("moe_shared_expert_gate", "--moe-shared-expert-gate", "true"),
    ("mtp_num_layers", "--mtp-num-layers", "value"),
    ("normalization", "--normalization", "value"),
    ("norm_epsilon", "--norm-epsilon", "value"),
    ("swiglu", "--swiglu", "true"),
    ("position_embedding_type", "--position-embedding-type", "value"),
    ("rotary_base", "--rotary-base", "int"),
    ("rotary_percent", "--rotary-percent", "partial"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", "true"),
    ("max_position_embeddings", "--max-position-embeddings", "value"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", "value"),
    ("bf16", "--bf16", "true"),
    ("fp16", "--fp16", "true"),
)


def _show(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def model_flags(args, table=FLAGS) -> list[str]:
    """The model-shape flags of `args` by `table` (FLAGS, or a framework's own of the same form).
    A field the args lack prints no flag: Megatron-LM then takes the same default we would read."""
    mla, gqa = arg_bool(args, "multi_latent_attention"), arg_bool(args, "group_query_attention")
    yarn = rope_type(args) == "yarn"
    flags = [] if arg_bool(args, "add_bias_linear") else ["--disable-bias-linear"]
    for field, flag, kind in table:
        value = getattr(args, field, None)  # explicit only (see above)
        if value is None or value is False:
            continue
        if kind == "true":
            flags.append(flag)
        elif kind == "spaced":
            flags.append(f"{flag} {' '.join(str(int(v)) for v in value)}")
        elif kind == "list":
            flags.append(f'{flag} "{list(value)}"' if isinstance(value, (list, tuple)) else f"{flag} {value}")
        elif kind == "int":
            flags.append(f"{flag} {_show(value)}")
        elif (
            kind == "value"
            or (kind == "gqa" and gqa)
            or (kind == "mla" and mla)
            or (kind == "not_mla" and not mla)
            or (kind == "yarn" and yarn)
            or (kind == "partial" and value < 1)
        ):
            flags.append(f"{flag} {_show(value)}")
    return flags
