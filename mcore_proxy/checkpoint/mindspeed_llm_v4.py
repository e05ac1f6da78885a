"""MindSpeed-LLM's names, shardings and args for DeepSeek-V4, and the mapping to Megatron-LM dev's.

mcore-proxy's canonical DeepSeek-V4 names are Megatron-LM dev's (`checkpoint/hf/deepseek_v4.py`).
MindSpeed-LLM has its own DeepSeek-V4 (`--spec mindspeed_llm.tasks.models.spec.deepseek4_spec
layer_spec`, `--transformer-impl local`, `--ckpt-format torch`), saved under other names and
shardings. Facts from MindSpeed-LLM at c77308a1: its converter
`mindspeed_llm/tasks/checkpoint/convert_ckpt_deepseek4.py` (names, TP chunks, the saved dict), the
model `mindspeed_llm/tasks/models/transformer/deepseek4/{csa,compressor,mhc}.py`, and the args of
`examples/mcore/deepseek4_flash/pretrain_deepseek4_flash_4k_A3_ptd.sh` with their definitions under
`mindspeed_llm/features_manager/`:

  Megatron-LM dev (canonical)                       MindSpeed-LLM                          TP split
  self_attention.linear_q_down_proj.weight          self_attention.linear_q.weight          replicated
  self_attention.linear_q_up_proj.weight            (same)                                   rows
  self_attention.linear_kv_proj.weight              self_attention.linear_kv.weight         replicated
  self_attention.linear_o_group_proj                self_attention.linear_o_down_proj.weight rows (groups)
  self_attention.linear_proj.weight                 self_attention.linear_o_up_proj.weight  columns
  self_attention.core_attention.attn_sink           self_attention.attn_sink                rows (heads)
  ...core_attention.compressor.linear_{wkv,wgate}   self_attention.compressor.{wkv,wgate}   replicated
  ...core_attention.indexer.compressor.*            self_attention.indexer.kv_compressor.*  replicated
  ...core_attention.indexer.linear_{wq_b,weights_proj} self_attention.indexer.{wq_b,weights_proj} replicated
  {self_attention,mlp}_hyper_connection.            {attn,mlp}_mhc.
    mapping_proj.weight / bias                        hc_fn.weight / hc_base                replicated
    alpha_pre, alpha_post, alpha_res ([1] each)       hc_scale ([3], in that order)          replicated
  decoder.hc_head_{fn,base,scale}                   hc_head.hc_fn.weight / hc_base / hc_scale
  decoder.final_layernorm                           final_layernorm (names.NAME_VARIANTS)
  mtp.layers.{k}.e_proj, h_proj [H, H]              mtp.layers.{k}.eh_proj [H, 2H] = [e | h] rows
  mtp.layers.{k}.hc_head_*                          mtp.layers.{k}.hc_head.* (as above)
  mtp.layers.{k}.final_layernorm                    mtp.final_layernorms.{k} (NAME_VARIANTS)

Everything else (layer norms, q/kv layernorms, router weight and expert_bias, experts, shared
experts, embedding, output layer, MTP enorm/hnorm and `transformer_layer`) has megatron-core's name
and split; experts are per-expert modules or GroupedMLP `weight1`/`weight2` (`--moe-grouped-gemm`).
The hash table `mlp.router.tid2eid` is an int64 Parameter there (router.py), an int32 buffer in the
dev tree. MindSpeed-LLM builds its MTP layers without compressor or indexer (csa.py; its converter
drops them): a model whose MTP layer has them loses them when written in these names, with a
warning. The sharding rows of the MindSpeed names are in `sharding.py` (layer spec "mindspeed_llm").

Args: MindSpeed-LLM's own (`--enable-mhc --hc-mult`, `--n-hash-layers`, `--compress-ratios` per
decoder layer (none for MTP layers), `--sliding-window-size`, `--o-groups --o-lora-rank`,
`--enable-dsa-indexer --index-n-heads --index-head-dim --index-topk`, `--compress-rope-theta
--rope-factor --original-seq-len`, `--swiglu-limit`, `--position-embedding-type deepseek4`,
`--first-k-dense-replace -1`); `qk_head_dim` is the whole head dimension there (csa.py), not
Megatron's head dimension without RoPE; `kv_lora_rank` and `v_head_dim` are not read by its V4
attention (written as the head dimension). Its compressed layers use YaRN at `compress_rope_theta`
with `rope_factor` from `original_seq_len` on (0: off; the dev tree's `rotary_scaling_factor`,
`original_max_position_embeddings`), its sliding-window layers plain RoPE (deepseek4_model.py,
deepseek_utils.py). `canonical_args` adds the dev tree's fields to a MindSpeed-LLM namespace
(readers); `mindspeed_args` gives the MindSpeed-LLM namespace of dev args (writers).

Proven against checkpoints derived from the HF model the way MindSpeed-LLM's converter writes them
(`testing/mindspeed_v4.py`, tests/checkpoint/test_mindspeed_llm_v4.py); no MindSpeed-LLM model runs
here (it needs the Ascend stack).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcore_proxy.checkpoint.names import MTP_MODEL_LAYER, canonical_sort_key
from mcore_proxy.checkpoint.view import ModelView
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.core.tensors import cast, cat
from mcore_proxy.mcore.megatron_args import arg_float, arg_int, arg_list
from mcore_proxy.core.dtypes import torch_dtype
from mcore_proxy.mcore.sharding import MINDSPEED_SPEC

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

VARIANT = "dsv4_hybrid"  # Megatron-LM dev's experimental_attention_variant
# the hash table: an int64 Parameter in MindSpeed-LLM (router.py), an int32 buffer in Megatron-LM dev
HASH_TABLE, MINDSPEED_HASH_DTYPE, DEV_HASH_DTYPE = ".mlp.router.tid2eid", "int64", "int32"
SCALE_PARTS = ("pre", "post", "res")  # hc_scale [3] rows, mhc.py's order (alpha_pre, alpha_post, alpha_res)

_LAYER = r"^(?P<p>decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\."
_CORE = "self_attention.core_attention."


def _compressor(canonical: str, mindspeed: str) -> tuple[tuple[str, str], ...]:
    return (
        (f"{canonical}.linear_wkv.weight", f"{mindspeed}.wkv.weight"),
        (f"{canonical}.linear_wgate.weight", f"{mindspeed}.wgate.weight"),
        (f"{canonical}.ape", f"{mindspeed}.ape"),
        (f"{canonical}.norm.weight", f"{mindspeed}.norm.weight"),
    )


# one-to-one renames inside a decoder (or MTP) layer: (Megatron-LM dev, MindSpeed-LLM)
LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    ("self_attention.linear_q_down_proj.weight", "self_attention.linear_q.weight"),
    ("self_attention.linear_kv_proj.weight", "self_attention.linear_kv.weight"),
    ("self_attention.linear_o_group_proj", "self_attention.linear_o_down_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attention.linear_o_up_proj.weight"),
    (_CORE + "attn_sink", "self_attention.attn_sink"),
    *_compressor(_CORE + "compressor", "self_attention.compressor"),
    *_compressor(_CORE + "indexer.compressor", "self_attention.indexer.kv_compressor"),
    (_CORE + "indexer.linear_wq_b.weight", "self_attention.indexer.wq_b.weight"),
    (_CORE + "indexer.linear_weights_proj.weight", "self_attention.indexer.weights_proj.weight"),
    *(
        (f"{dev}_hyper_connection.mapping_proj.weight", f"{ms}_mhc.hc_fn.weight")
        for dev, ms in (("self_attention", "attn"), ("mlp", "mlp"))
    ),
    *(
        (f"{dev}_hyper_connection.bias", f"{ms}_mhc.hc_base")
        for dev, ms in (("self_attention", "attn"), ("mlp", "mlp"))
    ),
)
# whole-name renames: the head's hyper-connection (main model and each MTP layer)
_HEAD = (
    ("hc_head_fn", "hc_head.hc_fn.weight"),
    ("hc_head_base", "hc_head.hc_base"),
    ("hc_head_scale", "hc_head.hc_scale"),
)

_TO_MS = {dev: ms for dev, ms in LAYER_RENAMES}
_TO_DEV = {ms: dev for dev, ms in LAYER_RENAMES}
_LAYER_RE = re.compile(_LAYER + r"(?P<s>.+)$")
_HEAD_RE = re.compile(r"^(?P<p>decoder\.|mtp\.layers\.\d+\.)(?P<s>hc_head_(?:fn|base|scale))$")
_MS_HEAD_RE = re.compile(r"^(?P<p>|mtp\.layers\.\d+\.)(?P<s>hc_head\.(?:hc_fn\.weight|hc_base|hc_scale))$")
_ALPHA = re.compile(_LAYER + r"(?P<m>self_attention|mlp)_hyper_connection\.alpha_(?P<part>pre|post|res)$")
_SCALE = re.compile(_LAYER + r"(?P<m>attn|mlp)_mhc\.hc_scale$")
_EH = re.compile(r"^(?P<p>mtp\.layers\.\d+)\.(?P<w>e|h)_proj\.weight$")
_EH_FUSED = re.compile(r"^(?P<p>mtp\.layers\.\d+)\.eh_proj\.weight$")
_MHC_OF = {"self_attention": "attn", "mlp": "mlp", "attn": "self_attention"}
# what MindSpeed-LLM's MTP layers do not have: its attention builds them without compression (csa.py)
_WARNED: set = set()
_MTP_COMPRESSION = re.compile(
    r"^mtp\.layers\.\d+\.transformer_layer\.self_attention\.core_attention\."
    r"(compressor|indexer)\."
)


@dataclass(frozen=True)
class MindSpeedV4Naming:
    """MindSpeed-LLM's naming of DeepSeek-V4 (a view's or a writer's `naming`).

    mtp: the model has MTP layers (their final norms are `mtp.final_layernorms.{k}`)."""

    mtp: bool = False
    mla_mm_split = False  # what `mindspeed_llm.naming_args` asks of any MindSpeed-LLM naming

    def variants(self) -> frozenset[str]:
        """The names.NAME_VARIANTS spellings this naming uses beside its own renames."""
        return frozenset({"final_layernorm_top"} | ({"mtp_final_layernorms"} if self.mtp else set()))

    def megatron_info(self, info):
        """The ViewInfo `info` of a source in this naming as Megatron-LM dev saves the same model: its
        Transformer Engine spec (`_extra_state` beside each linear) and legacy files naming the MTP
        layer's decoder layer `mtp_model_layer`, as `checkpoint/hf/deepseek_v4.py` writes it."""
        args = copy.copy(info.args)
        for key in _MINDSPEED_ONLY:
            if hasattr(args, key):
                delattr(args, key)
        args.transformer_impl, args.position_embedding_type = "transformer_engine", "rope"
        return dataclasses.replace(
            info,
            naming=None,
            args=args,
            linear_extra_state=True,
            variants=(info.variants - self.variants()) | ({MTP_MODEL_LAYER} if self.mtp else set()),
        )

    def describe(self) -> str:
        return "MindSpeed-LLM (DeepSeek-V4)"


# -- keys ------------------------------------------------------------------------------------------


def to_mindspeed_key(name: str) -> str:
    """Megatron-LM dev name -> MindSpeed-LLM key (before NAME_VARIANTS) for the one-to-one renames;
    the fused members (alpha_*, e_proj / h_proj) map to their fused key."""
    if m := _ALPHA.match(name):
        return f"{m['p']}.{_MHC_OF[m['m']]}_mhc.hc_scale"
    if m := _EH.match(name):
        return f"{m['p']}.eh_proj.weight"
    if m := _HEAD_RE.match(name):
        return ("" if m["p"] == "decoder." else m["p"]) + dict(_HEAD)[m["s"]]
    if (m := _LAYER_RE.match(name)) and m["s"] in _TO_MS:
        return f"{m['p']}.{_TO_MS[m['s']]}"
    return name


def to_canonical_keys(key: str) -> tuple[str, ...]:
    """MindSpeed-LLM key (after NAME_VARIANTS) -> the Megatron-LM dev name(s) it holds, in the order
    of the fused tensor's parts (hc_scale: alpha_pre, alpha_post, alpha_res; eh_proj: e, h)."""
    if m := _SCALE.match(key):
        return tuple(f"{m['p']}.{_MHC_OF[m['m']]}_hyper_connection.alpha_{part}" for part in SCALE_PARTS)
    if m := _EH_FUSED.match(key):
        return (f"{m['p']}.e_proj.weight", f"{m['p']}.h_proj.weight")
    if m := _MS_HEAD_RE.match(key):
        return ((m["p"] or "decoder.") + {ms: dev for dev, ms in _HEAD}[m["s"]],)
    if (m := _LAYER_RE.match(key)) and m["s"] in _TO_DEV:
        return (f"{m['p']}.{_TO_DEV[m['s']]}",)
    return (key,)


# -- tensors (full, or one TP shard of whole rows for eh_proj) --------------------------------------


def fuse(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts of a fused MindSpeed-LLM tensor (`to_canonical_keys` order) -> the tensor as saved:
    hc_scale [3] from three [1]; eh_proj [R, 2H] from e [R, H] and h [R, H]. (Readers take the
    parts back as slices: `part_slices`.)"""
    return cat(parts, dim=1 if _EH_FUSED.match(key) else 0)


def part_slices(key: str, hidden: int) -> list[tuple[int, int, int]]:
    """(dim, start, count) of each canonical part inside the fused tensor `key`."""
    if _EH_FUSED.match(key):
        return [(1, 0, hidden), (1, hidden, hidden)]
    return [(0, i, 1) for i in range(len(SCALE_PARTS))]


# -- args ------------------------------------------------------------------------------------------


def is_mindspeed_v4(args) -> bool:
    """Args MindSpeed-LLM saved for its DeepSeek-V4: `enable_mhc` with per-layer `compress_ratios`,
    and not Megatron-LM dev's variant."""
    return (
        args is not None
        and bool(getattr(args, "enable_mhc", False))
        and getattr(args, "compress_ratios", None) is not None
        and getattr(args, "experimental_attention_variant", None) != VARIANT
    )


def _need(args, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if getattr(args, f, None) is None]
    if missing:
        raise CheckpointError(
            f"{where}: MindSpeed-LLM's DeepSeek-V4 args lack {missing}; mcore-proxy reads the "
            "args its pretrain_deepseek4.py saves (fix the args)"
        )


def canonical_args(args, where: str = "args"):
    """A copy of MindSpeed-LLM's DeepSeek-V4 `args` with Megatron-LM dev's fields added (the ones
    the two spell alike, and MindSpeed-LLM's own fields, stay)."""
    _need(
        args,
        (
            "num_attention_heads",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window_size",
            "compress_ratios",
            "hc_mult",
        ),
        where,
    )
    heads, head_dim, rope = (
        arg_int(args, f, where) for f in ("num_attention_heads", "qk_head_dim", "qk_pos_emb_head_dim")
    )
    out = copy.copy(args)
    original = int(getattr(args, "original_seq_len", 0) or 0)  # 0: YaRN off (deepseek_utils.precompute_freqs_cis)
    factor = float(getattr(args, "rope_factor", 1.0) or 1.0) if original > 0 else 1.0
    layers, mtp = arg_int(args, "num_layers", where), arg_int(args, "mtp_num_layers", where) or 0
    fields = dict(
        experimental_attention_variant=VARIANT,
        multi_latent_attention=True,
        group_query_attention=False,
        num_query_groups=heads,
        kv_channels=head_dim,
        qk_head_dim=head_dim - rope,
        v_head_dim=head_dim,
        kv_lora_rank=head_dim - rope,
        qk_layernorm=True,
        csa_window_size=arg_int(args, "sliding_window_size", where),
        # decoder layers only; MindSpeed-LLM builds MTP layers without compression (csa.py)
        csa_compress_ratios=[int(r) for r in args.compress_ratios][:layers] + [0] * mtp,
        csa_compress_rotary_base=float(getattr(args, "compress_rope_theta", 40000.0)),
        rope_type="yarn",
        rotary_scaling_factor=factor,
        mscale=1.0,
        mscale_all_dim=0.0,
        original_max_position_embeddings=original or None,
        dsa_indexer_n_heads=getattr(args, "index_n_heads", None),
        dsa_indexer_head_dim=getattr(args, "index_head_dim", None),
        dsa_indexer_topk=getattr(args, "index_topk", None),
        moe_n_hash_layers=int(getattr(args, "n_hash_layers", 0) or 0),
        activation_func_clamp_value=getattr(args, "swiglu_limit", None),
        enable_hyper_connections=True,
        num_residual_streams=arg_int(args, "hc_mult", where),
        mhc_sinkhorn_iterations=int(getattr(args, "hc_sinkhorn_iters", 20) or 20),
    )
    for key, value in fields.items():
        setattr(out, key, value)
    return out


# Megatron-LM dev fields MindSpeed-LLM has under another name or not at all
_DEV_ONLY = (
    "experimental_attention_variant",
    "csa_window_size",
    "csa_compress_ratios",
    "csa_compress_rotary_base",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "original_max_position_embeddings",
    "dsa_indexer_n_heads",
    "dsa_indexer_head_dim",
    "dsa_indexer_topk",
    "moe_n_hash_layers",
    "activation_func_clamp_value",
    "enable_hyper_connections",
    "num_residual_streams",
    "mhc_sinkhorn_iterations",
    "kv_channels",
    "group_query_attention",
)


# MindSpeed-LLM fields Megatron-LM dev has under another name or not at all
_MINDSPEED_ONLY = (
    "enable_mhc",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "n_hash_layers",
    "compress_ratios",
    "sliding_window_size",
    "compress_rope_theta",
    "rope_factor",
    "original_seq_len",
    "rope_theta",
    "kv_compress",
    "enable_dsa_indexer",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "swiglu_limit",
    "first_k_dense_replace",
    "spec",
    "mtp_spec",
    "mla_mm_split",
)


def mindspeed_args(args):
    """MindSpeed-LLM's DeepSeek-V4 args from Megatron-LM dev `args` (a copy): its field names and
    meanings, MindSpeed-LLM's local spec and `deepseek4` position embedding."""
    head_dim = arg_int(args, "v_head_dim", minimum=1)
    factor = arg_float(args, "rotary_scaling_factor")
    layers = arg_int(args, "num_layers", minimum=1)
    out = copy.copy(args)
    fields = dict(
        enable_mhc=True,
        hc_mult=arg_int(args, "num_residual_streams", minimum=1),
        hc_sinkhorn_iters=arg_int(args, "mhc_sinkhorn_iterations", minimum=1),
        hc_eps=1e-6,
        n_hash_layers=arg_int(args, "moe_n_hash_layers", maximum=layers),
        # no MTP entries
        compress_ratios=arg_list(args, "csa_compress_ratios", needed="DeepSeek-V4")[:layers],
        sliding_window_size=arg_int(args, "csa_window_size", minimum=1),
        compress_rope_theta=arg_float(args, "csa_compress_rotary_base"),
        rope_factor=factor,
        rope_scaling_type="yarn" if factor != 1.0 else None,
        original_seq_len=arg_int(args, "original_max_position_embeddings", minimum=1) if factor != 1.0 else 0,
        rope_theta=arg_float(args, "rotary_base"),
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        kv_lora_rank=head_dim,
        kv_compress=True,
        qk_layernorm=True,
        multi_latent_attention=True,
        enable_dsa_indexer=arg_int(args, "dsa_indexer_n_heads", minimum=1) is not None,
        index_n_heads=arg_int(args, "dsa_indexer_n_heads", minimum=1),
        index_head_dim=arg_int(args, "dsa_indexer_head_dim", minimum=1),
        index_topk=arg_int(args, "dsa_indexer_topk", minimum=1),
        swiglu_limit=arg_float(args, "activation_func_clamp_value"),
        first_k_dense_replace=-1,
        moe_layer_freq=1,
        position_embedding_type="deepseek4",
        transformer_impl="local",
        spec=["mindspeed_llm.tasks.models.spec.deepseek4_spec", "layer_spec"],
        mtp_spec=["mindspeed_llm.tasks.models.spec.deepseek4_spec", "mtp_spec"],
    )
    for key in _DEV_ONLY:
        if hasattr(out, key):
            delattr(out, key)
    for key, value in fields.items():
        setattr(out, key, value)
    return out


# MindSpeed-LLM's launch flags of the model shape (args field, flag, kind as in launch_flags.FLAGS);
# the spellings of pretrain_deepseek4_flash_4k_A3_ptd.sh
FLAGS = (
    ("num_layers", "--num-layers", "value"),
    ("hidden_size", "--hidden-size", "value"),
    ("ffn_hidden_size", "--ffn-hidden-size", "value"),
    ("num_attention_heads", "--num-attention-heads", "value"),
    ("multi_latent_attention", "--multi-latent-attention", "true"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", "value"),
    ("qk_head_dim", "--qk-head-dim", "value"),
    ("q_lora_rank", "--q-lora-rank", "value"),
    ("o_lora_rank", "--o-lora-rank", "value"),
    ("kv_lora_rank", "--kv-lora-rank", "value"),
    ("v_head_dim", "--v-head-dim", "value"),
    ("qk_layernorm", "--qk-layernorm", "true"),
    ("kv_compress", "--kv-compress", "true"),
    ("o_groups", "--o-groups", "value"),
    ("sliding_window_size", "--sliding-window-size", "value"),
    ("original_seq_len", "--original-seq-len", "value"),
    ("rope_factor", "--rope-factor", "value"),
    ("compress_rope_theta", "--compress-rope-theta", "value"),
    ("compress_ratios", "--compress-ratios", "spaced"),
    ("beta_fast", "--beta-fast", "value"),
    ("beta_slow", "--beta-slow", "value"),
    ("enable_dsa_indexer", "--enable-dsa-indexer", "true"),
    ("index_n_heads", "--index-n-heads", "value"),
    ("index_head_dim", "--index-head-dim", "value"),
    ("index_topk", "--index-topk", "value"),
    ("enable_mhc", "--enable-mhc", "true"),
    ("hc_mult", "--hc-mult", "value"),
    ("hc_sinkhorn_iters", "--hc-sinkhorn-iters", "value"),
    ("first_k_dense_replace", "--first-k-dense-replace", "value"),
    ("moe_layer_freq", "--moe-layer-freq", "value"),
    ("num_experts", "--num-experts", "value"),
    ("moe_router_topk", "--moe-router-topk", "value"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", "value"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", "value"),
    ("moe_router_score_function", "--moe-router-score-function", "value"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", "true"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", "value"),
    ("n_hash_layers", "--n-hash-layers", "value"),
    ("swiglu_limit", "--swiglu-limit", "value"),
    ("mtp_num_layers", "--mtp-num-layers", "value"),
    ("position_embedding_type", "--position-embedding-type", "value"),
    ("rotary_base", "--rotary-base", "value"),
    ("normalization", "--normalization", "value"),
    ("norm_epsilon", "--norm-epsilon", "value"),
    ("swiglu", "--swiglu", "true"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", "true"),
    ("max_position_embeddings", "--max-position-embeddings", "value"),
    ("padded_vocab_size", "--padded-vocab-size", "value"),
    ("bf16", "--bf16", "true"),
    ("fp16", "--fp16", "true"),
)


def launch_flags(args) -> list[str]:
    """MindSpeed-LLM's model flags for DeepSeek-V4 `args` (MindSpeed-LLM's namespace)."""
    from mcore_proxy.mcore.launch_flags import model_flags

    return [
        "--transformer-impl local",
        "--spec mindspeed_llm.tasks.models.spec.deepseek4_spec layer_spec",
        "--mtp-spec mindspeed_llm.tasks.models.spec.deepseek4_spec mtp_spec",
        *model_flags(args, FLAGS),
    ]


# -- writing: a canonical view seen under MindSpeed-LLM's names --------------------------------------


class MindSpeedV4NamedView(ModelView):
    """A DeepSeek-V4 view with Megatron-LM dev names seen under MindSpeed-LLM's (full tensors,
    global layers), for writers: hc_scale and eh_proj fused, the rest renamed; the NAME_VARIANTS
    spellings (final norms) are left to the writer (`info.variants`); args MindSpeed-LLM's; layer
    spec "mindspeed_llm" (its sharding rows)."""

    def __init__(self, view: ModelView, naming: MindSpeedV4Naming):
        super().__init__(
            dataclasses.replace(
                view.info,
                naming=naming,
                layer_spec=MINDSPEED_SPEC,
                args=mindspeed_args(view.args),
                linear_extra_state=False,  # MindSpeed-LLM's local spec: no Transformer Engine metadata
                variants=(view.info.variants - {MTP_MODEL_LAYER}) | naming.variants(),
            )
        )
        self.source = view
        self._sources: dict[str, list[str]] = {}
        dropped = [n for n in view.names() if _MTP_COMPRESSION.match(n)]
        if dropped and view.info.path not in _WARNED:  # once per source, not per writer pass
            _WARNED.add(view.info.path)
            log.warning(
                "%s: MindSpeed-LLM builds its MTP layers without compressor or indexer (csa.py; its converter "
                "drops them too), so %d tensors such as %s are not written",
                view.info.path or "the model",
                len(dropped),
                dropped[0],
            )
        for name in view.names():
            if not _MTP_COMPRESSION.match(name):
                self._sources.setdefault(to_mindspeed_key(name), []).append(name)
        for key, names in self._sources.items():
            want = to_canonical_keys(key)
            if len(want) > 1 and sorted(names) != sorted(want):
                raise CheckpointError(
                    f"{view.info.path or 'the checkpoint'}: {key} needs {list(want)} but the view "
                    f"holds {names}; the model is incomplete"
                )
            names.sort(key=want.index)
        self._names = sorted(self._sources, key=canonical_sort_key)

    def names(self) -> list[str]:
        return list(self._names)

    def get(self, key: str):
        src = self._sources[key]
        if len(src) > 1:
            return fuse(key, [self.source.get(n) for n in src])
        value = self.source.get(src[0])
        return cast(value, MINDSPEED_HASH_DTYPE) if key.endswith(HASH_TABLE) else value

    def shape(self, key: str):
        src = self._sources[key]
        if len(src) == 1:
            return self.source.shape(src[0])
        shapes = [self.source.shape(n) for n in src]
        dim = 1 if _EH_FUSED.match(key) else 0
        out = list(shapes[0])
        out[dim] = sum(s[dim] for s in shapes)
        return tuple(out)

    def dtype(self, key: str):
        if key.endswith(HASH_TABLE):
            return torch_dtype(MINDSPEED_HASH_DTYPE)
        return self.source.dtype(self._sources[key][0])

    def dtype_name(self, key: str):
        if key.endswith(HASH_TABLE):
            return MINDSPEED_HASH_DTYPE
        return self.source.dtype_name(self._sources[key][0])

    def prefetch(self, names: list[str]) -> None:
        self.source.prefetch([n for k in names for n in self._sources.get(k, ())])
