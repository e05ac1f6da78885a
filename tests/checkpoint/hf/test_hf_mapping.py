"""The pure pieces of the HF mapping: transforms by round trip and against transformers'
own computation, the tables by what they match, FP8 block scales against their definition."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_proxy.checkpoint.hf.families import (
    DEEPSEEK_V3,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    GPT_OSS,
    MIXTRAL,
    QWEN3_MOE,
    with_megatron,
)
from mcore_proxy.checkpoint.hf.mapping import (
    FUSED,
    GLU,
    LAYER,
    MODEL,
    MTP,
    QKV,
    canonical_name,
    glu_join,
    glu_split,
    qkv_join,
    qkv_split,
    split_canonical,
    split_hf_key,
)


def test_qkv_interleave_is_megatrons_per_group_layout_and_round_trips():
    heads, groups, d, h = 6, 2, 3, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    qkv = qkv_join(q, k, v, groups)
    # megatron views linear_qkv as [groups, (heads/groups + 2) * d]: group g = its 3 query heads, k_g, v_g
    per = qkv.reshape(groups, heads // groups + 2, d, h)
    for g in range(groups):
        torch.testing.assert_close(per[g, :3].reshape(-1, h), q[g * 3 * d : (g + 1) * 3 * d], rtol=0, atol=0)
        torch.testing.assert_close(per[g, 3], k[g * d : (g + 1) * d], rtol=0, atol=0)
        torch.testing.assert_close(per[g, 4], v[g * d : (g + 1) * d], rtol=0, atol=0)
    for a, b in zip(qkv_split(qkv, heads, groups, d), (q, k, v)):
        assert torch.equal(a, b)


def test_glu_join_is_the_layout_of_transformers_fused_experts():
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    fc1 = glu_join(gate, up)
    x = torch.randn(2, 3)
    # transformers 5: gate, up = linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    g, u = torch.nn.functional.linear(x, fc1).chunk(2, dim=-1)
    torch.testing.assert_close(g, x @ gate.t())
    torch.testing.assert_close(u, x @ up.t())
    assert all(torch.equal(a, b) for a, b in zip(glu_split(fc1), (gate, up)))


@pytest.mark.parametrize(
    "key,layers,expected",
    [
        ("model.embed_tokens.weight", 4, (MODEL, None, "model.embed_tokens.weight")),
        ("model.layers.3.self_attn.q_proj.weight", 4, (LAYER, 3, "self_attn.q_proj.weight")),
        ("model.layers.61.enorm.weight", 61, (MTP, 0, "enorm.weight")),
    ],
)
def test_hf_keys_split_into_scope_layer_and_rest(key, layers, expected):
    assert split_hf_key(key, layers) == expected


def test_every_row_maps_back_to_its_own_hf_names():
    """canonical -> HF -> canonical is the identity for every written row of every family."""
    for family in with_megatron():
        table = family.megatron_table()
        for row in table.rows:
            if row.read_only:
                continue
            for scope, index in ((MODEL, None),) if row.scope == MODEL else ((LAYER, 2), (MTP, 0)):
                if row.scope == MTP and scope != MTP:
                    continue
                name = canonical_name(row, scope, index, 5 if "{e}" in row.canonical else None)
                s, i, rest, row_scope = split_canonical(name)
                found = table.match_canonical(row_scope, rest)
                assert found is not None and found[0] == row, name
                for part, pattern in enumerate(row.hf):
                    hf_rest = pattern.replace("{e}", "5")
                    first = table.siblings(row)[0]  # a pick row's HF tensor reads as its first element's
                    assert table.match_hf(scope, hf_rest)[:2] == (first, part), (name, pattern)


def test_tables_know_the_family_tensors():
    qwen3 = QWEN3_MOE.megatron_table()
    assert qwen3.match_hf(LAYER, "self_attn.q_proj.weight")[0].transform == QKV
    assert qwen3.match_hf(LAYER, "mlp.experts.7.up_proj.weight")[1:] == (1, 7)
    assert qwen3.match_hf(LAYER, "self_attn.q_a_proj.weight") is None  # not a Qwen3 tensor
    v3, v32 = DEEPSEEK_V3.megatron_table(), DEEPSEEK_V32.megatron_table()
    assert v3.match_hf(LAYER, "self_attn.indexer.wq_b.weight") is None and v32.match_hf(
        LAYER, "self_attn.indexer.wq_b.weight"
    )
    assert v3.match_hf(MTP, "enorm.weight") is not None and v3.match_hf(LAYER, "enorm.weight") is None
    assert v3.match_hf(MTP, "shared_experts.gate_proj.weight") is None
    assert v3.match_hf(LAYER, "mlp.shared_experts.gate_proj.weight")[0].transform == GLU
    assert v3.ignored_for(MTP, "shared_head.head.weight").tied_to == "output_layer.weight"


def test_router_and_expert_rows_come_from_the_family_record():
    """The Megatron table's router and expert rows are the record's HF layout: its first spelling
    written, the others read only; a layout megatron-core's router cannot hold is refused."""
    table = MIXTRAL.megatron_table()
    written, alternative = (
        table.match_hf(LAYER, "block_sparse_moe.gate.weight"),
        table.match_hf(LAYER, "mlp.gate.weight"),
    )
    assert written[0].canonical == alternative[0].canonical == "mlp.router.weight"
    assert not written[0].read_only and alternative[0].read_only
    assert table.match_hf(LAYER, "block_sparse_moe.experts.3.w3.weight")[1:] == (1, 3)  # up: fc1's part 1
    assert table.match_hf(LAYER, "mlp.experts.gate_up_proj")[0].transform == FUSED
    v4 = DEEPSEEK_V4.megatron_table().match_hf(LAYER, "ffn.gate.tid2eid")[0]
    assert (v4.canonical, v4.dtypes) == ("mlp.router.tid2eid", ("int64", "int32"))
    with pytest.raises(ValueError, match="logit bias"):
        dataclasses.replace(GPT_OSS, megatron=QWEN3_MOE.megatron)
