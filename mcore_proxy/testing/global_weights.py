"""Identical weights at every parallel layout, without a checkpoint round trip.

`fill_global_weights(model)` overwrites every parameter of this rank's megatron-core GPT stage
with its slice of a *global* tensor drawn from a generator seeded by the tensor's canonical
name (DESIGN.md 4.3: global layer numbers, one key per expert, un-sharded shapes). Built at
TP=1, TP=2/EP=2, PP=2, with SequentialMLP or GroupedMLP, the model computes the same function,
so routing statistics and logits can be compared across layouts.

Covers the parameter kinds of the tiny models in `mcore_proxy.testing.build` and
`mcore_proxy.testing.families` (local spec, no TE: GQA with qk norms, MLA, learned positions): a parameter that
matches no rule raises, it is never left at its initial value.
"""

from __future__ import annotations

import re
import zlib

import torch

# (pattern on the canonical name, kind). Kinds: "vocab"/"column" split dim 0 by TP, "glu"
# splits gate and up halves of dim 0 by TP, "row" splits dim 1 by TP; "expert_*" use the expert
# TP rank instead; "norm" and "replicated" are whole on every rank.
RULES = [
    (r"embedding\.word_embeddings\.weight|output_layer\.weight", "vocab"),
    (r"embedding\.position_embeddings\.weight", "replicated"),  # learned_absolute: nn.Embedding
    (r".*\.self_attention\.linear_q_proj\.weight", "column"),
    # multi-latent attention, local spec: all four projections are ColumnParallelLinear
    (r".*\.self_attention\.linear_(q_down|q_up|kv_down|kv_up)_proj\.weight", "column"),
    (r".*\.self_attention\.linear_qkv\.weight", "column"),
    (r".*\.self_attention\.linear_proj\.weight", "row"),
    (r".*\.mlp\.experts\.\d+\.linear_fc1\.weight", "expert_glu"),
    (r".*\.mlp\.experts\.\d+\.linear_fc2\.weight", "expert_row"),
    (r".*\.mlp\.(shared_experts\.)?linear_fc1\.weight", "glu"),
    (r".*\.mlp\.(shared_experts\.)?linear_fc2\.weight", "row"),
    (r".*\.mlp\.router\.weight", "router"),
    (r".*\.mlp\.shared_experts\.gate_weight", "replicated"),
    (r"mtp\.layers\.\d+\.eh_proj\.weight", "column"),
    (r".*(layernorm|norm)\.weight|.*\.layer_norm_weight", "norm"),
]
_COMPILED = [(re.compile(p + r"$"), kind) for p, kind in RULES]


def kind_of(name: str) -> str:
    for pattern, kind in _COMPILED:
        if pattern.match(name):
            return kind
    raise KeyError(f"no sharding rule for parameter {name!r}; add one to global_weights.RULES")


def global_tensor(name: str, shape, kind: str, seed: int, router_std: float) -> torch.Tensor:
    """The full tensor of canonical `name`, the same in every rank and layout."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 7919 * seed) % 2**63)
    x = torch.randn(tuple(shape), generator=g)
    if kind == "norm":
        return 1.0 + 0.1 * x
    if kind == "router":
        return router_std * x
    return x / shape[-1] ** 0.5  # unit-variance outputs for unit-variance inputs


def _split(full: torch.Tensor, kind: str, rank: int, size: int) -> torch.Tensor:
    if size == 1 or kind in ("norm", "router", "replicated"):
        return full
    if kind in ("vocab", "column"):
        return full.chunk(size, dim=0)[rank]
    if kind in ("row", "expert_row"):
        return full.chunk(size, dim=1)[rank]
    gate, up = full.chunk(2, dim=0)  # glu, expert_glu: each shard is [gate_r ; up_r]
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])


def _sharded_shape(local_shape, kind: str, size: int):
    shape = list(local_shape)
    if kind in ("vocab", "column", "glu", "expert_glu"):
        shape[0] *= size
    elif kind in ("row", "expert_row"):
        shape[1] *= size
    return shape


def _layer_numbers(gpt) -> dict[str, int]:
    """Local `decoder.layers.{i}` prefix -> global 0-based layer index."""
    if getattr(gpt, "decoder", None) is None:
        return {}
    return {f"decoder.layers.{i}.": layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}


def fill_global_weights(model, seed: int = 0, router_std: float = 1.0) -> None:
    """Overwrite every parameter of `model` (a GPTModel stage or a list of VP chunks)."""
    from megatron.core import parallel_state as ps

    tp, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp, etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    ep = ps.get_expert_model_parallel_rank()
    for gpt in model if isinstance(model, (list, tuple)) else [model]:
        layers = _layer_numbers(gpt)
        with torch.no_grad():
            for local_name, param in gpt.named_parameters():
                for target, value in _global_slices(
                    local_name, param, gpt, layers, seed, router_std, (tp, tp_size), (etp, etp_size), ep
                ):
                    (param.data if target is None else target).copy_(value)


def _canonical_prefix(local_name: str, layers: dict[str, int]) -> str:
    for prefix, index in layers.items():
        if local_name.startswith(prefix):
            return f"decoder.layers.{index}." + local_name[len(prefix) :]
    return local_name


def _global_slices(local_name, param, gpt, layers, seed, router_std, tp, etp, ep):
    """Yield (target, value): target None means the whole parameter, else a view into it."""
    name = _canonical_prefix(local_name, layers)
    if name == "output_layer.weight" and getattr(gpt, "share_embeddings_and_output_weights", False):
        name = "embedding.word_embeddings.weight"  # a later stage's copy of the tied embeddings
    match = re.match(r"(.*\.mlp\.experts\.)(local_experts\.(\d+)\.(.*)|weight([12]))$", name)
    if not match:
        kind = kind_of(name)
        rank, size = tp if kind != "norm" else (0, 1)
        full = global_tensor(name, _sharded_shape(param.shape, kind, size), kind, seed, router_std)
        yield None, _split(full, kind, rank, size)
        return
    local = gpt.get_submodule(local_name.split(".mlp.experts.")[0] + ".mlp.experts").num_local_experts
    rank, size = etp
    if match.group(3) is not None:  # SequentialMLP
        j = int(match.group(3))
        canon = f"{match.group(1)}{ep * local + j}.{match.group(4)}"
        kind = kind_of(canon)
        full = global_tensor(canon, _sharded_shape(param.shape, kind, size), kind, seed, router_std)
        yield None, _split(full, kind, rank, size)
        return
    which = match.group(5)  # GroupedMLP weight1 / weight2
    hidden = gpt.config.hidden_size
    view = param.data.view(local, hidden, -1) if which == "1" else param.data.view(local, -1, hidden)
    for j in range(local):
        fc = "linear_fc1" if which == "1" else "linear_fc2"
        canon = f"{match.group(1)}{ep * local + j}.{fc}.weight"
        kind = kind_of(canon)
        local_shape = view[j].t().shape  # fc1 [2F/etp, H], fc2 [H, F/etp]
        full = global_tensor(canon, _sharded_shape(local_shape, kind, size), kind, seed, router_std)
        yield view[j], _split(full, kind, rank, size).t()
