"""The twin proof (convert/twin.py) of a discovered family: it passes where the record is right,
and fails where the record is wrong."""

from __future__ import annotations

import dataclasses

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
