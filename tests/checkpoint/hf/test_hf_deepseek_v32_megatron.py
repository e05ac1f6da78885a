"""DeepSeek-V3.2 HF -> Megatron, run by megatron-core: layer 0's multi-latent attention with its DSA
indexer, built by megatron-core 0.16.1 from the converted args and loaded with the converted
tensors, computes what transformers computes from the HF checkpoint (the indexer picks the same
tokens), and Megatron -> HF gives the HF tensors back.

megatron-core's indexer keeps each head's rotated dims last and rotates interleaved pairs, where
transformers keeps them first and rotates halves (`mapping.rope_last_order`); copied as they are,
the converted indexer scores other tokens."""

from __future__ import annotations

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

PREFIX = "decoder.layers.0.self_attention."
TOKENS = 12  # more than index_topk (4), so the indexer's choice matters


def _megatron_attention(args):
    """MLA with megatron-core's DSA core attention, local modules, as the args describe."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    # stand-in: fast_hadamard_transform is CUDA-only; an orthonormal transform of both the indexer's
    # queries and keys leaves their dot products unchanged
    dsa.rotate_activation = lambda x: x

    class Linear(torch.nn.Module):  # what TELinear(parallel_mode="duplicated") computes on one rank
        def __init__(self, i, o, *, config, init_method, bias, **_):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(o, i))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), None

    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        multi_latent_attention=True,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_type=args.rope_type,
        rotary_base=args.rotary_base,
        rotary_scaling_factor=args.rotary_scaling_factor,
        qk_layernorm=True,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=False,
        params_dtype=torch.float32,
        experimental_attention_variant=args.experimental_attention_variant,
        dsa_indexer_n_heads=args.dsa_indexer_n_heads,
        dsa_indexer_head_dim=args.dsa_indexer_head_dim,
        dsa_indexer_topk=args.dsa_indexer_topk,
        dsa_indexer_loss_coeff=0.0,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    indexer = ModuleSpec(
        module=dsa.DSAIndexer,
        submodules=dsa.DSAIndexerSubmodules(
            linear_wq_b=Linear, linear_wk=Linear, k_norm=WrappedTorchNorm, linear_weights_proj=Linear
        ),
    )
    spec = ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(indexer=indexer)),
            linear_proj=RowParallelLinear,
            q_layernorm=WrappedTorchNorm,
            kv_layernorm=WrappedTorchNorm,
        ),
    )
    return build_module(spec, config=config, layer_number=1).eval()


def _worker(rank, port, args, weights, x, out_path):
    from mcore_proxy.functional.cpu import destroy_distributed, init_distributed

    init_distributed(0, 1, port)
    try:
        attention = _megatron_attention(args)
        result = attention.load_state_dict(weights, strict=False)
        assert not [k for k in result.missing_keys if not k.endswith("_extra_state")], result
        assert not result.unexpected_keys, result
        h = x.transpose(0, 1).contiguous()  # [s, b, H]
        with torch.no_grad():
            out, _ = attention(h, None)
            q = attention.q_layernorm(attention.linear_q_down_proj(h)[0])
            causal = torch.full((TOKENS, TOKENS), float("-inf")).triu(1)
            _, picked = attention.core_attention.indexer.forward_with_scores(h, q, mask=causal)
        torch.save({"out": out.transpose(0, 1), "picked": picked.reshape(TOKENS, -1)}, out_path)
    finally:
        destroy_distributed()


def _transformers_attention(folder, x):
    """Layer 0's attention output and its indexer's picks, as transformers computes them."""
    from mcore_proxy.hf.models import load_model

    model = load_model(folder)
    layer = model.model.layers[0].self_attn
    positions = torch.arange(TOKENS)[None]
    rope = model.model.rotary_emb(x, positions)
    mask = torch.full((TOKENS, TOKENS), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x, rope, mask)[0]
        q = layer.q_a_layernorm(layer.q_a_proj(x))
        picked = layer.indexer(x, q, rope, mask[:, 0], positions)
    return out, picked.reshape(TOKENS, -1)


def test_the_indexer_converted_to_megatron_picks_the_tokens_transformers_picks(hf_model, tmp_path, digest):
    from mcore_proxy.functional.cpu import free_port

    folder = hf_model("deepseek_v32")
    before = digest(folder)
    view = open_checkpoint(folder).megatron()
    weights = {n[len(PREFIX) :]: view.get(n) for n in view.names() if n.startswith(PREFIX)}
    x = torch.randn(1, TOKENS, view.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    out = tmp_path / "megatron.pt"
    torch.multiprocessing.spawn(_worker, args=(free_port(), view.args, weights, x, str(out)), nprocs=1, join=True)
    got = torch.load(out)
    want_out, want_picked = _transformers_attention(folder, x)
    assert [set(r) for r in got["picked"].tolist()] == [set(r) for r in want_picked.tolist()]
    assert torch.allclose(got["out"], want_out, rtol=1e-5, atol=1e-6), (got["out"] - want_out).abs().max()

    # and back: Megatron -> HF writes the indexer as transformers keeps it
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert main(["convert", folder, "-o", megatron, "--format", "legacy"]) == 0
    assert main(["convert", megatron, "-o", back, "--format", "hf"]) == 0
    original, again = open_checkpoint(folder), open_checkpoint(back)
    for name in [n for n in original.names() if ".indexer." in n]:
        assert torch.equal(original.get(name), again.get(name)), name
    assert digest(folder) == before
