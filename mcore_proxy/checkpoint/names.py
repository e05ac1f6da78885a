"""Name mapping of the Megatron family: rank-local state-dict keys <-> canonical names.

Data first: `NAME_VARIANTS` pairs a source spelling (MindSpeed-LLM, older megatron) with the
canonical megatron-core spelling, and `EXPERT_LAYOUTS` describes how each expert module type
stores its experts. Readers and writers both resolve names through the functions below.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# (variant id, source regex, canonical replacement, canonical regex, source replacement)
NAME_VARIANTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("shared_expert_gate", r"^(.*)\.mlp\.shared_expert_gate\.weight$", r"\1.mlp.shared_experts.gate_weight",
     r"^(.*)\.mlp\.shared_experts\.gate_weight$", r"\1.mlp.shared_expert_gate.weight"),
    ("mtp_final_layernorms", r"^mtp\.final_layernorms\.(\d+)\.weight$", r"mtp.layers.\1.final_layernorm.weight",
     r"^mtp\.layers\.(\d+)\.final_layernorm\.weight$", r"mtp.final_layernorms.\1.weight"),
)

# Expert module types: SequentialMLP (one module per local expert), GroupedMLP (`weight1`,
# `weight2` holding every local expert), TEGroupedMLP (`linear_fc1.weight{j}`).
SEQUENTIAL, GROUPED, TE_GROUPED = "sequential", "grouped", "te_grouped"
EXPERT_LAYOUTS = (SEQUENTIAL, GROUPED, TE_GROUPED)

# Weights of megatron-core linear modules (the local ones save `_extra_state: None` beside them):
# `linear_*` layers, the output layer and MTP's `eh_proj` (a ColumnParallelLinear).
LINEAR_WEIGHT = re.compile(r"^(.*\.linear_[a-z0-9_]+|.*\.eh_proj|output_layer)\.weight$")

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

    canonical: str            # for "grouped": the prefix `...mlp.experts`
    kind: str = "plain"
    local_expert: int = 0
    fc: int = 0
    expert_layout: str | None = None   # which expert module type the key reveals
    variant: str | None = None         # which NAME_VARIANTS spelling the key used


def to_global_layer(key: str, layer_offset: int) -> str:
    """`decoder.layers.{l}.X` -> `decoder.layers.{l + offset}.X`; other keys unchanged."""
    m = _LAYER_KEY.match(key)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else key


def to_local_layer(name: str, layer_offset: int) -> str:
    m = _LAYER_KEY.match(name)
    return f"decoder.layers.{int(m.group(1)) - layer_offset}.{m.group(2)}" if m else name


def apply_variants(key: str) -> tuple[str, str | None]:
    """Source spelling -> (canonical spelling, variant id or None)."""
    for variant, src, canon, _, _ in NAME_VARIANTS:
        if re.match(src, key):
            return re.sub(src, canon, key), variant
    return key, None


def restore_variant(name: str, variants: frozenset[str]) -> str:
    """Canonical spelling -> the source's spelling, for the variants the source used."""
    for variant, _, _, canon, src in NAME_VARIANTS:
        if variant in variants and re.match(canon, name):
            return re.sub(canon, src, name)
    return name


def parse_local_key(key: str, layer_offset: int, expert_offset: int) -> LocalKey:
    """Classify one rank-local key (layer numbers local to the stage, experts local to EP)."""
    key = to_global_layer(key, layer_offset)
    if m := _SEQ_EXPERT.match(key):
        j = int(m.group(2))
        return LocalKey(f"{m.group(1)}.{expert_offset + j}.{m.group(3)}", "expert", j,
                        expert_layout=SEQUENTIAL)
    if m := _TE_EXPERT.match(key):
        j = int(m.group(4))
        return LocalKey(f"{m.group(1)}.{expert_offset + j}.{m.group(2)}.{m.group(3)}", "expert", j,
                        expert_layout=TE_GROUPED)
    if m := _GROUPED.match(key):
        return LocalKey(m.group(1), "grouped", fc=int(m.group(2)), expert_layout=GROUPED)
    canonical, variant = apply_variants(key)
    return LocalKey(canonical, variant=variant)


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
