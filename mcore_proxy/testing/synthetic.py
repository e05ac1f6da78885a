"""A large synthetic MoE checkpoint as a lazy ModelView, for benchmarks (no megatron needed).

Tensors are generated on demand from a seed keyed by name, so a multi-GB checkpoint can be
written by the streaming writers without ever being in memory.
"""

from __future__ import annotations

import argparse
import zlib

import torch

from mcore_proxy.checkpoint.view import ModelView, ViewInfo
from mcore_proxy.mcore.spec import ModelSpec


def synthetic_args(
    num_layers=16, hidden=1024, experts=16, ffn=1024, topk=4, heads=8, vocab=8192, dense_first=0
) -> argparse.Namespace:
    freq = [0] * dense_first + [1] * (num_layers - dense_first) if dense_first else 1
    return argparse.Namespace(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=None,
        ffn_hidden_size=4 * hidden,
        num_experts=experts,
        moe_ffn_hidden_size=ffn,
        moe_router_topk=topk,
        moe_layer_freq=freq,
        swiglu=True,
        padded_vocab_size=vocab,
        bf16=True,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        moe_grouped_gemm=False,
        moe_router_score_function="softmax",
    )


class SyntheticMoEView(ModelView):
    """Megatron GPT MoE names and shapes; bf16 values from a per-name seed."""

    def __init__(self, args: argparse.Namespace, dtype=torch.bfloat16):
        super().__init__(
            ViewInfo(
                spec=ModelSpec.from_args(args), format="synthetic", iteration=100, args=args, linear_extra_state=True
            )
        )
        self.dtype_ = dtype
        h, v, f, e = args.hidden_size, args.padded_vocab_size, args.moe_ffn_hidden_size, args.num_experts
        shapes = {"embedding.word_embeddings.weight": (v, h)}
        for L in range(args.num_layers):
            p = f"decoder.layers.{L}"
            shapes.update(
                {
                    f"{p}.input_layernorm.weight": (h,),
                    f"{p}.self_attention.linear_qkv.weight": (3 * h, h),
                    f"{p}.self_attention.linear_proj.weight": (h, h),
                    f"{p}.pre_mlp_layernorm.weight": (h,),
                }
            )
            if L in self.spec.moe_layers:
                shapes[f"{p}.mlp.router.weight"] = (e, h)
                for x in range(e):
                    shapes[f"{p}.mlp.experts.{x}.linear_fc1.weight"] = (2 * f, h)
                    shapes[f"{p}.mlp.experts.{x}.linear_fc2.weight"] = (h, f)
            else:
                shapes[f"{p}.mlp.linear_fc1.weight"] = (2 * args.ffn_hidden_size, h)
                shapes[f"{p}.mlp.linear_fc2.weight"] = (h, args.ffn_hidden_size)
        shapes["decoder.final_layernorm.weight"] = (h,)
        shapes["output_layer.weight"] = (v, h)
        self._shapes = shapes

    def names(self):
        return list(self._shapes)

    def shape(self, name):
        return self._shapes[name]

    def dtype(self, name):
        return torch.float32 if name.endswith("router.weight") else self.dtype_

    def get(self, name):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return (torch.randn(self._shapes[name], generator=g) * 0.02).to(self.dtype(name))
