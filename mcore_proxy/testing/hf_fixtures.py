"""Tiny Hugging Face MoE checkpoints written by transformers itself, for tests and examples.

Each model is built offline from its transformers config class at a tiny size, given decisive
deterministic weights (router rows of unit scale so routing is far from uniform, experts that
differ), and saved with `save_pretrained` in several safetensors shards. DeepSeek models get the
MTP layer DeepSeek publishes (`model.layers.{N}`: a MoE decoder layer plus enorm, hnorm,
eh_proj, shared_head.norm and copies of the embedding and LM head), which transformers neither
builds nor saves, as an extra shard added to the index. A word-level tokenizer (the `tokenizers`
package, trained on a fixed word list) is saved beside every model.

`testing.quantized` makes FP8, MXFP4 and DeepSeek-V4 FP4 copies of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from mcore_proxy.testing.cache import build_lock

WORDS = (
    "the a one two red blue cat dog sat ran on under big small tree house river stone bird fish "
    "light dark fast slow old new sun moon over near far green high low day night"
).split()
VOCAB = 128
SHARD = "20KB"
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    moe_intermediate_size=8,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    pad_token_id=1,
    bos_token_id=None,
    eos_token_id=2,
)
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    pad_token_id=1,
    bos_token_id=None,
    eos_token_id=2,
)
_DEEPSEEK = dict(
    _COMMON,
    num_hidden_layers=3,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=16,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    q_lora_rank=20,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    num_nextn_predict_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# the MTP block a family's release carries and transformers neither builds nor saves: DeepSeek's
# layer num_hidden_layers (1: as its release and GLM's spell it), Qwen3-Next's `mtp.*` (as vLLM
# reads it), DeepSeek-V4's `mtp.0.*`
QWEN_NEXT_MTP, DEEPSEEK_V4_MTP = "qwen3_next", "deepseek_v4"

# name -> (config class, model class, config kwargs, MTP block to add: 0/1 DeepSeek-style layers, or a kind)
MODELS = {
    # GQA 4 heads / 2 groups, head dim 12 != H/heads, q/k norms; 16 experts top-4 softmax
    # (renormalised); layer 0 dense (mlp_only_layers); non-default rope_theta and eps
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=12,
            num_experts=16,
            mlp_only_layers=[0],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        0,
    ),
    # MLA with q_lora; layer 0 dense; 16 experts in 4 groups (top-2 groups), top-4 sigmoid with
    # expert bias, scaling 2.5, one shared expert; one MTP layer
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK), 1),
    # the same with the DSA indexer (2 heads of 8, top-4 tokens)
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(_DEEPSEEK, index_n_heads=2, index_head_dim=8, index_topk=4),
        1,
    ),
    # -- one tiny model per further family (8 experts, top-2; K = E/2 = 4 keeps top-k feasible) ----
    # shared expert with its sigmoid gate, q/k/v biases, layer 0 dense
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _SMALL,
            num_hidden_layers=3,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            mlp_only_layers=[0],
            norm_topk_prob=True,
        ),
        0,
    ),
    # gated delta net (linear attention) beside gated full attention, layer 0 dense
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            _SMALL,
            num_hidden_layers=4,
            head_dim=8,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            mlp_only_layers=[0],
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        QWEN_NEXT_MTP,
    ),
    # the text model of Qwen3.5-MoE (every layer MoE, always renormalised)
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            _SMALL,
            num_hidden_layers=4,
            head_dim=8,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        0,
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(_SMALL, num_hidden_layers=2, intermediate_size=16, num_experts=8, norm_topk_prob=True),
        0,
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_SMALL, num_hidden_layers=2, intermediate_size=16, num_local_experts=8),
        0,
    ),
    # sigmoid scores with a selection bias on the MoE block
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(_SMALL, num_hidden_layers=2, head_dim=8, intermediate_size=16, num_local_experts=8),
        0,
    ),
    # DeepSeek's biased sigmoid router in 2 groups, sliding and full attention with sinks, v head
    # dim != q/k head dim, partial rotary per attention kind, layer 0 dense
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            _SMALL,
            num_hidden_layers=3,
            head_dim=12,
            v_head_dim=8,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        0,
    ),
    # DeepSeek's router (2 groups, top-1 group), q/k norms, q/k/v biases, partial rotary, MTP layer
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            _SMALL,
            num_hidden_layers=3,
            head_dim=8,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            num_nextn_predict_layers=1,
        ),
        1,
    ),
    # hash-routed layer 0 (tid2eid), sqrtsoftplus scores with a selection bias, hyper-connections,
    # sliding / compressed sparse / heavily compressed attention with sinks
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=16,
            num_experts_per_tok=2,
            n_routed_experts=8,
            n_shared_experts=1,
            scoring_func="sqrtsoftplus",
            routed_scaling_factor=1.5,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            hc_mult=4,
            hc_sinkhorn_iters=20,
            sliding_window=8,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            num_nextn_predict_layers=1,
            partial_rotary_factor=0.25,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            pad_token_id=1,
            eos_token_id=2,
        ),
        DEEPSEEK_V4_MTP,
    ),
    # Kimi-K2.5: a DeepSeek-V3 text model (sigmoid, bias, 2 groups) in a vision-language wrapper
    "kimi_k25": (
        "Kimi_K25Config",
        "Kimi_K25ForConditionalGeneration",
        dict(
            text_config=dict(
                model_type="kimi_k2",
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                norm_topk_prob=True,
                routed_scaling_factor=2.827,
                num_nextn_predict_layers=0,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=8,
                max_position_embeddings=64,
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
                pad_token_id=1,
                eos_token_id=2,
            ),
            vision_config=dict(
                patch_size=14,
                pos_emb_height=8,
                pos_emb_width=8,
                pos_emb_time=4,
                num_attention_heads=2,
                num_hidden_layers=1,
                hidden_size=32,
                intermediate_size=64,
                merge_kernel_size=[2, 2],
            ),
            projection_hidden_size=32,
            tie_word_embeddings=False,
            image_token_id=120,
            video_token_id=121,
            vision_start_token_id=122,
            vision_end_token_id=123,
        ),
        0,
    ),
    # Kimi-Linear: KDA linear attention and MLA, DeepSeek's router under block_sparse_moe
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=16,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_renormalize=True,
            num_expert_group=2,
            topk_group=1,
            routed_scaling_factor=2.446,
            first_k_dense_replace=1,
            moe_router_activation_func="sigmoid",
            moe_layer_freq=1,
            linear_attn_config={
                "full_attn_layers": [4],
                "kda_layers": [1, 2, 3],
                "head_dim": 16,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
            },
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            tie_word_embeddings=False,
            model_max_length=256,
        ),
        0,
    ),
    # a router with a logit bias, transposed fused experts with biases (gate/up interleaved), sinks
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _SMALL,
            head_dim=8,
            intermediate_size=32,
            num_hidden_layers=2,
            num_local_experts=8,
            sliding_window=4,
            max_position_embeddings=131072,
        ),
        0,
    ),
    # softmax scores with a [1, E] selection bias (moe_statics), two shared experts, tied embeddings
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            _SMALL,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
            tie_word_embeddings=True,
        ),
        0,
    ),
    # sigmoid top-k router scaling the experts' input, MoE every second layer, a shared expert
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            _SMALL,
            head_dim=8,
            intermediate_size=16,
            intermediate_size_mlp=64,
            num_hidden_layers=4,
            num_local_experts=8,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
        ),
        0,
    ),
}
# Families no declaration covers: read by discovery from transformers itself (checkpoint/hf/discovery.py)
_NO_TOPK = {k: v for k, v in _SMALL.items() if k != "num_experts_per_tok"}
DISCOVERED = {
    # fused experts, sliding and full attention, softmax top-2
    "cohere2_moe": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        dict(
            _SMALL,
            head_dim=8,
            num_hidden_layers=2,
            intermediate_size=16,
            num_experts=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"],
            sliding_window=8,
        ),
        0,
    ),
    # the router module wraps its linear (`mlp.gate.wg`), top-k as `moe_topk`, a shared MLP
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(_NO_TOPK, head_dim=8, num_hidden_layers=2, intermediate_size=16, num_experts=8, moe_topk=2),
        0,
    ),
    # sigmoid scores with a selection bias, a shared expert, layer 0 dense
    "exaone_moe": (
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(
            _SMALL,
            head_dim=8,
            num_hidden_layers=3,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_experts=8,
            first_k_dense_replace=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=8,
        ),
        0,
    ),
    # hybrid Mamba / attention / MoE blocks (`layers_block_type`: config.json saves no
    # num_hidden_layers), the router and its selection bias under `mixer`, a shared expert, inf saved
    # as transformers' {"__float__": "Infinity"} (time_step_limit)
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            _SMALL,
            head_dim=8,
            layers_block_type=["mamba", "moe", "attention", "moe"],
            n_routed_experts=8,
            moe_intermediate_size=8,
            moe_shared_expert_intermediate_size=8,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=1,
            expand=1,
        ),
        0,
    ),
}
# Vision-language wrappers, discovered: the language model's experts are pruned, the vision tower,
# its projector and their configs copied. Image token ids sit above every calibration word's id.
_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
_TEXT = dict(_SMALL, head_dim=8, num_hidden_layers=2)
VISION_LANGUAGE = {
    # the language model under `model.language_model`, fused experts, multimodal RoPE
    "qwen3_vl_moe": (
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
        dict(
            text_config=dict(_TEXT, moe_intermediate_size=16, num_experts=8),
            vision_config=dict(_VISION, depth=1, num_heads=4, out_hidden_size=32, deepstack_visual_indexes=[0]),
            image_token_id=VOCAB - 3,
            video_token_id=VOCAB - 2,
            vision_start_token_id=VOCAB - 1,
            vision_end_token_id=VOCAB - 4,
            tie_word_embeddings=False,
        ),
        0,
    ),
    # top-k as `moe_topk`, shared experts beside the routed ones, a cross-attention projector
    "aria": (
        "AriaConfig",
        "AriaForConditionalGeneration",
        dict(
            text_config=dict(_TEXT, model_type="aria_text", moe_intermediate_size=16, moe_num_experts=8, moe_topk=2),
            # 980-pixel images (the processor's size) in 14 x 14 patches, 4 queries each
            vision_config=dict(_VISION, num_hidden_layers=1, image_size=980, patch_size=70),
            projector_patch_to_query_dict={196: 4},
            image_token_index=VOCAB - 1,
        ),
        0,
    ),
    # MiniMax-M3's sparse text model (sigmoid scores, selection bias, a shared expert, an indexer)
    "minimax_m3_vl": (
        "MiniMaxM3VLConfig",
        "MiniMaxM3SparseForConditionalGeneration",
        dict(
            text_config=dict(
                _TEXT,
                model_type="minimax_m3_vl_text",
                num_local_experts=8,
                dense_intermediate_size=16,
                shared_intermediate_size=16,
                mlp_layer_types=["sparse", "sparse"],
                layer_types=["full_attention", "full_attention"],
                index_n_heads=2,
                index_head_dim=8,
                index_block_size=16,
            ),
            vision_config=dict(_VISION, num_hidden_layers=1),
            image_token_index=VOCAB - 1,
            video_token_index=VOCAB - 2,
        ),
        0,
    ),
}
DISCOVERED.update(VISION_LANGUAGE)
MODELS.update(DISCOVERED)
FAMILY_FIXTURES = tuple(MODELS)

# The same models at head sizes vLLM's CPU attention accepts (64 and more; it refuses 16), named
# `NAME@vllm`: the rollout tests serve them in vLLM. DeepSeek's MLA runs there only in bf16 and only
# with the latent sizes its CPU kernel has (kv_lora_rank 512, rope dim 64).
ROLLOUT_SIZES = {
    "qwen3_moe": dict(head_dim=64),
    "mixtral": dict(head_dim=64),
    "qwen2_moe": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
    # vLLM's OLMoE never renormalises the top-k weights (the released model does not either)
    "olmoe": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, norm_topk_prob=False),
    "glm4_moe": dict(head_dim=64),
    "gpt_oss": dict(head_dim=64),
    # top-1 as the releases route (vLLM scales the expert's input by its weight for top-1 only),
    # and an attention chunk of at least vLLM's KV block (128), so longer than every test sequence
    "llama4": dict(head_dim=64, attention_chunk_size=128, num_experts_per_tok=1),
    # and with the router keys DeepSeek's release carries (transformers does not write them; vLLM
    # builds the selection bias only for topk_method noaux_tc)
    "deepseek_v3": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    ),
}
ROLLOUT = "@vllm"
DEEP = "-deep"  # `NAME@vllm-deep`: the rollout form with DEEP_LAYERS decoder layers
DEEP_LAYERS = 9  # enough MoE layers (8 for Qwen3-MoE, whose first layer is dense) to rank them


def model_entry(name: str) -> tuple:
    """(config class, model class, config kwargs, MTP block) of `name` or of its `NAME@vllm` and
    `NAME@vllm-deep` forms."""
    base, _, variant = name.partition("@")
    config_cls, model_cls, kwargs, mtp = MODELS[base]
    if variant:
        deep = f"@{variant}" == ROLLOUT + DEEP
        if (f"@{variant}" != ROLLOUT and not deep) or base not in ROLLOUT_SIZES:
            raise KeyError(name)
        kwargs = dict(kwargs, **ROLLOUT_SIZES[base], **({"num_hidden_layers": DEEP_LAYERS} if deep else {}))
    return config_cls, model_cls, kwargs, mtp


def _generator(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((zlib.crc32(name.encode()) + 7919 * seed) % 2**63)


def decisive_value(name: str, shape, seed: int) -> torch.Tensor:
    """A deterministic value for parameter `name`: norms near 1, router rows of unit scale,
    expert biases of 0.1, other weights of unit-variance outputs."""
    x = torch.randn(tuple(shape), generator=_generator(name, seed))
    module, param = name.split(".")[-2:]
    if "norm" in module:
        return 1.0 + 0.1 * x if param == "weight" else 0.1 * x
    if name.endswith("e_score_correction_bias"):
        return 0.1 * x
    if name.endswith(ROUTER_WEIGHTS):
        return x
    if name.endswith("router.bias"):
        return 0.5 * x
    return x / shape[-1] ** 0.5


# routers of unit scale (routing far from uniform), whatever the family calls them
ROUTER_WEIGHTS = ("mlp.gate.weight", "mlp.router.weight", "feed_forward.router.weight", "mlp.gate.wg.weight")


def fill(model, seed: int = 0) -> None:
    """Decisive weights everywhere, nonzero selection biases, and hash tables that send every
    token to distinct experts (transformers zero-fills them: every token to expert 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(decisive_value(name, p.shape, seed))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(decisive_value(name, b.shape, seed))
            elif name.endswith("tid2eid"):
                g = _generator(name, seed)
                experts = model.config.get_text_config().num_local_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))


def _mtp_tensors(model, config, seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek's published MTP layer k = N, under Hub names (experts per expert)."""
    n, h = config.num_hidden_layers, config.hidden_size
    layer = type(model.model.layers[-1])(config, n - 1)  # a MoE decoder layer (its index only picks the type)
    prefix = f"model.layers.{n}."
    fill(layer, seed + 1)
    out = {}
    for key, value in layer.state_dict().items():
        name = prefix + key
        if key.endswith("experts.gate_up_proj"):
            for e, fc1 in enumerate(value):
                gate, up = fc1.chunk(2)
                out[prefix + key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.clone()
                out[prefix + key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.clone()
        elif key.endswith("experts.down_proj"):
            for e, fc2 in enumerate(value):
                out[prefix + key.replace("down_proj", f"{e}.down_proj.weight")] = fc2.clone()
        else:
            out[name] = value.clone()
    for key, shape in (
        ("enorm.weight", (h,)),
        ("hnorm.weight", (h,)),
        ("eh_proj.weight", (h, 2 * h)),
        ("shared_head.norm.weight", (h,)),
    ):
        out[prefix + key] = decisive_value(prefix + key, shape, seed)
    out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def _mtp_block(folder: Path, config, kind: str, seed: int) -> dict[str, torch.Tensor]:
    """An MTP block as the family's release spells it, made of a copy of the last (MoE) decoder
    layer as save_pretrained wrote it (its own router and experts) and the block's own tensors."""
    from safetensors.torch import load_file

    h, last = config.hidden_size, f"model.layers.{config.num_hidden_layers - 1}."
    saved = {}
    for shard in folder.glob("*.safetensors"):
        saved.update({k: v for k, v in load_file(str(shard)).items() if k.startswith(last)})
    if kind == QWEN_NEXT_MTP:  # vLLM's names: mtp.fc, its norms, one decoder layer mtp.layers.0
        extra = {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.norm.weight": (h,),
        }
        prefix = "mtp.layers.0."
    else:  # DeepSeek-V4's release: mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_*}
        hc = config.hc_mult
        extra = {
            "mtp.0.e_proj.weight": (h, h),
            "mtp.0.h_proj.weight": (h, h),
            "mtp.0.enorm.weight": (h,),
            "mtp.0.hnorm.weight": (h,),
            "mtp.0.norm.weight": (h,),
            "mtp.0.hc_head_fn": (hc, hc * h),
            "mtp.0.hc_head_base": (hc,),
            "mtp.0.hc_head_scale": (1,),
        }
        prefix = "mtp.0."
    out = {prefix + k[len(last) :]: v.clone() for k, v in saved.items()}
    out.update({k: decisive_value(k, shape, seed + 1) for k, shape in extra.items()})
    return out


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder, by key (tests compare whole checkpoints of tiny models)."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / file)))
    return out


def add_shard(folder: Path, file: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write one more shard and list its tensors in the index."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / file), metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: file for k in tensors})
    index["metadata"]["total_size"] += sum(v.numel() * v.element_size() for v in tensors.values())
    index_path.write_text(json.dumps(index, indent=2))


def word_tokenizer(marks: dict[str, int] | None = None):
    """A word-level tokenizer over WORDS (ids below the model's vocab); `marks`: special tokens at
    the ids the model's config gives them (an image placeholder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    if marks:
        tok = Tokenizer(models.WordLevel(vocab={**tok.get_vocab(), **marks}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(list(marks))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="[EOS]",
        extra_special_tokens={"image_token": next(iter(marks))} if marks else None,
    )


def save_tokenizer(folder: Path) -> None:
    """`word_tokenizer`, saved by transformers."""
    word_tokenizer().save_pretrained(str(folder))


def _aria_processor(config):
    """Aria's processor at the tiny vision tower's size: its default 980-pixel images become
    `size_conversion[980]` = 4 image tokens (the projector's queries for 14 x 14 patches)."""
    from transformers.models.aria import AriaImageProcessorPil, AriaProcessor

    tokens = config.projector_patch_to_query_dict[(980 // config.vision_config.patch_size) ** 2]
    tokenizer = word_tokenizer({ARIA_IMAGE: config.image_token_id})
    return AriaProcessor(image_processor=AriaImageProcessorPil(), tokenizer=tokenizer, size_conversion={980: tokens})


# fixtures saved with a processor (image-text calibration): those transformers builds without
# torchvision, which has no build for this torch (Qwen3-VL's needs a video processor)
ARIA_IMAGE = "<|img|>"
PROCESSORS = {"aria": _aria_processor}


def build(name: str, folder: Path, seed: int = 0) -> Path:
    """Save tiny model `name` (see MODELS) into `folder` (created)."""
    import transformers

    config_cls, model_cls, kwargs, mtp = model_entry(name)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    fill(model, seed)
    folder.mkdir(parents=True)
    model.save_pretrained(str(folder), max_shard_size=SHARD)
    if mtp in (QWEN_NEXT_MTP, DEEPSEEK_V4_MTP):
        add_shard(folder, "model-mtp.safetensors", _mtp_block(folder, config, mtp, seed))
    elif mtp:
        add_shard(folder, "model-mtp.safetensors", _mtp_tensors(model, config, seed))
    save_tokenizer(folder)
    if name in PROCESSORS:
        PROCESSORS[name](config).save_pretrained(str(folder))
    return folder


def fixture_key(name: str, seed: int = 0) -> str:
    import transformers

    source = Path(__file__).read_bytes()
    facts = repr((model_entry(name), seed, transformers.__version__)).encode()
    digest = hashlib.sha256(facts + source).hexdigest()[:12]
    return f"hf-{name.replace('@', '-')}-{digest}"


def build_cached(name: str, root: str | os.PathLike, seed: int = 0) -> Path:
    """Build (or reuse from `root`) tiny model `name`; returns its folder."""
    key = fixture_key(name, seed)
    base = Path(root) / key
    folder = base / "model"
    with build_lock(root, key):
        if not (base / "done").is_file():
            shutil.rmtree(base, ignore_errors=True)
            build(name, folder, seed)
            (base / "done").write_text("ok")
    return folder


def calibration_jsonl(path: Path, records: int = 24, seed: int = 0, as_ids: bool = False) -> Path:
    """Deterministic calibration data: `{"text": ...}` sentences of WORDS of varied lengths (or
    `{"input_ids": [...]}` with ids in 3..VOCAB-1)."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(records):
        length = 4 + int(torch.randint(0, 20, (1,), generator=g))
        if as_ids:
            lines.append(json.dumps({"input_ids": torch.randint(3, VOCAB, (length,), generator=g).tolist()}))
        else:
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (length,), generator=g)]
            lines.append(json.dumps({"text": " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")
    return path
