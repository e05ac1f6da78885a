"""MindSpeed-LLM-named DeepSeek-V3 checkpoints through inspect, select and convert, and the
DeepSeek-V3.2 indexer.

The checkpoints are DERIVED, NOT SAVED BY MINDSPEED-LLM (it cannot be installed here): built from the
megatron-core-saved `deepseek_v3_mla` fixture (TP 2, PP 2 with layout "Ettt|tt|m|L", EP 2, ETP 1)
by the documented key mapping, `mcore_proxy/testing/mindspeed_llm.py` (fused replicated
`linear_qkv`, --mla-mm-split parts, --moe-tp-extend-ep placement, MTP/final norm names, indexer
tensors with random values). Proven: the reader yields the original's tensors bit for bit; a proxy
converted from it (K = 16, another TP/PP/EP) with megatron-core names is loaded by megatron-core and
computes the original's logits with routers restricted to the kept experts (1e-4); the same proxy
written with MindSpeed-LLM names holds exactly the same tensors; indexer tensors survive read ->
write -> read bit for bit, pruning included; an unknown indexer tensor is refused in one sentence."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.testing.families import StagedLayout, iteration_dir, load_and_run
from mcore_proxy.testing.mindspeed_llm import Derivation, derive

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

KEEP = 16
CLOSE = dict(rtol=1e-4, atol=1e-4)
FUSED, SPLIT_EXTEND = Derivation(), Derivation(mla_mm_split=True, tp_extend_ep=True)


def _same_tensors(a, b, names=None) -> None:
    for name in names or a.names():
        x, y = a.get(name), b.get(name)
        assert (x is None and y is None) or torch.equal(x, y), name


def _keys(root) -> set[str]:
    out = set()
    for f in iteration_dir(root).glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, map_location="cpu", weights_only=False)
        out |= {k for c in state if re.fullmatch(r"model\d*", c) for k in state[c]}
    return out


def _plan(view, path, target_ep: int):
    """Multiview selection of KEEP experts on planted statistics shaped like `view`."""
    from mcore_proxy.select.synthetic import planted_plan

    return planted_plan(view, KEEP, path, target_ep=target_ep)


@pytest.fixture(scope="module")
def derived(family_ckpt, tmp_path_factory):
    ckpt = family_ckpt["deepseek_v3_mla"]
    tmp = tmp_path_factory.mktemp("mindspeed-llm")
    return ckpt, {
        how: derive(ckpt.legacy, tmp / f"d{i}", how)
        for i, how in enumerate(
            (
                FUSED,
                SPLIT_EXTEND,
                Derivation(indexer="mindspeed-llm"),
                Derivation(indexer="megatron", mindspeed_names=False),
            )
        )
    }


def test_the_reader_maps_mindspeed_llm_names_to_the_original_tensors(derived):
    ckpt, roots = derived
    original = open_checkpoint(ckpt.legacy)
    for how in (FUSED, SPLIT_EXTEND):
        keys = _keys(roots[how])
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in keys and "final_layernorm.weight" in keys
        assert "mtp.final_layernorms.0.weight" in keys and not any("down_proj" in k for k in keys)
        assert ("decoder.layers.0.self_attention.linear_qk_rope.weight" in keys) == how.mla_mm_split
        view = open_checkpoint(roots[how])
        assert view.info.naming.mla_mm_split == how.mla_mm_split and view.layer_spec == "local"
        assert view.layout.tp_extend_ep == how.tp_extend_ep
        assert sorted(view.names()) == sorted(original.names())
        _same_tensors(original, view)
    # --moe-tp-extend-ep: all 8 (tp, pp, ep) folders, 8 whole experts each, chunk ep * TP + tp
    folders = sorted(p.name for p in iteration_dir(roots[SPLIT_EXTEND]).glob("mp_rank_*"))
    assert len(folders) == 8
    state = torch.load(
        iteration_dir(roots[SPLIT_EXTEND]) / "mp_rank_01_001_000" / "model_optim_rng.pt", weights_only=False
    )
    local = {k for k in state["model0"] if ".local_experts." in k and k.endswith("linear_fc1.weight")}
    assert len(local) == 2 * 8  # 2 MoE layers on the stage x 8 experts
    assert torch.equal(
        state["model0"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
        original.get("decoder.layers.3.mlp.experts.8.linear_fc1.weight"),
    )  # chunk 0 * 2 + 1


def test_args_silent_about_mla_the_split_and_tp_extend_ep_still_read(derived, tmp_path):
    """Without `mla_mm_split` and `moe_tp_extend_ep` in the args the names and the local expert
    count (E / (EP x TP) per folder) say it."""
    ckpt, roots = derived
    silent = tmp_path / "silent"
    shutil.copytree(roots[SPLIT_EXTEND], silent)
    for f in iteration_dir(silent).glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        del state["args"].mla_mm_split, state["args"].moe_tp_extend_ep
        torch.save(state, f)
    view = open_checkpoint(silent)
    assert view.info.naming.mla_mm_split and view.layout.tp_extend_ep
    _same_tensors(open_checkpoint(ckpt.legacy), view)


def test_inspect_reports_the_naming(derived, capsys):
    _, roots = derived
    assert main(["inspect", str(roots[SPLIT_EXTEND])]) == 0
    out = capsys.readouterr().out
    assert "MindSpeed-LLM (--mla-mm-split) names" in out and "tp-extend-ep" in out
    assert main(["inspect", "--json", str(roots[SPLIT_EXTEND])]) == 0
    assert '"naming": "MindSpeed-LLM (--mla-mm-split)"' in capsys.readouterr().out


@pytest.fixture(scope="module")
def proxies(derived, tmp_path_factory):
    """A K = 16 plan on planted statistics; the MindSpeed-LLM source converted with megatron-core
    names (TP 1, PP 2 keeping the source's layout string, EP 2) and with MindSpeed-LLM names (TP 2, PP 1, EP 2,
    --moe-tp-extend-ep);
    megatron-core runs the megatron-named proxy and the restricted original."""
    ckpt, roots = derived
    tmp = tmp_path_factory.mktemp("mindspeed-proxies")
    plan = _plan(open_checkpoint(roots[SPLIT_EXTEND]), tmp / "plan.json", target_ep=2)
    out = {"megatron": tmp / "megatron", "mindspeed": tmp / "mindspeed"}
    assert (
        main(
            [
                "convert",
                roots[SPLIT_EXTEND],
                "--plan",
                tmp / "plan.json",
                "-o",
                out["megatron"],
                "--target-tp",
                "1",
                "--target-pp",
                "2",
                "--target-ep",
                "2",
                "--naming",
                "megatron",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "convert",
                roots[SPLIT_EXTEND],
                "--plan",
                tmp / "plan.json",
                "-o",
                out["mindspeed"],
                "--target-tp",
                "2",
                "--target-pp",
                "1",
                "--target-ep",
                "2",
            ]
        )
        == 0
    )
    keep = {lid: plan.kept(lid) for lid in plan.layer_ids}
    proxy_model = dataclasses.replace(ckpt.model, num_experts=KEEP)
    logits = load_and_run(
        [
            (ckpt.model, ckpt.layout, "torch_dist", ckpt.torch_dist, tmp / "restricted.pt"),
            (
                proxy_model,
                StagedLayout(tp=1, pp=2, ep=2, etp=1, pipeline_layout="Ettt|tt|m|L"),
                "legacy",
                out["megatron"],
                tmp / "proxy.pt",
            ),
        ],
        keeps=[keep, None],
    )
    return out, logits


def test_the_megatron_named_proxy_computes_the_restricted_original(proxies, family_ckpt):
    _, (restricted, proxy) = proxies
    assert proxy.shape == restricted.shape == (2, 2, 16, 128)
    torch.testing.assert_close(proxy, restricted, **CLOSE)
    assert (torch.load(family_ckpt["deepseek_v3_mla"].logits) - restricted).abs().max() > 1e-3


def test_the_mindspeed_named_proxy_holds_the_same_tensors(proxies, capsys):
    out, _ = proxies
    keys = _keys(out["mindspeed"])
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in keys
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state" not in keys  # LinearNoTP: none
    assert not any("down_proj" in k or "up_proj" in k for k in keys)
    mind, mega = open_checkpoint(out["mindspeed"]), open_checkpoint(out["megatron"])
    assert mind.layout.tp_extend_ep and mind.args.moe_tp_extend_ep and mind.args.mla_mm_split
    assert mega.info.naming is None and not mega.args.moe_tp_extend_ep and not mega.args.mla_mm_split
    assert sorted(mind.names()) == sorted(mega.names())
    _same_tensors(mega, mind)


@pytest.mark.parametrize("which", ["mindspeed-llm", "megatron"])
def test_indexer_tensors_round_trip_and_are_kept(derived, tmp_path, which):
    _, roots = derived
    how = (
        Derivation(indexer="mindspeed-llm")
        if which == "mindspeed-llm"
        else Derivation(indexer="megatron", mindspeed_names=False)
    )
    src = open_checkpoint(roots[how])
    indexer = [n for n in src.names() if ".core_attention.indexer." in n]
    assert len(indexer) == 5 * 6  # 5 tensors x (5 decoder layers + the MTP layer)
    stored = (
        "self_attention.dsa_indexer.wq_b.weight"
        if which == "mindspeed-llm"
        else "self_attention.core_attention.indexer.linear_wq_b.weight"
    )
    assert f"decoder.layers.0.{stored}" in _keys(roots[how])
    _plan(src, tmp_path / "plan.json", target_ep=1)
    out = tmp_path / "proxy"
    assert (
        main(
            [
                "convert",
                roots[how],
                "--plan",
                tmp_path / "plan.json",
                "-o",
                out,
                "--target-tp",
                "1",
                "--target-pp",
                "1",
                "--target-ep",
                "1",
            ]
        )
        == 0
    )
    proxy = open_checkpoint(out)
    assert f"decoder.layers.0.{stored}" in _keys(out)  # written back in the source's names
    _same_tensors(src, proxy, indexer)  # kept whole, bit for bit
    assert proxy.spec.num_experts == KEEP
    assert sum(".mlp.experts." in n for n in proxy.names()) * 2 == sum(".mlp.experts." in n for n in src.names())


def test_an_unknown_indexer_tensor_is_refused_in_one_sentence(derived, tmp_path, capsys):
    _, roots = derived
    bad = tmp_path / "bad"
    shutil.copytree(roots[Derivation(indexer="mindspeed-llm")], bad)
    f = sorted(iteration_dir(bad).glob("mp_rank_*/model_optim_rng.pt"))[0]
    state = torch.load(f, weights_only=False)
    state["model0"]["decoder.layers.1.self_attention.dsa_indexer.wq_c.weight"] = torch.zeros(4, 4)
    torch.save(state, f)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "dsa_indexer.wq_c.weight" in err and "nearest supported kind is the DSA indexer tensors" in err


def test_other_formats_and_expert_layouts(derived, tmp_path, capsys):
    """torch_dist output of a MindSpeed-LLM source has megatron-core names (MindSpeed-LLM saves
    legacy); GroupedMLP experts (--moe-grouped-gemm) with --moe-tp-extend-ep round trip; asking for
    MindSpeed-LLM names in torch_dist is refused in one sentence."""
    ckpt, roots = derived
    original = open_checkpoint(ckpt.legacy)
    src = roots[SPLIT_EXTEND]
    assert (
        main(
            [
                "convert",
                src,
                "-o",
                tmp_path / "dist",
                "--format",
                "torch_dist",
                "--target-tp",
                "1",
                "--target-pp",
                "1",
                "--target-ep",
                "2",
            ]
        )
        == 0
    )
    assert "megatron-core names" in capsys.readouterr().out
    dist = open_checkpoint(tmp_path / "dist")
    assert dist.info.format == "torch_dist" and dist.info.naming is None and not dist.layout.tp_extend_ep
    assert dist.args.moe_tp_extend_ep is False and dist.args.mla_mm_split is False  # the files' truth
    _same_tensors(original, dist)
    assert (
        main(
            [
                "convert",
                src,
                "-o",
                tmp_path / "grouped",
                "--expert-layout",
                "grouped",
                "--target-tp",
                "2",
                "--target-pp",
                "2",
                "--target-ep",
                "2",
            ]
        )
        == 0
    )
    grouped = open_checkpoint(tmp_path / "grouped")
    assert grouped.layout.expert_layout == "grouped" and grouped.layout.tp_extend_ep
    assert "decoder.layers.0.mlp.experts.weight1" in _keys(tmp_path / "grouped")
    _same_tensors(original, grouped)
    capsys.readouterr()
    assert (
        main(["convert", str(src), "-o", str(tmp_path / "bad"), "--format", "torch_dist", "--naming", "mindspeed-llm"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "legacy format only" in err and not (tmp_path / "bad").exists()


def test_verify_functional_on_the_mindspeed_named_proxy(derived, proxies, capsys):
    """verify reads both MindSpeed-LLM-named checkpoints, checks every kept tensor bit for bit, and
    runs both in megatron-core (written with megatron-core names for the run)."""
    _, roots = derived
    out, _ = proxies
    assert (
        main(
            [
                "verify",
                "--orig",
                roots[SPLIT_EXTEND],
                "--proxy",
                out["mindspeed"],
                "--plan",
                out["mindspeed"].parent / "plan.json",
                "--functional",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "verify: OK" in text and "functional: max |logit difference|" in text


def test_mindspeed_llm_names_for_a_gqa_model_are_refused(family_ckpt, tmp_path, capsys):
    """Qwen3-MoE (GQA) has no MindSpeed-LLM-specific names: asking for them is one sentence."""
    assert main(["convert", family_ckpt["qwen3_moe"].legacy, "-o", tmp_path / "out", "--naming", "mindspeed-llm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "grouped-query attention" in err and not (tmp_path / "out").exists()
