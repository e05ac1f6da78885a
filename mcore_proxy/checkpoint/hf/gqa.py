"""What the grouped-query-attention families with a Megatron mapping share (Mixtral, Qwen2-MoE,
GLM-4.5-MoE): the q/k/v rows, the decoder-wide half of both config translations, and the softmax
router of Mixtral and Qwen2-MoE.

Checked against transformers 5.24 (`models/{mixtral,qwen2_moe,glm4_moe}`) and megatron-core 0.16.1
(`transformer/attention.py`, `models/common/embeddings/rope_utils.py`, `transformer/moe/moe_utils.py`):
- q/k/v weights, and biases where a family has them, interleave per query group into
  `linear_qkv` (`mapping.qkv_join`; megatron's `add_qkv_bias`);
- q/k norms, where a family has them, are RMSNorms over one head (`head_dim`) applied before RoPE:
  megatron's `q_layernorm`/`k_layernorm` under `qk_layernorm`, which are sized `kv_channels`
  (OLMoE's norms span the whole projection: they are not these, and OLMoE has no mapping);
- RoPE rotates the halves (`rotate_half`; megatron's `rotary_interleaved=False`) of the first
  `int(head_dim * partial_rotary_factor)` channels of each head, with frequencies over that width:
  megatron's `rotary_percent`. Mixtral and Qwen2-MoE rotate whole heads whatever config.json says;
- a softmax router over all experts, top-k, renormalised, gives the weights megatron's softmax
  router gives with `moe_router_pre_softmax=False` (softmax over the top-k logits); without
  renormalisation it is `moe_router_pre_softmax=True` (softmax over all, then top-k).
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf.megatron_mapping import dtype_fields, dtype_name
from mcore_proxy.checkpoint.hf.mapping import LAYER, QKV, Ignored, Row
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

QKV_ROW = Row(
    "self_attention.linear_qkv.weight",
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    QKV,
)
QKV_BIAS_ROW = Row(
    "self_attention.linear_qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), QKV
)
QK_NORM_ROWS = (
    Row("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    Row("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
ROPE_FREQUENCIES = Ignored("self_attn.rotary_emb.inv_freq", LAYER, "RoPE frequencies, recomputed from rope_theta")
WHOLE_HEADS = None  # `decoder_args(rotary_default=...)` of a family that rotates whole heads


def qkv_groups(args) -> tuple[int, int, int]:
    """(query heads, query groups, head dim) of Megatron args, for the q/k/v transform, as
    megatron-core derives the last two when the args leave them to it (`megatron_args`)."""
    return ma.arg_int(args, "num_attention_heads", minimum=1), ma.num_query_groups(args), ma.kv_channels(args)


def decoder_args(config, family: str, *, eps: float, rotary_default: float | None) -> dict:
    """Megatron args of everything a GQA config.json describes but the MLPs and the router.
    eps: transformers' default `rms_norm_eps` of the family; rotary_default: its
    `partial_rotary_factor` when config.json has none (WHOLE_HEADS: it rotates whole heads)."""
    hidden = config.int("hidden_size", minimum=1)
    heads = config.int("num_attention_heads", minimum=1)
    groups = config.int("num_key_value_heads", heads, minimum=1)
    if heads % groups:
        raise CheckpointError(
            f"{config.path}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {groups}; fix config.json"
        )
    if config.data.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"{config.path}: hidden_act is {config.data.get('hidden_act')!r}; {family} maps to "
            "megatron-core's SwiGLU (silu) only"
        )
    rope = config.rope()
    if rope["rope_type"] != "default":
        raise CheckpointError(
            f"{config.path}: rope type {rope['rope_type']!r} is not supported for {family} "
            "(plain RoPE only); use the model's original config.json"
        )
    vocab = config.int("vocab_size", minimum=1)
    positions = config.int("max_position_embeddings", 4096, minimum=1)
    return dict(
        num_layers=config.int("num_hidden_layers", minimum=1),
        hidden_size=hidden,
        num_attention_heads=heads,
        group_query_attention=groups != heads,
        num_query_groups=groups,
        kv_channels=config.int("head_dim", hidden // heads, minimum=1),
        multi_latent_attention=False,
        rotary_base=float(rope["rope_theta"]),
        rotary_percent=_rotary_percent(config, rope, rotary_default),
        rotary_interleaved=False,
        norm_epsilon=config.float("rms_norm_eps", eps),
        untie_embeddings_and_output_weights=not config.bool("tie_word_embeddings", False),
        padded_vocab_size=vocab,
        vocab_size=vocab,
        seq_length=positions,
        max_position_embeddings=positions,
        **dtype_fields(config),
    )


def _rotary_percent(config, rope: dict, default: float | None) -> float:
    """transformers' order: `rope_parameters`, then config.json's top level, then the family's default."""
    if default is WHOLE_HEADS:
        return 1.0
    value = rope.get("partial_rotary_factor", config.data.get("partial_rotary_factor"))
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CheckpointError(
            f"{config.path}: partial_rotary_factor is {value!r}, expected a number in (0, 1]; fix config.json"
        )
    return float(value)


def decoder_config(args, spec, *, rotary_key: bool) -> dict:
    """The config.json keys `decoder_args` reads, from Megatron args (Megatron -> HF). rotary_key:
    write `partial_rotary_factor` (always, for a family whose default is not 1)."""
    heads, groups, head_dim = qkv_groups(args)
    rope = {"rope_type": "default", "rope_theta": ma.arg_float(args, "rotary_base")}
    if rotary_key:
        rope["partial_rotary_factor"] = ma.arg_float(args, "rotary_percent")
    return {
        "vocab_size": ma.arg_int(args, "padded_vocab_size", minimum=1),
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": ma.max_position_embeddings(args),
        "rms_norm_eps": ma.norm_epsilon(args),
        "rope_parameters": rope,
        "tie_word_embeddings": not ma.arg_bool(args, "untie_embeddings_and_output_weights"),
        "attention_dropout": 0.0,
        "dtype": dtype_name(args),
    }


def decoder_requirements(args, spec) -> list[tuple[str, object, object]]:
    """(field, found, expected) for `family.require`: what every GQA family here needs of Megatron args."""
    return [
        ("multi_latent_attention", ma.arg_bool(args, "multi_latent_attention"), False),
        ("swiglu", ma.arg_bool(args, "swiglu"), True),
        ("add_bias_linear", ma.arg_bool(args, "add_bias_linear"), False),
        ("normalization", ma.arg_str(args, "normalization"), "RMSNorm"),
        ("position_embedding_type", ma.arg_str(args, "position_embedding_type"), "rope"),
        ("rotary_interleaved", ma.arg_bool(args, "rotary_interleaved"), False),
    ]


def is_gqa(args) -> bool:
    """Megatron args of a model whose attention is `linear_qkv` (not multi-latent attention)."""
    return not ma.arg_bool(args, "multi_latent_attention")


# -- the softmax router of Mixtral and Qwen2-MoE ---------------------------------------------------


def softmax_router_args(config, *, renormalised: bool) -> dict:
    return dict(
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not renormalised,
        moe_router_enable_expert_bias=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_topk_scaling_factor=None,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=config.float("router_aux_loss_coef", 0.0),
    )


def softmax_router_requirements(args, spec) -> list[tuple[str, object, object]]:
    return [
        ("moe_router_score_function", spec.score_function, "softmax"),
        ("moe_router_enable_expert_bias", spec.expert_bias, False),
        ("moe_router_num_groups", spec.num_groups or 1, 1),
        ("moe_router_topk_scaling_factor", ma.topk_scaling_factor(args), 1.0),
    ]
