"""LayerAccumulator against a per-token reference written the obvious way."""

import numpy as np
import pytest
import torch

from mcore_proxy.trace import accumulator
from mcore_proxy.trace.accumulator import LayerAccumulator, full_routing, routed_sum


def random_routing(tokens=40, experts=6, hidden=5, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(tokens, hidden, generator=g)
    scores = torch.randn(tokens, experts, generator=g).softmax(-1)
    top, idx = scores.topk(topk, dim=-1)
    probs = torch.zeros_like(scores).scatter(1, idx, top)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
    return hidden_states, probs, routing_map, top, idx


def per_token_reference(hidden, probs, routing_map, valid):
    e, h = routing_map.shape[1], hidden.shape[1]
    freq, gate = np.zeros(e, np.int64), np.zeros(e)
    coact, proto = np.zeros((e, e), np.int64), np.zeros((e, h))
    for t in range(hidden.shape[0]):
        if not valid[t]:
            continue
        chosen = [x for x in range(e) if routing_map[t, x]]
        for i in chosen:
            freq[i] += 1
            gate[i] += float(probs[t, i])
            proto[i] += hidden[t].double().numpy()
            for j in chosen:
                coact[i, j] += 1
    return int(valid.sum()), freq, gate, coact, proto


@pytest.mark.parametrize("with_padding", [False, True])
def test_sums_match_per_token_loop(with_padding):
    hidden, probs, routing_map, _, _ = random_routing()
    pad = torch.zeros(40, dtype=torch.bool)
    if with_padding:
        pad[::3] = True
    acc = LayerAccumulator(6, 5, "cpu")
    acc.add(hidden[:25], probs[:25], routing_map[:25], pad[:25] if with_padding else None)
    acc.add(hidden[25:], probs[25:], routing_map[25:], pad[25:] if with_padding else None)
    s = acc.to_layer_stats()
    tokens, freq, gate, coact, proto = per_token_reference(hidden, probs, routing_map, ~pad)
    assert s.tokens == tokens
    np.testing.assert_array_equal(s.freq, freq)
    np.testing.assert_array_equal(s.coact, coact)
    np.testing.assert_array_equal(np.diag(s.coact), s.freq)
    assert s.freq.sum() == tokens * 2
    np.testing.assert_allclose(s.gate_mass, gate, rtol=1e-6)
    np.testing.assert_allclose(s.proto_sum, proto, rtol=1e-5, atol=1e-6)
    assert s.freq.dtype == np.int64 and s.coact.dtype == np.int64 and s.proto_sum.dtype == np.float64


def test_sequence_batch_shapes_and_bf16_hidden():
    hidden, probs, routing_map, _, _ = random_routing(tokens=12)
    acc = LayerAccumulator(6, 5, "cpu")
    pad = torch.zeros(4, 3, dtype=torch.bool)
    pad[3] = True  # [s, b]: last position of every sequence
    acc.add(hidden.view(4, 3, 5).bfloat16(), probs.bfloat16(), routing_map, pad)
    s = acc.to_layer_stats()
    assert s.tokens == 9 and s.freq.sum() == 18
    ref = per_token_reference(hidden.bfloat16().float(), probs, routing_map, ~pad.reshape(-1))
    np.testing.assert_allclose(s.proto_sum, ref[4], rtol=1e-6)


def test_compact_scores_indices_format_of_older_cores():
    hidden, probs, routing_map, top, idx = random_routing()
    dense = LayerAccumulator(6, 5, "cpu")
    dense.add(hidden, probs, routing_map)
    compact = LayerAccumulator(6, 5, "cpu")
    compact.add(hidden, *full_routing(top, idx, 6))
    a, b = dense.to_layer_stats(), compact.to_layer_stats()
    np.testing.assert_array_equal(a.coact, b.coact)
    np.testing.assert_allclose(a.gate_mass, b.gate_mass)


def test_saliency_is_added_per_global_expert():
    acc = LayerAccumulator(6, 5, "cpu")
    assert acc.to_layer_stats().saliency_sum is None
    acc.add_saliency(torch.tensor([3, 4, 5]), torch.tensor([1.0, 0.0, 2.5], dtype=torch.float64))
    np.testing.assert_array_equal(acc.to_layer_stats().saliency_sum, [0, 0, 0, 1.0, 0, 2.5])


def test_routed_sum_falls_back_to_fp32_where_the_fp32_output_gemm_is_missing(monkeypatch):
    """CPU has no `mm(..., out_dtype=float32)`; pretend it might, as on a GPU: the first call
    falls back, remembers, and the result is the exact fp32 product either way."""
    monkeypatch.setattr(accumulator, "_FP32_OUT_GEMM", {("cpu", torch.bfloat16): True})
    hidden, _, routing_map, _, _ = random_routing(tokens=600, hidden=8)  # > one CPU slice
    mask, h = routing_map.float(), hidden.bfloat16()
    expected = mask.t().double() @ h.double()
    for _ in range(2):
        out = routed_sum(mask, h)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert accumulator._FP32_OUT_GEMM[("cpu", torch.bfloat16)] is False
