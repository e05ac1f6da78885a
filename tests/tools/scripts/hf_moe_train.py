"""A user's training script in miniature, knowing nothing of mcore-proxy: a tiny Qwen3-MoE built by
transformers (2 layers, 4 experts, top-2), 3 AdamW steps on fixed tokens. Prints one JSON line:
the losses, and whether mcore-proxy got imported (only the launch environment can do that)."""

import json
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

torch.manual_seed(0)
config = Qwen3MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    mlp_only_layers=[],
    decoder_sparse_step=1,
    tie_word_embeddings=False,
)
model = Qwen3MoeForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
losses = []
for step in range(3):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
print(json.dumps({"losses": losses, "mcore_proxy": sorted(m for m in sys.modules if m.startswith("mcore_proxy"))}))
