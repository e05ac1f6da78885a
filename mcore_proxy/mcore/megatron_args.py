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

Some defaults are derived from other fields, as Megatron-LM's `validate_args` and
`core_transformer_config_from_args` derive them: `default_ffn_hidden_size`, `kv_channels`,
`num_query_groups`, `norm_epsilon`, `max_position_embeddings`, `rope_type` below. Read those
through their helper, never through `arg`, which gives only the stored default. The argparse
defaults are Megatron-LM core_v0.16.1's (`megatron/training/arguments.py`; since 0.16 many are
generated from TransformerConfig's fields); DeepSeek-V4's fields are Megatron-LM dev's.
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
    "ffn_hidden_size": None,  # Megatron derives it from hidden_size (see default_ffn_hidden_size)
    # attention (argparse defaults; the None ones are derived by the helpers of the same name)
    "kv_channels": None,  # hidden_size // num_attention_heads (see kv_channels)
    "group_query_attention": False,
    "num_query_groups": None,  # used only with group_query_attention (see num_query_groups)
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "multi_latent_attention": False,
    "q_lora_rank": None,  # MLA sizes: Megatron-LM's argparse defaults (not MLATransformerConfig's)
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "experimental_attention_variant": None,
    "dsa_indexer_n_heads": None,
    "dsa_indexer_head_dim": None,
    "dsa_indexer_topk": None,
    # positions
    "max_position_embeddings": None,  # see max_position_embeddings
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "rope_type": None,  # yarn with MLA, rope otherwise (see rope_type)
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    # YaRN fields Megatron-LM's argparse lacks: MLATransformerConfig's defaults
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 4096,
    # norms, biases, embeddings, precision
    "normalization": "LayerNorm",
    "norm_epsilon": None,  # 1e-5; Megatron-LM >= 0.16 saves it as layernorm_epsilon (see norm_epsilon)
    "layernorm_epsilon": 1e-5,
    "add_bias_linear": True,
    # False is Megatron's default (tied), but `checkpoint.names.embeddings_tied` lets the tensors
    # decide when the field is absent: hand-made args (the quickstart's) omit it beside an untied model
    "untie_embeddings_and_output_weights": False,
    "bf16": False,
    "fp16": False,
    "params_dtype": None,  # validate_args: float32 unless bf16 or fp16
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
    "moe_router_topk_scaling_factor": None,
    "moe_router_pre_softmax": False,
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
    # DeepSeek-V4 (Megatron-LM dev's TransformerConfig and argparse)
    "csa_compress_ratios": None,
    "csa_window_size": 128,
    "csa_compress_rotary_base": 40000.0,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "enable_hyper_connections": False,
    "num_residual_streams": 4,
    "mhc_sinkhorn_iterations": 20,
    "moe_n_hash_layers": 0,
    "activation_func_clamp_value": None,
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
    "overlap_p2p_comm": True,  # --no-overlap-p2p-communication turns it off
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
    "kv_channels": "kv_channels",
    "add_qkv_bias": "add_qkv_bias",
    "qk_layernorm": "qk_layernorm",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "add_bias_linear": "add_bias_linear",
    "normalization": "normalization",
    "layernorm_epsilon": "layernorm_epsilon",
    "rotary_interleaved": "rotary_interleaved",
    "transformer_impl": "transformer_impl",
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


def arg_int(
    args, name: str, where: str | None = None, *, minimum: int = 0, maximum: int = 1 << 40, needed: str | None = None
) -> int | None:
    """An integer field (None stays None, unless `needed` says what needs it: then None is refused
    by name); any other type or a value outside [minimum, maximum] is refused (the bound keeps a
    damaged count from sizing a huge allocation)."""
    value = _number(args, name, where)
    if value is None and needed is not None:
        raise lacking(name, where, needed)
    if value is None and DEFAULTS.get(name) is not REQUIRED:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= int(value) <= maximum:
        raise CheckpointError(
            f"args {name}{_where(where)} is {_show(value)}, expected an integer in "
            f"{minimum}..{maximum}; the args are damaged, fix them or re-save the checkpoint"
        )
    return int(value)


def arg_float(args, name: str, where: str | None = None, *, needed: str | None = None) -> float | None:
    """A real-number field (None stays None, unless `needed`); any other type is refused."""
    value = _number(args, name, where)
    if value is None:
        if needed is not None:
            raise lacking(name, where, needed)
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointError(
            f"args {name}{_where(where)} is {_show(value)}, expected a number; the args are "
            "damaged, fix them or re-save the checkpoint"
        )
    return float(value)


def arg_list(args, name: str, where: str | None = None, *, needed: str | None = None) -> list[int] | None:
    """A list of whole numbers (Megatron-LM dev's `csa_compress_ratios`); None stays None, unless `needed`."""
    value = arg(args, name, where)
    if value is None:
        if needed is not None:
            raise lacking(name, where, needed)
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value
    ):
        raise CheckpointError(
            f"args {name}{_where(where)} is {_show(value)}, expected a list of whole numbers; the "
            "args are damaged, fix them or re-save the checkpoint"
        )
    return [int(v) for v in value]


def _number(args, name: str, where: str | None):
    """`arg`, with a saved None read as Megatron's default when that is a number: no Megatron
    version computes with a None there, so it can only mean "not set"."""
    value = arg(args, name, where)
    default = DEFAULTS.get(name)
    if value is None and isinstance(default, numbers.Real) and not isinstance(default, bool):
        return default
    return value


def lacking(name: str, where: str | None, needed: str) -> CheckpointError:
    return CheckpointError(
        f"the Megatron args{_where(where)} lack {name}, which {needed} needs; the checkpoint was "
        "saved without it, add it to the args or re-save"
    )


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


def default_ffn_hidden_size(hidden: int, swiglu: bool) -> int:
    """Megatron-LM's validate_args: 4h, or 8h/3 rounded down to a multiple of 64 with SwiGLU."""
    return int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden


def kv_channels(args, where: str | None = None) -> int:
    """The head dim of GQA/MHA attention: the saved value, else Megatron's rule (validate_args:
    hidden_size // num_attention_heads, which must divide)."""
    value = arg_int(args, "kv_channels", where, minimum=1)
    if value is not None:
        return value
    hidden = arg_int(args, "hidden_size", where, minimum=1)
    heads = arg_int(args, "num_attention_heads", where, minimum=1)
    if hidden % heads:
        raise CheckpointError(
            f"the Megatron args{_where(where)} lack kv_channels and hidden_size {hidden} is not a "
            f"multiple of num_attention_heads {heads}, so Megatron's default (their quotient) does "
            "not exist; add kv_channels to the args"
        )
    return hidden // heads


def num_query_groups(args, where: str | None = None) -> int:
    """Query groups (key/value heads) as megatron-core runs the model. Megatron-LM's
    core_transformer_config_from_args passes the saved count only with `group_query_attention`
    (without it the count, whose argparse default 1 is saved regardless, is ignored); the config
    then turns None into one group per head. With GQA on and the count absent, argparse's 1."""
    heads = arg_int(args, "num_attention_heads", where, minimum=1)
    if not arg_bool(args, "group_query_attention", where):
        return heads
    if args is not None and not hasattr(args, "num_query_groups"):
        return 1
    return arg_int(args, "num_query_groups", where, minimum=1, maximum=heads) or heads


def norm_epsilon(args, where: str | None = None) -> float:
    """The norms' epsilon: `norm_epsilon` (Megatron-LM before 0.16), else `layernorm_epsilon`
    (0.16 generates `--norm-epsilon` from TransformerConfig with that field's name as its dest),
    else 1e-5."""
    value = arg_float(args, "norm_epsilon", where)
    return value if value is not None else arg_float(args, "layernorm_epsilon", where)


def max_position_embeddings(args, where: str | None = None) -> int:
    """The saved value; Megatron-LM requires it, so args without it are hand-made: the sequence
    length trained on is then the only length the model is known to handle."""
    value = arg_int(args, "max_position_embeddings", where, minimum=1)
    return value if value is not None else arg_int(args, "seq_length", where, minimum=1)


def rope_type(args, where: str | None = None) -> str:
    """`rope` or `yarn`: the saved value, else the config class's default, as Megatron-LM leaves an
    unset `--rope-type` (MLATransformerConfig: yarn; TransformerConfig: rope)."""
    value = arg_str(args, "rope_type", where)
    if value is not None:
        return value
    return "yarn" if arg_bool(args, "multi_latent_attention", where) else "rope"


def topk_scaling_factor(args, where: str | None = None) -> float:
    """The factor routing weights are scaled by: None (Megatron's default) scales by nothing."""
    value = arg_float(args, "moe_router_topk_scaling_factor", where)
    return 1.0 if value is None else value


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
