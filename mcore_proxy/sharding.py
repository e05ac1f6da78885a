"""The one table of sharding rules: how each canonical tensor is split across parallel ranks.

Readers use it to un-shard, writers to shard; both call `rule_for(name)`. A canonical name that
matches no rule and no deliberate ignore is an error: silently dropping a tensor is the worst
bug a converter can have.

Kinds (dims are of the canonical, un-sharded tensor):
  replicated  every rank holds the whole tensor
  column      split along dim 0 (output features; vocab rows)
  row         split along dim 1 (input features)
  glu_column  dim 0 holds [gate; up]; each shard holds [gate_r; up_r]
Group: which parallel degree splits it, "tp" (attention/dense tensor parallel) or "etp"
(expert tensor parallel); `expert` marks routed-expert tensors, further split over EP by expert.
Spec: the layer spec a row applies to, "local" or "transformer_engine" (None: both). Only
multi-latent attention's down projections differ: `ColumnParallelLinear` in the local spec,
`TELinear(parallel_mode="duplicated")` in the Transformer Engine spec
(megatron-core 0.16.1 `transformer/multi_latent_attention.py`). Which spec saved a checkpoint is
decided by `checkpoint/layer_spec.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from mcore_proxy.errors import CheckpointError

REPLICATED, COLUMN, ROW, GLU_COLUMN = "replicated", "column", "row", "glu_column"
LOCAL_SPEC, TE_SPEC = "local", "transformer_engine"


@dataclass(frozen=True)
class ShardRule:
    pattern: str          # canonical name with wildcards {layer} {expert} {k} {rest}
    kind: str
    group: str = "tp"     # "tp" or "etp"
    expert: bool = False
    spec: str | None = None   # LOCAL_SPEC / TE_SPEC: the row applies to that layer spec only

    def __post_init__(self):
        if self.kind not in (REPLICATED, COLUMN, ROW, GLU_COLUMN) or self.group not in ("tp", "etp") \
                or self.spec not in (None, LOCAL_SPEC, TE_SPEC):
            raise ValueError(f"bad sharding rule {self}")


_L = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"

# Order matters only for readability: patterns are disjoint (per spec).
SHARDING_RULES: tuple[ShardRule, ...] = (
    ShardRule("embedding.word_embeddings.weight", COLUMN),
    ShardRule("embedding.position_embeddings.weight", REPLICATED),   # learned_absolute: nn.Embedding
    ShardRule("output_layer.weight", COLUMN),
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
    ShardRule("{layer}.mlp.linear_fc1.weight", GLU_COLUMN),
    ShardRule("{layer}.mlp.linear_fc2.weight", ROW),
    ShardRule("{layer}.mlp.shared_experts.linear_fc1.weight", GLU_COLUMN),
    ShardRule("{layer}.mlp.shared_experts.linear_fc2.weight", ROW),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc1.weight", GLU_COLUMN, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc2.weight", ROW, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc1.bias", GLU_COLUMN, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.linear_fc2.bias", REPLICATED, "etp", expert=True),
    ShardRule("{layer}.mlp.experts.{expert}.{rest}._extra_state", REPLICATED, "etp", expert=True),
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
    ShardRule("decoder.final_layernorm.{rest}", REPLICATED),
    ShardRule("mtp.layers.{k}.enorm.weight", REPLICATED),
    ShardRule("mtp.layers.{k}.hnorm.weight", REPLICATED),
    ShardRule("mtp.layers.{k}.final_layernorm.weight", REPLICATED),
    ShardRule("mtp.layers.{k}.eh_proj.weight", COLUMN),
    ShardRule("{rest}._extra_state", REPLICATED),   # TE/fp8 metadata: opaque, copied as is
)

# Keys present in checkpoints that are deliberately not part of the ModelView.
IGNORED_PATTERNS: tuple[str, ...] = (
    r".*\.local_tokens_per_expert$",   # router bookkeeping buffer (not saved by 0.16.1, but older)
    r"rotary_pos_emb\.inv_freq$",      # recomputed from args
)


def _compile(pattern: str) -> re.Pattern:
    out = re.escape(pattern)
    out = out.replace(re.escape("{layer}"), _L)
    out = out.replace(re.escape("{expert}"), r"\d+")
    out = out.replace(re.escape("{k}"), r"\d+")
    out = out.replace(re.escape("{rest}"), r".*")
    return re.compile(f"^{out}$")


_COMPILED = tuple((_compile(r.pattern), r) for r in SHARDING_RULES)
_IGNORED = tuple(re.compile(p) for p in IGNORED_PATTERNS)


def is_ignored(name: str) -> bool:
    return any(p.search(name) for p in _IGNORED)


@lru_cache(maxsize=None)
def rule_for(name: str, spec: str = LOCAL_SPEC) -> ShardRule:
    """The sharding rule of a canonical tensor name in a checkpoint of layer spec `spec`
    (`view.layer_spec`; megatron-core's local spec by default); CheckpointError if none applies."""
    for regex, rule in _COMPILED:
        if rule.spec in (None, spec) and regex.match(name):
            return rule
    raise CheckpointError(f"no sharding rule for tensor {name!r}; mcore-proxy does not know how "
                          "this tensor is split across ranks (add a rule to mcore_proxy/sharding.py)")


def split(tensor: torch.Tensor, rule: ShardRule, parts: int) -> list[torch.Tensor]:
    """Canonical tensor -> `parts` shards (views where possible)."""
    if parts == 1 or rule.kind == REPLICATED or not isinstance(tensor, torch.Tensor):
        return [tensor] * parts
    dim = 1 if rule.kind == ROW else 0
    if tensor.shape[dim] % parts:
        raise CheckpointError(f"dimension {dim} of size {tensor.shape[dim]} does not divide into "
                              f"{parts} tensor-parallel shards")
    if rule.kind == GLU_COLUMN:
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(parts), up.chunk(parts))]
    return list(tensor.chunk(parts, dim=dim))


def join(shards: list[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    """Shards (in rank order) -> canonical tensor; inverse of `split`."""
    if len(shards) == 1 or rule.kind == REPLICATED or not isinstance(shards[0], torch.Tensor):
        return shards[0]
    if rule.kind == ROW:
        return torch.cat(shards, dim=1)
    if rule.kind == GLU_COLUMN:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0)


def shard_shape(shape: tuple[int, ...], rule: ShardRule, parts: int) -> tuple[int, ...]:
    """Shape of one shard of a canonical tensor of `shape`."""
    if parts == 1 or rule.kind == REPLICATED:
        return tuple(shape)
    dim = 1 if rule.kind == ROW else 0
    out = list(shape)
    out[dim] //= parts
    return tuple(out)
