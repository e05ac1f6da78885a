"""`mcore-proxy fidelity`: the metrics by their definitions, an original against a proxy that
equals the original with its gates restricted to the kept experts (perfect), a real proxy (what must and must
not be 1), and a Megatron checkpoint measured through its HF conversion."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_proxy.cli import main
from mcore_proxy.hf.calibration import data_batches, load_processor
from mcore_proxy.fidelity.measure import compare_models, gate_mass_share, measure, next_token_kl, top1
from mcore_proxy.hf.models import load_model, restrict_gates
from mcore_proxy.testing.hf_fixtures import calibration_jsonl


def test_metrics_by_definition():
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    experts = torch.tensor([[4, 0, 2], [1, 3, 0]])
    kept = torch.tensor([True, False, True, False, False])
    torch.testing.assert_close(gate_mass_share(weights, experts, kept), torch.tensor([0.5, 0.3]))
    assert top1(weights, experts).tolist() == [4, 3]
    a, b = torch.randn(5, 11), torch.randn(5, 11)
    expected = torch.nn.functional.kl_div(
        torch.log_softmax(b, -1), torch.log_softmax(a, -1), log_target=True, reduction="none"
    ).sum(-1)
    torch.testing.assert_close(next_token_kl(a, b), expected.double(), rtol=1e-6, atol=1e-6)  # expected in fp32
    assert next_token_kl(a, a).abs().max() < 1e-12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return calibration_jsonl(tmp_path_factory.mktemp("fidelity") / "eval.jsonl", records=12, seed=5)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_a_proxy_is_perfect_against_the_restricted_original_and_measurably_not_against_the_original(
    hf_proxy, data, tmp_path, capsys, name
):
    orig, _, plan_path, plan, proxy = hf_proxy(name)
    # the reference a correct proxy reproduces: the original with its gates restricted to the kept experts
    original, pruned = load_model(orig), load_model(proxy)
    with restrict_gates(original, plan):
        batches = data_batches(data, orig, 128, 8, 64)
        perfect = compare_models(original, pruned, plan, batches, progress=False)
    assert perfect["next_token_kl"] < 1e-9 and perfect["next_token_top1_agreement"] == 1.0
    assert all(abs(c - 1) < 1e-5 for c in perfect["hidden_cosine"])
    assert all(m["gate_mass_share"] == 1.0 and m["top1_routing_agreement"] == 1.0 for m in perfect["moe_layers"])

    out = tmp_path / "report"
    argv = ["fidelity", "--orig", str(orig), "--proxy", str(proxy), "--plan", str(plan_path), "--data", str(data)]
    argv += ["-o", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "fidelity.json").read_text())
    assert (out / "fidelity.png").stat().st_size > 10_000
    if name == "qwen3_moe":  # an existing report is refused without --force, replaced with it
        argv.append("--json")
        assert main(argv) == 2 and json.loads((out / "fidelity.json").read_text()) == report
        capsys.readouterr()
        assert main(argv + ["--force"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["format"] == "mcore-proxy-fidelity/1" and doc["tokens"] == report["tokens"]
        assert doc["next_token_kl"] == pytest.approx(report["next_token_kl"], rel=1e-6)
    assert report["tokens"] == perfect["tokens"] > 100
    first = report["moe_layers"][0]
    assert [m["kept"] for m in report["moe_layers"]] == [8] * len(report["moe_layers"])
    # layer 0 is dense with the same weights: identical hidden states; the first MoE layer sees
    # the same input, so its gate-mass share is the plan's coverage of the original's routing
    assert abs(report["hidden_cosine"][0] - 1) < 1e-6 and report["hidden_cosine"][1] < 1 - 1e-4
    assert 0.3 < first["gate_mass_share"] < 1 and 0 < first["top1_routing_agreement"] < 1
    assert 0 < report["next_token_kl"] and report["next_token_top1_agreement"] < 1


def test_megatron_original_is_measured_through_its_hf_conversion(hf_proxy, data, tmp_path):
    orig, _, plan, _, proxy = hf_proxy("qwen3_moe")
    legacy = tmp_path / "legacy"
    assert main(["convert", str(orig), "-o", str(legacy), "--format", "legacy", "--target-tp", "2"]) == 0
    a, b = measure(orig, proxy, plan, data, progress=False), measure(legacy, proxy, plan, data, progress=False)
    for key in ("next_token_kl", "next_token_top1_agreement"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7)
    assert [m["gate_mass_share"] for m in b["moe_layers"]] == pytest.approx(
        [m["gate_mass_share"] for m in a["moe_layers"]]
    )


def test_a_plan_of_another_model_is_refused(hf_proxy, data, tmp_path, capsys):
    orig, _, _, _, proxy = hf_proxy("qwen3_moe")
    other = hf_proxy("deepseek_v3")[2]
    capsys.readouterr()  # the fixtures' own output when this test builds them (run alone)
    assert (
        main(["fidelity", "--orig", orig, "--proxy", proxy, "--plan", other, "--data", data, "-o", tmp_path / "r"]) == 2
    )
    err = capsys.readouterr().err
    assert str(other) in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_image_text_records_are_measured_with_their_image_tokens(hf_proxy, tmp_path):
    """Aria: the proxy equals the restricted original on an image's 4 tokens too, and differs from
    the unrestricted one."""
    import numpy as np
    from PIL import Image

    from mcore_proxy.testing.hf_fixtures import ARIA_IMAGE

    orig, _, plan_path, plan, proxy = hf_proxy("aria")
    Image.fromarray((np.random.default_rng(3).random((50, 70, 3)) * 255).astype("uint8")).save(tmp_path / "a.png")
    data = tmp_path / "eval.jsonl"
    image_text = f"the old stone {ARIA_IMAGE} under the moon"
    data.write_text(
        json.dumps({"text": image_text, "image": "a.png"}) + "\n" + json.dumps({"text": "a dog ran"}) + "\n"
    )
    original, pruned = load_model(orig), load_model(proxy)
    with restrict_gates(original, plan):
        perfect = compare_models(
            original, pruned, plan, data_batches(data, orig, 128, 8, 64, images=True), progress=False
        )
    assert perfect["next_token_kl"] < 1e-9 and perfect["next_token_top1_agreement"] == 1.0
    assert all(m["gate_mass_share"] == 1.0 for m in perfect["moe_layers"])
    report = measure(orig, proxy, plan_path, data, progress=False)
    words = load_processor(orig).tokenizer
    assert (
        report["tokens"]
        == perfect["tokens"]
        == len(words("a dog ran")["input_ids"]) + len(words(image_text)["input_ids"]) - 1 + 4
    )
    assert report["next_token_kl"] > 0
