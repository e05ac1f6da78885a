"""The Megatron side of a model family (`MegatronMapping`): what HF <-> Megatron conversion adds
to the family's record (`descriptor.MoEFamily.megatron`).

- `rows`: the family's mapping rows for every tensor but the router and the routed experts (its
  attention, norms, shared experts, MTP layers); those rows are derived from the record's own
  HF layout (`mapping.routed_rows`), so a router or expert key is spelled in one place;
- `args_from_config` turns `config.json` into the Megatron `args` a megatron-core run of the same
  model uses (argparse names; the canonical ModelView carries them, so an HF checkpoint converts
  to legacy or torch_dist with its args written, and the launch flags are printed from them);
- `config_from_args` is the way back, for Megatron -> HF. It leaves the expert count, top-k and
  routing groups out: the writer sets them in every spelling the record's `ConfigKeys` name
  (`native_writer.proxy_config`), as it does for a pruned HF source.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma


@dataclass(frozen=True)
class MegatronMapping:
    architectures: tuple[str, ...]  # those of the family's architectures the mapping covers
    rows: tuple  # mapping.Row, the router's and routed experts' excepted
    args_from_config: Callable  # (HFConfig, mtp_layers) -> argparse.Namespace
    config_from_args: Callable  # (args, ModelSpec) -> dict (a new config.json, expert counts aside)
    ignored: tuple = ()  # mapping.Ignored
    mtp_prefix: str | None = None  # where HF keeps MTP layer k when not at `model.layers.{N + k}.`
    qkv_groups: Callable | None = None  # (args) -> (heads, groups, head_dim) for the qkv transform
    # (args) -> (head_dim, rotated dims, interleave) for the rope_last transform (`mapping.rope_last_order`)
    rope_layout: Callable | None = None
    # (view) -> bool: a Megatron checkpoint of this family's shape. Megatron -> HF writes the first
    # family of the registry whose mapping claims the view, else the one marked `default` (whose
    # checks then say what the model lacks); claims are only what tells the families apart,
    # `config_from_args` refuses the rest
    claims: Callable | None = None
    default: bool = False
    # the `names.py` spellings the Megatron version that runs this family saves in legacy files
    # (DeepSeek-V4, Megatron-LM dev: "mtp_model_layer"); HF -> Megatron writes them
    variants: frozenset = frozenset()
    # a hash table's canonical name and (HF, Megatron) dtypes, where the family has one
    # (DeepSeek-V4: Megatron-LM dev's `mlp.router.tid2eid`, int64 in transformers, int32 there)
    hash_table: tuple[str, tuple[str, str]] | None = None


def local_spec_args(**fields) -> argparse.Namespace:
    """Megatron args shared by every HF-derived model: RMSNorm, SwiGLU, no linear biases, rotary
    positions; the names written are megatron-core's local (non-TE) spec names, as MindSpeed-LLM
    saves them, so `transformer_impl` says local. Parallel sizes are 1 (a writer sets its target)."""
    base = dict(
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        transformer_impl="local",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        ckpt_format="torch",
        iteration=0,
        use_distributed_optimizer=False,
        make_vocab_size_divisible_by=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(fields)
    return argparse.Namespace(**base)


def dtype_fields(config) -> dict:
    """`params_dtype`, `bf16`, `fp16` from config.json's `dtype` (or older `torch_dtype`)."""
    import torch

    name = config.data.get("dtype") or config.data.get("torch_dtype") or "bfloat16"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name)
    if dtype is None:
        raise CheckpointError(f"{config.path}: dtype {name!r} is not bfloat16, float16 or float32; fix config.json")
    return {"params_dtype": dtype, "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}


def dtype_name(args) -> str:
    import torch

    # validate_args derives params_dtype from the flags: float32 unless bf16 or fp16
    dtype = ma.arg(args, "params_dtype")
    if ma.arg_bool(args, "bf16") or dtype == torch.bfloat16:
        return "bfloat16"
    if ma.arg_bool(args, "fp16") or dtype == torch.float16:
        return "float16"
    return "float32"


def require(args, checks: list[tuple[str, object, object]], family: str) -> None:
    """Refuse Megatron args an HF model of `family` cannot express: (field, found, expected)."""
    for field, found, expected in checks:
        if found != expected:
            raise CheckpointError(
                f"Megatron args {field} is {found!r} but a {family} checkpoint on Hugging Face "
                f"needs {expected!r}; this model has no HF equivalent in that family"
            )
