"""Every Mixture-of-Experts family mcore-proxy reads from Hugging Face checkpoints: one
declaration each (`descriptor.MoEFamily`). Adding a family is adding one here.

Facts checked against transformers 5.24 (`models/<family>/modeling_*.py`, `conversion_mapping.py`)
by building each tiny model, saving it and reading the keys back; the Hub spellings that
transformers converts on load are accepted beside what `save_pretrained` writes. The Megatron
mapping of a family (`megatron=`) is optional: only HF <-> Megatron conversion needs it.
"""

from __future__ import annotations

from mcore_proxy.checkpoint.hf import deepseek, deepseek_v4, glm4_moe, mixtral, qwen2_moe, qwen3_moe
from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.descriptor import (
    E_LOCAL,
    E_QWEN,
    E_ROUTED,
    ConfigKeys,
    Experts,
    MoEFamily,
    Router,
    Runtime,
)

# -- pieces many families share --------------------------------------------------------------------
ATTENTION = ("self_attn.*",)  # every kind: GQA, MLA, indexers, sinks, biases, q/k norms
NORMS = ("input_layernorm.*", "post_attention_layernorm.*")
DENSE_MLP = ("mlp.gate_proj.*", "mlp.up_proj.*", "mlp.down_proj.*")
MODEL = ("model.embed_tokens.*", "model.norm.*", "lm_head.*")
# transformers' Llama-style routed experts: per expert on the Hub and in save_pretrained, fused in memory
HUB_EXPERTS = Experts(
    per_expert=(
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight",
    ),
    fused=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)
GATE = Router(weight=("mlp.gate.weight",))
BIASED_GATE = Router(weight=("mlp.gate.weight",), score_bias=("mlp.gate.e_score_correction_bias",))
BIASED_RUNTIME = Runtime(score_bias="mlp.gate.e_score_correction_bias")
# DeepSeek-style MTP layer (model.layers.{N + k}): its own norms and projection, embedding and head copies
DEEPSEEK_MTP = ("enorm.*", "hnorm.*", "eh_proj.*", "shared_head.*", "embed_tokens.*")

QWEN3_MOE = MoEFamily(
    "Qwen3-MoE",
    ("Qwen3MoeForCausalLM",),
    GATE,
    HUB_EXPERTS,
    ConfigKeys(E_QWEN),
    copied=ATTENTION + NORMS + DENSE_MLP,
    model_copied=MODEL,
    megatron=qwen3_moe.MAPPING,
)

QWEN2_MOE = MoEFamily(
    "Qwen2-MoE",
    ("Qwen2MoeForCausalLM",),
    GATE,
    HUB_EXPERTS,
    ConfigKeys(E_QWEN),
    copied=ATTENTION + NORMS + DENSE_MLP + ("mlp.shared_expert.*", "mlp.shared_expert_gate.*"),
    model_copied=MODEL,
    megatron=qwen2_moe.MAPPING,
)

# linear attention (gated delta net) beside full attention; the MTP block (`mtp.*`, which
# transformers neither builds nor saves) holds one MoE layer of its own
QWEN3_NEXT = MoEFamily(
    "Qwen3-Next",
    ("Qwen3NextForCausalLM",),
    GATE,
    HUB_EXPERTS,
    ConfigKeys(E_QWEN, mtp=("num_nextn_predict_layers",)),
    copied=ATTENTION + ("linear_attn.*",) + NORMS + DENSE_MLP + ("mlp.shared_expert.*", "mlp.shared_expert_gate.*"),
    model_copied=MODEL + ("mtp.fc.*", "mtp.pre_fc_norm_hidden.*", "mtp.pre_fc_norm_embedding.*", "mtp.norm.*"),
    mtp=("mtp.layers.{k}.",),
    notes="transformers does not build the MTP layer: it is pruned by router weights only (no statistics)",
)

# the text model of a vision-language checkpoint (`model.language_model.*`, vision tower copied)
QWEN3_5_MOE = MoEFamily(
    "Qwen3.5-MoE",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    GATE,
    HUB_EXPERTS,
    ConfigKeys(E_QWEN, mtp=("mtp_num_hidden_layers",)),
    layers=("model.layers.{L}.", "model.language_model.layers.{L}."),
    copied=ATTENTION + ("linear_attn.*",) + NORMS + ("mlp.shared_expert.*", "mlp.shared_expert_gate.*"),
    model_copied=MODEL
    + (
        "model.language_model.embed_tokens.*",
        "model.language_model.norm.*",
        "model.visual.*",
        "mtp.fc.*",
        "mtp.pre_fc_norm_hidden.*",
        "mtp.pre_fc_norm_embedding.*",
        "mtp.norm.*",
    ),
    mtp=("mtp.layers.{k}.",),
    notes="transformers does not build the MTP layer: it is pruned by router weights only (no statistics)",
)

OLMOE = MoEFamily(
    "OLMoE", ("OlmoeForCausalLM",), GATE, HUB_EXPERTS, ConfigKeys(E_QWEN), copied=ATTENTION + NORMS, model_copied=MODEL
)

# the Hub and save_pretrained spell the block `block_sparse_moe` and the experts w1 (gate), w3 (up), w2 (down)
_W123 = Experts(
    per_expert=(
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
    fused=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)
MIXTRAL = MoEFamily(
    "Mixtral",
    ("MixtralForCausalLM",),
    Router(weight=("block_sparse_moe.gate.weight", "mlp.gate.weight")),
    _W123,
    ConfigKeys(E_LOCAL),
    copied=ATTENTION + NORMS,
    model_copied=MODEL,
    megatron=mixtral.MAPPING,
)

# sigmoid scores; the selection bias sits on the MoE block, not on the gate
MINIMAX_M2 = MoEFamily(
    "MiniMax-M2",
    ("MiniMaxM2ForCausalLM",),
    Router(
        weight=("block_sparse_moe.gate.weight", "mlp.gate.weight"),
        score_bias=("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias"),
    ),
    _W123,
    ConfigKeys(E_LOCAL, score_function="sigmoid"),
    runtime=Runtime(score_bias="mlp.e_score_correction_bias"),
    copied=ATTENTION + NORMS,
    model_copied=MODEL,
)

_DEEPSEEK_KEYS = ConfigKeys(
    E_ROUTED, groups=("n_group", "topk_group"), score_function="sigmoid", mtp=("num_nextn_predict_layers",)
)
DEEPSEEK_V3 = MoEFamily(
    "DeepSeek-V3",
    ("DeepseekV3ForCausalLM",),
    BIASED_GATE,
    HUB_EXPERTS,
    _DEEPSEEK_KEYS,
    runtime=Runtime(score_bias="mlp.gate.e_score_correction_bias", model_type_alias=(("kimi_k2", "deepseek_v3"),)),
    copied=ATTENTION + NORMS + DENSE_MLP + ("mlp.shared_experts.*",),
    model_copied=MODEL,
    mtp_after_decoder=True,
    mtp_copied=DEEPSEEK_MTP,
    megatron=deepseek.MAPPINGS[deepseek.V3],
    notes="also Kimi-K2 text checkpoints (model_type kimi_k2, which transformers builds as deepseek_v3)",
)

DEEPSEEK_V32 = MoEFamily(
    "DeepSeek-V3.2",
    ("DeepseekV32ForCausalLM",),
    BIASED_GATE,
    HUB_EXPERTS,
    _DEEPSEEK_KEYS,
    runtime=BIASED_RUNTIME,
    copied=ATTENTION + NORMS + DENSE_MLP + ("mlp.shared_experts.*",),
    model_copied=MODEL,
    mtp_after_decoder=True,
    mtp_copied=DEEPSEEK_MTP,
    megatron=deepseek.MAPPINGS[deepseek.V32],
)

# MiMo-V2-Flash: DeepSeek-V3's biased sigmoid gate over sliding and full attention with sinks
MIMO_V2_FLASH = MoEFamily(
    "MiMo-V2-Flash",
    ("MiMoV2FlashForCausalLM",),
    BIASED_GATE,
    HUB_EXPERTS,
    ConfigKeys(E_ROUTED, groups=("n_group", "topk_group"), score_function="sigmoid"),
    runtime=BIASED_RUNTIME,
    copied=ATTENTION + NORMS + DENSE_MLP,
    model_copied=MODEL,
)

# Kimi-K2.5/K2.6: a DeepSeek-V3 text model inside a vision-language wrapper; the Hub writes
# `language_model.model.layers`, transformers' save_pretrained `language_model.model.blocks`
KIMI_K25 = MoEFamily(
    "Kimi-K2.5",
    ("Kimi_K25ForConditionalGeneration",),
    BIASED_GATE,
    HUB_EXPERTS,
    ConfigKeys(E_ROUTED, groups=("n_group", "topk_group"), score_function="sigmoid"),
    runtime=Runtime(score_bias="mlp.gate.e_score_correction_bias", auto_class="AutoModelForImageTextToText"),
    layers=("language_model.model.layers.{L}.", "language_model.model.blocks.{L}.", "model.language_model.layers.{L}."),
    copied=ATTENTION + NORMS + DENSE_MLP + ("mlp.shared_experts.*",),
    model_copied=(
        "language_model.model.embed_tokens.*",
        "language_model.model.norm.*",
        "language_model.lm_head.*",
        "model.language_model.embed_tokens.*",
        "model.language_model.norm.*",
        "lm_head.*",
        "vision_tower.*",
        "mm_projector.*",
        "model.vision_tower.*",
        "model.mm_projector.*",
    ),
)

# Kimi-Linear: linear (KDA) and MLA attention; the DeepSeek-V3 router under `block_sparse_moe`
KIMI_LINEAR = MoEFamily(
    "Kimi-Linear",
    ("KimiLinearForCausalLM",),
    Router(
        weight=("block_sparse_moe.gate.weight", "mlp.gate.weight"),
        score_bias=("block_sparse_moe.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    ),
    _W123,
    ConfigKeys(
        E_QWEN,
        topk=("num_experts_per_token", "num_experts_per_tok"),
        groups=("num_expert_group", "topk_group"),
        score_function="sigmoid",
    ),
    runtime=BIASED_RUNTIME,
    copied=ATTENTION
    + NORMS
    + DENSE_MLP
    + (
        "block_sparse_moe.gate_proj.*",
        "block_sparse_moe.up_proj.*",
        "block_sparse_moe.down_proj.*",
        "block_sparse_moe.shared_experts.*",
        "mlp.shared_experts.*",
    ),
    model_copied=MODEL,
)

# GLM-4.5/4.6/4.7 (glm4_moe), GLM-4.7-Flash (glm4_moe_lite, MLA) and GLM-5 (glm_moe_dsa, MLA + DSA
# indexer): DeepSeek's router, and its MTP layer at num_hidden_layers
GLM4_MOE = MoEFamily(
    "GLM-4.5-MoE",
    ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM"),
    BIASED_GATE,
    HUB_EXPERTS,
    _DEEPSEEK_KEYS,
    runtime=BIASED_RUNTIME,
    copied=ATTENTION + NORMS + DENSE_MLP + ("mlp.shared_experts.*",),
    model_copied=MODEL,
    mtp_after_decoder=True,
    mtp_copied=DEEPSEEK_MTP,
    megatron=glm4_moe.MAPPING,
)

# DeepSeek-V4: hash-routed first layers (tid2eid), sqrtsoftplus scores; the release spells keys
# without `model.` (`layers.{L}.ffn.*`, FP4 experts with `.scale`), save_pretrained with it
V4_EXPERTS = Experts(
    per_expert=tuple(f"ffn.experts.{{e}}.{w}.{part}" for w in ("w1", "w3", "w2") for part in ("weight", "scale")),
    fused=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)
DEEPSEEK_V4 = MoEFamily(
    "DeepSeek-V4",
    ("DeepseekV4ForCausalLM",),
    Router(
        weight=("ffn.gate.weight", "mlp.gate.weight"),
        score_bias=("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
        hash_table=("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ),
    V4_EXPERTS,
    ConfigKeys(E_ROUTED, score_function=("scoring_func", "sqrtsoftplus"), mtp=("num_nextn_predict_layers",)),
    runtime=Runtime(score_bias="mlp.gate.e_score_correction_bias", hash_table="mlp.gate.tid2eid"),
    layers=("layers.{L}.", "model.layers.{L}."),
    copied=(
        "attn.*",
        "self_attn.*",
        "attn_norm.*",
        "ffn_norm.*",
        "input_layernorm.*",
        "post_attention_layernorm.*",
        "hc_attn_*",
        "hc_ffn_*",
        "attn_hc.*",
        "ffn_hc.*",
        "ffn.shared_experts.*",
        "mlp.shared_experts.*",
    ),
    model_copied=(
        "embed.*",
        "head.*",
        "norm.*",
        "hc_head_*",
        "model.embed_tokens.*",
        "model.norm.*",
        "model.hc_head.*",
        "lm_head.*",
    ),
    mtp=("mtp.{k}.",),
    mtp_copied=("e_proj.*", "h_proj.*", "enorm.*", "hnorm.*", "norm.*", "hc_head_*"),
    megatron=deepseek_v4.MAPPING,
    notes="transformers does not build the MTP layer: it is pruned by router weights only (no statistics); "
    "Megatron mapping: Megatron-LM's dev branch names at TP 1 (a quantized release: --dequantize to HF first)",
)

# gpt-oss: a router with a logit bias; fused experts transposed ([E, H, 2F], gate/up interleaved)
# with biases, MXFP4 on the Hub (`_blocks`, `_scales`, expert on axis 0)
GPT_OSS = MoEFamily(
    "gpt-oss",
    ("GptOssForCausalLM",),
    Router(weight=("mlp.router.weight",), bias=("mlp.router.bias",)),
    Experts(
        per_expert=(),
        fused=(
            "mlp.experts.gate_up_proj",
            "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias",
        ),
    ),
    ConfigKeys(E_LOCAL, topk=("num_experts_per_tok", "experts_per_token")),
    runtime=Runtime(router_module="mlp.router"),
    copied=ATTENTION + NORMS,
    model_copied=MODEL,
)

# ERNIE-4.5-MoE: softmax scores plus a selection bias of shape [1, E] (`moe_statics`)
ERNIE4_5_MOE = MoEFamily(
    "ERNIE-4.5-MoE",
    ("Ernie4_5_MoeForCausalLM",),
    Router(
        weight=("mlp.gate.weight",),
        score_bias=("mlp.moe_statics.e_score_correction_bias", "mlp.gate.moe_statics.e_score_correction_bias"),
    ),
    HUB_EXPERTS,
    ConfigKeys(("moe_num_experts", "num_experts"), topk=("moe_k", "num_experts_per_tok")),
    runtime=Runtime(score_bias="mlp.gate.moe_statics.e_score_correction_bias"),
    copied=ATTENTION + NORMS + DENSE_MLP + ("mlp.shared_experts.*",),
    model_copied=MODEL,
)

# Llama-4: `feed_forward`, a sigmoid top-k router returning (scores, logits), fused transposed
# experts (per expert in quantized releases), the text model of a multimodal checkpoint
LLAMA4 = MoEFamily(
    "Llama-4",
    ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
    Router(weight=("feed_forward.router.weight",)),
    Experts(
        per_expert=(
            "feed_forward.experts.{e}.gate_proj.weight",
            "feed_forward.experts.{e}.up_proj.weight",
            "feed_forward.experts.{e}.down_proj.weight",
        ),
        fused=("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"),
    ),
    ConfigKeys(("num_local_experts",), score_function="sigmoid"),
    runtime=Runtime(router_module="feed_forward.router", output="scores_logits"),
    layers=("model.layers.{L}.", "language_model.model.layers.{L}."),
    copied=ATTENTION
    + NORMS
    + (
        "feed_forward.shared_expert.*",
        "feed_forward.gate_proj.*",
        "feed_forward.up_proj.*",
        "feed_forward.down_proj.*",
    ),
    model_copied=MODEL
    + (
        "language_model.model.embed_tokens.*",
        "language_model.model.norm.*",
        "language_model.lm_head.*",
        "vision_model.*",
        "multi_modal_projector.*",
    ),
)

FAMILIES: tuple[MoEFamily, ...] = (
    QWEN3_MOE,
    QWEN2_MOE,
    QWEN3_NEXT,
    QWEN3_5_MOE,
    OLMOE,
    MIXTRAL,
    MINIMAX_M2,
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    DEEPSEEK_V4,
    KIMI_K25,
    KIMI_LINEAR,
    GLM4_MOE,
    GPT_OSS,
    ERNIE4_5_MOE,
    LLAMA4,
    MIMO_V2_FLASH,
)


def declared(architecture: str) -> MoEFamily | None:
    """The declaration of `architecture` (a config.json `architectures` entry), or None."""
    return next((f for f in FAMILIES if architecture in f.architectures), None)


def family_of(config: HFConfig) -> MoEFamily:
    """The family of config.json's architecture: its declaration, else the family discovered from
    transformers itself (`discovery.py`); one sentence naming what is missing if neither reads it."""
    from mcore_proxy.checkpoint.hf.discovery import discover

    return declared(config.architecture()) or discover(config).family


def family_named(name: str) -> MoEFamily:
    """A declared family, or one discovered in this process (`discovery.py`), by its name."""
    from mcore_proxy.checkpoint.hf.discovery import discovered_named

    found = next((f for f in FAMILIES if f.name == name), None) or discovered_named(name)
    if found is None:
        raise KeyError(name)
    return found


def with_megatron() -> tuple[MoEFamily, ...]:
    """The declared families that convert to and from megatron-core (registry order)."""
    return tuple(f for f in FAMILIES if f.megatron is not None)


# every spelling of the expert count any family's config.json uses (estimate reads configs by these)
EXPERT_COUNT_KEYS = tuple(dict.fromkeys(k for f in FAMILIES for k in f.config.experts))
