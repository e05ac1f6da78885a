"""Architectures from the three inputs of `estimate`: a preset, an HF config.json, a checkpoint.

Each source yields a partial dict of `Architecture` fields; `merge` layers them (preset, then
config.json, then the checkpoint's own args, later ones override) and validates the result.
HF configs are read as plain JSON with transformers' field names (Qwen3MoeConfig,
Qwen2MoeConfig, DeepseekV3Config and DeepSeek-V3.2's additions); transformers is not needed.
A checkpoint contributes its Megatron/MindSpeed `args` and, where an argument is absent, the
tensor names it holds (metadata only: no tensor bytes are read).
"""
from __future__ import annotations

from pathlib import Path

from mcore_proxy.jsonfile import read_json_object
from mcore_proxy.errors import ProxyError
from mcore_proxy.estimate.model import MLA, Architecture, Indexer
from mcore_proxy.estimate.presets import PRESETS

# transformers' defaults where a config.json may leave a field out, per model_type
# (configuration_qwen3_moe.py, configuration_qwen2_moe.py, configuration_deepseek_v3.py)
_HF_DEFAULTS = {
    "qwen3_moe": {"tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "attention_bias": False},
    "qwen2_moe": {"tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "deepseek_v3": {"tie_word_embeddings": False, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "n_shared_experts": 1, "attention_bias": False},
}
_HF_DEFAULTS["deepseek_v32"] = _HF_DEFAULTS["deepseek_v3"]


def read_hf_config(path: str | Path) -> dict:
    """config.json (or a model folder holding one) as a dict; ProxyError naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return read_json_object(path, "model config", "pass the model's config.json or its folder")


def from_hf_config(cfg: dict, source: str) -> dict:
    """Architecture fields from transformers-style config values."""
    cfg = {**_HF_DEFAULTS.get(cfg.get("model_type", ""), {}), **cfg}
    need = lambda key: _require(cfg, key, source)  # noqa: E731
    layers = int(need("num_hidden_layers"))
    experts = cfg.get("num_experts", cfg.get("n_routed_experts", cfg.get("num_local_experts")))
    if not experts:
        raise ProxyError(f"{source}: no num_experts / n_routed_experts; estimate needs a MoE model")
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    moe_ffn = int(cfg.get("moe_intermediate_size") or need("intermediate_size"))  # Mixtral: one width
    out = dict(
        num_layers=layers, hidden_size=hidden, vocab_size=int(need("vocab_size")),
        num_attention_heads=heads, num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg.get("intermediate_size") or moe_ffn), num_experts=int(experts),
        moe_ffn_hidden_size=moe_ffn, topk=int(need("num_experts_per_tok")),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        # Qwen2-MoE's q/k/v projections always carry biases; the others follow attention_bias
        add_qkv_bias=bool(cfg.get("attention_bias")) or cfg.get("model_type") == "qwen2_moe",
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0), source=source,
    )
    if "n_routed_experts" in cfg:   # DeepSeek: dense first layers, MLA, shared experts, groups, bias
        first, freq = int(cfg["first_k_dense_replace"]), int(cfg.get("moe_layer_freq") or 1)
        out["moe_layers"] = tuple(i for i in range(layers) if i >= first and i % freq == 0)
        out["shared_expert_size"] = int(cfg.get("n_shared_experts") or 0) * moe_ffn
        out.update(num_groups=cfg.get("n_group"), group_topk=cfg.get("topk_group"),
                   score_function=cfg.get("scoring_func", "sigmoid"),
                   expert_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc", qk_layernorm=True)
        if cfg.get("kv_lora_rank"):
            out["mla"] = MLA(q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                             qk_head_dim=int(need("qk_nope_head_dim")),
                             qk_pos_emb_head_dim=int(need("qk_rope_head_dim")), v_head_dim=int(need("v_head_dim")))
        if cfg.get("index_n_heads"):
            out["indexer"] = Indexer(n_heads=int(cfg["index_n_heads"]), head_dim=int(need("index_head_dim")))
    else:                           # Qwen-MoE: every decoder_sparse_step-th layer outside mlp_only_layers
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
        out["moe_layers"] = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        out["shared_expert_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
        out["shared_expert_gate"] = bool(out["shared_expert_size"])   # Qwen2-MoE's sigmoid gate
        out["qk_layernorm"] = cfg.get("model_type", "qwen3_moe").startswith("qwen3")
    return out


def _require(cfg: dict, key: str, source: str):
    if cfg.get(key) is None:
        raise ProxyError(f"{source}: no {key!r}; pass a complete config.json (transformers field names)")
    return cfg[key]


def from_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ProxyError(f"--preset {name!r} is not one of {', '.join(sorted(PRESETS))}")
    return {**from_hf_config(PRESETS[name], f"preset {name}"), "name": PRESETS[name]["name"]}


def from_megatron_args(args, names: list[str], source: str) -> dict:
    """Architecture fields from a checkpoint's `args` (Megatron and MindSpeed-LLM spellings);
    where an argument is absent, the checkpoint's canonical tensor names decide, and what neither
    says is left to a preset or config.json (merge names what is still missing)."""
    from mcore_proxy.spec import ModelSpec

    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731
    spec = ModelSpec.from_args(args)
    heads, hidden = _int(get("num_attention_heads")), spec.hidden_size
    # MindSpeed-LLM pads the layer count with --noop-layers (placeholders that hold no
    # parameters, for even pipeline stages): count the real layers only
    real = [L for L in range(spec.num_layers) if L not in spec.noop_layers]
    groups = get("num_query_groups") if get("group_query_attention") else heads
    has = lambda text: any(text in n for n in names)  # noqa: E731
    out = dict(
        num_layers=len(real), hidden_size=hidden,
        vocab_size=_int(get("padded_vocab_size") or get("vocab_size")),
        num_attention_heads=heads, num_query_groups=_int(groups),
        kv_channels=_int(get("kv_channels") or (hidden // heads if heads else None)),
        ffn_hidden_size=_int(get("ffn_hidden_size")), num_experts=spec.num_experts,
        moe_ffn_hidden_size=_int(spec.moe_ffn_hidden_size), topk=spec.topk,
        moe_layers=tuple(i for i, L in enumerate(real) if L in spec.moe_layers),
        shared_expert_size=_int(spec.shared_expert_size) or _n_shared(args),
        shared_expert_gate=bool(get("moe_shared_expert_gate")) or has("shared_expert_gate")
        or has("shared_experts.gate_weight"),
        mtp_layers=spec.mtp_layers,
        tied_embeddings=_flag(get("untie_embeddings_and_output_weights"), not has("output_layer.weight"), invert=True),
        qk_layernorm=_flag(get("qk_layernorm"), has("q_layernorm")),
        add_bias_linear=_flag(get("add_bias_linear"), has("linear_proj.bias")),
        add_qkv_bias=_flag(get("add_qkv_bias"), has("linear_qkv.bias")),
        gated_linear_unit=spec.gated_linear_unit, layernorm_bias=get("normalization") == "LayerNorm",
        expert_bias=spec.expert_bias or has("router.expert_bias"), score_function=spec.score_function,
        source=source,
    )
    out = {k: v for k, v in out.items() if v is not None}   # unknown here: left to a preset
    # decided even when absent: a checkpoint says whether it has MLA and routing groups
    mla = get("multi_latent_attention") or get("multi_head_latent_attention")
    if mla is None:
        mla = has("linear_kv_down_proj") or has("kv_layernorm")
    out["mla"] = MLA(q_lora_rank=_int(get("q_lora_rank")), kv_lora_rank=_int(get("kv_lora_rank")),
                     qk_head_dim=_int(get("qk_head_dim") or get("qk_nope_head_dim")),
                     qk_pos_emb_head_dim=_int(get("qk_pos_emb_head_dim") or get("qk_rope_head_dim")),
                     v_head_dim=_int(get("v_head_dim"))) if mla else None
    out["num_groups"], out["group_topk"] = spec.num_groups or get("n_group"), spec.group_topk or get("topk_group")
    return out


def _int(value) -> int | None:
    return None if value is None else int(value)


def _flag(arg, from_names: bool, invert: bool = False) -> bool:
    """A boolean argument when the args hold it, else what the tensor names show."""
    if arg is None:
        return from_names
    return not bool(arg) if invert else bool(arg)


def _n_shared(args) -> int:
    """MindSpeed-LLM's --n-shared-experts (x the expert width) when the Megatron size is absent."""
    n = getattr(args, "n_shared_experts", None)
    width = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "moe_intermediate_size", None)
    return int(n) * int(width) if n and width else 0


def merge(*parts: dict) -> Architecture:
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
    return Architecture(**fields)
