"""The sharding rules own their arithmetic (split, join, shard, shapes, byte boxes, chunks), and
the table's overlaps are found at import: only declared precedence may let two rules match."""

from __future__ import annotations

import pytest
import torch

from mcore_proxy.checkpoint.layout import ParallelLayout
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.sharding import (
    COLUMN,
    GLU_COLUMN,
    REPLICATED,
    ROW,
    SHARDING_RULES,
    ShardRule,
    check_rules,
    overlap,
    rule_for,
)

RULES = {kind: ShardRule("x", kind) for kind in (REPLICATED, COLUMN, ROW, GLU_COLUMN)}


@pytest.mark.parametrize("kind", [COLUMN, ROW, GLU_COLUMN, REPLICATED])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_shards_are_the_boxes_of_the_tensor_and_join_back(kind, parts):
    rule = RULES[kind]
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    shards = rule.split(full, parts)
    assert torch.equal(rule.join(shards), full)
    for i, shard in enumerate(shards):
        assert tuple(shard.shape) == rule.shard_shape((8, 12), parts)
        assert rule.full_shape(tuple(shard.shape), parts) == (8, 12) or kind == REPLICATED
        boxes = rule.shard_boxes((8, 12), parts, i)
        pieces = [full[tuple(slice(o, o + s) for o, s in zip(off, size))] for off, size in boxes]
        assert torch.equal(shard, torch.cat(pieces, dim=0 if kind != ROW else 1))
        assert all(torch.equal(p, q) for p, q in zip(rule.shard_pieces(full, parts, i), pieces))
        assert len(boxes) == (2 if kind == GLU_COLUMN and parts > 1 else 1)


def test_a_glu_shard_holds_its_gate_rows_then_its_up_rows():
    rows = torch.arange(4.0)[:, None].expand(4, 3)
    full = torch.cat([rows, 10 + rows])  # [2F=8, H=3]: gate rows 0..3, then up rows 10..13
    shard1 = RULES[GLU_COLUMN].shard(full, 2, 1)
    assert shard1[:, 0].tolist() == [2, 3, 12, 13]
    assert RULES[GLU_COLUMN].shard_boxes((8, 3), 2, 1) == [((2, 0), (2, 3)), ((6, 0), (2, 3))]


def test_column_and_row_shards_are_views_sliced_once():
    full = torch.randn(8, 6)
    col = RULES[COLUMN].shard(full, 2, 1)
    row = RULES[ROW].shard(full, 3, 2)
    assert col.data_ptr() == full[4:].data_ptr() and col.is_contiguous()
    assert row.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view, no copy


def test_chunk_boxes_and_divisibility():
    fc1 = RULES[GLU_COLUMN]
    assert fc1.chunk_boxes((8, 4), 2) == [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((4, 0), (2, 4)), ((6, 0), (2, 4))]
    assert RULES[ROW].chunk_boxes((4, 5), 2) == [((0, 0), (4, 5))]  # not divisible: one chunk
    assert not fc1.divides((6, 4), 2) and fc1.divides((8, 4), 2) and RULES[REPLICATED].divides((3,), 4)
    with pytest.raises(CheckpointError, match="dimension 1 of size 5 does not divide into 2"):
        RULES[ROW].split(torch.zeros(4, 5), 2)


def test_parts_and_shard_index_follow_the_layout():
    layout = ParallelLayout(tp=4, ep=2, etp=1)
    fc2 = rule_for("decoder.layers.0.mlp.experts.3.linear_fc2.weight")
    proj = rule_for("decoder.layers.0.self_attention.linear_proj.weight")
    assert (fc2.parts(layout), fc2.shard_index(layout, 3)) == (1, 0)  # ETP=1: every TP rank holds it whole
    assert (proj.parts(layout), proj.shard_index(layout, 3)) == (4, 3)
    assert rule_for("decoder.layers.0.mlp.router.weight").parts(layout) == 1


def test_overlap_finds_a_name_both_patterns_match():
    assert overlap("{layer}.mlp.experts.{expert}.{rest}._extra_state", "{rest}._extra_state") is not None
    assert overlap("a{k}b", "a12b") == "a12b"
    assert overlap("a{k}b", "ab") is None and overlap("a{k}{k}", "a1") is None
    assert overlap("{layer}.mlp.router.weight", "{layer}.mlp.router.bias") is None


def test_an_undeclared_overlap_is_refused_and_precedence_is_first_match():
    table = (
        ShardRule("{layer}.mlp.experts.{expert}.{rest}._extra_state", REPLICATED, "etp", expert=True),
        ShardRule("{rest}._extra_state", REPLICATED),
    )
    with pytest.raises(ValueError, match="both match 'decoder.layers.0.mlp.experts.0.._extra_state'"):
        check_rules(table)
    with pytest.raises(ValueError, match="not a later rule"):
        check_rules((ShardRule("a", REPLICATED, overrides="b"),))
    check_rules(SHARDING_RULES)  # the real table: every overlap declared
    # the name of the issue: an expert's extra state travels with its expert (the declared override)
    rule = rule_for("decoder.layers.1.mlp.experts.3.linear_fc1._extra_state")
    assert rule.expert and rule.group == "etp"
    assert not rule_for("decoder.layers.1.self_attention.linear_proj._extra_state").expert


def test_rows_of_one_pattern_for_different_specs_are_not_an_overlap():
    local = ShardRule("{layer}.self_attention.linear_q_down_proj.weight", COLUMN, spec="local")
    te = ShardRule("{layer}.self_attention.linear_q_down_proj.weight", REPLICATED, spec="transformer_engine")
    check_rules((local, te))
    # a spec row still overlaps a row for both specs
    with pytest.raises(ValueError, match="both match"):
        check_rules((local, ShardRule("{layer}.self_attention.{rest}", REPLICATED)))
    name = "decoder.layers.0.self_attention.linear_q_down_proj.weight"
    assert rule_for(name, "local").kind == COLUMN and rule_for(name, "transformer_engine").kind == REPLICATED
