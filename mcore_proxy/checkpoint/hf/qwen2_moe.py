"""Qwen2-MoE (`Qwen2MoeForCausalLM`, transformers 5): mapping table and config translations.

Checked against transformers 5.24 `models/qwen2_moe` and megatron-core 0.16.1
(`transformer/moe/shared_experts.py`):
- GQA with q/k/v biases (`qkv_bias`, absent in older config.json files: always on) and no q/k
  norms; RoPE over whole heads;
- a MoE layer adds to the routed experts one shared expert of `shared_expert_intermediate_size`,
  scaled per token by sigmoid(`shared_expert_gate` [1, H] . x): megatron's shared experts with
  `moe_shared_expert_gate`, whose `gate_weight` [1, H] is applied the same way to the same input;
- the router is softmax over all experts, top-k, renormalised only with `norm_topk_prob`
  (`gqa.py`: `moe_router_pre_softmax` is its negation);
- dense layers (`mlp_only_layers`, `decoder_sparse_step`) have `mlp.{gate,up,down}_proj` of
  `intermediate_size`, without a shared expert;
- sliding-window attention (`use_sliding_window`) is refused: megatron-core's local spec has none.
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf import gqa
from mcore_proxy.checkpoint.hf.descriptor import E_QWEN
from mcore_proxy.checkpoint.hf.mapping import GLU, SHARED_ROWS, Row
from mcore_proxy.checkpoint.hf.megatron_mapping import MegatronMapping, local_spec_args, require
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

NAME = "Qwen2-MoE"
ARCHITECTURE = "Qwen2MoeForCausalLM"
ROWS = SHARED_ROWS + (
    gqa.QKV_ROW,
    gqa.QKV_BIAS_ROW,
    Row(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        GLU,
    ),
    Row("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight"),
    Row("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"),
)


def moe_pattern(config, layers: int, experts: int) -> list[int]:
    """1 for MoE layers: not in `mlp_only_layers`, and every `decoder_sparse_step`-th (Qwen2-MoE and
    Qwen3-MoE alike)."""
    step = config.int("decoder_sparse_step", 1, minimum=1)
    dense = set(config.list("mlp_only_layers", []))
    return [int(i not in dense and experts > 0 and (i + 1) % step == 0) for i in range(layers)]


def args_from_config(config, mtp_layers: int = 0):
    """Megatron args of the Qwen2-MoE `config` (an HFConfig) describes; refuses what megatron-core
    would compute differently."""
    if config.bool("use_sliding_window", False):
        raise CheckpointError(
            f"{config.path}: use_sliding_window is true; megatron-core's local attention has no "
            f"window, so this {NAME} has no Megatron equivalent"
        )
    experts = config.first_int(*E_QWEN)
    shared = config.int("shared_expert_intermediate_size", minimum=1)
    if experts < 1:
        raise CheckpointError(f"{config.path}: {NAME} with {experts} experts is not a MoE model; fix config.json")
    decoder = gqa.decoder_args(config, NAME, eps=1e-6, rotary_default=gqa.WHOLE_HEADS)
    return local_spec_args(
        **decoder,
        qk_layernorm=False,
        add_qkv_bias=config.bool("qkv_bias", True),
        ffn_hidden_size=config.int("intermediate_size", minimum=1),
        num_experts=experts,
        moe_ffn_hidden_size=config.int("moe_intermediate_size", minimum=1),
        moe_router_topk=config.int("num_experts_per_tok", minimum=1),
        moe_layer_freq=moe_pattern(config, decoder["num_layers"], experts),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        mtp_num_layers=None,
        **gqa.softmax_router_args(config, renormalised=config.bool("norm_topk_prob", False)),
    )


def config_from_args(args, spec) -> dict:
    """A Qwen2-MoE config.json for a Megatron model (Megatron -> HF)."""
    require(
        args,
        gqa.decoder_requirements(args, spec)
        + gqa.softmax_router_requirements(args, spec)
        + [
            ("qk_layernorm", ma.arg_bool(args, "qk_layernorm"), False),
            ("rotary_percent", ma.arg_float(args, "rotary_percent"), 1.0),
            ("moe_shared_expert_intermediate_size", bool(spec.shared_expert_size), True),
            ("moe_shared_expert_gate", ma.arg_bool(args, "moe_shared_expert_gate"), True),
            ("mtp_num_layers", spec.mtp_layers, 0),
        ],
        NAME,
    )
    dense = [i for i in range(spec.num_layers) if i not in spec.moe_layers]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen2_moe",
        **gqa.decoder_config(args, spec, rotary_key=False),
        "intermediate_size": int(spec.ffn_hidden_size or spec.moe_ffn_hidden_size),
        "qkv_bias": ma.arg_bool(args, "add_qkv_bias"),
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "moe_intermediate_size": int(spec.moe_ffn_hidden_size),
        "shared_expert_intermediate_size": int(spec.shared_expert_size),
        "norm_topk_prob": not ma.arg_bool(args, "moe_router_pre_softmax"),
    }


def claims(view) -> bool:
    """GQA without q/k norms, a softmax router and a shared expert."""
    args, spec = view.args, view.spec
    return (
        gqa.is_gqa(args)
        and not ma.arg_bool(args, "qk_layernorm")
        and spec.score_function == "softmax"
        and bool(spec.shared_expert_size)
    )


MAPPING = MegatronMapping(
    (ARCHITECTURE,),
    ROWS,
    args_from_config,
    config_from_args,
    ignored=(gqa.ROPE_FREQUENCIES,),
    qkv_groups=gqa.qkv_groups,
    claims=claims,
)
