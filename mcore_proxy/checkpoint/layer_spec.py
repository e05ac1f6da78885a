"""Which megatron-core layer spec saved a checkpoint: the local one or Transformer Engine's.

It matters for one thing in the sharding table (`sharding.py`): multi-latent attention's down
projections `linear_q_down_proj` [q_lora, H] and `linear_kv_down_proj` [kv_lora + rope, H] are
column-parallel in the local spec (`ColumnParallelLinear`, rank shard [q_lora / TP, H]) but
duplicated in the Transformer Engine spec (`TELinear(parallel_mode="duplicated")`, the full
tensor on every TP rank), megatron-core 0.16.1 `transformer/multi_latent_attention.py`. The
Transformer Engine spec also fuses MLA's latent norms into the up projections
(`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`) where the local
spec has `q_layernorm.weight` / `kv_layernorm.weight`. Those names are kept as saved (canonical
names follow the checkpoint's spec; both are replicated).

How the spec is decided, first match wins:
  1. a fused MLA norm key (`...linear_q_up_proj.layer_norm_weight`) -> Transformer Engine;
  2. a rank-local down projection whose dim 0 is the full `q_lora_rank` (or `kv_lora_rank +
     qk_pos_emb_head_dim`) at TP > 1 -> Transformer Engine (duplicated); the size / TP -> local;
  3. a separate `q_layernorm.weight` / `kv_layernorm.weight` of an MLA layer -> local (not for
     DeepSeek-V4's hybrid attention, whose Transformer Engine spec keeps them separate);
  4. `args.transformer_impl` ("local" or "transformer_engine"; absent: Megatron's default,
     transformer_engine, `megatron_args.DEFAULTS`).
MindSpeed-LLM's MLA names (`checkpoint/mindspeed_llm.py`) are a third layout, "mindspeed_llm": the
legacy reader detects them before asking this module and reads them as the local spec's tensors.
Evidence from the tensors that contradicts an explicit `args.transformer_impl` is refused: the args
then do not describe the files, and guessing would split the down projections wrongly. Without
MLA the spec changes no split, and rules 2-3 do not apply.
"""

from __future__ import annotations

import re

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.megatron_args import DEFAULTS, arg, arg_int
from mcore_proxy.mcore.sharding import LOCAL_SPEC, TE_SPEC

_FUSED_MLA_NORM = re.compile(r"\.self_attention\.linear_(q|kv)_up_proj\.layer_norm_weight$")
_MLA_NORM = re.compile(r"\.self_attention\.(q|kv)_layernorm\.weight$")
_DOWN = re.compile(r"\.self_attention\.linear_(q|kv)_down_proj\.weight$")
# MindSpeed-LLM's MLA names (checkpoint/mindspeed_llm.py): the legacy reader maps them before it asks
# for a spec; anywhere else (torch_dist) they are refused, since `linear_qkv` would otherwise match
# GQA's column-parallel row and its TP copies be joined wrongly.
_MINDSPEED_MLA = re.compile(
    r"\.self_attention\.(linear_qkv|linear_qb|linear_kvb|linear_qk_nope|linear_qk_rope"
    r"|linear_kv_nope|linear_v)\.weight$"
)


def attention_kind(args) -> str:
    """ "mla" (multi-latent attention) or "gqa" (`linear_qkv`, multi-head included)."""
    return "mla" if arg(args, "multi_latent_attention") else "gqa"


def _from_tensors(args, shapes: dict[str, tuple[int, ...] | None], tp: int) -> tuple[str, str] | None:
    """(spec, the key that shows it) from rank-local keys and shapes, or None if they do not say."""
    for key in shapes:
        if _FUSED_MLA_NORM.search(key):
            return TE_SPEC, key
    if attention_kind(args) != "mla":
        return None
    q_lora = arg_int(args, "q_lora_rank")
    kv_full = (arg_int(args, "kv_lora_rank") or 0) + (arg_int(args, "qk_pos_emb_head_dim") or 0)
    for key, shape in shapes.items():
        m = _DOWN.search(key)
        if m and shape and tp > 1:
            full = q_lora if m.group(1) == "q" else kv_full
            if full and shape[0] == full:
                return TE_SPEC, key
            if full and shape[0] * tp == full:
                return LOCAL_SPEC, key
    if arg(args, "experimental_attention_variant") == "dsv4_hybrid":
        return None
    for key in shapes:
        if _MLA_NORM.search(key):
            return LOCAL_SPEC, key
    return None


def infer_layer_spec(args, shapes: dict[str, tuple[int, ...] | None], tp: int = 1, where: str = "args") -> str:
    """LOCAL_SPEC or TE_SPEC for a checkpoint with Megatron `args` and rank-local (legacy) or
    global (torch_dist: pass tp=1) `shapes` per key; see the module docstring for the rules."""
    said = getattr(args, "transformer_impl", None)  # explicit only; arg() would give the default
    if not isinstance(said, str):
        # not a name (e.g. an unpickled call kept inert): decide from the tensors; writers refuse
        # such an args field by name (safe_globals.writable_args)
        said = None
    if said not in (None, LOCAL_SPEC, TE_SPEC):
        raise CheckpointError(
            f"{where}: args transformer_impl is {said!r}, expected 'local' or 'transformer_engine'; fix the args"
        )
    if attention_kind(args) == "mla":
        for key in shapes:
            if _MINDSPEED_MLA.search(key):
                raise CheckpointError(
                    f"{where}: tensor {key} is MindSpeed-LLM's naming of multi-latent attention, which "
                    "mcore-proxy maps in legacy (--ckpt-format torch) checkpoints only; the nearest supported "
                    "kind is megatron-core's MLA names (linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, "
                    "linear_kv_up_proj) or MindSpeed-LLM's legacy checkpoint: save it with --ckpt-format torch"
                )
    found = _from_tensors(args, shapes, tp)
    if found is None:
        return said or DEFAULTS["transformer_impl"]
    spec, key = found
    if said is not None and said != spec:
        raise CheckpointError(
            f"{where}: tensor {key} is laid out as the {spec} layer spec saves it, but "
            f"args transformer_impl says {said!r}; the args do not describe these files, "
            "fix transformer_impl in the args"
        )
    return spec
