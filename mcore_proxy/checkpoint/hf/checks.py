"""config.json against the tensors: a disagreement is one sentence naming both files.

A proxy is only as right as its config.json: transformers builds the model from it and loads
the tensors into that shape (or refuses with a traceback about a size mismatch deep inside the
loader). So the reader checks what the model's shape depends on before anything else runs.
"""

from __future__ import annotations

import re

from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore import megatron_args as ma

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_ROUTER = re.compile(r"^(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.router\.weight$")
_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.(\d+)\.linear_fc([12])\.weight$"
)
# (tensor, the Megatron arg that says it exists, the tensor whose layers it belongs to): where the
# anchor exists, the tensor exists exactly when the arg (made from config.json) is true; a mismatch
# would write a Megatron checkpoint that megatron-core refuses to load, or that lacks a tensor
_OPTIONAL = (
    ("self_attention.linear_qkv.bias", "add_qkv_bias", "self_attention.linear_qkv.weight"),
    ("self_attention.q_layernorm.weight", "qk_layernorm", "self_attention.linear_qkv.weight"),
    ("mlp.shared_experts.gate_weight", "moe_shared_expert_gate", "mlp.shared_experts.linear_fc2.weight"),
)
_PREFIX = re.compile(r"^(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.(.+)$")


def _where(view, name: str) -> str:
    part = view._entries[name].parts[0]
    return f"{view.path / part.file} holds {part.key} of shape {list(part.info.shape)}"


def _fail(view, says: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"{view.config.path} says {says} but {_where(view, name)}; fix config.json or use the "
        "config.json that came with these weights"
    )


def _expert_key(view) -> str:
    """The spelling of E this config.json uses (the family record's `ConfigKeys.experts`)."""
    keys = view.family.config.experts
    return next((k for k in keys if view.config.has(k)), keys[0])


def check_optional_tensors(view) -> None:
    """q/k/v biases, q/k norms and the shared-expert gate are where config.json says they are."""
    names = set(view._entries)
    for name in sorted(names):
        m = _PREFIX.match(name)
        for leaf, arg, anchor in _OPTIONAL:
            if not m or m.group(2) != anchor:
                continue
            said, held = ma.arg_bool(view.args, arg), f"{m.group(1)}.{leaf}" in names
            if said and not held:
                raise CheckpointError(
                    f"{view.config.path} makes Megatron args {arg}=True but no shard holds "
                    f"{m.group(1)}.{leaf} (beside {_where(view, name)}); fix config.json or copy "
                    "the missing shards"
                )
            if held and not said:
                raise CheckpointError(
                    f"{view.config.path} makes Megatron args {arg}=False but "
                    f"{_where(view, f'{m.group(1)}.{leaf}')}; fix config.json or use the config.json "
                    "that came with these weights"
                )


def check_config_matches(view) -> None:
    """Layers, MoE layers, expert count and every shape the config determines."""
    check_optional_tensors(view)
    spec, names = view.spec, sorted(view._entries)
    present = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
    if present != list(range(spec.num_layers)):
        beyond = next((n for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= spec.num_layers), None)
        if beyond:
            raise _fail(view, f"num_hidden_layers={spec.num_layers}", beyond)
        raise CheckpointError(
            f"{view.config.path} says num_hidden_layers={spec.num_layers} but the shards hold "
            f"decoder layers {present[0]}..{present[-1]} only; copy the missing shards or fix config.json"
        )
    routers = {m.group(1) for n in names if (m := _ROUTER.match(n))}
    want = {f"decoder.layers.{L}" for L in spec.moe_layers} | {
        f"mtp.layers.{k}.transformer_layer" for k in range(spec.mtp_layers) if spec.moe_layers
    }
    for prefix in sorted(routers - want):
        raise _fail(view, f"layer {prefix.split('.')[2]} is dense", prefix + ".mlp.router.weight")
    for prefix in sorted(want - routers):
        raise CheckpointError(
            f"{view.config.path} says {prefix} is a MoE layer but no shard holds its router "
            "(mlp.gate.weight); fix config.json or copy the missing shards"
        )
    H, E, F = spec.hidden_size, spec.num_experts, spec.moe_ffn_hidden_size
    vocab = ma.arg_int(view.args, "padded_vocab_size", minimum=1)
    experts: dict[str, set[int]] = {}
    for name in names:
        shape = view.shape(name)
        if name == "embedding.word_embeddings.weight" and shape != (vocab, H):
            raise _fail(view, f"vocab_size={vocab}, hidden_size={H}", name)
        if _ROUTER.match(name) and shape != (E, H):
            raise _fail(view, f"{_expert_key(view)}={E}, hidden_size={H}", name)
        if m := _EXPERT.match(name):
            experts.setdefault(m.group(1), set()).add(int(m.group(2)))
            if shape != ((2 * F, H) if m.group(3) == "1" else (H, F)):
                raise _fail(view, f"moe_intermediate_size={F}, hidden_size={H}", name)
    for prefix, ids in sorted(experts.items()):
        if ids != set(range(E)):
            odd = max(ids) if max(ids) >= E else min(set(range(E)) - ids)
            name = f"{prefix}.mlp.experts.{max(ids)}.linear_fc1.weight"
            if odd >= E:
                raise _fail(view, f"{_expert_key(view)}={E}", name)
            raise CheckpointError(
                f"{view.config.path} says {_expert_key(view)}={E} but {prefix} lacks expert {odd}; "
                "copy the missing shards or fix config.json"
            )
