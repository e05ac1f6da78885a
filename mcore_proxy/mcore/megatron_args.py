"""Reading Megatron/MindSpeed `args` from checkpoints of any version: one table of defaults.

Checkpoints saved by older (or other) Megatron versions lack fields that newer versions add:
e.g. `moe_layer_freq`, `moe_shared_expert_intermediate_size`, `moe_router_enable_expert_bias`,
`moe_router_num_groups`, `moe_router_group_topk`. An absent field means the saving run used the
behaviour that Megatron's own default now describes, so it takes that default from `DEFAULTS`
(megatron-core 0.16.1's `TransformerConfig` defaults and Megatron-LM's argparse defaults; a test
checks the first against the installed megatron-core). A field without a safe default (sizes
that define the model) is `REQUIRED`: its absence is one sentence naming the field and the file.

Values are validated here too: `args` come from whoever made the file, so a field of the wrong
type is refused by name, never passed on to `int()` and a traceback.
"""

from __future__ import annotations

import numbers

from mcore_proxy.core.errors import CheckpointError

REQUIRED = object()  # no safe default: the field must be in the args

# field -> Megatron's default when the field is absent (REQUIRED: no safe default)
DEFAULTS: dict[str, object] = {
    # model sizes: nothing can stand in for them
    "num_layers": REQUIRED,
    "hidden_size": REQUIRED,
    "num_attention_heads": REQUIRED,
    "padded_vocab_size": REQUIRED,
    "seq_length": REQUIRED,
    "ffn_hidden_size": None,  # Megatron derives it from hidden_size (see ffn_hidden_size)
    "num_query_groups": None,
    # MoE (TransformerConfig defaults)
    "num_experts": None,
    "moe_ffn_hidden_size": None,  # None: ffn_hidden_size
    "moe_router_topk": 2,
    "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_grouped_gemm": False,
    "moe_use_legacy_grouped_gemm": False,
    "mtp_num_layers": None,
    "first_k_dense_replace": None,  # MindSpeed-LLM (DeepSeek): first k layers dense
    "linear_attention_freq": None,
    "heterogeneous_layers_config_path": None,
    "heterogeneous_layers_config_encoded_json": None,
    "swiglu": False,
    "gated_linear_unit": False,
    "transformer_impl": "transformer_engine",
    "multi_latent_attention": False,
    # parallel layout (argparse defaults)
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,  # None: equal to tensor_model_parallel_size
    "virtual_pipeline_model_parallel_size": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "pipeline_model_parallel_layout": None,
    "num_layer_list": None,  # MindSpeed spelling of uneven stages
}

# Fields whose defaults are megatron-core TransformerConfig's (same name unless mapped here).
TRANSFORMER_CONFIG_NAMES = {
    "moe_router_topk": "moe_router_topk",
    "moe_layer_freq": "moe_layer_freq",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_num_groups": "moe_router_num_groups",
    "moe_router_group_topk": "moe_router_group_topk",
    "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "num_experts": "num_moe_experts",
    "mtp_num_layers": "mtp_num_layers",
    "gated_linear_unit": "gated_linear_unit",
    "multi_latent_attention": "multi_latent_attention",
    "num_query_groups": "num_query_groups",
}


def _where(where: str | None) -> str:
    return f" in {where}" if where else ""


def arg(args, name: str, where: str | None = None):
    """`args.name`, or Megatron's default when the field is absent (CheckpointError if REQUIRED)."""
    default = DEFAULTS.get(name)
    if args is not None and hasattr(args, name):
        return getattr(args, name)
    if default is REQUIRED:
        raise CheckpointError(
            f"the Megatron args{_where(where)} lack {name}, which has no safe default; "
            "the checkpoint was saved without it, add it to the args or re-save"
        )
    return default


def arg_int(args, name: str, where: str | None = None, *, minimum: int = 0, maximum: int = 1 << 40) -> int | None:
    """An integer field (None stays None); any other type or a value outside [minimum, maximum]
    is refused (the bound keeps a damaged count from sizing a huge allocation)."""
    value = arg(args, name, where)
    if value is None and DEFAULTS.get(name) is not REQUIRED:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= int(value) <= maximum:
        raise CheckpointError(
            f"args {name}{_where(where)} is {_show(value)}, expected an integer in "
            f"{minimum}..{maximum}; the args are damaged, fix them or re-save the checkpoint"
        )
    return int(value)


def arg_str(args, name: str, where: str | None = None) -> str | None:
    value = arg(args, name, where)
    if value is not None and not isinstance(value, str):
        raise CheckpointError(
            f"args {name}{_where(where)} is {_show(value)}, expected a string; the args "
            "are damaged, fix them or re-save the checkpoint"
        )
    return value


def arg_bool(args, name: str, where: str | None = None) -> bool:
    value = arg(args, name, where)
    if value is not None and not isinstance(value, (bool, numbers.Integral)):
        raise CheckpointError(
            f"args {name}{_where(where)} is {_show(value)}, expected true or false; the args "
            "are damaged, fix them or re-save the checkpoint"
        )
    return bool(value)


def ffn_hidden_size(args, where: str | None = None) -> int:
    """Megatron's dense FFN size: the saved value, else its own rule (4h, or 8h/3 rounded down
    to a multiple of 64 with SwiGLU)."""
    value = arg_int(args, "ffn_hidden_size", where, minimum=1)
    if value is not None:
        return value
    hidden = arg_int(args, "hidden_size", where, minimum=1)
    return int(4 * hidden * 2 / 3 / 64) * 64 if arg_bool(args, "swiglu", where) else 4 * hidden


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# The MLP activations Megatron's args describe (Megatron-LM's core_transformer_config_from_args):
# `--swiglu` is SiLU-gated; a gated linear unit without it is GELU-gated; otherwise GELU, the
# default `activation_func`.
ACTIVATIONS = ("swiglu", "geglu", "gelu")


def activation_of_args(args, where: str | None = None) -> str:
    """One of ACTIVATIONS, as the args say."""
    if arg_bool(args, "swiglu", where):
        return "swiglu"
    return "geglu" if arg_bool(args, "gated_linear_unit", where) else "gelu"
