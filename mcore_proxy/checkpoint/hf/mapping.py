"""Name mapping between Hugging Face keys and canonical megatron-core names, as data rows.

A family (`qwen3_moe.py`, `deepseek.py`, `mixtral.py`, `qwen2_moe.py`, `glm4_moe.py`) is a table of
`Row`s. A row pairs a canonical name pattern with one or more HF key patterns and a transform:

  copy   one HF tensor is the canonical tensor
  glu    canonical `linear_fc1` [2F, H] = cat(gate_proj [F, H], up_proj [F, H])
  qkv    canonical `linear_qkv` [G*(r+2)*d, H] = per query group g: the r query heads of g, then
         k_g, then v_g (megatron's layout; HF keeps q_proj [G*r*d, H], k_proj, v_proj [G*d, H])
  fused  transformers' in-memory expert tensors (`experts.gate_up_proj` [E, 2F, H],
         `experts.down_proj` [E, H, F]): canonical expert e is slice e (read only; written per
         expert under the Hub names that `save_pretrained` writes)
  pick   canonical [1] = element `index` of one HF tensor [n] (DeepSeek-V4's `hc_attn_scale` [3] is
         megatron's `alpha_pre`, `alpha_post`, `alpha_res`); the rows of one HF pattern ("siblings")
         are written back as its elements in `index` order
  rope_last  one HF tensor with its rows reordered per head (`rope_last_order`, sizes from the
         mapping's `rope_layout`): DeepSeek-V3.2's indexer, whose rotated dims transformers keeps
         first and megatron-core last
A row's `dtypes` (HF dtype, canonical dtype) casts a tensor whose two frameworks store it
differently (DeepSeek-V4's hash table: int64 in transformers, int32 in Megatron-LM).

Scopes: "model" rows name whole keys (`model.embed_tokens.weight`); "layer" rows name what
follows `model.layers.{i}.` in HF and the layer prefix in megatron (`decoder.layers.{L}` or, for
HF layers past `num_hidden_layers`, or HF keys under `mtp.{k}.` (DeepSeek-V4, `Table.mtp_prefix`), the
MTP layer `mtp.layers.{k}.transformer_layer`); "mtp" rows exist only in MTP layers and map to
`mtp.layers.{k}.X` (DeepSeek's enorm, hnorm, eh_proj, shared_head.norm). `{e}` is an expert id.

A key that matches no row must match an `Ignored` pattern (with the reason it is not a
canonical tensor), otherwise reading stops with its name: a dropped tensor is never silent.
FP8 checkpoints store `X_scale_inv` beside a quantised `X`; it follows X's row (copy and glu
only: block scales of one tensor cannot be re-interleaved per query group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mcore_proxy.core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

COPY, GLU, QKV, FUSED, PICK, ROPE_LAST = "copy", "glu", "qkv", "fused", "pick", "rope_last"
MODEL, LAYER, MTP = "model", "layer", "mtp"
SCALE_SUFFIX = "_scale_inv"
_PARTS = {COPY: 1, GLU: 2, QKV: 3, FUSED: 1, PICK: 1, ROPE_LAST: 1}

_HF_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")  # DeepSeek-V4's release: `layers.{i}.`
_HF_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")  # DeepSeek-V4's MTP block `mtp.{k}.`
_CANON_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_CANON_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.(.+)$")
_CANON_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Row:
    """canonical: pattern under the scope's prefix; hf: the HF pattern(s), one per part."""

    canonical: str
    hf: tuple[str, ...]
    transform: str = COPY
    scope: str = LAYER
    read_only: bool = False  # an alternative spelling accepted when reading, never written
    index: int | None = None  # pick: the element of the HF tensor
    dtypes: tuple[str, str] | None = None  # (HF dtype, canonical dtype) names when they differ

    def __post_init__(self):
        hf = (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)
        object.__setattr__(self, "hf", hf)
        if self.transform not in _PARTS or len(hf) != _PARTS[self.transform] or self.scope not in (MODEL, LAYER, MTP):
            raise ValueError(f"bad mapping row {self}")
        if self.transform == FUSED and not self.read_only:
            raise ValueError(f"fused rows are read only: {self}")
        if (self.transform == PICK) != (self.index is not None):
            raise ValueError(f"pick rows, and only they, name an element index: {self}")


@dataclass(frozen=True)
class Ignored:
    """HF keys that are deliberately not canonical tensors. `tied_to`: the canonical tensor they
    copy (DeepSeek's MTP layers carry copies of the embedding and LM head, which megatron's MTP
    shares with the main model); the writer writes the copy again from it."""

    hf: str
    scope: str
    why: str
    tied_to: str | None = None


# Rows every family here shares: transformers names these tensors alike in its Llama-style MoE
# models. A family's table is its own rows, these, and its router and expert rows (`routed_rows`)
# (tables match by anchored patterns, so the order between rows of different tensors does not
# matter; a read-only alternative spelling follows the row it stands in for).
WHOLE_MODEL_ROWS = (
    Row("embedding.word_embeddings.weight", "model.embed_tokens.weight", scope=MODEL),
    Row("decoder.final_layernorm.weight", "model.norm.weight", scope=MODEL),
    Row("output_layer.weight", "lm_head.weight", scope=MODEL),
)
LAYER_NORM_ROWS = (
    Row("input_layernorm.weight", "input_layernorm.weight"),
    Row("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)
ATTENTION_OUTPUT_ROW = Row("self_attention.linear_proj.weight", "self_attn.o_proj.weight")
DENSE_SWIGLU_ROWS = (
    Row("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GLU),
    Row("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)
SHARED_ROWS = WHOLE_MODEL_ROWS + LAYER_NORM_ROWS + (ATTENTION_OUTPUT_ROW,) + DENSE_SWIGLU_ROWS


def _spellings(canonical: str, patterns: tuple[str, ...], **fields) -> tuple[Row, ...]:
    """A tensor's rows: its first HF spelling is the one written, the others are read only."""
    return tuple(Row(canonical, p, read_only=i > 0, **fields) for i, p in enumerate(patterns))


def routed_rows(router, experts, hash_table: tuple[str, tuple[str, str]] | None = None) -> tuple[Row, ...]:
    """The router's and routed experts' rows, derived from a family record's HF layout
    (`descriptor.Router`, `descriptor.Experts`), so that those keys are spelled once:

      router weight [E, H]          -> mlp.router.weight
      selection bias [E]            -> mlp.router.expert_bias
      hash table [V, k]             -> `hash_table`'s canonical name, cast between its dtypes
      expert e's gate, up [F, H]    -> mlp.experts.{e}.linear_fc1.weight (glu)
      expert e's down [H, F]        -> mlp.experts.{e}.linear_fc2.weight
      fused gate_up [E, 2F, H], down [E, H, F] -> the same, row e (read only)

    Per-expert patterns list (gate, up, down) weights in that order; their quantization
    companions (DeepSeek-V4's FP4 `.scale`) are not Megatron tensors. A layout megatron-core's
    router cannot hold (a logit bias) or whose experts are not SwiGLU is a ValueError at import."""
    if router.bias:
        raise ValueError(f"megatron-core's router has no logit bias ({router.bias[0]})")
    weights = [p for p in experts.per_expert if p.endswith(".weight")]
    if len(weights) != 3 or len(experts.fused) not in (0, 2):
        raise ValueError(f"not SwiGLU experts (gate, up, down): {experts}")
    rows = _spellings("mlp.router.weight", router.weight) + _spellings("mlp.router.expert_bias", router.score_bias)
    if router.hash_table:
        name, dtypes = hash_table
        rows += _spellings(name, router.hash_table, dtypes=dtypes)
    rows += (
        Row("mlp.experts.{e}.linear_fc1.weight", tuple(weights[:2]), GLU),
        Row("mlp.experts.{e}.linear_fc2.weight", weights[2]),
    )
    fused = ("mlp.experts.{e}.linear_fc1.weight", "mlp.experts.{e}.linear_fc2.weight")
    return rows + tuple(Row(c, hf, FUSED, read_only=True) for c, hf in zip(fused, experts.fused))


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{e}"), r"(?P<e>\d+)") + "$")


@dataclass(frozen=True)
class Table:
    """One family's rows, compiled once. `mtp_prefix`: where HF keeps MTP layer k when not at
    `model.layers.{N + k}.` (DeepSeek-V4: "mtp.{k}.")."""

    rows: tuple[Row, ...]
    ignored: tuple[Ignored, ...] = ()
    mtp_prefix: str | None = None
    _hf: tuple = field(init=False, repr=False, compare=False)
    _canon: tuple = field(init=False, repr=False, compare=False)
    _ign: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        hf = tuple((row, part, _compile(p)) for row in self.rows for part, p in enumerate(row.hf))
        canon = tuple((row, _compile(row.canonical)) for row in self.rows if not row.read_only)
        object.__setattr__(self, "_hf", hf)
        object.__setattr__(self, "_canon", canon)
        object.__setattr__(self, "_ign", tuple((i, _compile(i.hf)) for i in self.ignored))

    def match_hf(self, scope: str, rest: str) -> tuple[Row, int, int | None] | None:
        """(row, part, expert or None) of an HF key's scoped remainder."""
        scopes = (LAYER, MTP) if scope == MTP else (scope,)
        for row, part, regex in self._hf:
            if row.scope in scopes and (m := regex.match(rest)):
                return row, part, int(m.group("e")) if "e" in regex.groupindex else None
        return None

    def ignored_for(self, scope: str, rest: str) -> Ignored | None:
        for ign, regex in self._ign:
            if ign.scope == scope and regex.match(rest):
                return ign
        return None

    def match_canonical(self, scope: str, rest: str) -> tuple[Row, int | None] | None:
        for row, regex in self._canon:
            if row.scope == scope and (m := regex.match(rest)):
                return row, int(m.group("e")) if "e" in regex.groupindex else None
        return None

    def siblings(self, row: Row) -> tuple[Row, ...]:
        """The pick rows reading the same HF tensor as `row`, in element order (`row` alone otherwise)."""
        if row.transform != PICK:
            return (row,)
        return tuple(
            sorted(
                (r for r in self.rows if r.transform == PICK and r.hf == row.hf and r.scope == row.scope),
                key=lambda r: r.index,
            )
        )


# -- where a key lives -------------------------------------------------------------------------


def split_hf_key(key: str, num_layers: int) -> tuple[str, int | None, str]:
    """HF key -> (scope, layer index or MTP depth, remainder). Layers at or past
    `num_layers` are MTP layers (DeepSeek publishes MTP layer k as `model.layers.{N + k}`,
    DeepSeek-V4 as `mtp.{k}.`)."""
    m = _HF_LAYER.match(key)
    if not m:
        if v4 := _HF_MTP.match(key):
            return MTP, int(v4.group(1)), v4.group(2)
        return MODEL, None, key
    i = int(m.group(1))
    return (LAYER, i, m.group(2)) if i < num_layers else (MTP, i - num_layers, m.group(2))


def canonical_name(row: Row, scope: str, index: int | None, expert: int | None) -> str:
    name = row.canonical.replace("{e}", str(expert)) if expert is not None else row.canonical
    if row.scope == MODEL:
        return name
    if row.scope == MTP:
        return f"mtp.layers.{index}.{name}"
    return f"decoder.layers.{index}.{name}" if scope == LAYER else f"mtp.layers.{index}.transformer_layer.{name}"


def split_canonical(name: str) -> tuple[str, int | None, str, str]:
    """Canonical name -> (scope, index, remainder, the row scope to look in)."""
    if m := _CANON_DECODER.match(name):
        return LAYER, int(m.group(1)), m.group(2), LAYER
    if m := _CANON_MTP_LAYER.match(name):
        return MTP, int(m.group(1)), m.group(2), LAYER
    if m := _CANON_MTP.match(name):
        return MTP, int(m.group(1)), m.group(2), MTP
    return MODEL, None, name, MODEL


def hf_name(
    pattern: str, scope: str, index: int | None, expert: int | None, num_layers: int, mtp_prefix: str | None = None
) -> str:
    key = pattern.replace("{e}", str(expert)) if expert is not None else pattern
    if scope == MODEL:
        return key
    if scope == MTP and mtp_prefix is not None:
        return mtp_prefix.replace("{k}", str(index)) + key
    return f"model.layers.{index if scope == LAYER else num_layers + index}.{key}"


# -- transforms: pure functions of tensors ------------------------------------------------------


def glu_join(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[F, H] gate, [F, H] up -> [2F, H] megatron `linear_fc1` (gate rows, then up rows)."""
    import torch

    return torch.cat([gate, up])


def glu_split(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [G*r*d, H], k/v [G*d, H] -> megatron `linear_qkv` [G*(r+2)*d, H]: per query group its r
    query heads, then its key head, then its value head."""
    import torch

    h = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *h), k.reshape(groups, -1, *h), v.reshape(groups, -1, *h)], dim=1).reshape(
        -1, *h
    )


def qkv_split(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of `qkv_join`."""
    h = qkv.shape[1:]
    per = heads // groups * head_dim
    q, k, v = qkv.reshape(groups, per + 2 * head_dim, *h).split([per, head_dim, head_dim], dim=1)
    return q.reshape(-1, *h), k.reshape(-1, *h), v.reshape(-1, *h)


def rope_last_order(rows: int, head_dim: int, rope: int, interleave: bool) -> list[int]:
    """The HF row each canonical row is read from, for a tensor of `rows` = heads x `head_dim` rows
    whose first `rope` rows of each head transformers rotates (DeepSeek-V3.2's indexer: `wq_b`
    [heads*d, q_lora], `wk` [d, H], `k_norm` [d]). megatron-core 0.16.1's DSA indexer rotates the
    last `rope` of each head (`dsa.py`, `_apply_rope`) and, under multi-latent attention, pairs them
    interleaved (x0 x1, x2 x3, ...), where transformers' `rotate_half` pairs x_i with x_{i+rope/2}
    (`interleave`: put each such pair side by side). Canonical = HF[order]; HF = canonical[argsort]."""
    if rows % head_dim or rope > head_dim or rope % 2:
        raise CheckpointError(f"{rows} rows are not whole heads of {head_dim} with {rope} rotated dims")
    half = rope // 2
    rotated = [j for i in range(half) for j in (i, i + half)] if interleave else list(range(rope))
    per_head = list(range(rope, head_dim)) + rotated
    return [h * head_dim + r for h in range(rows // head_dim) for r in per_head]


def rope_last(tensor: torch.Tensor, layout: tuple[int, int, bool], inverse: bool = False) -> torch.Tensor:
    """HF rows -> canonical (`rope_last_order`), or back with `inverse`; layout: (head_dim, rotated
    dims, interleave), the mapping's `rope_layout`."""
    import torch

    order = torch.tensor(rope_last_order(tensor.shape[0], *layout))
    return tensor[torch.argsort(order)] if inverse else tensor[order]


def joined_shape(transform: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Canonical shape from the HF parts' shapes (no data read)."""
    if transform == FUSED:
        return tuple(shapes[0][1:])
    if transform in (COPY, ROPE_LAST):
        return tuple(shapes[0])
    if transform == PICK:
        return (1,) + tuple(shapes[0][1:])
    if len({s[1:] for s in shapes}) != 1:
        raise CheckpointError(f"parts of one tensor disagree in their trailing dimensions: {shapes}")
    return (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])
