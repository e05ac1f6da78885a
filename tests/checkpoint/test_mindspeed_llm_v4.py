"""DeepSeek-V4 as MindSpeed-LLM saves it (checkpoint/mindspeed_llm_v4.py).

MindSpeed-LLM and its Ascend stack cannot be installed here, so no MindSpeed-LLM model runs. Its
checkpoints are stood in for by `testing/mindspeed_v4.py`, which derives rank files from the tiny
transformers-built DeepSeek-V4 the way MindSpeed-LLM's own converter does
(`convert_ckpt_deepseek4.py`: names, TP chunks, EP placement, grouped GEMM, MTP, args of its
pretrain recipe), written apart from the library's mapping. What is proven: our writer produces
those files byte for byte (keys, shapes, dtypes, values, the MindSpeed-LLM args), our reader reads
them as the HF model tensor for tensor, a plan applied to them gives the HF -> HF proxy bit for bit,
and their Megatron-LM dev names equal the HF -> Megatron-LM conversion file for file.
"""

from __future__ import annotations

import re

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.hf.reader import HFCheckpoint
from mcore_proxy.checkpoint.mindspeed_llm_v4 import MindSpeedV4Naming
from mcore_proxy.cli import main
from mcore_proxy.testing.hf_fixtures import hf_tensors
from mcore_proxy.testing.mindspeed_v4 import mindspeed_v4_checkpoint

# layout -> (derivation options, convert options): MindSpeed-LLM's converter keeps experts whole (ETP 1)
LAYOUTS = {
    "tp2_pp2_ep2": (
        dict(tp=2, pp=2, ep=2),
        ["--target-tp", "2", "--target-pp", "2", "--target-ep", "2", "--target-etp", "1"],
    ),
    "grouped_ep2": (dict(ep=2, grouped_gemm=True), ["--target-tp", "1", "--target-ep", "2", "--moe-grouped-gemm"]),
}
# MindSpeed-LLM builds MTP layers without compressor or indexer (the fixture's MTP block, a copy of a CSA
# layer, has both): not written, so not read back
MTP_COMPRESSION = re.compile(
    r"^mtp\.\d+\.attn\.(compressor|indexer)\.|^mtp\.layers\.\d+\.(transformer|mtp_model)_layer"
    r"\.self_attention\.core_attention\.(compressor|indexer)\."
)
# MindSpeed-LLM's own args, as its DeepSeek-V4 recipe spells them
MINDSPEED_FIELDS = (
    "enable_mhc",
    "hc_mult",
    "n_hash_layers",
    "compress_ratios",
    "sliding_window_size",
    "o_groups",
    "o_lora_rank",
    "q_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "compress_rope_theta",
    "rope_factor",
    "swiglu_limit",
    "num_experts",
    "moe_router_topk",
    "moe_router_score_function",
    "mtp_num_layers",
    "position_embedding_type",
    "transformer_impl",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "moe_grouped_gemm",
)


def _assert_hf_equal(folder, reference) -> None:
    """The HF tensors of `folder` are `reference`'s bit for bit, but for the MTP layer's compression."""
    got, want = hf_tensors(folder), hf_tensors(reference)
    assert sorted(got) == sorted(k for k in want if not MTP_COMPRESSION.match(k))
    for key, value in got.items():
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key


def _convert(src, out, *extra) -> None:
    assert main(["convert", str(src), "-o", str(out), *extra]) == 0


def _rank_files(root) -> dict[str, dict]:
    (iteration,) = [p for p in root.iterdir() if p.is_dir()]
    return {d.name: torch.load(d / "model_optim_rng.pt", weights_only=False) for d in sorted(iteration.iterdir())}


@pytest.fixture(scope="module")
def ms(hf_model, hf_proxy, tmp_path_factory):
    """Per layout: MindSpeed-LLM's files derived from the HF V4 and ours written from it; the plan
    (K = 4 of 8) and the HF -> HF proxy."""
    src, tmp = hf_model("deepseek_v4"), tmp_path_factory.mktemp("v4-mindspeed")
    _, _, plan, _, proxy = hf_proxy("deepseek_v4")
    out = {"src": src, "plan": plan, "hf_proxy": proxy}
    for name, (derive, options) in LAYOUTS.items():
        out[f"{name}_derived"] = mindspeed_v4_checkpoint(src, tmp / f"{name}-derived", **derive)
        out[f"{name}_ours"] = tmp / f"{name}-ours"
        _convert(src, out[f"{name}_ours"], "--format", "legacy", "--naming", "mindspeed-llm", *options)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_writes_the_files_mindspeed_llm_saves(ms, layout):
    derived, ours = _rank_files(ms[f"{layout}_derived"]), _rank_files(ms[f"{layout}_ours"])
    assert sorted(ours) == sorted(derived)
    for rank, want in derived.items():
        got = ours[rank]
        assert sorted(got["model"]) == sorted(want["model"]), rank
        for key, value in want["model"].items():
            assert got["model"][key].dtype == value.dtype and torch.equal(got["model"][key], value), (rank, key)
        for field in MINDSPEED_FIELDS:
            assert getattr(got["args"], field) == getattr(want["args"], field), (rank, field)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reads_mindspeed_llm_files_as_the_hf_model(ms, layout):
    view, hf = open_checkpoint(ms[f"{layout}_derived"]), HFCheckpoint(ms["src"])
    assert isinstance(view.info.naming, MindSpeedV4Naming)
    kept = [n for n in hf.names() if not MTP_COMPRESSION.match(n)]
    assert view.names() == kept and len(hf.names()) - len(kept) == 10
    for name in kept:
        got, want = view.get(name), hf.get(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert view.spec.hash_layers == (0,) and view.spec.num_experts == 8


def test_mindspeed_llm_to_hf_is_bit_for_bit(ms, tmp_path):
    _convert(ms["tp2_pp2_ep2_derived"], tmp_path / "hf", "--format", "hf")
    _assert_hf_equal(tmp_path / "hf", ms["src"])


def test_a_plan_on_mindspeed_llm_files_gives_the_hf_proxy(ms, tmp_path):
    """Pruned as MindSpeed-LLM files (their names kept by default) and read back, the proxy is the
    HF -> HF proxy bit for bit, the hash table rewritten by the same rule."""
    _convert(ms["tp2_pp2_ep2_derived"], tmp_path / "proxy", "--plan", str(ms["plan"]))
    proxy = open_checkpoint(tmp_path / "proxy")
    assert isinstance(proxy.info.naming, MindSpeedV4Naming) and proxy.spec.num_experts == 4
    ranks = _rank_files(tmp_path / "proxy")
    assert all("decoder.layers.0.attn_mhc.hc_scale" in r["model"] for name, r in ranks.items() if "_000_" in name)
    assert {r["args"].num_experts for r in ranks.values()} == {4}
    _convert(tmp_path / "proxy", tmp_path / "proxy-hf", "--format", "hf")
    _assert_hf_equal(tmp_path / "proxy-hf", ms["hf_proxy"])


def test_megatron_lm_names_from_mindspeed_llm_equal_hf_to_megatron_lm(ms, tmp_path):
    """MindSpeed-LLM -> Megatron-LM dev names at TP 1 gives the files HF -> Megatron-LM gives (but for
    the MTP layer's compression, which MindSpeed-LLM does not have)."""
    _convert(
        ms["tp2_pp2_ep2_derived"],
        tmp_path / "dev",
        "--format",
        "legacy",
        "--naming",
        "megatron",
        "--target-tp",
        "1",
        "--target-pp",
        "1",
        "--target-ep",
        "2",
    )
    _convert(ms["src"], tmp_path / "direct", "--format", "legacy", "--target-ep", "2")
    dev, direct = _rank_files(tmp_path / "dev"), _rank_files(tmp_path / "direct")
    assert sorted(dev) == sorted(direct)
    for rank, want in direct.items():
        got, want = dev[rank]["model"], {k: v for k, v in want["model"].items() if not MTP_COMPRESSION.match(k)}
        assert sorted(got) == sorted(want), rank
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), (rank, key)
        assert dev[rank]["args"].experimental_attention_variant == "dsv4_hybrid"
        assert dev[rank]["args"].csa_compress_ratios == [0, 4, 8, 4, 0]  # the MTP layer uncompressed
        assert not hasattr(dev[rank]["args"], "enable_mhc")


def test_launch_flags_and_inspect_speak_mindspeed_llm(ms, tmp_path, capsys):
    capsys.readouterr()
    _convert(
        ms["src"], tmp_path / "dry", "--format", "legacy", "--naming", "mindspeed-llm", "--target-tp", "2", "--dry-run"
    )
    printed = capsys.readouterr().out
    for flag in (
        "--spec mindspeed_llm.tasks.models.spec.deepseek4_spec layer_spec",
        "--enable-mhc",
        "--hc-mult 4",
        "--n-hash-layers 1",
        "--compress-ratios 0 4 8 4 --",
        "--sliding-window-size 8",
        "--o-groups 2",
        "--qk-head-dim 32",
        "--enable-dsa-indexer",
        "--index-topk 4",
        "--swiglu-limit 10",
        "--position-embedding-type deepseek4",
        "--moe-router-score-function sqrtsoftplus",
        "--tensor-model-parallel-size 2",
    ):
        assert flag in printed, flag
    assert "--experimental-attention-variant" not in printed and "--csa-compress-ratios" not in printed
    assert main(["inspect", str(ms["tp2_pp2_ep2_derived"])]) == 0
    assert "MindSpeed-LLM (DeepSeek-V4) names" in capsys.readouterr().out


def test_megatron_lm_names_at_tp2_are_refused(ms, tmp_path, capsys):
    """Megatron-LM dev runs V4's attention at TP 1 only: a TP 2 MindSpeed-LLM source written under its
    names keeps TP 2 by default, which is refused in one sentence naming both ways out."""
    capsys.readouterr()
    assert (
        main(["convert", str(ms["tp2_pp2_ep2_derived"]), "-o", str(tmp_path / "dist"), "--format", "torch_dist"]) == 2
    )
    err = capsys.readouterr().err
    assert "tensor-parallel size 1 only" in err and "--naming mindspeed-llm" in err
    assert not (tmp_path / "dist").exists()
