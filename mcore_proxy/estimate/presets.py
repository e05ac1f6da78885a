"""Public model configurations, as config.json values with transformers' field names.

Sources (read with the search tool; values, not code):
- Qwen3-30B-A3B: transformers `src/transformers/models/qwen3_moe/configuration_qwen3_moe.py`
  (Qwen3MoeConfig defaults: vocab 151936, hidden 2048, intermediate 6144, 32 heads, 4 key/value
  heads, moe_intermediate_size 768, 128 experts, top-8, untied embeddings); the layer count 48,
  head_dim 128 and the q/k norms from NVIDIA/Megatron-LM
  `examples/post_training/modelopt/conf/qwen/Qwen3-30B-A3B.sh` (--num-layers 48 --kv-channels 128
  --qk-layernorm --untie-embeddings-and-output-weights) and Ascend/MindSpeed-LLM
  `examples/mcore/qwen3_moe/tune_qwen3_30b_a3b_4K_full_ptd.sh` (--padded-vocab-size 151936).
- DeepSeek-V3: transformers `src/transformers/models/deepseek_v3/configuration_deepseek_v3.py`
  (DeepseekV3Config defaults are V3's: 61 layers, hidden 7168, intermediate 18432, 128 heads,
  q_lora_rank 1536, kv_lora_rank 512, qk_nope/rope/v head dims 128/64/128, 256 routed + 1 shared
  expert of 2048, top-8 in 8 groups / 4, first 3 layers dense, vocab 129280, untied); one MTP
  module (`num_nextn_predict_layers: 1`) and sigmoid/noaux_tc routing from DeepSeek's config.json
  as documented in tenstorrent/tt-metal `models/demos/deepseek_v3/reference/README_WEIGHTS.md`
  and Ascend/MindSpeed-LLM `examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh`
  (--mtp-num-layers 1, --moe-router-score-function sigmoid, --moe-router-enable-expert-bias).
- DeepSeek-V3.2: DeepSeek-V3 plus the sparse-attention indexer (index_n_heads 64,
  index_head_dim 128, index_topk 2048) of `DeepseekV32Config` in InternLM/lmdeploy and
  hicann/cann-recipes-train `llm_pretrain/deepseekv32/.../model/args.py`; its weights (wq_b,
  wk, k_norm with bias, weights_proj) as in ModelTC/LightLLM
  `lightllm/models/deepseek3_2/layer_weights/nsa_indexer_layer_weight.py`.
- DeepSeek-V4-Flash: transformers `src/transformers/models/deepseek_v4/configuration_deepseek_v4.py`
  (DeepseekV4Config defaults are Flash's: 43 layers, hidden 4096, 64 heads, one key/value head
  of head_dim 512, q_lora_rank 1024, o_groups 8 x o_lora_rank 1024, 256 routed + 1 shared expert
  of 2048, top-6 sqrtsoftplus, index_n_heads 64 x index_head_dim 128, hc_mult 4, one MTP layer,
  vocab 129280, untied) and XinyuJiangCMU/miles `scripts/models/deepseek-v4-flash.sh` (the same
  sizes, --dsv4-n-hash-layers 3, and the release's 44 compress ratios: 0 0, then 4 128 twenty
  times, 4 for layer 42 and 0 for the MTP layer); the tensors each ratio adds are those of
  DeepSeek's `inference/model.py` as mirrored in foreverlasting1202/DeepSeek-V4-Deconstruction-Lab
  `DeepSeek_official/model.py` (Compressor: ape [ratio, c*head_dim], wkv, wgate, norm).
- DeepSeek-V4-Pro: XinyuJiangCMU/miles `scripts/models/deepseek-v4-pro.sh` (61 layers, hidden
  7168, 128 heads, q_lora_rank 1536, --dsv4-o-groups 16, o_lora_rank 1024, 384 routed + 1 shared
  expert of 3072, top-6 sqrtsoftplus with expert bias, 3 hash layers, hc_mult 4, index 64 x 128,
  the release's 62 compress ratios: 128 128, then 4 128 twenty-nine times, 4, and 0 for the MTP
  layer); head_dim 512, one key/value head, vocab 129280 and one MTP layer as in Flash's config
  (the Pro script's --qk-head-dim 512 / --vocab-size 129280; its --mtp-num-layers is not given,
  so the MTP count is the one DeepseekV4Config and the 62nd compress ratio give).
- Qwen3.5-397B-A17B (the text model of the vision-language release): THUDM/slime
  `scripts/models/qwen3.5-397B-A17B.sh` (60 layers, hidden 4096, 32 heads, 2 key/value heads of
  256, gated attention, 512 experts of 1024, top-10, a gated shared expert of 1024, vocab 248320,
  untied); the Gated DeltaNet sizes (16 key heads, 64 value heads, head dims 128, conv kernel 4)
  and full_attention_interval 4 from NVIDIA-NeMo/Megatron-Bridge
  `tests/unit_tests/models/qwen_vl/test_qwen35_vl_bridge.py` (`_make_moe_text_config`, a mock
  "matching Qwen3.5-397B-A17B"; its shared_expert_intermediate_size 4096 is not taken: slime's
  1024 is, as the model card lists 10 routed + 1 shared experts of intermediate size 1024); one
  MTP layer (mtp_num_hidden_layers 1) from NVIDIA-NeMo/Megatron-Bridge
  `src/megatron/bridge/recipes/qwen_vl/qwen35_vl.py`. The vision tower is not part of the preset.
- Qwen3.5-35B-A3B: transformers `src/transformers/models/qwen3_5_moe/configuration_qwen3_5_moe.py`
  (Qwen3_5MoeTextConfig defaults are this checkpoint's: 40 layers, hidden 2048, 16 heads, 2
  key/value heads of 256, 256 experts of 512, top-8, shared expert 512, linear 16 key / 32 value
  heads of 128, kernel 4, full attention every 4th layer, vocab 248320, untied) and THUDM/slime
  `scripts/models/qwen3.5-35B-A3B.sh` (the same values); one MTP layer as above.
- GLM-4.5: NVIDIA-NeMo/Megatron-Bridge `src/megatron/bridge/models/glm/glm45_provider.py`
  (GLM45ModelProvider355B: 92 layers of which the first 3 dense, hidden 5120, ffn 12288, 96
  heads, 8 key/value groups of 128, q/k/v biases, q/k norms, 160 experts of 1536, top-8 sigmoid
  with expert bias, a shared expert of 1536, vocab 151552, untied, one MTP layer) and
  zyzshishui/slime `scripts/models/glm4.5-355B-A32B.sh` (the same); transformers'
  `src/transformers/models/glm4_moe/configuration_glm4_moe.py` for the field names
  (first_k_dense_replace, use_qk_norm, attention_bias, num_nextn_predict_layers) and its
  defaults n_group = topk_group = 1 (no group-limited routing). GLM-4.6 and GLM-4.7 are listed as 355B-A32B with the
  same
  transformers/vLLM/SGLang glm4_moe code in zai-org/GLM-4.5 `README.md`: the same shape (their
  config.json files differ in context length, which the parameter count does not see; they were
  not compared field by field here).
- Kimi-K2: MoonshotAI/Kimi-K2 `README.md` (61 layers of which 1 dense, hidden 7168, 64 heads,
  MLA, 384 experts of 2048, top-8, 1 shared expert) and zyzshishui/slime
  `scripts/models/kimi-k2.sh` (ffn 18432, vocab 163840, q_lora_rank 1536, kv_lora_rank 512,
  qk nope/rope/v head dims 128/64/128, sigmoid routing with expert bias in 1 group, untied);
  `model_type` kimi_k2, which transformers builds as DeepseekV3 (whose defaults give
  moe_layer_freq 1; num_key_value_heads is left out: MLA has no key/value groups). No MTP layer: the release has
  none and the slime recipe gives no --mtp-num-layers, so num_nextn_predict_layers is left out.
- gpt-oss-120b: transformers `src/transformers/models/gpt_oss/configuration_gpt_oss.py` (GptOssConfig
  defaults: 36 layers, 128 local experts, top-4, vocab 201088, hidden and expert width 2880,
  64 heads, 8 key/value heads of 64, sliding window 128 on every other layer, attention biases,
  untied) and openai/gpt-oss `gpt_oss/torch/model.py` (ModelConfig: the same values, top-k
  spelled experts_per_token; biased qkv, out, gate and expert weights; per-head sinks).
"""

from __future__ import annotations

QWEN3_30B_A3B = {
    "name": "Qwen3-30B-A3B",
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}

DEEPSEEK_V3 = {
    "name": "DeepSeek-V3",
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "vocab_size": 129280,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}

DEEPSEEK_V32 = {
    **DEEPSEEK_V3,
    "name": "DeepSeek-V3.2",
    "model_type": "deepseek_v32",
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}

DEEPSEEK_V4_FLASH = {
    "name": "DeepSeek-V4-Flash",
    "model_type": "deepseek_v4",
    "num_hidden_layers": 43,
    "hidden_size": 4096,
    "vocab_size": 129280,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],  # 43 layers, then the MTP layer
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "hc_mult": 4,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}

DEEPSEEK_V4_PRO = {
    **DEEPSEEK_V4_FLASH,
    "name": "DeepSeek-V4-Pro",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "index_topk": 1024,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],  # 61 layers, then the MTP layer
    "n_routed_experts": 384,
    "moe_intermediate_size": 3072,
}

QWEN3_5_397B_A17B = {
    "name": "Qwen3.5-397B-A17B",
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 60,
    "hidden_size": 4096,
    "vocab_size": 248320,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": False,
}

QWEN3_5_35B_A3B = {
    **QWEN3_5_397B_A17B,
    "name": "Qwen3.5-35B-A3B",
    "num_hidden_layers": 40,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}

GLM4_5 = {
    "name": "GLM-4.5",
    "model_type": "glm4_moe",
    "num_hidden_layers": 92,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "vocab_size": 151552,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": True,
    "use_qk_norm": True,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536,
    "first_k_dense_replace": 3,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}

KIMI_K2 = {
    "name": "Kimi-K2",
    "model_type": "kimi_k2",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
}

GPT_OSS_120B = {
    "name": "gpt-oss-120b",
    "model_type": "gpt_oss",
    "num_hidden_layers": 36,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "vocab_size": 201088,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "tie_word_embeddings": False,
}

PRESETS = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v3.2": DEEPSEEK_V32,
    "deepseek-v4-flash": DEEPSEEK_V4_FLASH,
    "deepseek-v4-pro": DEEPSEEK_V4_PRO,
    "qwen3.5-397b-a17b": QWEN3_5_397B_A17B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    "glm-4.5": GLM4_5,
    "kimi-k2": KIMI_K2,
    "gpt-oss-120b": GPT_OSS_120B,
}
