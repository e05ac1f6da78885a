"""MindSpeed-LLM's multi-latent attention names: the pure mapping (checkpoint/mindspeed_llm.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from mcore_proxy.checkpoint.mindspeed_llm import (
    MindSpeedNaming,
    MLADims,
    detect_naming,
    join_up,
    megatron_to_mindspeed,
    megatron_to_mindspeed_key,
    mindspeed_to_megatron,
    mindspeed_to_megatron_key,
    split_up,
)
from mcore_proxy.core.errors import CheckpointError

DIMS = MLADims(heads=4, q_lora=20, kv_lora=12, qk=8, rope=4, v=6)
L = "decoder.layers.3.self_attention."


def _megatron_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {
        L + "linear_q_down_proj.weight": (20, 32),
        L + "linear_kv_down_proj.weight": (16, 32),
        L + "linear_q_up_proj.weight": (48, 20),
        L + "linear_kv_up_proj.weight": (56, 12),
        L + "q_layernorm.weight": (20,),
        L + "kv_layernorm.weight": (12,),
        L + "linear_proj.weight": (32, 24),
        L + "core_attention.indexer.linear_wq_b.weight": (16, 20),
        L + "core_attention.indexer.k_norm.bias": (8,),
        "mtp.layers.0.final_layernorm.weight": (32,),
        "decoder.final_layernorm.weight": (32,),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("old", [False, True])
def test_the_mapping_round_trips_bit_exactly(split, old):
    naming = MindSpeedNaming(mla_mm_split=split, old_up_names=old and not split, mtp=True)
    state = _megatron_state()
    ms = megatron_to_mindspeed(state, naming, DIMS)
    fused = ms[L + "linear_qkv.weight"]
    assert fused.shape == (36, 32)
    assert torch.equal(fused[:20], state[L + "linear_q_down_proj.weight"])
    assert "final_layernorm.weight" in ms and "mtp.final_layernorms.0.weight" in ms
    assert L + "dsa_indexer.wq_b.weight" in ms and L + "dsa_indexer.k_norm.bias" in ms
    if split:
        assert ms[L + "linear_qk_nope.weight"].shape == (32, 20) and ms[L + "linear_v.weight"].shape == (24, 12)
        # head 1's nope rows are rows 12..19 of the fused-per-head q_up (qk + rope = 12 rows per head)
        assert torch.equal(ms[L + "linear_qk_nope.weight"][8:16], state[L + "linear_q_up_proj.weight"][12:20])
    elif old:
        assert L + "linear_qb.weight" in ms and L + "linear_kvb.weight" in ms
    back = mindspeed_to_megatron(ms, DIMS)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_split_parts_of_whole_head_shards_are_shards_of_the_parts():
    up = torch.randn(48, 20)
    nope, rope = split_up(up, "q", DIMS)
    shards = [split_up(s, "q", DIMS) for s in up.chunk(2)]  # TP 2: two heads each
    assert torch.equal(torch.cat([s[0] for s in shards]), nope) and torch.equal(torch.cat([s[1] for s in shards]), rope)
    assert torch.equal(join_up(nope, rope, "q", DIMS), up)


def test_keys():
    naming = MindSpeedNaming(mla_mm_split=True)
    assert megatron_to_mindspeed_key(L + "linear_kv_down_proj.weight", naming) == (L + "linear_qkv.weight",)
    assert megatron_to_mindspeed_key(L + "linear_kv_up_proj.weight", naming) == (
        L + "linear_kv_nope.weight",
        L + "linear_v.weight",
    )
    assert mindspeed_to_megatron_key(L + "linear_qkv.weight") == (
        L + "linear_q_down_proj.weight",
        L + "linear_kv_down_proj.weight",
    )
    assert mindspeed_to_megatron_key(L + "linear_qkv.weight", mla=False) == (L + "linear_qkv.weight",)
    assert mindspeed_to_megatron_key(L + "linear_qk_rope.weight") == (L + "linear_q_up_proj.weight",)


def test_detection_decides_by_layer_kind():
    mla = argparse.Namespace(multi_latent_attention=True, mtp_num_layers=None)
    gqa = argparse.Namespace(multi_latent_attention=False)
    assert detect_naming(gqa, [L + "linear_qkv.weight", L + "linear_proj.weight"]) is None
    assert detect_naming(mla, [L + "linear_q_down_proj.weight", L + "kv_layernorm.weight"]) is None
    assert detect_naming(mla, [L + "linear_qkv.weight"]) == MindSpeedNaming()
    # args silent: MLA from an MLA-only key beside the linear_qkv
    silent = argparse.Namespace()
    assert detect_naming(
        silent, [L + "linear_qkv.weight", L + "kv_layernorm.weight", L + "linear_qk_nope.weight"]
    ) == MindSpeedNaming(mla_mm_split=True)
    with pytest.raises(CheckpointError, match="args mla_mm_split is False"):
        detect_naming(
            argparse.Namespace(multi_latent_attention=True, mla_mm_split=False),
            [L + "linear_qkv.weight", L + "linear_qk_nope.weight"],
            "f.pt",
        )
