"""GLM-4.5/4.6/4.7 (`Glm4MoeForCausalLM`, transformers 5): mapping table and config translations.

Checked against transformers 5.24 `models/glm4_moe` and megatron-core 0.16.1:
- GQA with q/k/v biases (`attention_bias`) and, with `use_qk_norm`, per-head q/k RMSNorms before
  RoPE; RoPE over the first `head_dim * partial_rotary_factor` channels of each head (default 0.5
  when config.json has none): megatron's `rotary_percent` (`gqa.py`);
- DeepSeek's router (`deepseek.sigmoid_router_args`): sigmoid scores, `e_score_correction_bias`
  (megatron `expert_bias`, fp32) for selection, `topk_group` of `n_group` groups, top-k,
  renormalised, scaled by `routed_scaling_factor`;
- a shared expert of `moe_intermediate_size * n_shared_experts` without a gate; the first
  `first_k_dense_replace` layers are dense MLPs of `intermediate_size`;
- MTP layer k is HF layer `num_hidden_layers + k`, spelled as DeepSeek's (`deepseek.MTP_ROWS`, and
  the embedding and LM head copies megatron's MTP shares with the main model). transformers builds
  no MTP layer; GLM's releases hold one.
The MLA variants under the same descriptor (`Glm4MoeLiteForCausalLM`, `GlmMoeDsaForCausalLM`) have
no Megatron mapping here.
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf import deepseek, gqa
from mcore_proxy.checkpoint.hf.mapping import GLU, SHARED_ROWS, Row
from mcore_proxy.checkpoint.hf.megatron_mapping import MegatronMapping, local_spec_args, require
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

NAME = "GLM-4.5-MoE"
ARCHITECTURE = "Glm4MoeForCausalLM"
HF_ROTARY_DEFAULT = 0.5  # Glm4MoeConfig's partial_rotary_factor when config.json has none

ROWS = (
    SHARED_ROWS
    + deepseek.MTP_ROWS
    + (gqa.QKV_ROW, gqa.QKV_BIAS_ROW)
    + gqa.QK_NORM_ROWS
    + (
        Row(
            "mlp.shared_experts.linear_fc1.weight",
            ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
            GLU,
        ),
        Row("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"),
    )
)


def args_from_config(config, mtp_layers: int = 0):
    """Megatron args of the GLM-4.5 `config` (an HFConfig) describes, with `mtp_layers` MTP layers
    (those the shards hold); refuses what megatron-core would compute differently."""
    decoder = gqa.decoder_args(config, NAME, eps=1e-5, rotary_default=HF_ROTARY_DEFAULT)
    layers = decoder["num_layers"]
    first_dense = config.int("first_k_dense_replace", 1)
    moe_size = config.int("moe_intermediate_size", minimum=1)
    return local_spec_args(
        **decoder,
        qk_layernorm=config.bool("use_qk_norm", False),
        add_qkv_bias=config.bool("attention_bias", False),
        ffn_hidden_size=config.int("intermediate_size", minimum=1),
        num_experts=config.first_int("n_routed_experts", "num_local_experts"),
        moe_ffn_hidden_size=moe_size,
        moe_layer_freq=[int(i >= first_dense) for i in range(layers)],
        moe_shared_expert_intermediate_size=moe_size * config.int("n_shared_experts", 1, minimum=1),
        **deepseek.sigmoid_router_args(config),
        moe_aux_loss_coeff=config.float("router_aux_loss_coef", 0.0),
        mtp_num_layers=mtp_layers or None,
    )


def config_from_args(args, spec) -> dict:
    """A GLM-4.5 config.json for a Megatron model (Megatron -> HF)."""
    require(
        args,
        gqa.decoder_requirements(args, spec)
        + [
            ("moe_router_score_function", spec.score_function, "sigmoid"),
            ("moe_router_enable_expert_bias", spec.expert_bias, True),
            ("moe_shared_expert_gate", ma.arg_bool(args, "moe_shared_expert_gate"), False),
        ],
        NAME,
    )
    moe_size, shared = int(spec.moe_ffn_hidden_size), spec.shared_expert_size or 0
    if not shared or shared % moe_size:
        raise CheckpointError(
            f"Megatron args moe_shared_expert_intermediate_size is {shared or None} but a {NAME} "
            f"checkpoint on Hugging Face has n_shared_experts shared experts of {moe_size} "
            f"(moe_ffn_hidden_size) each; this model has no HF equivalent in that family"
        )
    first_dense = next((i for i in range(spec.num_layers) if i in spec.moe_layers), spec.num_layers)
    if list(spec.moe_layers) != list(range(first_dense, spec.num_layers)):
        raise CheckpointError(
            f"MoE layers {list(spec.moe_layers)} are not 'dense first, then MoE', which is all a "
            f"{NAME} config.json can say"
        )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "glm4_moe",
        **gqa.decoder_config(args, spec, rotary_key=True),
        "intermediate_size": int(spec.ffn_hidden_size),
        "moe_intermediate_size": moe_size,
        "attention_bias": ma.arg_bool(args, "add_qkv_bias"),
        "use_qk_norm": ma.arg_bool(args, "qk_layernorm"),
        "n_shared_experts": shared // moe_size,
        "first_k_dense_replace": first_dense,
        "norm_topk_prob": spec.topk > 1,  # what megatron does (`deepseek.sigmoid_router_args`)
        "routed_scaling_factor": ma.topk_scaling_factor(args),
        "num_nextn_predict_layers": spec.mtp_layers,
    }


def claims(view) -> bool:
    """GQA with a sigmoid router."""
    return gqa.is_gqa(view.args) and view.spec.score_function == "sigmoid"


MAPPING = MegatronMapping(
    (ARCHITECTURE,),
    ROWS,
    args_from_config,
    config_from_args,
    ignored=deepseek.MTP_COPIES + (gqa.ROPE_FREQUENCIES,),
    qkv_groups=gqa.qkv_groups,
    claims=claims,
)
