"""The name registry of the Megatron family: canonical names, and the keys each format stores.

Canonical names (DESIGN.md 4.3) are megatron-core module names with global layer numbers and one
key per routed expert. This module holds everything that maps them:
  - their order and streaming units (`canonical_sort_key`, `group_of`);
  - legacy rank files: rank-local keys (local layer numbers, local experts, the expert module
    types of `EXPERT_LAYOUTS`, the MindSpeed-LLM / older spellings of `NAME_VARIANTS`);
  - torch_dist: ShardedTensor keys (`KeyStyle`, `parse_dist_key`; stacked layer and expert axes,
    the local spec's norms under TE's fused-norm keys in `LOCAL_SPEC_RENAMES`).
Data first: a new spelling is a row in one of the tables. Readers and writers both resolve names
through the functions below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.megatron_args import arg
from mcore_proxy.mcore.spec import homogeneous_layers

# -- canonical names ---------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^(decoder\.layers\.(\d+)|mtp\.layers\.(\d+))\.")
_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# Weights of megatron-core linear modules (the local ones save `_extra_state: None` beside them):
# `linear_*` layers, the output layer and MTP's `eh_proj` (a ColumnParallelLinear; with DeepSeek-V4's
# hyper-connections Megatron-LM keeps it as `e_proj` and `h_proj`).
LINEAR_WEIGHT = re.compile(r"^(.*\.linear_[a-z0-9_]+|.*\.eh_proj|.*\.[eh]_proj|output_layer)\.weight$")


def group_of(name: str) -> str:
    """Streaming unit of a canonical name: a layer id (`"3"`, `"mtp.0"`) or `"other"`."""
    m = _LAYER_RE.match(name)
    if not m:
        return "other"
    return m.group(2) if m.group(2) is not None else f"mtp.{m.group(3)}"


def layer_number(name: str) -> int | None:
    """The global decoder layer of `decoder.layers.{L}.…` names, None for other names."""
    m = _DECODER_LAYER.match(name)
    return int(m.group(1)) if m else None


def mtp_depth(name: str) -> int | None:
    """The MTP depth of `mtp.layers.{j}.…` names, None for other names."""
    m = _LAYER_RE.match(name)
    return int(m.group(3)) if m and m.group(3) is not None else None


def canonical_sort_key(name: str):
    """Embedding first, decoder layers in order (experts by id), final norm/output, then MTP."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    if m:
        e = re.match(r"^mlp\.experts\.(\d+)\.(.*)$", m.group(2))
        return (1, int(m.group(1)), 1 if e else 0, int(e.group(1)) if e else 0, name)
    m = re.match(r"^mtp\.layers\.(\d+)\.(.*)$", name)
    if m:
        return (3, int(m.group(1)), 0, 0, name)
    if name.startswith("embedding."):
        return (0, 0, 0, 0, name)
    return (2, 0, 0, 0, name)


def linear_extra_state(key: str) -> str | None:
    """The `_extra_state` key megatron's linear layers save beside a linear weight `key`
    (`X.linear_fc1.weight` -> `X.linear_fc1._extra_state`), None for other keys."""
    return key[: -len(".weight")] + "._extra_state" if LINEAR_WEIGHT.match(key) else None


# -- legacy rank files: rank-local keys ----------------------------------------------------------

# (variant id, source regex, canonical replacement, canonical regex, source replacement)
NAME_VARIANTS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "shared_expert_gate",
        r"^(.*)\.mlp\.shared_expert_gate\.weight$",
        r"\1.mlp.shared_experts.gate_weight",
        r"^(.*)\.mlp\.shared_experts\.gate_weight$",
        r"\1.mlp.shared_expert_gate.weight",
    ),
    (
        "mtp_final_layernorms",
        r"^mtp\.final_layernorms\.(\d+)\.weight$",
        r"mtp.layers.\1.final_layernorm.weight",
        r"^mtp\.layers\.(\d+)\.final_layernorm\.weight$",
        r"mtp.final_layernorms.\1.weight",
    ),
    # MindSpeed-LLM (checkpoint/mindspeed_llm.py): up projections before tag 2.2.0, the main model's
    # final norm with MTP, the DeepSeek-V3.2 indexer (`self_attention.dsa_indexer`)
    (
        "linear_qb",
        r"^(.*)\.self_attention\.linear_qb\.weight$",
        r"\1.self_attention.linear_q_up_proj.weight",
        r"^(.*)\.self_attention\.linear_q_up_proj\.weight$",
        r"\1.self_attention.linear_qb.weight",
    ),
    (
        "linear_kvb",
        r"^(.*)\.self_attention\.linear_kvb\.weight$",
        r"\1.self_attention.linear_kv_up_proj.weight",
        r"^(.*)\.self_attention\.linear_kv_up_proj\.weight$",
        r"\1.self_attention.linear_kvb.weight",
    ),
    (
        "final_layernorm_top",
        r"^final_layernorm\.(weight|bias)$",
        r"decoder.final_layernorm.\1",
        r"^decoder\.final_layernorm\.(weight|bias)$",
        r"final_layernorm.\1",
    ),
    (
        "dsa_indexer",
        r"^(.*)\.self_attention\.dsa_indexer\.(wq_b|wk|weights_proj)\.weight$",
        r"\1.self_attention.core_attention.indexer.linear_\2.weight",
        r"^(.*)\.self_attention\.core_attention\.indexer\.linear_(wq_b|wk|weights_proj)\.weight$",
        r"\1.self_attention.dsa_indexer.\2.weight",
    ),
    (
        "dsa_indexer",
        r"^(.*)\.self_attention\.dsa_indexer\.k_norm\.(weight|bias)$",
        r"\1.self_attention.core_attention.indexer.k_norm.\2",
        r"^(.*)\.self_attention\.core_attention\.indexer\.k_norm\.(weight|bias)$",
        r"\1.self_attention.dsa_indexer.k_norm.\2",
    ),
)

# Expert module types: SequentialMLP (one module per local expert), GroupedMLP (`weight1`,
# `weight2` holding every local expert), TEGroupedMLP (`linear_fc1.weight{j}`).
SEQUENTIAL, GROUPED, TE_GROUPED = "sequential", "grouped", "te_grouped"
EXPERT_LAYOUTS = (SEQUENTIAL, GROUPED, TE_GROUPED)

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQ_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.*)$")
_TE_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.weight([12])$")
_CANON_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class LocalKey:
    """How one rank-local key maps to canonical names.

    kind: "plain" (one canonical tensor), "expert" (one expert: SequentialMLP / TEGroupedMLP),
    "grouped" (GroupedMLP weight1/weight2: every local expert; `fc` is 1 or 2).
    """

    canonical: str  # for "grouped": the prefix `...mlp.experts`
    kind: str = "plain"
    local_expert: int = 0
    fc: int = 0
    expert_layout: str | None = None  # which expert module type the key reveals
    variant: str | None = None  # which NAME_VARIANTS spelling the key used


def to_global_layer(key: str, layer_offset: int) -> str:
    """`decoder.layers.{l}.X` -> `decoder.layers.{l + offset}.X`; other keys unchanged."""
    m = _LAYER_KEY.match(key)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else key


def to_local_layer(name: str, layer_offset: int) -> str:
    m = _LAYER_KEY.match(name)
    return f"decoder.layers.{int(m.group(1)) - layer_offset}.{m.group(2)}" if m else name


# Megatron-LM's dev branch (DeepSeek-V4) names an MTP layer's decoder layer `mtp_model_layer` in module
# state dicts, which legacy files hold (torch_dist keys keep `transformer_layer`,
# multi_token_prediction.py `sharded_state_dict`): a prefix of any key, expert keys too.
MTP_MODEL_LAYER = "mtp_model_layer"
_MTP_MODEL_LAYER = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")
_MTP_TRANSFORMER_LAYER = re.compile(r"^(mtp\.layers\.\d+\.)transformer_layer\.")


def from_mtp_model_layer(key: str) -> tuple[str, str | None]:
    """`mtp.layers.{k}.mtp_model_layer.X` -> (`mtp.layers.{k}.transformer_layer.X`, MTP_MODEL_LAYER)."""
    renamed = _MTP_MODEL_LAYER.sub(r"\1transformer_layer.", key)
    return renamed, (MTP_MODEL_LAYER if renamed != key else None)


def to_mtp_model_layer(name: str, variants: frozenset[str]) -> str:
    """The inverse of `from_mtp_model_layer`, for a source that used that spelling."""
    return _MTP_TRANSFORMER_LAYER.sub(r"\1mtp_model_layer.", name) if MTP_MODEL_LAYER in variants else name


_VARIANT_SOURCES = tuple((variant, re.compile(src), canon) for variant, src, canon, _, _ in NAME_VARIANTS)


def apply_variants(key: str) -> tuple[str, str | None]:
    """Source spelling -> (canonical spelling, variant id or None)."""
    for variant, src, canon in _VARIANT_SOURCES:
        if src.match(key):
            return src.sub(canon, key), variant
    return key, None


def restore_variant(name: str, variants: frozenset[str]) -> str:
    """Canonical spelling -> the source's spelling, for the variants the source used."""
    name = to_mtp_model_layer(name, variants)
    for variant, _, _, canon, src in NAME_VARIANTS:
        if variant in variants and re.match(canon, name):
            return re.sub(canon, src, name)
    return name


def parse_local_key(key: str, layer_offset: int, expert_offset: int) -> LocalKey:
    """Classify one rank-local key (layer numbers local to the stage, experts local to EP)."""
    lk, expert = _classify_local_key(key, layer_offset)
    if expert is None:
        return lk
    prefix, j, rest = expert
    return LocalKey(
        f"{prefix}.{expert_offset + j}.{rest}", "expert", j, expert_layout=lk.expert_layout, variant=lk.variant
    )


# Every EP (and TP) rank of a stage holds the same local keys: classified once per stage, not once
# per rank file (100k keys in the 256-folder DeepSeek-V3 bench, bench/RESULTS.md).
@lru_cache(maxsize=1 << 16)
def _classify_local_key(key: str, layer_offset: int) -> tuple[LocalKey, tuple[str, int, str] | None]:
    """(LocalKey, None), or for one expert's key (LocalKey without its global id, (prefix, local id, rest))."""
    key, mtp_variant = from_mtp_model_layer(to_global_layer(key, layer_offset))
    if m := _SEQ_EXPERT.match(key):
        return (
            LocalKey("", "expert", expert_layout=SEQUENTIAL, variant=mtp_variant),
            (m.group(1), int(m.group(2)), m.group(3)),
        )
    if m := _TE_EXPERT.match(key):
        return (
            LocalKey("", "expert", expert_layout=TE_GROUPED, variant=mtp_variant),
            (m.group(1), int(m.group(4)), f"{m.group(2)}.{m.group(3)}"),
        )
    if m := _GROUPED.match(key):
        return LocalKey(m.group(1), "grouped", fc=int(m.group(2)), expert_layout=GROUPED, variant=mtp_variant), None
    canonical, variant = apply_variants(key)
    return LocalKey(canonical, variant=variant or mtp_variant), None


def split_expert_name(name: str) -> tuple[str, int, str] | None:
    """`P.mlp.experts.{e}.rest` -> (`P.mlp.experts`, e, rest); None for non-expert names."""
    m = _CANON_EXPERT.match(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def local_expert_key(prefix: str, local: int, rest: str, layout: str) -> str:
    """Rank-local key of one expert tensor for SequentialMLP / TEGroupedMLP."""
    if layout == TE_GROUPED:
        module, param = rest.rsplit(".", 1)
        return f"{prefix}.{module}.{param}{local}"
    return f"{prefix}.local_experts.{local}.{rest}"


# -- torch_dist: ShardedTensor keys ------------------------------------------------------------

# (canonical module prefix, torch_dist key prefix) inside a layer, for megatron's local layer spec
# (its `sharded_state_dict_keys_map`): its separate norms are saved under TE's fused-norm keys.
LOCAL_SPEC_RENAMES: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
# Keys in a training checkpoint that are not model weights: deliberately not in the view.
IGNORED_KEYS: tuple[str, ...] = (
    r"^optimizer[./]",
    r"^rng_state$",
    r"^rerun_state_machine",
    r"\.local_tokens_per_expert$",
)
_IGNORED_DIST = tuple(re.compile(p) for p in IGNORED_KEYS)

_DIST_DECODER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.*)$")
_CANON_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.*)$")
_DIST_EXPERTS = "mlp.experts.experts."
_CANON_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.*)$")
_OBJECT_KEY = re.compile(r"^(.*)/shard_([\d.]*)_([\d.]*)$")


def is_ignored_dist_key(key: str) -> bool:
    """A torch_dist key (or ShardedObject key) deliberately not in the view (IGNORED_KEYS)."""
    base = key.split("/shard_")[0]
    return any(p.search(base) for p in _IGNORED_DIST)


def parse_object_key(unique: str) -> tuple[str, tuple[int, ...]] | None:
    """ShardedObject key `KEY/shard_{offsets}_{shape}` -> (KEY, offsets); None if malformed."""
    m = _OBJECT_KEY.match(unique)
    return (m.group(1), tuple(int(x) for x in m.group(2).split(".") if x)) if m else None


def _rename(rest: str, local_spec: bool, to_dist: bool) -> str:
    if not local_spec:
        return rest
    for canon, dist in LOCAL_SPEC_RENAMES:
        src, dst = (canon, dist) if to_dist else (dist, canon)
        if rest.startswith(src):
            return dst + rest[len(src) :]
    return rest


@dataclass(frozen=True)
class DistName:
    """A torch_dist key seen from the canonical side.

    template: the canonical name with `{layer}` / `{expert}` holes for the prepended axes;
    axes: the kinds of the prepended axes in order (`("layer", "expert")`, `("expert",)`, `()`).
    """

    template: str
    axes: tuple[str, ...]

    def canonical(self, index: tuple[int, ...]) -> str:
        name = self.template
        for kind, i in zip(self.axes, index):
            name = name.replace("{" + kind + "}", str(i))
        return name


@lru_cache(maxsize=None)
def parse_dist_key(key: str, local_spec: bool) -> DistName:
    """torch_dist key -> canonical template and prepended axes."""
    if m := _DIST_DECODER.match(key):
        layer, rest = m.groups()
        prefix = f"decoder.layers.{layer}." if layer is not None else "decoder.layers.{layer}."
        axes: tuple[str, ...] = () if layer is not None else ("layer",)
    elif m := _MTP.match(key):
        (prefix, rest), axes = m.groups(), ()
    else:
        return DistName(key, ())
    if rest.startswith(_DIST_EXPERTS):
        return DistName(prefix + "mlp.experts.{expert}." + rest[len(_DIST_EXPERTS) :], axes + ("expert",))
    return DistName(prefix + _rename(rest, local_spec, to_dist=False), axes)


@dataclass(frozen=True)
class KeyStyle:
    """How one model's canonical names become torch_dist keys (decided by its args).

    stacked: homogeneous decoder, layers on a prepended axis of size num_layers;
    local_spec: megatron's local layer spec (norms under TE fused-norm keys);
    num_experts: size of the expert axis (K for a pruned view).
    """

    stacked: bool
    local_spec: bool
    num_layers: int
    num_experts: int

    @classmethod
    def from_args(cls, args, spec) -> "KeyStyle":
        """spec: the view's ModelSpec (its expert count is the one written)."""
        return cls(
            stacked=homogeneous_layers(args),
            local_spec=uses_local_spec(args),
            num_layers=spec.num_layers,
            num_experts=spec.num_experts,
        )

    def locate(self, name: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """Canonical name -> (torch_dist key, index on the prepended axes, their sizes)."""
        index: tuple[int, ...] = ()
        sizes: tuple[int, ...] = ()
        if m := _CANON_DECODER.match(name):
            layer, rest = int(m.group(1)), m.group(2)
            if self.stacked:
                prefix, index, sizes = "decoder.layers.", (layer,), (self.num_layers,)
            else:
                prefix = f"decoder.layers.{layer}."
        elif m := _MTP.match(name):
            prefix, rest = m.groups()
        else:
            return name, (), ()
        if e := _CANON_LOCAL_EXPERT.match(rest):
            expert = int(e.group(1))
            if expert >= self.num_experts:
                raise CheckpointError(
                    f"{name}: expert {expert} but the view has num_experts="
                    f"{self.num_experts}; number kept experts 0..K-1"
                )
            return prefix + _DIST_EXPERTS + e.group(2), index + (expert,), sizes + (self.num_experts,)
        return prefix + _rename(rest, self.local_spec, to_dist=True), index, sizes


def uses_local_spec(args) -> bool:
    """Megatron's local layer spec (not TE) without MLA renames its norms' sharded keys."""
    return arg(args, "transformer_impl") == "local" and not arg(args, "multi_latent_attention")


def object_key(key: str, index: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """ShardedObject unique key: offsets and shape over the prepended axes, (0,)/(1,) if none."""
    offsets = ".".join(map(str, index)) if index else "0"
    shape = ".".join(map(str, sizes)) if sizes else "1"
    return f"{key}/shard_{offsets}_{shape}"


# -- tied embeddings (megatron's default: no --untie-embeddings-and-output-weights) ---------------

WORD_EMBEDDINGS, OUTPUT_LAYER = "embedding.word_embeddings.weight", "output_layer.weight"


def embeddings_tied(args, has_output_layer: bool) -> bool:
    """Whether the output layer is the word embedding matrix (`share_embeddings_and_output_weights`).

    `args.untie_embeddings_and_output_weights` decides when it is a bool. When args lack it
    (Megatron always saves it; hand-made args may not), the tensors decide: tied only if the
    checkpoint holds no `output_layer.weight` of its own (`has_output_layer`). With PP > 1 a tied
    checkpoint also holds the last stage's copy, so without the field such a checkpoint reads as
    untied: its output layer is kept as a tensor, never dropped on a guess.
    """
    said = getattr(args, "untie_embeddings_and_output_weights", None)
    if isinstance(said, bool):
        return not said
    return not has_output_layer


# -- Transformer Engine grouped experts (TEGroupedMLP) ---------------------------------------------

# One `_extra_state` per grouped linear for all local experts of a legacy rank file (the per-expert
# keys are `_TE_EXPERT`'s `weight{j}`): `…mlp.experts.linear_fc1._extra_state`.
_TE_GROUPED_EXTRA = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\._extra_state$")


@lru_cache(maxsize=1 << 16)  # asked for every plain key of every rank file, which repeat per stage
def te_grouped_extra_state(key: str) -> tuple[str, str] | None:
    """`P.mlp.experts.linear_fc1._extra_state` -> (`P.mlp.experts`, `linear_fc1`); None otherwise."""
    m = _TE_GROUPED_EXTRA.match(key)
    return (m.group(1), m.group(2)) if m else None
