"""The twin proof (convert/twin.py) of a discovered family: it passes where pruning is exact, it
can fail, and convert refuses a checkpoint whose family's twin disagrees."""

from __future__ import annotations

import json

import pytest

from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.discovery import discover
from mcore_proxy.cli import main
from mcore_proxy.convert.twin import TOLERANCE, _build, fill, prove, twin_plan


@pytest.mark.parametrize("name", ["cohere2_moe", "hunyuan_v1_moe", "exaone_moe"])
def test_the_proof_passes_and_could_have_failed(hf_model, name):
    config = HFConfig.load(hf_model(name))
    discover(config)
    proof = prove(config.architecture())
    assert proof.passed and proof.max_abs_diff <= TOLERANCE and proof.effect > 1e-3, proof
    assert proof.experts == (8, 4) and "proven on a tiny twin" in proof.summary()


@pytest.fixture(scope="module")
def flint(tmp_path_factory):
    """A tiny Flint checkpoint (a family whose pruned twin differs from its restricted original at
    positions past its sliding window: not understood yet, and refused) and a plan for it."""
    import transformers

    data = transformers.CONFIG_MAPPING["flint"]().to_dict()
    found = discover(HFConfig(dict(data, architectures=["FlintForCausalLM"]), tmp_path_factory.mktemp("c") / "x"))
    root = tmp_path_factory.mktemp("flint")
    model = _build(found.twin, "FlintForCausalLM")
    fill(model, found.family)
    model.save_pretrained(root / "model")
    from mcore_proxy.checkpoint import open_checkpoint

    twin_plan(open_checkpoint(root / "model").spec).save(root / "plan.json")
    return root


def test_a_failing_proof_refuses_convert_and_inspect_reports_it(flint, capsys):
    assert main(["inspect", str(flint / "model"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["support"]["origin"] == "discovered" and not report["twin_proof"]["passed"]
    assert "twin proof failed: pruned twin differs" in report["twin_proof"]["summary"]
    out = flint / "proxy"
    code = main(["convert", str(flint / "model"), "--plan", str(flint / "plan.json"), "--format", "hf", "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and "FlintForCausalLM was discovered from transformers" in err, err
    assert "docs/families.md" in err
