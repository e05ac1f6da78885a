"""Hugging Face in, Hugging Face out: tiny Qwen3-MoE, DeepSeek-V3 and DeepSeek-V3.2 models built
and saved by transformers (several shards, DeepSeek with the MTP layer it publishes), read into
the canonical view, written back, pruned by a plan made from `collect` statistics, and run in
transformers: the proxy computes what the original computes when its gates may only choose
the kept experts (group-limited routing included), and that restriction changes the output.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.hf.models import load_model, restrict_gates, run
from mcore_proxy.testing.hf_fixtures import hf_tensors

FAMILIES = ["qwen3_moe", "deepseek_v3", "deepseek_v32"]
TOKENS = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("name", FAMILIES)
def test_fixtures_are_sharded_transformers_checkpoints(hf_model, name):
    folder = hf_model(name)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) >= 3
    keys = hf_tensors(folder)
    # save_pretrained writes per-expert Hub names although transformers 5 holds experts fused
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    view = open_checkpoint(folder)
    assert view.info.format == "hf" and view.spec.num_experts == 16 and view.spec.topk == 4
    if name != "qwen3_moe":
        assert view.spec.moe_layer_ids == ["1", "2", "mtp.0"]  # MTP layer = HF layer num_hidden_layers
        assert (view.spec.num_groups, view.spec.group_topk, view.spec.expert_bias) == (4, 2, True)
        # the family's view keeps HF keys beside the canonical router and experts; megatron's names its own
        assert "model.layers.3.eh_proj.weight" in keys and "model.layers.3.eh_proj.weight" in view.names()
        assert "mtp.layers.0.transformer_layer.mlp.router.weight" in view.names()
        assert "mtp.layers.0.eh_proj.weight" in view.megatron().names()
        assert view.dtype("decoder.layers.1.mlp.router.expert_bias") == torch.float32


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_to_hf_without_plan_writes_the_same_tensors(hf_model, tmp_path, name):
    """Reader and writer are inverse: every HF tensor comes back under its name, bit for bit
    (q/k/v re-split from megatron's interleaved linear_qkv, gate/up from linear_fc1, the MTP
    layer's embedding and head copies re-made from the shared tensors)."""
    src = hf_model(name)
    out = tmp_path / "copy"
    assert main(["convert", str(src), "-o", str(out)]) == 0
    a, b = hf_tensors(src), hf_tensors(out)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    logits = run(load_model(src), TOKENS), run(load_model(out), TOKENS)
    assert torch.equal(*logits)


@pytest.mark.parametrize("name", FAMILIES)
def test_proxy_equals_the_original_with_gates_restricted_to_the_kept_experts(hf_proxy, name):
    orig, _, _, plan, proxy = hf_proxy(name)
    original, pruned = load_model(orig), load_model(proxy)
    assert pruned.config.num_experts_per_tok == 4
    with restrict_gates(original, plan):
        reference = run(original, TOKENS)
    unrestricted, got = run(original, TOKENS), run(pruned, TOKENS)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    assert (unrestricted - reference).abs().max() > 0.1  # the restriction is measurable
    if name != "qwen3_moe":
        assert (pruned.config.n_routed_experts, pruned.config.n_group, pruned.config.topk_group) == (8, 4, 2)
        for group in range(4):  # the plan kept 2 experts of each original routing group, in order
            assert [e // 4 for e in plan.kept("1")[2 * group : 2 * group + 2]] == [group, group]
    else:
        assert pruned.config.num_local_experts == 8


@pytest.mark.parametrize("name", FAMILIES)
def test_proxy_files_tensors_and_config(hf_proxy, name):
    orig, _, plan_path, plan, proxy = hf_proxy(name)
    names = {p.name for p in proxy.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "manifest.json",
    } <= names
    config, source_config = (json.loads((d / "config.json").read_text()) for d in (proxy, orig))
    changed = {k for k in config if config[k] != source_config.get(k)}
    assert changed == ({"num_local_experts"} if name == "qwen3_moe" else {"n_routed_experts"})
    a, b = hf_tensors(orig), hf_tensors(proxy)
    kept = plan.kept("2")
    for j, e in enumerate(kept):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(
                b[f"model.layers.2.mlp.experts.{j}.{proj}.weight"], a[f"model.layers.2.mlp.experts.{e}.{proj}.weight"]
            )
    assert torch.equal(b["model.layers.2.mlp.gate.weight"], a["model.layers.2.mlp.gate.weight"][kept])
    if name != "qwen3_moe":
        mtp = plan.kept("mtp.0")
        assert torch.equal(
            b["model.layers.3.mlp.gate.e_score_correction_bias"],
            a["model.layers.3.mlp.gate.e_score_correction_bias"][mtp],
        )
        assert torch.equal(b["model.layers.3.embed_tokens.weight"], a["model.embed_tokens.weight"])
        assert torch.equal(b["model.layers.3.shared_head.head.weight"], a["lm_head.weight"])
    assert main(["verify", "--orig", str(orig), "--proxy", str(proxy), "--plan", str(plan_path), "--functional"]) == 0


def test_fused_expert_tensors_read_like_hub_names(hf_proxy, tmp_path):
    """A checkpoint holding transformers' in-memory fused experts (`experts.gate_up_proj`
    [E, 2F, H]) reads to the same megatron-core tensors, one expert's rows at a time, and its
    proxy keeps the fused spelling: the kept experts' rows, in plan order."""
    from safetensors.torch import save_file

    src, _, plan_path, plan, _ = hf_proxy("qwen3_moe")
    model = load_model(src)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((src / "config.json").read_text())
    a, b = open_checkpoint(src).megatron(), open_checkpoint(fused).megatron()
    assert a.names() == b.names()
    for name in a.names():
        assert a.shape(name) == b.shape(name) and torch.equal(a.get(name), b.get(name)), name
    out = tmp_path / "proxy"
    assert main(["convert", str(fused), "--plan", str(plan_path), "-o", str(out)]) == 0
    got = hf_tensors(out)
    kept = plan.kept("2")
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" not in got
    for key in ("model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        assert torch.equal(got[key], state[key][kept]), key
    assert main(["verify", "--orig", str(fused), "--proxy", str(out), "--plan", str(plan_path), "--functional"]) == 0


def test_hf_output_is_the_same_from_one_process_and_two_workers(hf_model, tmp_path):
    """HF is a row of the format table like the Megatron formats: its shards are units, spread
    over `--workers` processes, hashed while written; the manifest (every shard, config.json and
    the tokenizer files, with sha256) and the bytes are the same however the shards were spread."""
    src = hf_model("deepseek_v3")
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["convert", str(src), "-o", str(one)]) == 0
    assert main(["convert", str(src), "-o", str(two), "--workers", "2"]) == 0
    files = [json.loads((out / "manifest.json").read_text())["files"] for out in (one, two)]
    assert files[0] == files[1] and len([f for f in files[0] if f.endswith(".safetensors")]) >= 3
    for name, entry in files[0].items():
        data = (two / name).read_bytes()
        assert len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"], name


def test_hf_to_megatron_with_a_plan_prints_the_proxys_expert_count(hf_proxy, tmp_path, capsys):
    """From HF every model flag comes from config.json's args, but the expert count and routing
    flags are the plan's: the proxy has K experts, not the source's E."""
    orig, _, plan_path, plan, _ = hf_proxy("qwen3_moe")
    assert main(["convert", orig, "--plan", plan_path, "-o", tmp_path / "m", "--format", "legacy", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert f"--num-experts {plan.num_experts} " in text and f"--moe-router-topk {plan.router.topk} " in text
    assert text.count("--num-experts ") == 1 and "--hidden-size " in text
