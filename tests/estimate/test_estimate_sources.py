"""Architectures from config.json, presets, Megatron/MindSpeed args, and their layering."""

from __future__ import annotations

import argparse
import json

import pytest

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.core.errors import ProxyError
from mcore_proxy.estimate.model import all_mtp_params, count_parameters
from mcore_proxy.estimate.presets import (
    DEEPSEEK_V3,
    DEEPSEEK_V4_FLASH,
    GLM4_5,
    GPT_OSS_120B,
    PRESETS,
    QWEN3_5_397B_A17B,
    QWEN3_30B_A3B,
)
from mcore_proxy.estimate.model import compress_ratio, tied
from mcore_proxy.mcore.spec import ModelSpec
from mcore_proxy.checkpoint.hf import read_config_json, spec_fields_from_config
from mcore_proxy.estimate.sources import from_preset, from_spec, merge

# what a real config.json carries besides the architecture (transformers writes these too)
NOISE = {
    "architectures": ["X"],
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
}


def write_config(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**NOISE, **{k: v for k, v in cfg.items() if k != "name"}}))
    return path


@pytest.mark.parametrize("preset, cfg", sorted(PRESETS.items()))
def test_a_config_json_reads_like_its_preset(tmp_path, preset, cfg):
    path = write_config(tmp_path, cfg)
    from_file = merge(spec_fields_from_config(read_config_json(tmp_path), str(path)))  # the folder works too
    assert count_parameters(from_file) == count_parameters(merge(from_preset(preset)))


def test_transformers_defaults_fill_what_a_config_leaves_out():
    cfg = {
        k: v
        for k, v in QWEN3_30B_A3B.items()
        if k not in ("tie_word_embeddings", "decoder_sparse_step", "mlp_only_layers", "name")
    }
    a = merge(spec_fields_from_config(cfg, "qwen"))
    assert not tied(a) and a.moe_layers == tuple(range(48))  # Qwen3MoeConfig defaults
    unknown = merge(spec_fields_from_config({**cfg, "model_type": "some_moe"}, "other"))
    assert tied(unknown) and not unknown.qk_layernorm  # PretrainedConfig's default
    output_layer, qk_norms = 151936 * 2048, 48 * 2 * 128
    assert count_parameters(a).total - count_parameters(unknown).total == output_layer + qk_norms


def test_dense_layers_follow_each_family_s_fields():
    qwen = merge(spec_fields_from_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3]}, "q"))
    assert qwen.moe_layers == tuple(i for i in range(48) if (i + 1) % 2 == 0 and i not in (1, 3))
    ds = merge(spec_fields_from_config({**DEEPSEEK_V3, "first_k_dense_replace": 5, "moe_layer_freq": 2}, "d"))
    assert ds.moe_layers == tuple(i for i in range(61) if i >= 5 and i % 2 == 0)
    assert ds.shared_expert_size == 2048 and ds.expert_bias and ds.num_groups == 8 and ds.mla.q_lora_rank == 1536


def _without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys and k != "name"}


def test_a_vision_language_config_json_is_read_through_its_text_config(tmp_path):
    """Qwen3.5's release is a vision-language config: the language model sits in text_config."""
    text = {**_without(QWEN3_5_397B_A17B, "tie_word_embeddings"), "model_type": "qwen3_5_moe_text"}
    path = write_config(
        tmp_path,
        {
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text,
            "vision_config": {"depth": 27, "hidden_size": 1152},
            "tie_word_embeddings": False,
        },
    )
    a = merge(spec_fields_from_config(read_config_json(path), str(path)))
    assert count_parameters(a) == count_parameters(merge(from_preset("qwen3.5-397b-a17b")))
    assert a.linear_layers == tuple(i for i in range(60) if (i + 1) % 4) and a.attention_output_gate
    assert a.shared_expert_gate and a.qk_layernorm and a.mtp_layers == 1 and not tied(a)


def test_qwen3_5_layer_types_and_the_full_attention_interval_agree():
    types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(60)]
    cfg = {**_without(QWEN3_5_397B_A17B, "full_attention_interval"), "layer_types": types}
    spelled = merge(spec_fields_from_config(cfg, "q"))
    assert count_parameters(spelled) == count_parameters(merge(from_preset("qwen3.5-397b-a17b")))


def test_gpt_oss_reads_its_own_top_k_spelling_and_its_biases():
    """openai/gpt-oss's own config spells top-k experts_per_token; its o_proj, router and experts
    carry biases (Megatron's add_bias_linear) and each head a sink."""
    own = merge(spec_fields_from_config(_without(GPT_OSS_120B, "num_experts_per_tok"), "gpt-oss"))
    assert own.topk == 4 and own.num_experts == 128 and own.attention_sinks and own.add_bias_linear
    assert not own.linear_layers and count_parameters(own) == count_parameters(merge(from_preset("gpt-oss-120b")))


def test_deepseek_v4_reads_transformers_5_spellings_like_the_release_s():
    """transformers 5 writes layer_types (with compress_rates) and mlp_layer_types where the release
    writes compress_ratios and num_hash_layers: the decoder layers come out the same (the MTP layer,
    which layer_types does not cover, takes the last decoder layer's ratio then)."""
    kind = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    ratios = DEEPSEEK_V4_FLASH["compress_ratios"][:43]
    cfg = {
        **_without(DEEPSEEK_V4_FLASH, "compress_ratios", "num_hash_layers"),
        "layer_types": [kind[r] for r in ratios],
        "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 40,
    }
    spelled, release = merge(spec_fields_from_config(cfg, "v4")), merge(from_preset("deepseek-v4-flash"))
    assert spelled.v4_attention.compress_ratios == tuple(ratios) and spelled.hash_layers == (0, 1, 2)
    main = lambda a: count_parameters(a).total - all_mtp_params(a).total  # noqa: E731
    assert main(spelled) == main(release) and compress_ratio(spelled, 43) == 4 and compress_ratio(release, 43) == 0
    default = merge(spec_fields_from_config(_without(DEEPSEEK_V4_FLASH, "compress_ratios", "num_hash_layers"), "v4"))
    assert default.v4_attention.compress_ratios[:4] == (128, 128, 128, 4) and default.hash_layers == (0, 1, 2)


def test_glm_reads_its_dense_layers_norms_and_biases():
    glm = merge(from_preset("glm-4.5"))
    assert glm.moe_layers == tuple(range(3, 92)) and glm.shared_expert_size == 1536 and glm.mtp_layers == 1
    assert glm.qk_layernorm and glm.add_qkv_bias and not glm.add_bias_linear and glm.expert_bias and glm.mla is None
    bare = merge(
        spec_fields_from_config(_without(GLM4_5, "use_qk_norm", "attention_bias", "first_k_dense_replace"), "glm")
    )
    assert not bare.qk_layernorm and not bare.add_qkv_bias and bare.moe_layers == tuple(range(1, 92))  # Glm4MoeConfig


def test_bad_config_files_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ProxyError, match=r"config\.json: model config not found; pass"):
        read_config_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ProxyError, match=r"config\.json: model config is not valid JSON"):
        read_config_json(tmp_path / "config.json")
    cfg = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts_per_tok"}
    with pytest.raises(ProxyError, match=r"cfg\.json: lacks num_experts_per_tok / experts_per_token, which"):
        spec_fields_from_config(cfg, "cfg.json")
    with pytest.raises(ProxyError, match="needs a MoE model"):
        spec_fields_from_config({"num_hidden_layers": 2, "hidden_size": 8}, "dense.json")


def test_mindspeed_llm_deepseek_launch_args_count_like_the_preset():
    """The argument values of MindSpeed-LLM's examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh
    (64 layers of which --noop-layers 61,62,63 are empty, --first-k-dense-replace, --n-shared-experts,
    --multi-head-latent-attention with --qk-nope/rope-head-dim) describe the same 671 B model."""
    args = argparse.Namespace(
        num_layers=64,
        noop_layers="61,62,63",
        hidden_size=7168,
        ffn_hidden_size=18432,
        num_attention_heads=128,
        multi_head_latent_attention=True,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        v_head_dim=128,
        qk_layernorm=True,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        n_shared_experts=1,
        num_experts=256,
        moe_router_topk=8,
        moe_intermediate_size=2048,
        moe_ffn_hidden_size=2048,
        n_group=8,
        topk_group=4,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        mtp_num_layers=1,
        padded_vocab_size=129280,
        untie_embeddings_and_output_weights=True,
        swiglu=True,
        add_bias_linear=False,
        normalization="RMSNorm",
    )
    a = merge(from_spec(ModelSpec.from_args(args), [], "mindspeed args"))
    assert a.num_layers == 61 and len(a.moe_layers) == 58 and a.num_groups == 8
    assert count_parameters(a) == count_parameters(merge(from_preset("deepseek-v3")))


def test_a_checkpoint_s_own_args_override_a_preset(megatron_ckpt):
    ckpt, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    view = open_checkpoint(ckpt)
    own = merge(from_spec(view.spec, view.names(), "ckpt"))
    layered = merge(from_preset("deepseek-v3"), from_spec(view.spec, view.names(), "ckpt"))
    assert count_parameters(layered) == count_parameters(own)
    assert layered.name == "DeepSeek-V3" and layered.source == "preset deepseek-v3 + ckpt"
