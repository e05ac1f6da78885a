"""Mixtral (`MixtralForCausalLM`, transformers 5): mapping table and config translations.

Checked against transformers 5.24 `models/mixtral` (and the `mixtral` entry of its
`conversion_mapping.py`) and megatron-core 0.16.1:
- every layer is a MoE layer and the experts' size is `intermediate_size` (there is no dense MLP);
- the router is softmax over all experts, top-k, always renormalised (`gqa.py`: megatron's
  `moe_router_pre_softmax=False`); no shared expert, no expert bias;
- GQA without biases and without q/k norms; RoPE over whole heads (`head_dim`, or H / heads);
- the Hub and `save_pretrained` spell the block `block_sparse_moe`, the router `gate` and the
  experts `w1` (gate), `w3` (up), `w2` (down); transformers' in-memory spelling (`mlp.gate`, fused
  `mlp.experts.gate_up_proj`) is read too, the Hub's is written;
- `sliding_window` (windowed attention) is refused: megatron-core's local spec attends to every
  earlier token.
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf import gqa
from mcore_proxy.checkpoint.hf.descriptor import E_LOCAL
from mcore_proxy.checkpoint.hf.mapping import ATTENTION_OUTPUT_ROW, LAYER_NORM_ROWS, WHOLE_MODEL_ROWS
from mcore_proxy.checkpoint.hf.megatron_mapping import MegatronMapping, local_spec_args, require
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

NAME = "Mixtral"
ARCHITECTURE = "MixtralForCausalLM"
# no dense MLP: every layer is a MoE layer
ROWS = WHOLE_MODEL_ROWS + LAYER_NORM_ROWS + (ATTENTION_OUTPUT_ROW, gqa.QKV_ROW)


def args_from_config(config, mtp_layers: int = 0):
    """Megatron args of the Mixtral `config` (an HFConfig) describes; refuses what megatron-core
    would compute differently."""
    if config.data.get("sliding_window") is not None:
        raise CheckpointError(
            f"{config.path}: sliding_window is {config.data['sliding_window']!r}; megatron-core's "
            f"local attention has no window, so this {NAME} has no Megatron equivalent"
        )
    experts = config.first_int(*E_LOCAL)
    if experts < 1:
        raise CheckpointError(f"{config.path}: {NAME} with {experts} experts is not a MoE model; fix config.json")
    decoder = gqa.decoder_args(config, NAME, eps=1e-5, rotary_default=gqa.WHOLE_HEADS)
    ffn = config.int("intermediate_size", minimum=1)
    return local_spec_args(
        **decoder,
        qk_layernorm=False,
        ffn_hidden_size=ffn,
        num_experts=experts,
        moe_ffn_hidden_size=ffn,
        moe_router_topk=config.int("num_experts_per_tok", minimum=1),
        moe_layer_freq=[1] * decoder["num_layers"],
        moe_shared_expert_intermediate_size=None,
        mtp_num_layers=None,
        **gqa.softmax_router_args(config, renormalised=True),
    )


def config_from_args(args, spec) -> dict:
    """A Mixtral config.json for a Megatron model (Megatron -> HF)."""
    require(
        args,
        gqa.decoder_requirements(args, spec)
        + gqa.softmax_router_requirements(args, spec)
        + [
            ("qk_layernorm", ma.arg_bool(args, "qk_layernorm"), False),
            ("add_qkv_bias", ma.arg_bool(args, "add_qkv_bias"), False),
            ("rotary_percent", ma.arg_float(args, "rotary_percent"), 1.0),
            ("moe_router_pre_softmax", ma.arg_bool(args, "moe_router_pre_softmax"), False),
            ("moe_shared_expert_intermediate_size", spec.shared_expert_size, None),
            ("moe_layer_freq", [int(i in spec.moe_layers) for i in range(spec.num_layers)], [1] * spec.num_layers),
            ("mtp_num_layers", spec.mtp_layers, 0),
        ],
        NAME,
    )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        **gqa.decoder_config(args, spec, rotary_key=False),
        "intermediate_size": int(spec.moe_ffn_hidden_size),
        "sliding_window": None,
    }


def claims(view) -> bool:
    """GQA without q/k norms, a softmax router and no shared expert."""
    args, spec = view.args, view.spec
    return (
        gqa.is_gqa(args)
        and not ma.arg_bool(args, "qk_layernorm")
        and spec.score_function == "softmax"
        and not spec.shared_expert_size
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
