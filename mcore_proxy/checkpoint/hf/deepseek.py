"""DeepSeek-V3 and DeepSeek-V3.2 (`DeepseekV3ForCausalLM`, `DeepseekV32ForCausalLM`, built into
transformers 5): mapping tables and config translations.

Checked against transformers 5.24 `models/deepseek_v3`, `models/deepseek_v32` and megatron-core
0.16.1 (`multi_latent_attention.py`, `experimental_attention_variant/dsa.py`):
- multi-latent attention maps one to one: `q_a_proj` -> `linear_q_down_proj`, `q_a_layernorm` ->
  `q_layernorm`, `q_b_proj` -> `linear_q_up_proj` (`q_proj` -> `linear_q_proj` without q_lora),
  `kv_a_proj_with_mqa` -> `linear_kv_down_proj`, `kv_a_layernorm` -> `kv_layernorm`, `kv_b_proj`
  -> `linear_kv_up_proj`, `o_proj` -> `linear_proj`. No RoPE permutation: HF's `rope_interleave`
  rotates interleaved pairs, and megatron's MLA de-interleaves before its rotation
  (`rope_utils._apply_rotary_pos_emb_bshd` with `multi_latent_attention`);
- the router: sigmoid scores plus `e_score_correction_bias` (megatron `expert_bias`, fp32) choose
  `topk_group` of `n_group` groups, then top-k; weights renormalised and scaled by
  `routed_scaling_factor`. HF scores a group by its two best experts, megatron by its best
  top-k / group-top-k: the same for DeepSeek's 8 / 4 (checked when args are made);
- a shared expert of `moe_intermediate_size * n_shared_experts`; the first
  `first_k_dense_replace` layers are dense (V3.2: `mlp_layer_types`);
- MTP layer k is HF layer `num_hidden_layers + k` with `enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm` (megatron `mtp.layers.{k}.final_layernorm`) and copies of the embedding
  and LM head (`embed_tokens`, `shared_head.head`), which megatron's MTP shares with the main
  model. transformers builds no MTP layer (its save_pretrained writes none), DeepSeek's
  published checkpoints hold one;
- V3.2 adds an indexer per layer (`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`; megatron
  `self_attention.core_attention.indexer.{linear_wq_b,linear_wk,k_norm,linear_weights_proj}`).
"""

from __future__ import annotations

from functools import partial

from mcore_proxy.checkpoint.hf.descriptor import E_ROUTED
from mcore_proxy.checkpoint.hf.mapping import GLU, MTP, ROPE_LAST, SHARED_ROWS, Ignored, Row
from mcore_proxy.checkpoint.hf.megatron_mapping import (
    MegatronMapping,
    dtype_fields,
    dtype_name,
    local_spec_args,
    require,
)
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

V3, V32 = "DeepSeek-V3", "DeepSeek-V3.2"
_ARCH = {V3: "DeepseekV3ForCausalLM", V32: "DeepseekV32ForCausalLM"}
_MODEL_TYPE = {V3: "deepseek_v3", V32: "deepseek_v32"}

# DeepSeek's MTP layer k (HF layer num_hidden_layers + k) beside its decoder layer; GLM's is the same
MTP_ROWS = (
    Row("enorm.weight", "enorm.weight", scope=MTP),
    Row("hnorm.weight", "hnorm.weight", scope=MTP),
    Row("eh_proj.weight", "eh_proj.weight", scope=MTP),
    Row("final_layernorm.weight", "shared_head.norm.weight", scope=MTP),
)
MTP_COPIES = (
    Ignored(
        "embed_tokens.weight",
        MTP,
        "megatron's MTP shares the main word embedding",
        tied_to="embedding.word_embeddings.weight",
    ),
    Ignored(
        "shared_head.head.weight", MTP, "megatron's MTP shares the main output layer", tied_to="output_layer.weight"
    ),
)
_MLA = (
    SHARED_ROWS
    + MTP_ROWS
    + (
        Row("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
        Row("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
        Row("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
        Row("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),
        Row("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        Row("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        Row("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
        Row(
            "mlp.shared_experts.linear_fc1.weight",
            ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
            GLU,
        ),
        Row("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"),
    )
)
# the indexer's query and key rows (and its key norm) hold each head's rotated dims where
# transformers keeps them first and megatron-core last (`mapping.rope_last_order`, `_rope_layout`)
_INDEXER_ROWS = (
    Row("self_attention.core_attention.indexer.linear_wq_b.weight", "self_attn.indexer.wq_b.weight", ROPE_LAST),
    Row("self_attention.core_attention.indexer.linear_wk.weight", "self_attn.indexer.wk.weight", ROPE_LAST),
    Row("self_attention.core_attention.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight", ROPE_LAST),
    Row("self_attention.core_attention.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias", ROPE_LAST),
    Row("self_attention.core_attention.indexer.linear_weights_proj.weight", "self_attn.indexer.weights_proj.weight"),
)
_IGNORED = MTP_COPIES + (
    Ignored("self_attn.rotary_emb.inv_freq", "layer", "RoPE frequencies, recomputed from rope_theta"),
)
ROWS = {V3: _MLA, V32: _MLA + _INDEXER_ROWS}
HF_GROUP_SCORE_EXPERTS = 2  # transformers scores a routing group by the sum of its 2 best experts


def moe_pattern(config, layers: int) -> list[int]:
    """1 for MoE layers: V3.2's `mlp_layer_types`, else layers from `first_k_dense_replace` on
    (with the remote-code configs' `moe_layer_freq`, every N-th of those)."""
    if config.has("mlp_layer_types"):
        types = config.list("mlp_layer_types")
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise CheckpointError(
                f"{config.path}: mlp_layer_types must list 'dense' or 'sparse' for each of "
                f"the {layers} layers; fix config.json"
            )
        return [int(t == "sparse") for t in types]
    first = config.int("first_k_dense_replace", 0)
    freq = config.int("moe_layer_freq", 1, minimum=1)
    return [int(i >= first and i % freq == 0) for i in range(layers)]


def _rope_args(config) -> dict:
    rope = config.rope()
    kind = rope["rope_type"]
    if kind == "default":
        return {"rope_type": "rope", "rotary_base": float(rope["rope_theta"]), "rotary_scaling_factor": 1.0}
    if kind != "yarn":
        raise CheckpointError(f"{config.path}: rope type {kind!r} is not supported for DeepSeek (plain or yarn)")
    return {
        "rope_type": "yarn",
        "rotary_base": float(rope["rope_theta"]),
        "rotary_scaling_factor": float(rope.get("factor", 1.0)),
        "mscale": float(rope.get("mscale", 1.0)),
        "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
        "beta_fast": float(rope.get("beta_fast", 32)),
        "beta_slow": float(rope.get("beta_slow", 1)),
        "original_max_position_embeddings": int(rope.get("original_max_position_embeddings", 4096)),
    }


def sigmoid_router_args(config) -> dict:
    """Megatron args of DeepSeek's router (GLM-4.5 has the same): sigmoid scores, the score-correction
    bias for selection, `topk_group` of `n_group` groups, top-k, renormalised, scaled. Refuses what
    megatron-core 0.16.1's `topk_routing_with_score_function` computes differently."""
    topk = config.int("num_experts_per_tok", minimum=1)
    groups, group_topk = config.int("n_group", 1, minimum=1), config.int("topk_group", 1, minimum=1)
    renormalised = config.bool("norm_topk_prob", True)
    if renormalised != (topk > 1):
        raise CheckpointError(
            f"{config.path}: norm_topk_prob is {str(renormalised).lower()} with top-{topk}; "
            "megatron-core's sigmoid router renormalises the top-k weights exactly when k > 1, so "
            "this router has no megatron equivalent"
        )
    if groups > 1 and topk // group_topk != HF_GROUP_SCORE_EXPERTS:
        raise CheckpointError(
            f"{config.path}: top-{topk} over {group_topk} of {groups} groups scores a group by its "
            f"best {topk // group_topk} experts in megatron but by its best {HF_GROUP_SCORE_EXPERTS} "
            "in transformers; the two would route differently"
        )
    return dict(
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False,
        # kept also when 1: a flattened proxy says so explicitly (MindSpeed-LLM falls back to the EP size)
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=config.float("routed_scaling_factor", 1.0),
        moe_router_load_balancing_type="seq_aux_loss",
        moe_router_dtype="fp32",
    )


def _args_from_config(config, mtp_layers: int = 0, *, family: str):
    layers = config.int("num_hidden_layers", minimum=1)
    hidden = config.int("hidden_size", minimum=1)
    heads = config.int("num_attention_heads", minimum=1)
    experts = config.first_int(*E_ROUTED)
    if config.data.get("rope_interleave", True) is not True and family == V3:
        raise CheckpointError(
            f"{config.path}: rope_interleave is false; megatron-core's multi-latent attention "
            "rotates interleaved pairs, as DeepSeek's published weights need"
        )
    vocab = config.int("vocab_size", minimum=1)
    positions = config.int("max_position_embeddings", 4096, minimum=1)
    q_lora = config.data.get("q_lora_rank")
    fields = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=config.int("v_head_dim", minimum=1),
        group_query_attention=False,
        multi_latent_attention=True,
        q_lora_rank=None if q_lora is None else config.int("q_lora_rank", minimum=1),
        kv_lora_rank=config.int("kv_lora_rank", minimum=1),
        qk_head_dim=config.int("qk_nope_head_dim", minimum=1),
        qk_pos_emb_head_dim=config.int("qk_rope_head_dim", minimum=1),
        v_head_dim=config.int("v_head_dim", minimum=1),
        qk_layernorm=True,
        ffn_hidden_size=config.int("intermediate_size", minimum=1),
        num_experts=experts,
        moe_ffn_hidden_size=config.int("moe_intermediate_size", minimum=1),
        moe_layer_freq=moe_pattern(config, layers),
        moe_shared_expert_intermediate_size=(config.int("moe_intermediate_size") * config.int("n_shared_experts", 0))
        or None,
        **sigmoid_router_args(config),
        norm_epsilon=config.float("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not config.bool("tie_word_embeddings", False),
        padded_vocab_size=vocab,
        vocab_size=vocab,
        seq_length=positions,
        max_position_embeddings=positions,
        mtp_num_layers=mtp_layers or None,
        **_rope_args(config),
        **dtype_fields(config),
    )
    if family == V32:
        fields.update(
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=config.int("index_n_heads", minimum=1),
            dsa_indexer_head_dim=config.int("index_head_dim", minimum=1),
            dsa_indexer_topk=config.int("index_topk", minimum=1),
        )
    return local_spec_args(**fields)


# config.json key -> the Megatron args field of DeepSeek-V3.2's indexer size
_INDEXER = (
    ("index_n_heads", "dsa_indexer_n_heads"),
    ("index_head_dim", "dsa_indexer_head_dim"),
    ("index_topk", "dsa_indexer_topk"),
)


def _config_from_args(args, spec, *, family: str) -> dict:
    require(
        args,
        [
            ("multi_latent_attention", ma.arg_bool(args, "multi_latent_attention"), True),
            ("swiglu", ma.arg_bool(args, "swiglu"), True),
            ("add_bias_linear", ma.arg_bool(args, "add_bias_linear"), False),
            ("normalization", ma.arg_str(args, "normalization"), "RMSNorm"),
            ("moe_router_score_function", spec.score_function, "sigmoid"),
        ],
        family,
    )
    rope = {"rope_type": "default", "rope_theta": ma.arg_float(args, "rotary_base")}
    if ma.rope_type(args) == "yarn":  # also when rope_type is unset: MLA's default is YaRN
        rope.update(
            rope_type="yarn",
            factor=ma.arg_float(args, "rotary_scaling_factor"),
            mscale=ma.arg_float(args, "mscale"),
            mscale_all_dim=ma.arg_float(args, "mscale_all_dim"),
            beta_fast=ma.arg_float(args, "beta_fast"),
            beta_slow=ma.arg_float(args, "beta_slow"),
            original_max_position_embeddings=ma.arg_int(args, "original_max_position_embeddings", minimum=1),
        )
    first_dense = next((i for i in range(spec.num_layers) if i in spec.moe_layers), spec.num_layers)
    if list(spec.moe_layers) != list(range(first_dense, spec.num_layers)):
        raise CheckpointError(
            f"MoE layers {list(spec.moe_layers)} are not 'dense first, then MoE', which is all a "
            f"{family} config.json can say"
        )
    shared = spec.shared_expert_size or 0
    heads = ma.arg_int(args, "num_attention_heads", minimum=1)
    config = {
        "architectures": [_ARCH[family]],
        "model_type": _MODEL_TYPE[family],
        "vocab_size": ma.arg_int(args, "padded_vocab_size", minimum=1),
        "hidden_size": spec.hidden_size,
        "intermediate_size": int(spec.ffn_hidden_size),
        "moe_intermediate_size": int(spec.moe_ffn_hidden_size),
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": shared // int(spec.moe_ffn_hidden_size),
        "first_k_dense_replace": first_dense,
        "q_lora_rank": ma.arg_int(args, "q_lora_rank", minimum=1),
        "kv_lora_rank": ma.arg_int(args, "kv_lora_rank", minimum=1),
        "qk_nope_head_dim": ma.arg_int(args, "qk_head_dim", minimum=1),
        "qk_rope_head_dim": ma.arg_int(args, "qk_pos_emb_head_dim", minimum=1),
        "v_head_dim": ma.arg_int(args, "v_head_dim", minimum=1),
        "hidden_act": "silu",
        "norm_topk_prob": spec.topk > 1,
        "routed_scaling_factor": ma.topk_scaling_factor(args),
        "max_position_embeddings": ma.max_position_embeddings(args),
        "rms_norm_eps": ma.norm_epsilon(args),
        "rope_parameters": rope,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": not ma.arg_bool(args, "untie_embeddings_and_output_weights"),
        "num_nextn_predict_layers": spec.mtp_layers,
        "dtype": dtype_name(args),
    }
    if family == V32:
        config.update({key: ma.arg_int(args, field, minimum=1, needed=f"{V32}'s indexer") for key, field in _INDEXER})
    return config


def _claims(view, *, family: str) -> bool:
    """Multi-latent attention (not DeepSeek-V4's variant), with (V3.2) or without (V3) an indexer."""
    args = view.args
    if not ma.arg_bool(args, "multi_latent_attention"):
        return False
    if ma.arg_str(args, "experimental_attention_variant") not in (None, "dsa"):
        return False
    return any(".core_attention.indexer." in n for n in view.names()) == (family == V32)


def _rope_layout(args) -> tuple[int, int, bool]:
    """The V3.2 indexer's head size, its rotated dims, and that transformers rotates them as halves
    (`rotate_half`; megatron-core: interleaved pairs)."""
    head_dim = ma.arg_int(args, "dsa_indexer_head_dim", minimum=1, needed=f"{V32}'s indexer")
    return head_dim, ma.arg_int(args, "qk_pos_emb_head_dim", minimum=1, needed=f"{V32}'s indexer"), True


def _mapping(name: str) -> MegatronMapping:
    return MegatronMapping(
        (_ARCH[name],),
        ROWS[name],
        partial(_args_from_config, family=name),
        partial(_config_from_args, family=name),
        ignored=_IGNORED,
        claims=partial(_claims, family=name),
        rope_layout=_rope_layout if name == V32 else None,
    )


MAPPINGS = {V3: _mapping(V3), V32: _mapping(V32)}
