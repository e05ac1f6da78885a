"""bench/bench_deepseek_scale.py (issue 10 item 5): its synthetic checkpoint generator writes what
megatron-core saves (checked against the megatron-core DeepSeek fixture at the fixture's own
size), and its smoke mode runs the real pipeline (cp, inspect, select, convert, verify)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.bench_deepseek_scale import smoke_model, stage_counts, write_checkpoint
from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.testing.families import DEEPSEEK_V3, iteration_dir

ROOT = Path(__file__).resolve().parents[2]

# args that differ with the layout, precision or run, not with the model
RUN_ARGS = {
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "world_size",
    "data_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "virtual_pipeline_model_parallel_size",
    "overlap_p2p_comm",
    "bf16",
    "params_dtype",
    "iteration",
    "use_distributed_optimizer",
}


def _rank_files(root: Path) -> dict[str, dict]:
    return {
        p.parent.name: torch.load(p, map_location="cpu", weights_only=False)
        for p in sorted(iteration_dir(root).glob("*/model_optim_rng.pt"))
    }


def _templates(files: dict[str, dict]) -> set[str]:
    """Every rank-local model key with its layer and local expert numbers blanked."""
    out = set()
    for state in files.values():
        for chunk in (k for k in state if re.fullmatch(r"model\d*", k)):
            for key in state[chunk]:
                key = re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.L.", key)
                out.add(re.sub(r"\.local_experts\.\d+\.", ".local_experts.j.", key))
    return out


def test_generator_writes_what_megatron_core_saves(family_ckpt, tmp_path):
    fixture = family_ckpt["deepseek_v3_mla"].legacy
    assert smoke_model() == DEEPSEEK_V3  # the smoke model is the fixture's model
    ours = tmp_path / "synthetic"
    write_checkpoint(ours, DEEPSEEK_V3, pp=2, ep=2, tokens=64)
    theirs, mine = _rank_files(fixture), _rank_files(ours)
    assert sorted(mine) == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    assert _templates(mine) == _templates(theirs)
    first_theirs, first_mine = next(iter(theirs.values())), next(iter(mine.values()))
    chunks = {k for k in first_theirs if re.fullmatch(r"model\d+", k)}
    assert set(first_mine) == set(first_theirs) - chunks | {"model"}
    assert (first_mine["checkpoint_version"], type(first_mine["args"])) == (3.0, type(first_theirs["args"]))
    a, b = vars(first_theirs["args"]), vars(first_mine["args"])
    assert set(a) <= set(b)
    assert {k: b[k] for k in a if k not in RUN_ARGS} == {k: v for k, v in a.items() if k not in RUN_ARGS}
    # the whole model: the same canonical tensors, global shapes, layer spec and ModelSpec through the reader
    v_theirs, v_mine = open_checkpoint(fixture), open_checkpoint(ours)
    shapes = lambda view: {n: tuple(view.shape(n)) for n in view.names()}  # noqa: E731
    assert shapes(v_mine) == shapes(v_theirs)
    assert (v_mine.layer_spec, v_mine.spec) == (v_theirs.layer_spec, v_theirs.spec)
    # a replicated tensor is the same on every EP rank; experts differ
    key = "decoder.layers.0.mlp.router.weight"
    assert torch.equal(mine["mp_rank_00_001_000"]["model"][key], mine["mp_rank_00_001_001"]["model"][key])
    e = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert not torch.equal(mine["mp_rank_00_001_000"]["model"][e], mine["mp_rank_00_001_001"]["model"][e])


def test_mindspeed_stage_spelling_reads_as_the_same_model(tmp_path):
    model = smoke_model(7)
    write_checkpoint(tmp_path / "a", model, pp=2, ep=2, tokens=64)
    write_checkpoint(tmp_path / "b", model, pp=2, ep=2, stages="num-layer-list", tokens=64)
    args = _rank_files(tmp_path / "b")["mp_rank_00_000_000"]["args"]
    assert (args.num_layer_list, args.first_k_dense_replace, args.moe_layer_freq) == ("4,3", 3, 1)
    va, vb = open_checkpoint(tmp_path / "a"), open_checkpoint(tmp_path / "b")
    assert va.spec == vb.spec and va.names() == vb.names()
    assert all(torch.equal(va.get(n), vb.get(n)) for n in va.names())


def test_mindspeed_llm_naming_reads_as_the_same_model(tmp_path):
    """--naming mindspeed-llm: the rank files hold MindSpeed-LLM's DeepSeek-V3 recipe keys (fused
    down projection, grouped GEMM experts, MTP / final norm names) and the reader yields the
    megatron-named checkpoint's model, tensor for tensor."""
    model = smoke_model(7)
    write_checkpoint(tmp_path / "a", model, pp=2, ep=2, tokens=64)
    write_checkpoint(tmp_path / "b", model, pp=2, ep=2, stages="num-layer-list", tokens=64, naming="mindspeed-llm")
    files = _rank_files(tmp_path / "b")
    last, args = files["mp_rank_00_001_001"]["model"], files["mp_rank_00_000_000"]["args"]
    assert (args.num_layer_list, args.moe_grouped_gemm, args.moe_tp_extend_ep, args.mla_mm_split) == (
        "4,3",
        True,
        True,
        False,
    )
    assert tuple(last["decoder.layers.0.self_attention.linear_qkv.weight"].shape) == (20 + 12 + 4, 32)
    assert tuple(last["decoder.layers.0.mlp.experts.weight1"].shape) == (32, 16 * 16)  # [H, E_local * 2F]
    assert tuple(last["mtp.layers.0.transformer_layer.mlp.experts.weight2"].shape) == (16 * 8, 32)
    assert {"mtp.final_layernorms.0.weight", "final_layernorm.weight"} <= set(last)
    assert not any(
        re.search(r"down_proj|local_experts|^decoder\.final_layernorm|mtp\.layers\.0\.final_layernorm", k)
        for f in files.values()
        for k in f["model"]
    )
    va, vb = open_checkpoint(tmp_path / "a"), open_checkpoint(tmp_path / "b")
    assert vb.info.naming is not None and vb.layout.expert_layout == "grouped" and vb.layout.tp_extend_ep
    assert (va.spec, va.layer_spec) == (vb.spec, vb.layer_spec) and va.names() == vb.names()
    assert all(tuple(va.shape(n)) == tuple(vb.shape(n)) and torch.equal(va.get(n), vb.get(n)) for n in va.names())


def test_stage_counts():
    assert stage_counts(61, 8) == [7, 8, 8, 8, 8, 8, 8, 6]
    assert stage_counts(32, 8) == [4] * 8 and stage_counts(5, 2) == [3, 2]


@pytest.mark.parametrize("naming", ["megatron", "mindspeed-llm"])
def test_smoke_runs_the_pipeline(tmp_path, naming):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [
            sys.executable,
            "bench/bench_deepseek_scale.py",
            "--smoke",
            "--warm",
            "--naming",
            naming,
            "--data",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "verify ok" in r.stdout
    rows = [ln.split(" | ")[0][2:] for ln in r.stdout.splitlines() if ln.startswith("| ") and "(5L)" in ln]
    assert rows == ["cp -r (5L)", "inspect (5L)", "select K=16 (5L)", "convert K=16 -> TP 1 PP 1 EP 2 (5L)"]
    assert (tmp_path / "scale-results.json").is_file() and not (tmp_path / "scale-tmp").exists()
    tag = "smoke-5L-pp2-ep4-" + ("first-last" if naming == "megatron" else "num-layer-list-mindspeed-llm")
    assert (tmp_path / tag).is_dir()
