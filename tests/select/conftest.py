"""Fixtures for the select tests: small models with planted expert clusters.

Router weights live in a DictModelView with a hand-made ModelSpec; no real checkpoint needed.
"""

from __future__ import annotations

import pytest
import torch

from mcore_proxy.checkpoint.view import DictModelView
from mcore_proxy.select.synthetic import planted_stats
from mcore_proxy.mcore.spec import ModelSpec, expert_bias_name, router_weight_name


def build_planted_model(
    moe_layers=(1, 2),
    mtp_layers=1,
    num_experts=32,
    clusters=8,
    hidden=64,
    topk=2,
    num_groups=None,
    group_topk=None,
    iteration=100,
    **kwargs,
):
    """(view, stats, planted): layer 0 dense, `moe_layers` MoE, plus `mtp_layers` MTP layers."""
    spec = ModelSpec(
        num_layers=max(moe_layers) + 1,
        hidden_size=hidden,
        num_experts=num_experts,
        topk=topk,
        moe_layers=tuple(moe_layers),
        mtp_layers=mtp_layers,
        num_groups=num_groups,
        group_topk=group_topk,
        score_function="sigmoid",
        expert_bias=True,
    )
    stats, planted = planted_stats(
        spec.moe_layer_ids, topk=topk, num_experts=num_experts, clusters=clusters, hidden=hidden, **kwargs
    )
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


# -- real statistics written by the trace on real megatron-core models ---------------------------
# Three tokens per layer: 6 top-2 selections over 8 experts (or 12 top-4 over 16), so every
# layer has never-selected experts and most expert pairs never co-activate (their partners
# distance is exactly 0): the inputs on which K-Medoids used to stop short and dead experts used
# to displace live ones. The architectures are those of the fixture checkpoints named here.
SPARSE_TRACES = {"seq_tp2_pp2_ep2": dict(batch=1, seq=3), "deepseek_like_pp2_uneven": dict(batch=1, seq=3)}


@pytest.fixture(scope="session")
def sparse_traced(tmp_path_factory, megatron_ckpt):
    """sparse_traced(fixture name) -> (checkpoint folder, merged routing_stats.safetensors)
    traced (with saliency) by `mcore_proxy.trace` on that fixture's architecture, one rank."""
    from mcore_proxy.cli import main
    from mcore_proxy.testing.fixtures import FIXTURES
    from mcore_proxy.testing.trace_runs import TraceRun, run_traced

    out = tmp_path_factory.mktemp("sparse_trace")
    runs = {name: TraceRun(model=FIXTURES[name][0], saliency=True, **kw) for name, kw in SPARSE_TRACES.items()}
    folders = run_traced(runs, out)
    merged = {}
    for name, folder in folders.items():
        assert main(["stats", "merge", str(folder)]) == 0
        merged[name] = folder / "routing_stats.safetensors"

    def get(name):
        return megatron_ckpt(name)[0], merged[name]

    return get
