"""Which layer spec saved a checkpoint (checkpoint/layer_spec.py), on the rank-local names and
shapes each spec saves for multi-latent attention at TP 2 (H 32, q_lora 20, kv_lora 12, rope 4).

The local-spec shapes are those of the megatron-core-saved fixture (tests/testing/test_families.py
opens it and finds "local"); the Transformer Engine ones are read from megatron-core 0.16.1's TE
spec (docs/families.md section 2), which cannot be built here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore_proxy.checkpoint.layer_spec import infer_layer_spec
from mcore_proxy.core.errors import CheckpointError
from mcore_proxy.mcore.sharding import COLUMN, LOCAL_SPEC, REPLICATED, TE_SPEC, rule_for

P = "decoder.layers.0.self_attention."
LOCAL = {
    P + "linear_q_down_proj.weight": (10, 32),
    P + "q_layernorm.weight": (20,),
    P + "linear_kv_down_proj.weight": (8, 32),
    P + "kv_layernorm.weight": (12,),
}
TE = {
    P + "linear_q_down_proj.weight": (20, 32),
    P + "linear_q_up_proj.layer_norm_weight": (20,),
    P + "linear_kv_down_proj.weight": (16, 32),
    P + "linear_kv_up_proj.layer_norm_weight": (12,),
}
TE_NO_NORMS = {P + "linear_q_down_proj.weight": (20, 32), P + "linear_kv_down_proj.weight": (16, 32)}


def mla_args(**kw):
    return SimpleNamespace(multi_latent_attention=True, q_lora_rank=20, kv_lora_rank=12, qk_pos_emb_head_dim=4, **kw)


@pytest.mark.parametrize("shapes,want", [(LOCAL, LOCAL_SPEC), (TE, TE_SPEC), (TE_NO_NORMS, TE_SPEC)])
def test_the_tensors_decide_without_args(shapes, want):
    assert infer_layer_spec(mla_args(), shapes, tp=2) == want


def test_args_decide_what_the_tensors_do_not_show():
    # TP 1 without latent norms: both specs save the same names and shapes
    plain = {P + "linear_q_down_proj.weight": (20, 32)}
    assert infer_layer_spec(mla_args(transformer_impl="local"), plain, tp=1) == LOCAL_SPEC
    assert infer_layer_spec(mla_args(), plain, tp=1) == TE_SPEC  # Megatron's default
    assert infer_layer_spec(SimpleNamespace(), {}, tp=2) == TE_SPEC


def test_tensors_contradicting_the_args_are_refused():
    with pytest.raises(CheckpointError, match="linear_q_down_proj.*transformer_impl says 'local'"):
        infer_layer_spec(mla_args(transformer_impl="local"), TE_NO_NORMS, tp=2, where="ckpt/mp_rank_00")
    with pytest.raises(CheckpointError, match="expected 'local' or 'transformer_engine'"):
        infer_layer_spec(mla_args(transformer_impl="te"), LOCAL, tp=2)


def test_the_down_projections_split_by_spec():
    name = "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight"
    assert rule_for(name, LOCAL_SPEC).kind == COLUMN and rule_for(name, TE_SPEC).kind == REPLICATED
    assert rule_for(P + "linear_q_up_proj.layer_norm_weight", TE_SPEC).kind == REPLICATED


def test_mindspeed_llm_mla_names_are_refused_not_misread():
    """MindSpeed-LLM's fused `linear_qkv` of MLA is replicated; read as GQA's column-parallel
    `linear_qkv` its TP copies would be concatenated. Refused, naming the tensor."""
    fused = {P + "linear_qkv.weight": (36, 32), P + "linear_q_up_proj.weight": (24, 20)}
    with pytest.raises(CheckpointError, match="linear_qkv.weight is MindSpeed-LLM's naming .* nearest supported"):
        infer_layer_spec(mla_args(transformer_impl="local"), fused, tp=2)
    gqa = SimpleNamespace(multi_latent_attention=False, transformer_impl="local")
    assert infer_layer_spec(gqa, {P + "linear_qkv.weight": (48, 32)}, tp=2) == LOCAL_SPEC
