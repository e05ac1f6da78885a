"""Hugging Face <-> Megatron through the canonical view, proven by both frameworks running the
result: Qwen3-MoE from transformers converted to legacy and torch_dist (args synthesised from
config.json) loads strictly into megatron-core at TP 2 / PP 2 / EP 2 and computes the HF model's
logits; a Qwen3-MoE saved by megatron-core converts to HF and transformers computes megatron's
logits; one plan applied HF -> HF and HF -> Megatron gives a rollout proxy and a trainer proxy
that compute the same logits; and the routing statistics `collect` measures in transformers
equal the Megatron trace's on the same tokens. DeepSeek-V3 (multi-latent attention, written
in megatron-core's local spec: down projections column-parallel) converts to legacy and
torch_dist and megatron-core computes the HF model's logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.hf.models import load_model, run
from mcore_proxy.core.stats import load_stats, merge_stats
from mcore_proxy.functional.run import fixed_tokens
from mcore_proxy.testing.families import StagedLayout, family_from_args, load_and_run

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

LAYOUT = ["--target-tp", "2", "--target-pp", "2", "--target-ep", "2", "--target-etp", "1"]
MEGATRON = StagedLayout(tp=2, pp=2, ep=2, etp=1)
CLOSE = dict(rtol=1e-4, atol=1e-4)  # fp32 logits of size ~1 from two frameworks' op orders


@pytest.fixture(scope="module")
def qwen3_in_megatron(hf_model, hf_proxy, tmp_path_factory):
    """The HF Qwen3-MoE converted to legacy and torch_dist, and its proxy plan (K = 8 of 16, made
    from `collect` statistics) applied HF -> Megatron legacy; all three loaded into megatron-core at
    TP 2 / PP 2 / EP 2 (the full legacy one traced), in one set of ranks."""
    src, tmp = hf_model("qwen3_moe"), tmp_path_factory.mktemp("qwen3-megatron")
    _, _, plan, _, hf_proxy_dir = hf_proxy("qwen3_moe")
    legacy, dist, proxy, trace = tmp / "legacy", tmp / "dist", tmp / "proxy", tmp / "trace"
    assert main(["convert", str(src), "-o", str(legacy), "--format", "legacy", *LAYOUT]) == 0
    assert main(["convert", str(src), "-o", str(dist), "--format", "torch_dist", *LAYOUT]) == 0
    assert main(["convert", str(src), "--plan", str(plan), "-o", str(proxy), "--format", "legacy", *LAYOUT]) == 0
    model, small = (family_from_args(open_checkpoint(p).args) for p in (legacy, proxy))
    logits = load_and_run(
        [
            (model, MEGATRON, "legacy", legacy, tmp / "legacy.pt"),
            (model, MEGATRON, "torch_dist", dist, tmp / "dist.pt"),
            (small, MEGATRON, "legacy", proxy, tmp / "proxy.pt"),
        ],
        trace_dirs=[trace, None, None],
    )
    return src, model, legacy, logits, trace, hf_proxy_dir


def test_qwen3_hf_to_megatron_computes_the_hf_logits(qwen3_in_megatron):
    src, model, legacy, (from_legacy, from_dist, _), _, _ = qwen3_in_megatron
    hf = run(load_model(src), fixed_tokens(model))
    torch.testing.assert_close(from_legacy[0], hf, **CLOSE)
    torch.testing.assert_close(from_dist[0], hf, **CLOSE)
    args = open_checkpoint(legacy).args
    config = json.loads((src / "config.json").read_text())
    # what megatron-core must be told, synthesised from config.json
    assert (args.kv_channels, args.num_query_groups, args.qk_layernorm) == (12, 2, True)
    assert (args.norm_epsilon, args.rotary_base, args.moe_layer_freq) == (1e-6, 1e6, [0, 1, 1, 1])
    assert args.moe_router_pre_softmax is (not config["norm_topk_prob"])
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size, args.transformer_impl) == (2, 2, "local")


def test_one_plan_gives_a_trainer_proxy_and_a_rollout_proxy_that_agree(qwen3_in_megatron):
    """The issue's promise: the plan applied HF -> HF (what vLLM loads) and HF -> Megatron (what the
    trainer loads) gives two proxies computing the same logits, and they differ from the
    original's (the pruning is not a no-op)."""
    _, model, _, (original, _, trainer), _, rollout_dir = qwen3_in_megatron
    rollout_model = load_model(rollout_dir)
    assert rollout_model.config.num_experts == 8
    rollout = run(rollout_model, fixed_tokens(model))
    assert trainer.shape == original.shape
    torch.testing.assert_close(trainer[0], rollout, **CLOSE)
    assert (trainer[0] - original[0]).abs().max() > 100 * CLOSE["atol"]


def test_qwen3_collect_and_megatron_trace_agree_on_the_same_tokens(qwen3_in_megatron, tmp_path):
    src, model, _, _, trace, _ = qwen3_in_megatron
    tokens = fixed_tokens(model)
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in tokens.tolist()))
    argv = ["collect", "--hf", str(src), "--data", str(data), "-o", str(tmp_path / "hf"), "--batch-size", "2"]
    assert main(argv) == 0
    written = (tmp_path / "hf" / "routing_stats.safetensors").read_bytes()
    assert main(argv) == 2  # an existing statistics file is refused without --force
    assert (tmp_path / "hf" / "routing_stats.safetensors").read_bytes() == written
    hf = load_stats(tmp_path / "hf" / "routing_stats.safetensors")
    files = sorted(trace.glob("rank*.safetensors"))
    assert len(files) == 2  # TP rank 0 of each pipeline stage records (TP without SP: one copy)
    mg = merge_stats([(f, load_stats(f)) for f in files])
    assert hf.layer_ids == mg.layer_ids == ["1", "2", "3"]
    for lid in hf.layer_ids:
        a, b = hf.layers[lid], mg.layers[lid]
        assert a.tokens == b.tokens == tokens.numel()
        assert np.array_equal(a.freq, b.freq) and np.array_equal(a.coact, b.coact), lid
        np.testing.assert_allclose(a.gate_mass, b.gate_mass, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.proto_sum, b.proto_sum, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_qwen3_megatron_to_hf_computes_megatrons_logits(family_ckpt, tmp_path, fmt):
    """A Qwen3-MoE-shaped model saved by megatron-core (rope, GroupedMLP, TP 2 / PP 2 / EP 2,
    testing/fixtures.py `qwen3_moe_hf`) converts to HF and transformers computes its logits."""
    megatron_qwen3 = family_ckpt["qwen3_moe_hf"]
    out = tmp_path / "hf"
    assert main(["convert", str(getattr(megatron_qwen3, fmt)), "-o", str(out), "--format", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_experts"], config["mlp_only_layers"]) == (
        ["Qwen3MoeForCausalLM"],
        32,
        [0],
    )
    assert (config["rms_norm_eps"], config["rope_parameters"]["rope_theta"], config["head_dim"]) == (1e-6, 1e6, 12)
    reference = torch.load(megatron_qwen3.logits)[0]
    got = run(load_model(out), fixed_tokens(megatron_qwen3.model))
    torch.testing.assert_close(got, reference, **CLOSE)


def test_megatron_with_learned_positions_is_refused_for_hf(family_ckpt, tmp_path, capsys):
    """Qwen3-MoE on HF has rotary positions only: the fixture with learned absolute position
    embeddings has a tensor the HF model lacks, named in one sentence, nothing written."""
    out = tmp_path / "hf"
    assert main(["convert", str(family_ckpt["qwen3_moe"].legacy), "-o", str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "position_embedding" in err and len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_hf_to_megatron_computes_the_hf_logits_and_converts_back_bit_for_bit(hf_model, tmp_path, name):
    """DeepSeek-V3.2: with megatron-core's DSA indexer, on a local spec (`functional.cpu`); its
    indexer rows are reordered both ways (`mapping.rope_last_order`): without that the logits
    differ by up to 4."""
    from mcore_proxy.testing.hf_fixtures import hf_tensors
    from mcore_proxy.checkpoint.interface import TargetOptions
    from mcore_proxy.convert.pipeline import ConvertRequest, convert

    src = hf_model(name)
    legacy, dist = tmp_path / "legacy", tmp_path / "dist"
    convert(
        ConvertRequest(ckpt=src, out=legacy, format="legacy", target=TargetOptions(tp=2, pp=1, ep=2, etp=1)),
        progress=False,
    )
    convert(
        ConvertRequest(ckpt=src, out=dist, format="torch_dist", target=TargetOptions(tp=2, pp=1, ep=2, etp=1)),
        progress=False,
    )
    model = family_from_args(open_checkpoint(legacy).args)
    assert model.mla is not None
    logits = load_and_run(
        [
            (model, StagedLayout(tp=2, pp=1, ep=2, etp=1), "legacy", legacy, tmp_path / "l.pt"),
            (model, StagedLayout(tp=1, pp=1, ep=1), "torch_dist", dist, tmp_path / "d.pt"),
        ]
    )
    want = run(load_model(src), fixed_tokens(model))
    for got in logits:
        torch.testing.assert_close(got[0], want, **CLOSE)
    assert main(["convert", legacy, "-o", tmp_path / "back", "--format", "hf"]) == 0
    original, back = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(back)
    assert all(torch.equal(original[k], back[k]) for k in original), [
        k for k in original if not torch.equal(original[k], back[k])
    ]


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_deepseek_megatron_to_hf_computes_megatron_logits(family_ckpt, tmp_path, fmt):
    """The megatron-core-saved DeepSeek-V3 fixture (MLA, layout "Ettt|tt|m|L" with a standalone MTP
    stage) converts to HF; transformers computes megatron's main-head logits, and the MTP layer is
    written as DeepSeek's extra decoder layer (`num_nextn_predict_layers`)."""
    ckpt = family_ckpt["deepseek_v3_mla"]
    out = tmp_path / "hf"
    assert main(["convert", str(getattr(ckpt, fmt)), "-o", str(out), "--format", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_nextn_predict_layers"], config["num_hidden_layers"]) == (1, 5)
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.5.eh_proj.weight" in names
    got = run(load_model(out), fixed_tokens(ckpt.model))
    torch.testing.assert_close(got, torch.load(ckpt.logits)[0], **CLOSE)
