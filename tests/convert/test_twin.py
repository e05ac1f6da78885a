"""The twin proof (convert/twin.py) of a discovered family: it passes where the record is right,
and fails where the record is wrong."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mcore_proxy.checkpoint.hf.config import HFConfig
from mcore_proxy.checkpoint.hf.descriptor import Router
from mcore_proxy.checkpoint.hf.discovery import discover
from mcore_proxy.convert.twin import TOLERANCE, prove, run_proof


@pytest.mark.parametrize("name", ["cohere2_moe", "hunyuan_v1_moe", "exaone_moe"])
def test_the_proof_passes_and_could_have_failed(hf_model, name):
    config = HFConfig.load(hf_model(name))
    discover(config)
    proof = prove(config.architecture())
    assert proof.passed and proof.max_abs_diff <= TOLERANCE and proof.effect > 1e-3, proof
    assert proof.experts == (8, 4) and "proven on a tiny twin" in proof.summary()


def test_a_wrong_record_fails_its_proof(hf_model):
    """EXAONE-MoE selects by sigmoid score plus a selection bias [E]. A record that does not know the
    bias cannot read the twin: the bias is neither pruned nor copied, so no proxy is made from it."""
    found = discover(HFConfig.load(hf_model("exaone_moe")))
    family = found.family
    unread = dataclasses.replace(family, router=Router(family.router.weight))
    proof = run_proof(dataclasses.replace(found, family=unread))
    assert not proof.passed and "could not be pruned and loaded" in proof.why, proof
    assert "e_score_correction_bias" in proof.why and "twin proof failed" in proof.summary()


def test_a_twin_that_cannot_run_small_keeps_the_sources_head_dim():
    """GLM-4.5V's text model splits its rotary dimensions [8, 12, 12], sized for head_dim 128: the
    twin's head_dim of 16 cannot run, so discovery retries with the source's own head_dim and the
    family is proven; a config that gives no head_dim is refused in one sentence."""
    import transformers

    from mcore_proxy.checkpoint.hf.discovery import NotDiscovered

    data = transformers.CONFIG_MAPPING["glm4v_moe"]().to_dict()
    arch = "Glm4vMoeForConditionalGeneration"

    def config(head_dim):
        text = dict(data["text_config"], head_dim=head_dim)
        return HFConfig(dict(data, text_config=text, model_type="glm4v_moe", architectures=[arch]), Path("c.json"))

    found = discover(config(128))
    assert found.twin["text_config"]["head_dim"] == 128 and found.twin["text_config"]["hidden_size"] == 64
    proof = run_proof(found)
    assert proof.passed and proof.effect > 1e-3, proof
    with pytest.raises(NotDiscovered, match="could not run small in transformers"):
        discover(config(None))
