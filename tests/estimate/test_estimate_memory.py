"""Bytes per device: Megatron's distributed-optimizer table, stage placement, activations."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_proxy.core.errors import ProxyError
from mcore_proxy.estimate.memory import (
    Layout,
    Training,
    device_memory,
    device_params,
    stage_activations,
    stage_layers,
    stage_params,
)
from mcore_proxy.estimate.model import architecture, count_parameters, embedding_params
from mcore_proxy.estimate.sources import from_preset, merge

SMALL = architecture(
    name="small",
    num_layers=4,
    hidden_size=256,
    vocab_size=1024,
    num_attention_heads=8,
    num_query_groups=8,
    kv_channels=32,
    ffn_hidden_size=1024,
    num_experts=8,
    moe_ffn_hidden_size=128,
    topk=2,
    moe_layers=(1, 2, 3),
)


def layout(tp=1, pp=1, ep=1, etp=1, dp=1, arch=SMALL):
    return Layout(tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, stages=stage_layers(arch.num_layers, pp))


def test_stages_split_like_megatron():
    assert stage_layers(48, 2) == (24, 24)
    assert stage_layers(61, 8) == (8,) * 7 + (5,)  # --decoder-last-pipeline-num-layers 5
    assert stage_layers(61, 16) == (4,) * 15 + (1,)
    assert stage_layers(61, 32) is None and stage_layers(4, 5) is None
    assert stage_layers(61, 61) == (1,) * 61


@pytest.mark.parametrize("precision, per_param", [("bf16", (6, 12)), ("fp16", (4, 16)), ("fp32", (8, 8))])
@pytest.mark.parametrize("dp", [1, 4])
def test_model_state_bytes_follow_megatrons_distributed_optimizer_table(precision, per_param, dp):
    """docs/source/api-guide/dist_optimizer.md: 6 + 12/d bytes per parameter for bf16 with fp32
    gradients, 4 + 16/d for fp16, 8 + 8/d for fp32 (d: data-parallel size)."""
    mem = device_memory(SMALL, layout(dp=dp), Training(precision=precision))
    params = count_parameters(SMALL).total  # no buffers: every parameter is trained
    fixed, sharded = per_param
    assert mem.weights + mem.gradients == fixed * params
    assert abs(mem.optimizer - sharded * params / dp) <= 2
    sgd = device_memory(SMALL, layout(dp=dp), Training(precision=precision, optimizer="sgd"))
    assert sgd.optimizer < mem.optimizer  # one moment instead of two


def test_expert_state_shards_over_expert_parallel_and_its_data_parallel_group():
    """8 devices, TP=2 EP=4: experts split 4 ways, their optimizer state over EDP = 2x4/4 = 2."""
    lay = layout(tp=2, ep=4, dp=4)
    assert lay.devices == 8 and lay.edp == 2
    p = stage_params(SMALL, lay.stages)[0]
    dense, expert, _ = device_params(p, lay)
    assert expert == p.expert // 4 and dense == p.tp // 2 + p.replicated
    mem = device_memory(SMALL, lay, Training())
    assert mem.optimizer == -(-dense * 12 // 4) + -(-expert * 12 // 2)


def test_embedding_copies_live_where_megatron_builds_them():
    mtp = dataclasses.replace(SMALL, mtp_layers=1)
    emb = embedding_params(SMALL).tp
    one, two = stage_params(mtp, (4,)), stage_params(mtp, (2, 2))
    assert one[0].tp + one[0].replicated < two[0].tp + two[0].replicated + two[1].tp + two[1].replicated
    # PP=2 with MTP: the last stage also holds the word embedding (MTP's input)
    assert sum(p.total for p in two) - sum(p.total for p in one) == emb
    tied = dataclasses.replace(SMALL, untie_embeddings=False)
    assert sum(p.total for p in stage_params(tied, (2, 2))) - count_parameters(tied).total == emb


def test_activations_match_korthikanti_for_a_dense_gpt_layer():
    """Korthikanti et al. 2022, Table 2 (selective recomputation, sequence parallel): 34 s b h / t
    bytes per layer, 2 s b h of which are the two dropout masks a dropout-free run does not keep."""
    gpt = dataclasses.replace(SMALL, moe_layers=(1,), num_layers=2, activation="gelu", ffn_hidden_size=4 * 256)
    s, b, h, t = 2048, 2, 256, 2
    acts = stage_activations(
        gpt, Layout(tp=t, pp=2, ep=1, etp=1, dp=1, stages=(1, 1)), Training(micro_batch=b, seq_len=s)
    )
    dense_stage_one_micro_batch = acts[0] / 2  # stage 0 of 2 holds two micro-batches
    flash_lse = 4 * s * b * gpt.num_attention_heads / t
    assert dense_stage_one_micro_batch - flash_lse == 32 * s * b * h / t


def test_activations_scale_with_tokens_tensor_parallelism_and_recomputation():
    base = device_memory(SMALL, layout(), Training(seq_len=1024)).activations
    assert device_memory(SMALL, layout(), Training(seq_len=2048)).activations == 2 * base
    assert device_memory(SMALL, layout(), Training(seq_len=1024, micro_batch=2)).activations == 2 * base
    assert device_memory(SMALL, layout(tp=2, dp=1), Training(seq_len=1024)).activations == pytest.approx(
        base / 2, rel=0.01
    )
    assert device_memory(SMALL, layout(), Training(seq_len=1024, recompute="full")).activations < base / 2


def test_first_stage_holds_one_micro_batch_per_stage_in_flight():
    qwen = merge(from_preset("qwen3-30b-a3b"))
    acts = stage_activations(qwen, Layout(tp=1, pp=4, ep=1, etp=1, dp=1, stages=(12,) * 4), Training())
    assert acts[0] == 4 * acts[2] // 2 and acts[1] == 3 * acts[2] // 2
    assert acts[3] == acts[2] // 2 + 4 * 4096 * 151936  # one micro-batch, plus fp32 logits


def test_bad_training_settings_are_refused():
    with pytest.raises(ProxyError, match="--precision 'int8'"):
        Training(precision="int8")
    with pytest.raises(ProxyError, match="--seq-len 0"):
        Training(seq_len=0)
