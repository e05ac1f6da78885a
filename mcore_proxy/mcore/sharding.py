"""The one table of sharding rules: how each canonical tensor is split across parallel ranks.

Readers use it to un-shard, writers to shard; both call `rule_for(name)` and then the rule's own
arithmetic (`split`, `join`, `shard`, `shard_boxes`, `chunk_boxes`, ...): what "row" or
"GLU column" means is written once, in `ShardRule`. A canonical name that matches no rule and no
deliberate ignore is an error: silently dropping a tensor is the worst bug a converter can have.

Kinds (dims are of the canonical, un-sharded tensor):
  replicated  every rank holds the whole tensor
  column      split along dim 0 (output features; vocab rows)
  row         split along dim 1 (input features)
  glu_column  dim 0 holds [gate; up]; each shard holds [gate_r; up_r] (two boxes of the tensor)
Group: which parallel degree splits it, "tp" (attention/dense tensor parallel) or "etp"
(expert tensor parallel); `expert` marks routed-expert tensors, further split over EP by expert.

Precedence: `rule_for` takes the first rule that matches. Two rules may match the same name only
when the earlier one says so (`overrides` names the later rule's pattern): every pair of rules is
checked for overlap when this module is imported (`check_rules`), and an undeclared overlap is an
error naming a string both match. Adding a model family is adding rows (and, if a new rule kind
is needed, one branch in ShardRule).
Spec: the layer spec a row applies to, "local" or "transformer_engine" (None: both). Only
multi-latent attention's down projections differ: `ColumnParallelLinear` in the local spec,
`TELinear(parallel_mode="duplicated")` in the Transformer Engine spec
(megatron-core 0.16.1 `transformer/multi_latent_attention.py`). Which spec saved a checkpoint is
decided by `checkpoint/layer_spec.py`. Rows of one pattern for different specs are not an overlap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.core.tensors import cat, is_tensor

if TYPE_CHECKING:  # shapes and rules need no torch; slicing tensors does
    import torch

REPLICATED, COLUMN, ROW, GLU_COLUMN = "replicated", "column", "row", "glu_column"
LOCAL_SPEC, TE_SPEC = "local", "transformer_engine"
# MindSpeed-LLM's local MLA module (checkpoint/mindspeed_llm.py): its fused down projection
# `linear_qkv` is a `LinearNoTP`, full on every TP rank; only multi-latent attention layers have it
MINDSPEED_SPEC = "mindspeed_llm"

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a block of a tensor


@dataclass(frozen=True)
class ShardRule:
    pattern: str  # canonical name with wildcards {layer} {expert} {k} {rest}
    kind: str
    group: str = "tp"  # "tp" or "etp"
    expert: bool = False
    overrides: str | None = None  # the pattern of a later, broader rule this one takes precedence over
    spec: str | None = None  # LOCAL_SPEC / TE_SPEC / MINDSPEED_SPEC: the row applies to that layer spec only

    def __post_init__(self):
        if (
            self.kind not in (REPLICATED, COLUMN, ROW, GLU_COLUMN)
            or self.group not in ("tp", "etp")
            or self.spec not in (None, LOCAL_SPEC, TE_SPEC, MINDSPEED_SPEC)
        ):
            raise ValueError(f"bad sharding rule {self}")

    # -- where the rule splits ----------------------------------------------------------------
    @property
    def dim(self) -> int | None:
        """The dimension shards split (None: replicated)."""
        return None if self.kind == REPLICATED else 1 if self.kind == ROW else 0

    def parts(self, layout) -> int:
        """Number of distinct shards at `layout` (a ParallelLayout): 1 if replicated."""
        if self.kind == REPLICATED:
            return 1
        return layout.etp if self.group == "etp" else layout.tp

    def shard_index(self, layout, tp_rank: int) -> int:
        """Which shard the rank folder of tensor-parallel rank `tp_rank` holds at `layout`."""
        return 0 if self.parts(layout) == 1 else tp_rank

    def _splits(self, shape, parts: int) -> bool:
        """Whether this tensor is split at `parts` (checked: the dimension divides)."""
        if parts == 1 or self.dim is None or shape is None or len(shape) <= self.dim:
            return False
        pieces = parts * 2 if self.kind == GLU_COLUMN else parts
        if shape[self.dim] % pieces:
            raise CheckpointError(
                f"dimension {self.dim} of size {shape[self.dim]} does not divide into "
                f"{parts} {'expert-' if self.group == 'etp' else ''}tensor-parallel shards"
                + (" of gate and up halves" if self.kind == GLU_COLUMN else "")
            )
        return True

    def divides(self, shape, parts: int) -> bool:
        """Whether a tensor of `shape` can be split at `parts` (replicated tensors always can)."""
        try:
            self._splits(shape, parts)
        except CheckpointError:
            return False
        return True

    # -- shapes and boxes ---------------------------------------------------------------------
    def shard_shape(self, shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
        """Shape of one shard of a canonical tensor of `shape`."""
        if not self._splits(shape, parts):
            return tuple(shape)
        out = list(shape)
        out[self.dim] //= parts
        return tuple(out)

    def full_shape(self, shard_shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
        """Shape of the canonical tensor whose shards at `parts` have `shard_shape`."""
        if parts == 1 or self.dim is None or len(shard_shape) <= self.dim:
            return tuple(shard_shape)
        out = list(shard_shape)
        out[self.dim] *= parts
        return tuple(out)

    def shard_boxes(self, shape: tuple[int, ...], parts: int, index: int) -> list[Box]:
        """The block(s) of the canonical tensor that shard `index` of `parts` holds, in the order
        the shard stores them: one box, or two for a GLU shard (its gate rows, then its up rows)."""
        shape = tuple(shape)
        if not self._splits(shape, parts):
            return [((0,) * len(shape), shape)]
        pieces = parts * 2 if self.kind == GLU_COLUMN else parts
        step = shape[self.dim] // pieces
        starts = [index * step, (parts + index) * step] if self.kind == GLU_COLUMN else [index * step]
        return [(_along(len(shape), self.dim, s), _along(len(shape), self.dim, step, shape)) for s in starts]

    def chunk_boxes(self, shape: tuple[int, ...], parts: int) -> list[Box]:
        """The chunks a torch_dist writer stores one canonical tensor as: every shard's boxes at
        `parts` in offset order (gate and up halves apart for GLU), so a load at that layout reads
        exactly its bytes; one chunk for the whole tensor if it is not split (or does not divide)."""
        if self.dim is None or parts == 1 or not self.divides(shape, parts):
            return [((0,) * len(shape), tuple(shape))]
        boxes = [b for i in range(parts) for b in self.shard_boxes(shape, parts, i)]
        return sorted(boxes)

    # -- tensors ------------------------------------------------------------------------------
    def shard_pieces(self, tensor: torch.Tensor, parts: int, index: int) -> list[torch.Tensor]:
        """Shard `index` of `parts` as views of `tensor` (nothing copied), one per box: written back
        to back they are the shard's bytes when each piece is contiguous (dim-0 slices of a
        contiguous tensor are; row slices are not)."""
        if not is_tensor(tensor):
            return [tensor]
        return [
            tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            for offsets, sizes in self.shard_boxes(tuple(tensor.shape), parts, index)
        ]

    def shard(self, tensor, parts: int, index: int):
        """Shard `index` of `parts`: a view where possible (one copy for a GLU shard). Slices only
        that shard: writing every rank costs one pass over the tensor, not `parts`."""
        pieces = self.shard_pieces(tensor, parts, index)
        return pieces[0] if len(pieces) == 1 else cat(pieces, dim=self.dim)

    def split(self, tensor, parts: int) -> list:
        """Canonical tensor -> `parts` shards (views where possible)."""
        return [self.shard(tensor, parts, i) for i in range(parts)]

    def join(self, shards: list):
        """Shards in rank order -> the canonical tensor; the inverse of `split`."""
        if len(shards) == 1 or self.dim is None or not is_tensor(shards[0]):
            return shards[0]
        if self.kind == GLU_COLUMN:
            halves = [s.chunk(2, dim=0) for s in shards]
            return cat([h[0] for h in halves] + [h[1] for h in halves])
        return cat(shards, dim=self.dim)


def _along(ndim: int, dim: int, value: int, shape=None) -> tuple[int, ...]:
    """A tuple of zeros (or of `shape`) with `value` at `dim`."""
    out = list(shape) if shape is not None else [0] * ndim
    out[dim] = value
    return tuple(out)


_LAYER_FORMS = ("decoder.layers.{n}", "mtp.layers.{n}.transformer_layer")  # what {layer} stands for
_EXTRA_STATE = "{rest}._extra_state"

SHARDING_RULES: tuple[ShardRule, ...] = (
    ShardRule("embedding.word_embeddings.weight", COLUMN),
    ShardRule("embedding.position_embeddings.weight", REPLICATED),  # learned_absolute: nn.Embedding
    ShardRule("output_layer.weight", COLUMN),
    # the same key is GQA's column-parallel projection and MindSpeed-LLM's fused MLA down projection
    # [q_lora + kv_lora + rope, H]; decided by layer kind: readers use the "mindspeed_llm" spec only
    # for multi-latent attention (checkpoint/mindspeed_llm.detect_naming)
    ShardRule(
        "{layer}.self_attention.linear_qkv.weight",
        REPLICATED,
        spec=MINDSPEED_SPEC,
        overrides="{layer}.self_attention.linear_qkv.weight",
    ),
    ShardRule("{layer}.self_attention.linear_qkv.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_qkv.bias", COLUMN),
    ShardRule("{layer}.self_attention.linear_proj.weight", ROW),
    ShardRule("{layer}.self_attention.linear_q_proj.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_q_up_proj.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_kv_up_proj.weight", COLUMN),
    # multi-latent attention's down projections [q_lora, H] / [kv_lora + rope, H]
    ShardRule("{layer}.self_attention.linear_q_down_proj.weight", COLUMN, spec=LOCAL_SPEC),
    ShardRule("{layer}.self_attention.linear_kv_down_proj.weight", COLUMN, spec=LOCAL_SPEC),
    ShardRule("{layer}.self_attention.linear_q_down_proj.weight", REPLICATED, spec=TE_SPEC),
    ShardRule("{layer}.self_attention.linear_kv_down_proj.weight", REPLICATED, spec=TE_SPEC),
    # MindSpeed-LLM --mla-mm-split: the up projections' per-head parts, column-parallel by heads
    ShardRule("{layer}.self_attention.linear_qk_nope.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_qk_rope.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_kv_nope.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_v.weight", COLUMN),
    # DeepSeek-V3.2 sparse-attention indexer: every linear `parallel_mode="duplicated"` (Megatron-LM
    # transformer/experimental_attention_variant/dsa.py), MindSpeed-LLM's `LinearNoTP`
    ShardRule("{layer}.self_attention.core_attention.indexer.linear_wq_b.weight", REPLICATED),
    ShardRule("{layer}.self_attention.core_attention.indexer.linear_wk.weight", REPLICATED),
    ShardRule("{layer}.self_attention.core_attention.indexer.linear_weights_proj.weight", REPLICATED),
    ShardRule("{layer}.self_attention.core_attention.indexer.k_norm.weight", REPLICATED),
    ShardRule("{layer}.self_attention.core_attention.indexer.k_norm.bias", REPLICATED),
    ShardRule("{layer}.mlp.linear_fc1.weight", GLU_COLUMN),
    ShardRule("{layer}.mlp.linear_fc2.weight", ROW),
    ShardRule("{layer}.mlp.shared_experts.linear_fc1.weight", GLU_COLUMN),
    ShardRule("{layer}.mlp.shared_experts.linear_fc2.weight", ROW),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc1.weight", GLU_COLUMN, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc2.weight", ROW, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc1.bias", GLU_COLUMN, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc2.bias", REPLICATED, "etp", expert=True),
    # an expert's TE/fp8 metadata travels with its expert (EP), not with every rank
    ShardRule(
        "{layer}.mlp.experts.{expert}.{rest}._extra_state", REPLICATED, "etp", expert=True, overrides=_EXTRA_STATE
    ),
    # norms, router, expert bias, shared-expert gate, MTP projections' norms, biases of row layers
    ShardRule("{layer}.{rest}layernorm.weight", REPLICATED),
    ShardRule("{layer}.{rest}layer_norm_weight", REPLICATED),
    ShardRule("{layer}.{rest}layernorm.bias", REPLICATED),
    ShardRule("{layer}.{rest}layer_norm_bias", REPLICATED),
    ShardRule("{layer}.mlp.router.weight", REPLICATED),
    ShardRule("{layer}.mlp.router.bias", REPLICATED),
    ShardRule("{layer}.mlp.router.expert_bias", REPLICATED),
    ShardRule("{layer}.mlp.shared_experts.gate_weight", REPLICATED),
    ShardRule("{layer}.self_attention.linear_proj.bias", REPLICATED),
    ShardRule("{layer}.mlp.linear_fc2.bias", REPLICATED),
    ShardRule("{layer}.mlp.linear_fc1.bias", GLU_COLUMN),
    ShardRule("decoder.final_layernorm.{rest}", REPLICATED, overrides=_EXTRA_STATE),
    ShardRule("mtp.layers.{k}.enorm.weight", REPLICATED),
    ShardRule("mtp.layers.{k}.hnorm.weight", REPLICATED),
    ShardRule("mtp.layers.{k}.final_layernorm.weight", REPLICATED),
    ShardRule("mtp.layers.{k}.eh_proj.weight", COLUMN),
    # DeepSeek-V4, Megatron-LM dev (checkpoint/hf/deepseek_v4.py): its hybrid attention runs at TP=1
    # only, so these splits are never taken (the writers refuse TP > 1 for it); compressor, indexer,
    # hyper-connections and the hash table are replicated ShardedTensors there
    ShardRule("{layer}.self_attention.linear_kv_proj.weight", COLUMN),
    ShardRule("{layer}.self_attention.linear_o_group_proj", REPLICATED),
    ShardRule("{layer}.self_attention.core_attention.attn_sink", REPLICATED),
    *(
        ShardRule(f"{{layer}}.self_attention.core_attention.{c}.{t}", REPLICATED)
        for c in ("compressor", "indexer.compressor")
        for t in ("linear_wkv.weight", "linear_wgate.weight", "ape", "norm.weight")
    ),
    *(
        ShardRule(f"{{layer}}.{m}_hyper_connection.{t}", REPLICATED)
        for m in ("self_attention", "mlp")
        for t in ("mapping_proj.weight", "bias", "alpha_pre", "alpha_post", "alpha_res")
    ),
    ShardRule("{layer}.mlp.router.tid2eid", REPLICATED),
    *(
        ShardRule(f"{p}hc_head_{t}", REPLICATED)
        for p in ("decoder.", "mtp.layers.{k}.")
        for t in ("fn", "base", "scale")
    ),
    ShardRule("mtp.layers.{k}.e_proj.weight", COLUMN),
    ShardRule("mtp.layers.{k}.h_proj.weight", COLUMN),
    # DeepSeek-V4 under MindSpeed-LLM's names (checkpoint/mindspeed_llm_v4.py): its attention is tensor
    # parallel (heads, output groups and sinks by rows, the output projection by columns)
    ShardRule("{layer}.self_attention.linear_q.weight", REPLICATED, spec=MINDSPEED_SPEC),
    ShardRule("{layer}.self_attention.linear_kv.weight", REPLICATED, spec=MINDSPEED_SPEC),
    ShardRule("{layer}.self_attention.linear_o_down_proj.weight", COLUMN, spec=MINDSPEED_SPEC),
    ShardRule("{layer}.self_attention.linear_o_up_proj.weight", ROW, spec=MINDSPEED_SPEC),
    ShardRule("{layer}.self_attention.attn_sink", COLUMN, spec=MINDSPEED_SPEC),
    *(
        ShardRule(f"{{layer}}.self_attention.{c}.{t}", REPLICATED, spec=MINDSPEED_SPEC)
        for c in ("compressor", "indexer.kv_compressor")
        for t in ("wkv.weight", "wgate.weight", "ape", "norm.weight")
    ),
    *(
        ShardRule(f"{{layer}}.self_attention.indexer.{t}.weight", REPLICATED, spec=MINDSPEED_SPEC)
        for t in ("wq_b", "weights_proj")
    ),
    *(
        ShardRule(f"{{layer}}.{m}_mhc.{t}", REPLICATED, spec=MINDSPEED_SPEC)
        for m in ("attn", "mlp")
        for t in ("hc_fn.weight", "hc_base", "hc_scale")
    ),
    *(
        ShardRule(f"{p}hc_head.{t}", REPLICATED, spec=MINDSPEED_SPEC)
        for p in ("", "mtp.layers.{k}.")
        for t in ("hc_fn.weight", "hc_base", "hc_scale")
    ),
    ShardRule(_EXTRA_STATE, REPLICATED),  # TE/fp8 metadata: opaque, copied as is
)

# For a name no rule matches: (regex, the nearest supported kind), named in the refusal.
NEAREST_KINDS: tuple[tuple[str, str], ...] = (
    (
        r"\.(core_attention\.indexer|dsa_indexer)\.",
        "the DSA indexer tensors linear_wq_b.weight, linear_wk.weight, k_norm.weight, k_norm.bias and "
        "linear_weights_proj.weight under self_attention.core_attention.indexer (MindSpeed-LLM: "
        "self_attention.dsa_indexer.wq_b/wk/k_norm/weights_proj)",
    ),
    (
        r"\.self_attention\.",
        "megatron-core's attention tensors (linear_qkv, linear_proj, q/k layernorms; MLA: "
        "linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj)",
    ),
)

# Keys present in checkpoints that are deliberately not part of the ModelView.
IGNORED_PATTERNS: tuple[str, ...] = (
    r".*\.local_tokens_per_expert$",  # router bookkeeping buffer (not saved by 0.16.1, but older)
    r"rotary_pos_emb\.inv_freq$",  # recomputed from args
)


# -- matching, and the overlap check ---------------------------------------------------------------

_WILDCARDS = {"{expert}": r"\d+", "{k}": r"\d+", "{rest}": r".*"}


def _compile(pattern: str) -> re.Pattern:
    out = re.escape(pattern).replace(
        re.escape("{layer}"),
        "(?:" + "|".join(re.escape(form).replace(re.escape("{n}"), r"\d+") for form in _LAYER_FORMS) + ")",
    )
    for wildcard, regex in _WILDCARDS.items():
        out = out.replace(re.escape(wildcard), regex)
    return re.compile(f"^{out}$")


# A pattern as a sequence of tokens: ("lit", char), ("digits",) for \d+, ("any",) for .*
@lru_cache(maxsize=None)
def _tokens(pattern: str) -> tuple[tuple[tuple, ...], ...]:
    """Every alternative of `pattern` ({layer} has two forms) as a token list."""
    alternatives = [pattern.replace("{layer}", form) for form in _LAYER_FORMS] if "{layer}" in pattern else [pattern]
    out = []
    for text in alternatives:
        tokens, i = [], 0
        while i < len(text):
            for wildcard, token in (
                ("{n}", ("digits",)),
                ("{expert}", ("digits",)),
                ("{k}", ("digits",)),
                ("{rest}", ("any",)),
            ):
                if text.startswith(wildcard, i):
                    tokens.append(token)
                    i += len(wildcard)
                    break
            else:
                tokens.append(("lit", text[i]))
                i += 1
        out.append(tuple(tokens))
    return tuple(out)


def _steps(tokens: list[tuple], state: int) -> list[tuple[tuple, int]]:
    """(character class, next state) moves of the automaton of `tokens` from `state`: state i >= 0
    is "before token i"; -(i + 1) is "inside the digit run of token i" (more digits may follow);
    an any token loops on itself."""
    moves = []
    for i in _closure(tokens, state):
        if i < 0:
            moves.append((("digit",), i))
        elif i < len(tokens):
            t = tokens[i]
            if t[0] == "any":
                moves.append((("any",), i))
            elif t[0] == "digits":
                moves.append((("digit",), -(i + 1)))
            else:
                moves.append((t, i + 1))
    return moves


def _closure(tokens: list[tuple], state: int) -> set[int]:
    """States reachable without reading a character (.* may match nothing; a digit run may end)."""
    out, todo = set(), [state]
    while todo:
        s = todo.pop()
        if s in out:
            continue
        out.add(s)
        if s < 0:
            todo.append(-s)
        elif s < len(tokens) and tokens[s][0] == "any":
            todo.append(s + 1)
    return out


def _meet(a: tuple, b: tuple) -> str | None:
    """A character both classes accept, or None."""
    if a[0] == "any" or b[0] == "any":
        other = b if a[0] == "any" else a
        return other[1] if other[0] == "lit" else ("0" if other[0] == "digit" else "x")
    if a[0] == "digit" and b[0] == "digit":
        return "0"
    if a[0] == "lit" and b[0] == "lit":
        return a[1] if a[1] == b[1] else None
    lit = a if a[0] == "lit" else b
    return lit[1] if lit[1].isdigit() else None


@lru_cache(maxsize=None)
def _literal_ends(tokens: tuple[tuple, ...]) -> tuple[str, str]:
    """The literal text before the first and after the last wildcard."""
    wild = [i for i, t in enumerate(tokens) if t[0] != "lit"]
    text = "".join(t[1] if t[0] == "lit" else "\0" for t in tokens)
    return (text, text) if not wild else (text[: wild[0]], text[wild[-1] + 1 :])


def overlap(p: str, q: str) -> str | None:
    """A name both patterns match, or None (breadth-first search over the product automaton,
    after a quick look at the literal ends)."""
    for ta in _tokens(p):
        for tb in _tokens(q):
            (pa, sa), (pb, sb) = _literal_ends(ta), _literal_ends(tb)
            if not (pa.startswith(pb) or pb.startswith(pa)) or not (sa.endswith(sb) or sb.endswith(sa)):
                continue
            seen, frontier = {(0, 0)}, [((0, 0), "")]
            while frontier:
                nxt = []
                for (sa, sb), text in frontier:
                    if len(ta) in _closure(ta, sa) and len(tb) in _closure(tb, sb):
                        return text
                    for ca, na in _steps(ta, sa):
                        for cb, nb in _steps(tb, sb):
                            char = _meet(ca, cb)
                            if char is not None and (na, nb) not in seen:
                                seen.add((na, nb))
                                nxt.append(((na, nb), text + char))
                frontier = nxt
    return None


def check_rules(rules: tuple[ShardRule, ...]) -> None:
    """ValueError if two rules of one layer spec match one name without the earlier one declaring
    `overrides` (rows for different specs never apply together, so they do not overlap)."""
    for i, a in enumerate(rules):
        for b in rules[i + 1 :]:
            if a.spec is not None and b.spec is not None and a.spec != b.spec:
                continue
            name = overlap(a.pattern, b.pattern)
            if name is not None and a.overrides != b.pattern:
                raise ValueError(
                    f"sharding rules {a.pattern!r} and {b.pattern!r} both match {name!r}; make "
                    f"them disjoint or list the narrower first with overrides={b.pattern!r}"
                )
        if a.overrides is not None and a.overrides not in {b.pattern for b in rules[i + 1 :]}:
            raise ValueError(f"sharding rule {a.pattern!r} overrides {a.overrides!r}, which is not a later rule")


check_rules(SHARDING_RULES)
_COMPILED = tuple((_compile(r.pattern), r) for r in SHARDING_RULES)
_IGNORED = tuple(re.compile(p) for p in IGNORED_PATTERNS)


@lru_cache(maxsize=1 << 16)
def is_ignored(name: str) -> bool:
    return any(p.search(name) for p in _IGNORED)


# Rules match layer, expert and MTP numbers as wildcards (no pattern has a literal `.N.`): names
# that differ only in them share one lookup (31k expert names per DeepSeek-V3 checkpoint).
_NUMBER = re.compile(r"\.\d+\.")


def rule_for(name: str, spec: str = LOCAL_SPEC) -> ShardRule:
    """The sharding rule of a canonical tensor name in a checkpoint of layer spec `spec`
    (`view.layer_spec`; megatron-core's local spec by default): the first row of that spec (or of
    both) that matches; CheckpointError if none applies."""
    rule = _first_rule(_NUMBER.sub(".0.", name), spec)
    if rule is not None:
        return rule
    nearest = next((kind for regex, kind in NEAREST_KINDS if re.search(regex, name)), None)
    raise CheckpointError(
        f"no sharding rule for tensor {name!r}; mcore-proxy does not know how "
        "this tensor is split across ranks"
        + (f" (the nearest supported kind is {nearest})" if nearest else f" (add a rule to {__name__})")
    )


@lru_cache(maxsize=1 << 14)
def _first_rule(name: str, spec: str) -> ShardRule | None:
    return next((rule for regex, rule in _COMPILED if rule.spec in (None, spec) and regex.match(name)), None)
