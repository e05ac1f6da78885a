"""DeepSeek-V4 between Hugging Face and Megatron-LM's names (checkpoint/hf/deepseek_v4.py).

megatron-core 0.16.1 cannot build DeepSeek-V4 (Megatron-LM has it on its `dev` branch only), so
nothing here runs a Megatron model. What is proven: the tiny transformers-built V4 (hash-routed
layer 0 with `tid2eid`, compressor and indexer, hyper-connections, the MTP block `mtp.0.*`;
testing/hf_fixtures.py) converts to legacy and torch_dist at EP 2 (legacy also at PP 2, placed as
Megatron-LM dev places it) under Megatron-LM dev's names, reads back tensor for tensor equal to the
HF source under the mapping, and converts back to HF bit for bit; the launch flags and args are
Megatron-LM dev's; a plan applied HF -> Megatron, then Megatron -> HF (and a plan applied to the
full Megatron checkpoint) gives the HF -> HF proxy bit for bit, hash table included: both paths
prune alike; the release's spelling converts once dequantized. That Megatron-LM dev loads these
files and computes transformers' logits is bench/deepseek_v4_megatron_dev.py's (off CI,
bench/RESULTS.md).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.hf.reader import HFCheckpoint
from mcore_proxy.cli import main
from mcore_proxy.convert.prune import new_ids
from mcore_proxy.select.plan import substitute_rows
from mcore_proxy.testing.hf_fixtures import hf_tensors

EP2 = ["--target-ep", "2"]
# output -> convert options: EP 2, and legacy at PP 2 (the hash layer with the embedding, hc_head beside the final norm)
OUTPUTS = {
    "legacy": ["--format", "legacy", *EP2],
    "torch_dist": ["--format", "torch_dist", *EP2],
    "legacy_pp2": ["--format", "legacy", "--target-pp", "2", *EP2],
}


def _convert(src, out, *extra) -> None:
    assert main(["convert", str(src), "-o", str(out), *extra]) == 0


@pytest.fixture(scope="module")
def v4(hf_model, hf_proxy, tmp_path_factory):
    """The HF V4, its plan (K = 4 of 8) and HF -> HF proxy, and what this module converts once:
    the full model in both formats at EP 2, back to HF from each, the plan applied HF -> legacy and
    back, and the plan applied to the full legacy checkpoint."""
    src, tmp = hf_model("deepseek_v4"), tmp_path_factory.mktemp("v4-megatron")
    _, stats, plan, _, hf_proxy_dir = hf_proxy("deepseek_v4")
    out = {"src": src, "stats": stats, "plan": plan, "hf_proxy": hf_proxy_dir}
    for name, options in OUTPUTS.items():
        out[name] = tmp / name
        _convert(src, out[name], *options)
        out[f"{name}_hf"] = tmp / f"{name}-hf"
        _convert(out[name], out[f"{name}_hf"], "--format", "hf")
    out["proxy"], out["proxy_hf"] = tmp / "proxy", tmp / "proxy-hf"
    _convert(src, out["proxy"], "--plan", str(plan), "--format", "legacy", *EP2)
    _convert(out["proxy"], out["proxy_hf"], "--format", "hf")
    out["pruned_hf"] = tmp / "pruned-hf"
    _convert(out["legacy"], out["pruned_hf"], "--plan", str(plan), "--format", "hf")
    return out


def _assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_megatron_args_and_launch_flags_are_megatron_lm_devs(v4, capsys):
    args = open_checkpoint(v4["legacy"]).args
    assert (args.experimental_attention_variant, args.multi_latent_attention, args.transformer_impl) == (
        "dsv4_hybrid",
        True,
        "transformer_engine",
    )
    # layer types sliding / CSA / HCA(8) / CSA, and the MTP block's compressor (ape of 4 rows) and indexer
    assert args.csa_compress_ratios == [0, 4, 8, 4, 4] and args.csa_window_size == 8
    assert (args.moe_n_hash_layers, args.moe_router_score_function, args.moe_router_topk_scaling_factor) == (
        1,
        "sqrtsoftplus",
        1.5,
    )
    assert (args.enable_hyper_connections, args.num_residual_streams, args.mhc_sinkhorn_iterations) == (True, 4, 20)
    assert (args.o_groups, args.o_lora_rank, args.q_lora_rank, args.v_head_dim, args.qk_pos_emb_head_dim) == (
        2,
        16,
        16,
        32,
        8,
    )
    assert (args.qk_head_dim, args.kv_lora_rank) == (24, 24)  # as Megatron-LM derives them for dsv4_hybrid
    assert (args.rotary_base, args.csa_compress_rotary_base, args.rotary_scaling_factor) == (1e4, 1.6e5, 1.0)
    assert (args.activation_func_clamp_value, args.moe_layer_freq, args.mtp_num_layers) == (10.0, [1] * 4, 1)
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (1, 2)
    capsys.readouterr()
    assert main(["convert", v4["src"], "-o", v4["legacy"].parent / "dry", "--format", "legacy", *EP2, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    for flag in (
        "--experimental-attention-variant dsv4_hybrid",
        '--csa-compress-ratios "[0, 4, 8, 4, 4]"',
        "--moe-n-hash-layers 1",
        "--enable-hyper-connections",
        "--num-residual-streams 4",
        "--o-groups 2",
        "--o-lora-rank 16",
        "--csa-window-size 8",
        "--csa-compress-rotary-base 160000",
        "--moe-router-score-function sqrtsoftplus",
        "--activation-func-clamp-value 10",
        "--expert-model-parallel-size 2",
        "--tensor-model-parallel-size 1",
    ):
        assert flag in printed, flag


def test_legacy_files_hold_megatron_lm_dev_names_and_expert_shards(v4):
    """Rank files as Megatron-LM dev saves them (names checked against its GPTModel's
    `state_dict_for_save_checkpoint`): EP rank 1 holds experts 4..7 as local 0..3, the MTP layer is
    `mtp_model_layer`, the hash table an int32 buffer, hyper-connection scales three [1] tensors."""
    rank1 = torch.load(v4["legacy"] / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    model, src = rank1["model"], hf_tensors(v4["src"])
    table = model["decoder.layers.0.mlp.router.tid2eid"]
    assert table.dtype == torch.int32 and torch.equal(table.long(), src["model.layers.0.ffn.gate.tid2eid"])
    assert "decoder.layers.0.mlp.router.expert_bias" not in model  # hash layers have none
    fc1 = model["mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([src["mtp.0.ffn.experts.5.w1.weight"], src["mtp.0.ffn.experts.5.w3.weight"]]))
    scale = src["model.layers.2.hc_ffn_scale"]
    for i, part in enumerate(("pre", "post", "res")):
        assert torch.equal(model[f"decoder.layers.2.mlp_hyper_connection.alpha_{part}"], scale[i : i + 1])
    assert torch.equal(
        model["decoder.layers.1.self_attention.linear_o_group_proj"], src["model.layers.1.attn.wo_a.weight"]
    )
    assert "mtp.layers.0.e_proj._extra_state" in model and not any(".transformer_layer." in k for k in model)
    assert not [k for k in model if re.search(r"local_experts\.[4-9]\.", k)]
    # PP 2: stage 0 holds layers 0-1 (the hash layer beside the embedding), stage 1 layers 2-3 as local
    # 0-1, the final norm, hc_head, the output layer, the MTP block and its copy of the embedding
    stages = [
        torch.load(v4["legacy_pp2"] / "release" / f"mp_rank_00_{p:03d}_000" / "model_optim_rng.pt", weights_only=False)[
            "model"
        ]
        for p in (0, 1)
    ]
    assert "decoder.layers.0.mlp.router.tid2eid" in stages[0] and "decoder.hc_head_fn" not in stages[0]
    assert {
        "decoder.hc_head_fn",
        "decoder.final_layernorm.weight",
        "embedding.word_embeddings.weight",
        "mtp.layers.0.hc_head_fn",
        "decoder.layers.1.mlp.router.expert_bias",
    } <= set(stages[1])
    assert torch.equal(
        stages[1]["decoder.layers.0.self_attention.linear_o_group_proj"], src["model.layers.2.attn.wo_a.weight"]
    )


@pytest.mark.parametrize("fmt", OUTPUTS)
def test_megatron_tensors_equal_the_hf_source_under_the_mapping(v4, fmt):
    megatron, hf = open_checkpoint(v4[fmt]), HFCheckpoint(v4["src"])
    assert megatron.names() == hf.names()
    for name in hf.names():
        got, want = megatron.get(name), hf.get(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert megatron.spec.hash_layers == (0,)


@pytest.mark.parametrize("fmt", OUTPUTS)
def test_hf_megatron_hf_round_trip_is_bit_for_bit(v4, fmt):
    _assert_bitwise(hf_tensors(v4[f"{fmt}_hf"]), hf_tensors(v4["src"]))
    config, source = (json.loads((p / "config.json").read_text()) for p in (v4[f"{fmt}_hf"], v4["src"]))
    for key in (
        "layer_types",
        "compress_rates",
        "mlp_layer_types",
        "rope_parameters",
        "hc_mult",
        "o_groups",
        "sliding_window",
        "index_topk",
        "n_routed_experts",
        "num_experts_per_tok",
        "routed_scaling_factor",
        "partial_rotary_factor",
        "num_nextn_predict_layers",
        "swiglu_limit",
    ):
        assert config[key] == source[key], key


def test_megatron_proxy_equals_the_hf_proxy_bit_for_bit(v4):
    """The plan applied HF -> Megatron (then Megatron -> HF), and applied to the full Megatron
    checkpoint (-> HF), give the HF -> HF proxy: router rows, expert bias, experts, and the hash
    table rewritten to the kept experts' new ids with the plan's substitutes."""
    want = hf_tensors(v4["hf_proxy"])
    _assert_bitwise(hf_tensors(v4["proxy_hf"]), want)
    _assert_bitwise(hf_tensors(v4["pruned_hf"]), want)
    from mcore_proxy.select.plan import load_plan

    plan = load_plan(v4["plan"])
    assert plan.layers["0"].substitutes  # the hash layer's dropped experts have substitutes
    table = open_checkpoint(v4["proxy"]).get("decoder.layers.0.mlp.router.tid2eid")
    original = hf_tensors(v4["src"])["model.layers.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int32 and int(table.max()) < plan.num_experts
    rows = substitute_rows(original, plan, "0", 8, "tid2eid").long()
    assert torch.equal(table.long(), new_ids(plan.kept("0"), 8)[rows])
    config = json.loads((v4["proxy_hf"] / "config.json").read_text())
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (4, 2)


def test_selecting_from_the_megatron_checkpoint_gives_the_same_plan(v4, tmp_path):
    """The Megatron checkpoint knows its hash-routed layers from `moe_n_hash_layers`: select there
    gives the HF plan, substitutes included."""
    out = tmp_path / "plan.json"
    assert (
        main(["select", "--ckpt", str(v4["legacy"]), "--stats", str(v4["stats"]), "--num-experts", "4", "-o", str(out)])
        == 0
    )
    got, want = (json.loads(p.read_text()) for p in (out, v4["plan"]))
    assert got["layers"] == want["layers"] and got["source"] == want["source"]
    assert got["params"]["hash_routing"] == want["params"]["hash_routing"]


def test_the_release_converts_once_dequantized(v4, tmp_path, capsys):
    """DeepSeek-V4's release spelling (`layers.{i}.`, `embed`, `norm`, `hc_head_*`; FP4 experts and FP8
    linears with E8M0 `.scale`): refused in one sentence while quantized; dequantized HF -> HF, the
    bf16 folder (still the release's names) converts to Megatron and back bit for bit."""
    from mcore_proxy.testing.quantized import v4_release_copy

    release = v4_release_copy(v4["src"], tmp_path / "release")
    capsys.readouterr()
    assert main(["convert", str(release), "-o", str(tmp_path / "refused"), "--format", "legacy"]) == 2
    assert "--dequantize first" in capsys.readouterr().err
    _convert(release, tmp_path / "bf16", "--format", "hf", "--dequantize")
    _convert(tmp_path / "bf16", tmp_path / "legacy", "--format", "legacy", *EP2)
    _convert(tmp_path / "legacy", tmp_path / "back", "--format", "hf")
    bf16, back = HFCheckpoint(tmp_path / "bf16"), HFCheckpoint(tmp_path / "back")
    megatron = open_checkpoint(tmp_path / "legacy")
    assert "layers.0.attn.wq_a.weight" in hf_tensors(tmp_path / "bf16")
    assert bf16.names() == megatron.names() == back.names()
    for name in bf16.names():
        assert torch.equal(megatron.get(name), bf16.get(name)) and torch.equal(back.get(name), bf16.get(name)), name


def test_megatron_lm_limits_are_refused_in_one_sentence(v4, tmp_path, capsys):
    """TP > 1 (Megatron-LM's V4 attention is TP 1 only; MindSpeed-LLM's names, whose V4 is tensor
    parallel, are tests/checkpoint/test_mindspeed_llm_v4.py's), MindSpeed-LLM's names in torch_dist
    (MindSpeed-LLM saves legacy), and a config.json whose layer types disagree with the compressors
    the shards hold (args made from it would build other layers)."""
    wrong = tmp_path / "wrong"
    shutil.copytree(v4["src"], wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["layer_types"][1] = "heavily_compressed_attention"
    (wrong / "config.json").write_text(json.dumps(config))
    for src, extra, says in (
        (v4["src"], ["--target-tp", "2"], "tensor-parallel size 1 only"),
        (v4["src"], ["--naming", "mindspeed-llm", "--format", "torch_dist"], "written in the legacy format only"),
        (wrong, [], "layers.1 has compress ratio 8 (config.json), but its compressor holds 4 rows"),
    ):
        out = tmp_path / "out"
        assert main(["convert", str(src), "-o", str(out), "--format", "legacy", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1 and not out.exists(), err
