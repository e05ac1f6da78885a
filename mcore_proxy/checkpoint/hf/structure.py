"""A transformers config.json as a model's structure: the ModelSpec fields `estimate` counts.

Read as plain JSON with transformers' field names (Qwen3MoeConfig, Qwen2MoeConfig,
Qwen3NextConfig, Qwen3_5MoeTextConfig, DeepseekV3Config and DeepSeek-V3.2's additions, Kimi-K2's
`kimi_k2`, Glm4MoeConfig, DeepseekV4Config, GptOssConfig); a vision-language config is read
through its `text_config`; transformers is not needed, and no weights. Sizes are read by the HF
format's one config reader (`HFConfig.int`: 1.5 or 1e308 is refused by name), and which layers are MoE
by the families' own rules (`qwen2_moe.moe_pattern`, `deepseek.moe_pattern`). Beyond the families
the HF format reads, this covers the token mixers only `estimate` needs (Gated DeltaNet,
DeepSeek-V4's attention, mHC), from the config alone.
"""

from __future__ import annotations

from pathlib import Path

from mcore_proxy.checkpoint.hf.config import HFConfig, config_int
from mcore_proxy.checkpoint.hf.deepseek import moe_pattern as deepseek_moe_layers
from mcore_proxy.checkpoint.hf.families import EXPERT_COUNT_KEYS
from mcore_proxy.checkpoint.hf.qwen2_moe import moe_pattern as qwen_moe_layers
from mcore_proxy.core.errors import ProxyError
from mcore_proxy.core.jsonfile import read_json_object
from mcore_proxy.mcore.spec import MLA, Indexer, LinearAttention, V4Attention

# transformers' defaults where a config.json may leave a field out, per model_type
# (configuration_qwen3_moe.py, configuration_qwen2_moe.py, configuration_qwen3_next.py,
# configuration_qwen3_5_moe.py, configuration_deepseek_v3.py, configuration_glm4_moe.py,
# configuration_deepseek_v4.py, configuration_gpt_oss.py of transformers 5)
_LINEAR_DEFAULTS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "full_attention_interval": 4,
}
_HF_DEFAULTS = {
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
    },
    "qwen2_moe": {"tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3_next": {
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "linear_num_value_heads": 32,
        **_LINEAR_DEFAULTS,
    },
    "qwen3_5_moe_text": {
        "tie_word_embeddings": False,
        "attention_bias": False,
        "linear_num_value_heads": 32,
        **_LINEAR_DEFAULTS,
    },
    "deepseek_v3": {
        "tie_word_embeddings": False,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_shared_experts": 1,
        "attention_bias": False,
    },
    "glm4_moe": {
        "tie_word_embeddings": False,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "attention_bias": False,
        "use_qk_norm": False,
        "num_nextn_predict_layers": 1,
    },
    "deepseek_v4": {
        "tie_word_embeddings": False,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "hc_mult": 4,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "num_nextn_predict_layers": 1,
    },
    "gpt_oss": {"tie_word_embeddings": False, "attention_bias": True},
}
_HF_DEFAULTS["deepseek_v32"] = _HF_DEFAULTS["deepseek_v3"]
_HF_DEFAULTS["kimi_k2"] = _HF_DEFAULTS["deepseek_v3"]  # Kimi-K2 is built as DeepseekV3 by transformers
_HF_DEFAULTS["qwen3_5_moe"] = _HF_DEFAULTS["qwen3_5_moe_text"]
# DeepSeek-V4's attention kinds as its config spells them (layer_types) and their compress ratios
# (DeepseekV4Config.default_compress_rates), and its default count of hash-routed layers
_V4_RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_V4_DEFAULT_HASH_LAYERS = 3


def read_config_json(path: str | Path) -> dict:
    """config.json (or a model folder holding one) as a dict; ProxyError naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return read_json_object(path, "model config", "pass the model's config.json or its folder")


def spec_fields_from_config(cfg: dict, source: str) -> dict:
    """ModelSpec fields from transformers-style config values (sizes checked by `HFConfig.int`), as
    `estimate` counts them: layers real and 0-based, sizes in elements."""
    if isinstance(cfg.get("text_config"), dict):  # a vision-language model: its language model
        outer = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}
        cfg = {**outer, **cfg["text_config"]}
    kind = cfg.get("model_type", "")
    c = HFConfig({**_HF_DEFAULTS.get(kind, {}), **cfg}, Path(source))
    cfg = c.data
    layers = c.int("num_hidden_layers")
    # every family's spelling of E (the family records' `ConfigKeys.experts`)
    experts = next(filter(None, (c.int(key, 0) for key in EXPERT_COUNT_KEYS)), None)
    if not experts:
        raise ProxyError(f"{source}: no {' / '.join(EXPERT_COUNT_KEYS)}; estimate needs a MoE model")
    heads, hidden = c.int("num_attention_heads"), c.int("hidden_size")
    moe_ffn = c.int("moe_intermediate_size", 0) or c.int("intermediate_size")  # Mixtral, gpt-oss: one width
    out = dict(
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=c.int("vocab_size"),
        num_attention_heads=heads,
        num_query_groups=c.int("num_key_value_heads", 0) or heads,
        # no heads: 0, which `estimate` refuses by name (instead of a division by zero)
        kv_channels=c.int("head_dim", 0) or (hidden // heads if heads else 0),
        ffn_hidden_size=c.int("intermediate_size", 0) or moe_ffn,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        # gpt-oss's own config spells top-k experts_per_token (transformers: num_experts_per_tok)
        topk=c.first_int("num_experts_per_tok", "experts_per_token"),
        untie_embeddings=not cfg.get("tie_word_embeddings", True),
        # Qwen2-MoE's q/k/v projections always carry biases; the others follow attention_bias
        add_qkv_bias=bool(cfg.get("attention_bias")) or kind == "qwen2_moe",
        # MTP modules: DeepSeek, GLM, Qwen3-Next spell them num_nextn_predict_layers, Qwen3.5
        # mtp_num_hidden_layers (transformers' Glm4MoeConfig: num_mtp_layers)
        mtp_layers=c.first_int("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", default=0),
        source=source,
    )
    if kind == "deepseek_v4" or "o_groups" in cfg:
        out.update(_deepseek_v4(c, out))
    elif "n_routed_experts" in cfg:  # DeepSeek-V3 style: dense first layers, shared experts, groups, bias
        out.update(_deepseek_v3(c, out))
    else:  # Qwen-MoE: every decoder_sparse_step-th layer outside mlp_only_layers
        out["moe_layers"] = _ids(qwen_moe_layers(c, layers, experts))
        out["shared_expert_size"] = c.int("shared_expert_intermediate_size", 0)
        out["shared_expert_gate"] = bool(out["shared_expert_size"])  # Qwen2-MoE's sigmoid gate
        out["qk_layernorm"] = kind.startswith("qwen3")
        out.update(_linear_attention(c, layers, kind))
        if kind == "gpt_oss":  # biased o_proj, experts and router (Megatron: add_bias_linear); sinks
            out.update(add_bias_linear=True, attention_sinks=True)
    return out


def _ids(pattern: list[int]) -> tuple[int, ...]:
    """The layer ids a 0/1 MoE pattern marks."""
    return tuple(i for i, moe in enumerate(pattern) if moe)


def _deepseek_v3(c: HFConfig, out: dict) -> dict:
    """DeepSeek-V3 style (DeepSeek-V3/V3.2, Kimi-K2, GLM-4.5): dense first layers, shared experts,
    group-limited routing, an expert bias; MLA when kv_lora_rank is set, else GQA; V3.2's indexer."""
    cfg = c.data
    found = dict(
        moe_layers=_ids(deepseek_moe_layers(c, out["num_layers"])),
        shared_expert_size=c.int("n_shared_experts", 0) * out["moe_ffn_hidden_size"],
        num_groups=c.int("n_group", None),
        group_topk=c.int("topk_group", None),
        score_function=cfg.get("scoring_func", "sigmoid"),
        expert_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
    )
    if c.int("kv_lora_rank", 0):  # MLA (DeepSeek, Kimi-K2): q_a/kv_a norms are Megatron's qk_layernorm
        found["mla"] = MLA(
            q_lora_rank=c.int("q_lora_rank", 0) or None,
            kv_lora_rank=c.int("kv_lora_rank"),
            qk_head_dim=c.int("qk_nope_head_dim"),
            qk_pos_emb_head_dim=c.int("qk_rope_head_dim"),
            v_head_dim=c.int("v_head_dim"),
        )
        found["qk_layernorm"] = True
    else:  # GQA (GLM-4.5/4.6/4.7): q/k norms when use_qk_norm
        found["qk_layernorm"] = bool(cfg.get("use_qk_norm"))
    if c.int("index_n_heads", 0):
        found["indexer"] = Indexer(
            n_heads=c.int("index_n_heads"), head_dim=c.int("index_head_dim"), topk=c.int("index_topk", None)
        )
    return found


def _linear_attention(c: HFConfig, layers: int, kind: str) -> dict:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers (layer_types, else every layer but each
    full_attention_interval-th) beside gated full attention. Sliding-window layers (gpt-oss's
    layer_types) hold the same parameters as full attention and change nothing here."""
    types = c.data.get("layer_types")
    hybrid = (
        kind in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
        or "linear_num_value_heads" in c.data
        or (types is not None and "linear_attention" in types)
    )
    if not hybrid:
        return {}
    if types is None:
        interval = c.int("full_attention_interval", 0) or 4
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    linear = tuple(i for i, t in enumerate(types[:layers]) if t == "linear_attention")
    return dict(
        linear_layers=linear,
        attention_output_gate=bool(c.data.get("attn_output_gate", True)),
        linear_attention=LinearAttention(
            num_key_heads=c.int("linear_num_key_heads"),
            num_value_heads=c.int("linear_num_value_heads"),
            key_head_dim=c.int("linear_key_head_dim"),
            value_head_dim=c.int("linear_value_head_dim"),
            conv_kernel=c.int("linear_conv_kernel_dim"),
        )
        if linear
        else None,
    )


def _deepseek_v4(c: HFConfig, out: dict) -> dict:
    """DeepSeek-V4: every layer MoE, the first hash-routed (mlp_layer_types, else num_hash_layers),
    a KV compress ratio per layer (compress_ratios, trailing entries for the MTP layers; else
    layer_types with compress_rates; else DeepseekV4Config's default), one shared key/value head,
    hyper-connections (hc_mult)."""
    cfg, layers, moe_ffn = c.data, out["num_layers"], out["moe_ffn_hidden_size"]
    if cfg.get("mlp_layer_types"):
        hashed = tuple(i for i, t in enumerate(cfg["mlp_layer_types"][:layers]) if t == "hash_moe")
    else:
        hashed = tuple(range(min(layers, c.int("num_hash_layers", _V4_DEFAULT_HASH_LAYERS))))
    if cfg.get("compress_ratios"):
        ratios = tuple(config_int(r, "compress_ratios", c.path) for r in cfg["compress_ratios"])
    else:
        rates = {**_V4_RATIOS, **(cfg.get("compress_rates") or {})}
        types = cfg.get("layer_types") or (
            ["heavily_compressed_attention"] * min(layers, 2)
            + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(layers - 2)]
        )
        unknown = sorted(set(types[:layers]) - set(rates))
        if unknown:
            raise ProxyError(f"{c.path}: DeepSeek-V4 layer_types {unknown} are not among {sorted(rates)}")
        ratios = tuple(config_int(rates[t], f"compress_rates[{t!r}]", c.path) for t in types[:layers])
    return dict(
        moe_layers=tuple(range(layers)),
        hash_layers=hashed,
        ffn_hidden_size=moe_ffn,
        shared_expert_size=c.int("n_shared_experts", 0) * moe_ffn,
        score_function=cfg.get("scoring_func", "sqrtsoftplus"),
        expert_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
        attention_sinks=True,
        hyper_connections=c.int("hc_mult", 0),
        v4_attention=V4Attention(
            head_dim=c.int("head_dim"),
            q_lora_rank=c.int("q_lora_rank"),
            o_groups=c.int("o_groups"),
            o_lora_rank=c.int("o_lora_rank"),
            index_n_heads=c.int("index_n_heads"),
            index_head_dim=c.int("index_head_dim"),
            compress_ratios=ratios,
        ),
    )
