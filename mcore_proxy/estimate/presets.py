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
"""
from __future__ import annotations

QWEN3_30B_A3B = {
    "name": "Qwen3-30B-A3B", "model_type": "qwen3_moe",
    "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144, "vocab_size": 151936,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
}

DEEPSEEK_V3 = {
    "name": "DeepSeek-V3", "model_type": "deepseek_v3",
    "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432, "vocab_size": 129280,
    "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}

DEEPSEEK_V32 = {**DEEPSEEK_V3, "name": "DeepSeek-V3.2", "model_type": "deepseek_v32",
                "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}

PRESETS = {"qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3, "deepseek-v3.2": DEEPSEEK_V32}
