"""The MindSpeed-LLM DeepSeek-V4 fixture: rank folders, TP/EP layouts that join back into the
Hugging Face tensors, and the training args."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_proxy.testing.hf_fixtures import build_cached, hf_tensors
from mcore_proxy.testing.mindspeed_v4 import dropped_release_keys, mindspeed_v4_checkpoint


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = build_cached("deepseek_v4", tmp_path_factory.mktemp("hf"))
    return folder, hf_tensors(folder), json.loads((folder / "config.json").read_text())


def _ranks(out, iteration=1):
    base = out / f"iter_{iteration:07d}"
    return {p.name: torch.load(p / "model_optim_rng.pt", weights_only=False) for p in sorted(base.iterdir())}


@pytest.fixture(scope="module")
def tp2pp2ep2(hf, tmp_path_factory):
    out = mindspeed_v4_checkpoint(hf[0], tmp_path_factory.mktemp("ms"), tp=2, pp=2, ep=2, iteration=7)
    return out, _ranks(out, 7)


@pytest.fixture(scope="module")
def grouped(hf, tmp_path_factory):
    out = mindspeed_v4_checkpoint(hf[0], tmp_path_factory.mktemp("gg"), tp=1, pp=1, ep=2, grouped_gemm=True)
    return out, _ranks(out)


def test_rank_folders(tp2pp2ep2, grouped, hf, tmp_path):
    out, ranks = tp2pp2ep2
    assert sorted(ranks) == sorted(
        f"mp_rank_{t:02}_{p:03}_{e:03}" for t in range(2) for p in range(2) for e in range(2)
    )
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    for rank in ranks.values():
        assert rank["iteration"] == 7 and rank["checkpoint_version"] == 3.0
    assert sorted(grouped[1]) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert (grouped[0] / "latest_checkpointed_iteration.txt").read_text() == "1"
    pp_only = mindspeed_v4_checkpoint(hf[0], tmp_path / "pp", pp=2)
    assert sorted(p.name for p in (pp_only / "iter_0000001").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]


def test_stages_hold_their_layers(tp2pp2ep2):
    ranks = tp2pp2ep2[1]
    first, last = ranks["mp_rank_01_000_001"]["model"], ranks["mp_rank_01_001_001"]["model"]
    # both stages embed (the last for the MTP block); only the last has the head, norms and MTP
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" in last
    assert not any(k.startswith(("output_layer", "final_layernorm", "hc_head", "mtp.")) for k in first)
    assert {
        "output_layer.weight",
        "final_layernorm.weight",
        "hc_head.hc_scale",
        "mtp.final_layernorms.0.weight",
    } <= set(last)
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers.")} == {"0", "1"}
    # layer 0 hashes (no bias), layer 1 (CSA) has the indexer, layer 2 (HCA, local 0 of stage 1) a
    # compressor only, layer 3 the indexer; the MTP layer has a bias and no compressor
    assert "decoder.layers.0.mlp.router.tid2eid" in first and "decoder.layers.0.mlp.router.expert_bias" not in first
    assert first["decoder.layers.0.mlp.router.tid2eid"].dtype == torch.int64
    assert "decoder.layers.1.mlp.router.expert_bias" in first
    assert "decoder.layers.1.self_attention.indexer.kv_compressor.ape" in first
    assert "decoder.layers.0.self_attention.compressor.ape" not in first
    assert "decoder.layers.0.self_attention.compressor.ape" in last
    assert "decoder.layers.0.self_attention.indexer.wq_b.weight" not in last
    assert "decoder.layers.1.self_attention.indexer.wq_b.weight" in last
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in last
    mtp_attention = [k for k in last if k.startswith("mtp.layers.0.transformer_layer.self_attention.")]
    assert mtp_attention and not any("compressor" in k or "indexer" in k for k in mtp_attention)
    # every (tp, ep) rank of a stage holds the same keys
    for p in range(2):
        keys = {n: set(r["model"]) for n, r in ranks.items() if n.split("_")[3] == f"{p:03}"}
        assert len(keys) == 4 and len({frozenset(k) for k in keys.values()}) == 1


def test_tp_shards_join_into_hf_tensors(tp2pp2ep2, hf):
    ranks, w = tp2pp2ep2[1], hf[1]

    def join(stage, key, dim, ep=0):
        return torch.cat([ranks[f"mp_rank_{t:02}_{stage:03}_{ep:03}"]["model"][key] for t in range(2)], dim)

    a = "decoder.layers.1.self_attention."  # HF layer 1, stage 0
    assert torch.equal(join(0, a + "linear_q_up_proj.weight", 0), w["model.layers.1.attn.wq_b.weight"])
    assert torch.equal(join(0, a + "linear_o_down_proj.weight", 0), w["model.layers.1.attn.wo_a.weight"])
    assert torch.equal(join(0, a + "linear_o_up_proj.weight", 1), w["model.layers.1.attn.wo_b.weight"])
    assert torch.equal(join(0, a + "attn_sink", 0), w["model.layers.1.attn.attn_sink"])
    for t in range(2):
        sd = ranks[f"mp_rank_{t:02}_000_001"]["model"]
        assert torch.equal(sd[a + "linear_q.weight"], w["model.layers.1.attn.wq_a.weight"])
        assert torch.equal(sd[a + "kv_layernorm.weight"], w["model.layers.1.attn.norm.weight"])
        assert torch.equal(sd["decoder.layers.1.attn_mhc.hc_scale"], w["model.layers.1.hc_attn_scale"])
    # shared expert: [gate_r; up_r] per TP rank, down by columns
    fc1 = [
        ranks[f"mp_rank_{t:02}_001_000"]["model"]["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
        for t in range(2)
    ]
    gate = torch.cat([x.chunk(2)[0] for x in fc1])
    up = torch.cat([x.chunk(2)[1] for x in fc1])
    assert torch.equal(gate, w["model.layers.3.ffn.shared_experts.w1.weight"])
    assert torch.equal(up, w["model.layers.3.ffn.shared_experts.w3.weight"])
    assert torch.equal(
        join(1, "decoder.layers.1.mlp.shared_experts.linear_fc2.weight", 1),
        w["model.layers.3.ffn.shared_experts.w2.weight"],
    )
    # embedding and head by rows; eh_proj = [e_proj | h_proj] by rows
    assert torch.equal(join(0, "embedding.word_embeddings.weight", 0), w["model.embed_tokens.weight"])
    assert torch.equal(join(1, "embedding.word_embeddings.weight", 0), w["model.embed_tokens.weight"])
    assert torch.equal(join(1, "output_layer.weight", 0), w["head.weight"])
    e_proj, h_proj = join(1, "mtp.layers.0.eh_proj.weight", 0).chunk(2, dim=1)
    assert torch.equal(e_proj, w["mtp.0.e_proj.weight"]) and torch.equal(h_proj, w["mtp.0.h_proj.weight"])
    last = ranks["mp_rank_00_001_000"]["model"]
    assert torch.equal(last["mtp.layers.0.transformer_layer.attn_mhc.hc_scale"], w["mtp.0.hc_attn_scale"])
    assert torch.equal(last["mtp.layers.0.hc_head.hc_scale"], w["mtp.0.hc_head_scale"])
    assert torch.equal(last["hc_head.hc_fn.weight"], w["model.hc_head.hc_fn"])


def test_experts_per_expert_and_grouped(tp2pp2ep2, grouped, hf):
    w, e = hf[1], "model.layers.1.ffn.experts.5."  # global expert 5 = EP rank 1, local 1
    for t in range(2):
        sd = tp2pp2ep2[1][f"mp_rank_{t:02}_000_001"]["model"]
        fc1 = sd["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([w[e + "w1.weight"], w[e + "w3.weight"]]))
        assert torch.equal(sd["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"], w[e + "w2.weight"])
        assert "decoder.layers.1.mlp.experts.local_experts.4.linear_fc1.weight" not in sd
    sd = grouped[1]["mp_rank_00_001"]["model"]
    w1, w2 = sd["decoder.layers.1.mlp.experts.weight1"], sd["decoder.layers.1.mlp.experts.weight2"]
    hidden, ffn = w["model.layers.1.ffn.experts.0.w2.weight"].shape
    assert w1.shape == (hidden, 4 * 2 * ffn) and w2.shape == (4 * ffn, hidden)
    gate, up = w1.view(4, hidden, 2 * ffn)[1].t().chunk(2)
    assert torch.equal(gate, w[e + "w1.weight"]) and torch.equal(up, w[e + "w3.weight"])
    assert torch.equal(w2.view(4, ffn, hidden)[1].t(), w[e + "w2.weight"])
    assert not any(".local_experts." in k for k in sd)


def test_args(tp2pp2ep2, grouped, hf):
    args = tp2pp2ep2[1]["mp_rank_00_000_000"]["args"]
    plain = (int, float, str, bool, list, type(None))
    assert all(isinstance(v, plain) for v in vars(args).values())
    assert (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
        args.expert_tensor_parallel_size,
    ) == (2, 2, 2, 1)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.padded_vocab_size) == (4, 64, 4, 128)
    assert (args.q_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.o_groups, args.o_lora_rank) == (
        16,
        32,
        8,
        2,
        16,
    )
    assert args.compress_ratios == [0, 4, 8, 4] and args.sliding_window_size == 8
    assert (
        args.num_experts,
        args.moe_router_topk,
        args.moe_ffn_hidden_size,
        args.moe_shared_expert_intermediate_size,
        args.n_hash_layers,
    ) == (8, 2, 32, 32, 1)
    assert args.moe_router_score_function == "sqrtsoftplus" and args.moe_router_topk_scaling_factor == 1.5
    assert (args.enable_mhc, args.hc_mult, args.enable_dsa_indexer, args.index_topk, args.mtp_num_layers) == (
        True,
        4,
        True,
        4,
        1,
    )
    assert (args.rope_theta, args.compress_rope_theta, args.original_seq_len) == (10000.0, 160000.0, 0)
    assert (args.transformer_impl, args.ckpt_format, args.position_embedding_type) == ("local", "torch", "deepseek4")
    assert (args.params_dtype, args.bf16, args.fp16, args.moe_grouped_gemm) == ("torch.float32", False, False, False)
    assert grouped[1]["mp_rank_00_000"]["args"].moe_grouped_gemm is True


def test_dropped_keys_are_the_mtp_compressor(hf):
    dropped = dropped_release_keys(hf[0])
    assert len(dropped) == 10 and all(k.startswith(("mtp.0.attn.compressor.", "mtp.0.attn.indexer.")) for k in dropped)
