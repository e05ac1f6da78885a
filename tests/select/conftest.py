"""Fixtures for the select tests: small models with planted expert clusters.

Router weights live in a DictModelView with a hand-made ModelSpec; no real checkpoint needed.
"""
from __future__ import annotations

import pytest
import torch

from mcore_proxy.checkpoint.view import DictModelView
from mcore_proxy.select.synthetic import planted_stats
from mcore_proxy.spec import ModelSpec, expert_bias_name, router_weight_name


def build_planted_model(moe_layers=(1, 2), mtp_layers=1, num_experts=32, clusters=8, hidden=64,
                        topk=2, num_groups=None, group_topk=None, iteration=100, **kwargs):
    """(view, stats, planted): layer 0 dense, `moe_layers` MoE, plus `mtp_layers` MTP layers."""
    spec = ModelSpec(num_layers=max(moe_layers) + 1, hidden_size=hidden, num_experts=num_experts,
                     topk=topk, moe_layers=tuple(moe_layers), mtp_layers=mtp_layers,
                     num_groups=num_groups, group_topk=group_topk, score_function="sigmoid",
                     expert_bias=True)
    stats, planted = planted_stats(spec.moe_layer_ids, topk=topk, num_experts=num_experts,
                                   clusters=clusters, hidden=hidden, **kwargs)
    tensors = {"embedding.word_embeddings.weight": torch.zeros(8, hidden)}
    for lid, p in planted.items():
        tensors[router_weight_name(lid)] = torch.from_numpy(p.router).to(torch.bfloat16)
        tensors[expert_bias_name(lid)] = torch.zeros(num_experts, dtype=torch.float32)
    return DictModelView(tensors, spec, iteration=iteration), stats, planted


@pytest.fixture
def planted_model():
    """Factory: planted_model(**kwargs) -> (view, stats, planted); see build_planted_model."""
    return build_planted_model


@pytest.fixture(scope="module")
def default_model():
    """One shared planted model (partners reading, E=32, 8 clusters, top-2) for read-only use."""
    return build_planted_model()
