"""The model `estimate` counts, from its three inputs: a preset, an HF config.json, a checkpoint.

Each source yields a partial dict of ModelSpec fields; `merge` layers them (preset, then
config.json, then the checkpoint's own args, later ones override) and checks the result
(`model.architecture`). config.json and the presets (config.json values) are read by the HF format
(`checkpoint.hf.spec_fields_from_config`). A checkpoint contributes its ModelSpec (read once from
its Megatron/MindSpeed `args` by the format) and, for what only tensors show, the tensor names it
holds (metadata only: no tensor bytes are read).
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf import spec_fields_from_config
from mcore_proxy.core.errors import ProxyError
from mcore_proxy.estimate.model import architecture
from mcore_proxy.estimate.presets import PRESETS
from mcore_proxy.mcore.spec import ModelSpec


def from_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ProxyError(f"--preset {name!r} is not one of {', '.join(sorted(PRESETS))}")
    return {**spec_fields_from_config(PRESETS[name], f"preset {name}"), "name": PRESETS[name]["name"]}


def from_spec(spec: ModelSpec, names: list[str], source: str) -> dict:
    """The fields of a checkpoint's ModelSpec `estimate` counts (its args, read once by the format);
    where the args leave a size unknown (None) it is left to a preset or config.json (merge names
    what is still missing). The tensor names (none: unknown) add what hand-made args leave out: a
    flag off by default is on when its tensors are there, one on by default (biases, LayerNorm) is
    off when they are not."""
    has = lambda *texts: any(t in n for n in names for t in texts)  # noqa: E731
    present = lambda said, *texts: said and (not names or has(*texts))  # noqa: E731
    heads, hidden = spec.num_attention_heads, spec.hidden_size
    # MindSpeed-LLM pads the layer count with --noop-layers (placeholders that hold no
    # parameters, for even pipeline stages): count the real layers only
    real = [L for L in range(spec.num_layers) if L not in spec.noop_layers]
    mla = spec.mla
    layernorm = present(spec.normalization == "LayerNorm", "layernorm.bias", "layer_norm_bias")
    if mla is None and has("linear_kv_down_proj", "kv_layernorm"):
        raise ProxyError(
            f"{source}: the tensors are multi-latent attention's but the args do not say "
            "multi_latent_attention; add it (and the MLA sizes) to the args"
        )
    out = dict(
        num_layers=len(real),
        hidden_size=hidden,
        vocab_size=spec.vocab_size,
        num_attention_heads=heads,
        # MLA has no key/value groups: counted as MHA
        num_query_groups=spec.num_query_groups or heads,
        kv_channels=spec.kv_channels or (hidden // heads if heads else None),
        ffn_hidden_size=spec.ffn_hidden_size,
        num_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        topk=spec.topk,
        moe_layers=tuple(i for i, L in enumerate(real) if L in spec.moe_layers),
        shared_expert_size=spec.shared_expert_size or 0,
        shared_expert_gate=spec.shared_expert_gate or has("shared_expert_gate", "shared_experts.gate_weight"),
        mtp_layers=spec.mtp_layers,
        untie_embeddings=has("output_layer.weight") if spec.untie_embeddings is None else spec.untie_embeddings,
        qk_layernorm=spec.qk_layernorm or has("q_layernorm"),
        add_bias_linear=present(spec.add_bias_linear, "linear_proj.bias"),
        add_qkv_bias=spec.add_qkv_bias or has("linear_qkv.bias"),
        activation=spec.activation,
        normalization="LayerNorm" if layernorm else "RMSNorm",
        expert_bias=spec.expert_bias or has("router.expert_bias"),
        score_function=spec.score_function,
        num_groups=spec.num_groups,
        group_topk=spec.group_topk,
        indexer=spec.indexer,  # DeepSeek-V3.2's, as the args say (`experimental_attention_variant` "dsa")
        source=source,
    )
    out = {k: v for k, v in out.items() if v is not None}  # unknown here: left to a preset
    out["mla"] = mla  # decided even when absent: a checkpoint says whether it has MLA
    return out


def merge(*parts: dict) -> ModelSpec:
    """Later parts override earlier ones (each part holds only what its source knows); the
    name is the first one given."""
    fields: dict = {}
    for part in parts:
        fields.update(part)
    names = [p["name"] for p in parts if p.get("name")]
    fields["name"] = names[0] if names else fields.get("source", "model")
    fields["source"] = " + ".join(p["source"] for p in parts if p.get("source"))
    missing = [f for f in ("num_layers", "hidden_size", "num_experts", "moe_layers") if f not in fields]
    if missing:
        raise ProxyError(f"{fields['source']}: {', '.join(missing)} unknown; pass --preset or --hf-config")
    return architecture(**fields)
