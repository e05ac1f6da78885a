"""Every Mixture-of-Experts family transformers 5 builds, through the path a user runs: a tiny
model built and saved by transformers in several shards, `collect` on calibration text, `select`
K = E/2, `convert` Hugging Face to Hugging Face by the family's descriptor alone, then in
transformers: the proxy's logits equal the original's with every router restricted to the kept
experts (within 1e-5), and the restriction changes them measurably; `verify --functional` and
`fidelity` run on each. Routers carry nonzero logit biases (gpt-oss) and selection biases
(DeepSeek, GLM, Kimi, MiniMax, ERNIE); DeepSeek-V4's hash-routed layer sends tokens to kept and
dropped experts alike. Three families no declaration covers (Cohere2-MoE, Hunyuan-V1-MoE,
EXAONE-MoE) go the same way, read by the family discovered from transformers itself."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint.hf.families import FAMILIES
from mcore_proxy.cli import main
from mcore_proxy.hf.models import load_model, restrict_gates, run
from mcore_proxy.testing.hf_fixtures import VISION_LANGUAGE, hf_tensors

# fixture name -> (family, MoE layer ids, config.json keys that hold the expert count)
CASES = {
    "qwen2_moe": ("Qwen2-MoE", ["1", "2"], ["num_experts"]),
    "qwen3_next": ("Qwen3-Next", ["1", "2", "3", "mtp.0"], ["num_experts"]),
    "qwen3_5_moe": ("Qwen3.5-MoE", ["0", "1", "2", "3"], ["num_experts"]),
    "olmoe": ("OLMoE", ["0", "1"], ["num_experts"]),
    "mixtral": ("Mixtral", ["0", "1"], ["num_local_experts"]),
    "minimax_m2": ("MiniMax-M2", ["0", "1"], ["num_local_experts"]),
    "glm4_moe": ("GLM-4.5-MoE", ["1", "2", "mtp.0"], ["n_routed_experts"]),
    "deepseek_v4": ("DeepSeek-V4", ["0", "1", "2", "3", "mtp.0"], ["n_routed_experts"]),
    "kimi_k25": ("Kimi-K2.5", ["1", "2"], ["text_config.n_routed_experts"]),
    "kimi_linear": ("Kimi-Linear", ["1", "2", "3"], ["num_experts"]),
    "gpt_oss": ("gpt-oss", ["0", "1"], ["num_local_experts"]),
    "ernie4_5_moe": ("ERNIE-4.5-MoE", ["1", "2"], ["moe_num_experts"]),
    "llama4": ("Llama-4", ["1", "3"], ["num_local_experts"]),
    "mimo_v2_flash": ("MiMo-V2-Flash", ["1", "2"], ["n_routed_experts"]),
    # no declaration: discovered from transformers (checkpoint/hf/discovery.py), proven on a twin
    "cohere2_moe": ("Cohere2Moe", ["0", "1"], ["num_experts"]),
    "hunyuan_v1_moe": ("HunYuanMoEV1", ["0", "1"], ["num_experts"]),
    "exaone_moe": ("ExaoneMoe", ["1", "2"], ["num_experts"]),
    "nemotron_h": ("NemotronH", ["1", "3"], ["n_routed_experts"]),
    # vision-language wrappers, discovered: the vision tower and projector are copied bit for bit
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", ["0", "1"], ["text_config.num_local_experts"]),
    "aria": ("AriaForConditionalGeneration", ["0", "1"], ["text_config.moe_num_experts"]),
    "minimax_m3_vl": ("MiniMaxM3SparseForConditionalGeneration", ["0", "1"], ["text_config.num_local_experts"]),
}
TOKENS = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(11))


def lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def test_every_family_has_a_fixture():
    assert {f.name for f in FAMILIES} <= {family for family, _, _ in CASES.values()} | {
        "Qwen3-MoE",
        "DeepSeek-V3",
        "DeepSeek-V3.2",
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_proxy_equals_the_restricted_original(hf_proxy, name):
    family, layers, expert_keys = CASES[name]
    orig, _, plan_path, plan, proxy = hf_proxy(name)
    assert len(list(orig.glob("*.safetensors"))) >= 3
    view = open_checkpoint(orig)
    assert view.info.format_info.family == family and view.spec.moe_layer_ids == layers
    original, pruned = load_model(orig), load_model(proxy)
    with restrict_gates(original, plan):
        reference = run(original, TOKENS)
    unrestricted, got = run(original, TOKENS), run(pruned, TOKENS)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    assert (unrestricted - reference).abs().max() > 0.1  # the restriction is measurable
    config = json.loads((proxy / "config.json").read_text())
    for key in expert_keys:
        assert lookup(config, key) == view.spec.num_experts // 2, key
    assert main(["verify", "--orig", str(orig), "--proxy", str(proxy), "--plan", str(plan_path), "--functional"]) == 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_kept_tensors_are_the_sources_and_the_rest_is_copied(hf_proxy, name):
    """Router rows and biases taken in plan order, kept experts renumbered, every other tensor
    bit for bit, under the source's own spelling of each key."""
    orig, _, _, plan, proxy = hf_proxy(name)
    view, got = open_checkpoint(orig), hf_tensors(proxy)
    source = hf_tensors(orig)
    spelling = view.info.format_info.spelling
    lid = plan.layer_ids[-1]
    kept = plan.kept(lid)
    prefix = f"decoder.layers.{lid}" if not lid.startswith("mtp.") else f"mtp.layers.{lid[4:]}.transformer_layer"
    router_key = spelling[f"{prefix}.mlp.router.weight"][0]
    assert torch.equal(got[router_key], source[router_key][kept])
    for leaf in ("bias", "expert_bias"):
        entry = spelling.get(f"{prefix}.mlp.router.{leaf}")
        if entry:
            assert torch.equal(got[entry[0]], source[entry[0]][..., kept]) and source[entry[0]].abs().sum() > 0
    expert_keys = {hf for template, (hf, kind) in spelling.items() if template.startswith(prefix + ".mlp.experts.")}
    for hf in expert_keys:
        if "{e}" in hf:
            for j, e in enumerate(kept):
                assert torch.equal(got[hf.replace("{e}", str(j))], source[hf.replace("{e}", str(e))]), hf
        else:
            assert torch.equal(got[hf], source[hf][kept]), hf
    moe = {hf.split("{e}")[0] for hf in spelling.values() for hf in [hf[0]]}
    copied = [k for k in source if not any(k.startswith(m) for m in moe) and k not in {v[0] for v in spelling.values()}]
    assert copied and all(torch.equal(got[k], source[k]) for k in copied)


@pytest.mark.parametrize("name", sorted(VISION_LANGUAGE))
def test_a_vision_language_proxy_keeps_its_vision_tower_and_its_config(hf_proxy, name):
    """Only the language model is pruned: every vision tensor and the vision config are the source's."""
    orig, _, _, _, proxy = hf_proxy(name)
    source, got = hf_tensors(orig), hf_tensors(proxy)
    vision = [k for k in source if "vision" in k or "visual" in k or "projector" in k]
    assert len(vision) > 10 and all(torch.equal(got[k], source[k]) for k in vision)
    before, after = (json.loads((folder / "config.json").read_text()) for folder in (orig, proxy))
    assert after["vision_config"] == before["vision_config"]
    assert {k: v for k, v in after.items() if k != "text_config"} == {
        k: v for k, v in before.items() if k != "text_config"
    }


def test_hash_routed_tokens_follow_their_substitutes(hf_proxy):
    """DeepSeek-V4's hash-routed layer 0: the original table sends tokens to kept and dropped
    experts. Each slot naming a dropped expert goes to the first of its ranked substitutes (the
    kept expert of its cluster first) that the row does not already name, so every row keeps
    distinct experts (transformers would sum a repeated one, Megatron-LM count it once); the
    proxy's table holds the new ids. Checked against a row-by-row reading of the rule."""
    orig, _, plan_path, plan, proxy = hf_proxy("deepseek_v4")
    key = "model.layers.0.ffn.gate.tid2eid"
    table, new = hf_tensors(orig)[key], hf_tensors(proxy)[key]
    kept, subs = plan.kept("0"), plan.layers["0"].substitutes
    assert set(table.unique().tolist()) & set(kept) and set(table.unique().tolist()) - set(kept)
    assert sorted(subs) == sorted(set(range(8)) - set(kept)) and all(sorted(r) == kept for r in subs.values())
    for cluster in plan.layers["0"].clusters:
        assert all(subs[m][0] == cluster.representative for m in cluster.members if m != cluster.representative)
    expected, second_choices = [], 0
    for row in table.tolist():
        taken, out = {e for e in row if e in kept}, []
        for e in row:
            pick = e if e in kept else next(s for s in subs[e] if s not in taken)
            second_choices += e not in kept and pick != subs[e][0]
            taken.add(pick)
            out.append(kept.index(pick))
        expected.append(out)
    assert torch.equal(new, torch.tensor(expected, dtype=new.dtype)) and new.dtype == table.dtype
    assert second_choices > 0 and all(len(set(row)) == len(row) for row in new.tolist())
    doc = json.loads(plan_path.read_text())
    assert doc["params"]["hash_routing"]["layers"] == ["0"] and len(doc["layers"]["0"]["substitutes"]) == 4


@pytest.mark.parametrize("name", ["deepseek_v4", "gpt_oss", "llama4"])
def test_fidelity(hf_proxy, tmp_path, capsys, name):
    from mcore_proxy.testing.hf_fixtures import calibration_jsonl

    orig, _, plan_path, _, proxy = hf_proxy(name)
    data = calibration_jsonl(tmp_path / "eval.jsonl", records=8, seed=3)
    capsys.readouterr()
    assert main(["fidelity", "--orig", orig, "--proxy", proxy, "--plan", plan_path, "--data", data, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] > 0 and 0 < report["next_token_kl"]
    assert all(0 < layer["gate_mass_share"] < 1 for layer in report["moe_layers"])


@pytest.mark.parametrize(
    "name,key",
    [
        ("qwen3_next", "mtp.layers.0.mlp.experts.{e}.down_proj.weight"),
        ("deepseek_v4", "mtp.0.ffn.experts.{e}.w2.weight"),
    ],
)
def test_mtp_layers_transformers_does_not_build_are_pruned_by_router_weights(hf_proxy, name, key):
    """Qwen3-Next's `mtp.*` and DeepSeek-V4's `mtp.0.*` hold a MoE layer of their own, which no
    token reaches in transformers: collect says so, select keeps the router view's medoids there
    (recorded in the plan), and the proxy's MTP layer holds those experts."""
    orig, stats, _, plan, proxy = hf_proxy(name)
    sidecar = json.loads(stats.with_suffix(".json").read_text())
    assert list(sidecar["unobserved_layers"]) == ["mtp.0"] and "mtp.0" not in sidecar["layers"]
    assert plan.unobserved == {"mtp.0": sidecar["unobserved_layers"]["mtp.0"]}
    kept = plan.kept("mtp.0")
    assert len(kept) == 4 and all(len(c.members) >= 1 for c in plan.layers["mtp.0"].clusters)
    source, got = hf_tensors(orig), hf_tensors(proxy)
    for j, e in enumerate(kept):
        assert torch.equal(got[key.format(e=j)], source[key.format(e=e)])
    assert key.format(e=4) not in got
