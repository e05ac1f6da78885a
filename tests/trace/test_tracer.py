"""Tracer rules without megatron: recomputation, TP duplicates, step counting, atomic flushes."""

import json

import numpy as np
import pytest
import torch
import torch.utils.checkpoint

from mcore_proxy.core.stats import load_stats
from mcore_proxy.trace.tracer import DEDUPE_RULE, RouterInfo, Tracer

E, H, K = 4, 3, 2


def router_call(tracer, info, hidden):
    """A stand-in router: top-k of a fixed projection; records like the megatron hook does."""
    logits = hidden @ torch.arange(E * H, dtype=torch.float32).reshape(H, E).sin()
    top, idx = logits.softmax(-1).topk(K, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, idx, top)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    tracer.record(info, hidden, probs, routing_map)
    return hidden * probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("reentrant", [True, False])
def test_recomputation_in_backward_is_not_counted_twice(tmp_path, reentrant):
    tracer = Tracer(tmp_path, rank=0)
    info = RouterInfo("0", E, K)
    hidden = torch.randn(10, H, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda h: router_call(tracer, info, h), hidden, use_reentrant=reentrant)
    out.sum().backward()
    stats = tracer.stats()
    assert stats.layers["0"].tokens == 10
    assert stats.meta["recompute_calls_skipped"] == 1
    assert hidden.grad is not None


def test_direct_double_call_outside_backward_counts_twice(tmp_path):
    """The rule is 'skip calls made inside backward', not 'deduplicate identical inputs'."""
    tracer = Tracer(tmp_path, rank=0)
    hidden = torch.randn(10, H)
    for _ in range(2):
        router_call(tracer, RouterInfo("0", E, K), hidden)
    assert tracer.stats().layers["0"].tokens == 20


def test_tensor_parallel_duplicate_rank_records_nothing(tmp_path):
    tracer = Tracer(tmp_path, rank=1)
    router_call(tracer, RouterInfo("0", E, K, counts=False), torch.randn(10, H))
    assert tracer.stats() is None
    assert tracer.close() is None
    assert list(tmp_path.iterdir()) == []


def test_flush_every_n_steps_holds_whole_forward_passes(tmp_path):
    tracer = Tracer(tmp_path, flush_every=2, rank=3, meta={"model_layers": ["0", "1"]})
    path = tmp_path / "rank00003.safetensors"
    hidden = torch.randn(6, H)
    for step in range(1, 6):
        for layer in ("0", "1"):
            router_call(tracer, RouterInfo(layer, E, K), hidden)
        if step <= 2:
            assert not path.exists()
        if step in (3, 4):  # written when step 3 began: steps 1-2, both layers complete
            s = load_stats(path)
            assert s.meta["steps"] == 2 and s.layers["1"].tokens == 12
    s = load_stats(path)
    assert s.meta["steps"] == 4 and s.layers["0"].tokens == 24  # flushed when step 5 began
    assert tracer.close() == path
    s = load_stats(path)
    assert s.meta["steps"] == 5 and s.layers["0"].tokens == s.layers["1"].tokens == 30
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["rank"] == 3 and meta["dedupe"] == DEDUPE_RULE and meta["model_layers"] == ["0", "1"]
    assert meta["topk"] == K and meta["num_experts"] == E
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]
    router_call(tracer, RouterInfo("0", E, K), hidden)  # after close: ignored
    assert load_stats(path).layers["0"].tokens == 30


def test_saliency_rows_are_summed_per_local_expert(tmp_path):
    tracer = Tracer(tmp_path, rank=0)
    router_call(tracer, RouterInfo("0", E, K), torch.randn(5, H))
    out = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]])  # norms 5, 1, 10
    tracer.record_saliency("0", torch.tensor([2, 3]), out, torch.tensor([2, 1]))
    tracer.record_saliency("7", torch.tensor([2, 3]), out, torch.tensor([2, 1]))  # unknown layer
    np.testing.assert_allclose(tracer.stats().layers["0"].saliency_sum, [0, 0, 6, 10])
    assert set(tracer.stats().layers) == {"0"}
