"""Exactness on real megatron-core models: the same weights and tokens at TP=1/EP=1/PP=1,
TP=2/EP=2 (4 gloo ranks, with and without sequence parallelism), PP=2 x EP=2 with GroupedMLP,
PP=2 with 2 virtual stages, activation recomputation, padding and MTP give the same merged
statistics.

Counts must be identical; sums allclose (reduction order differs between layouts)."""

import numpy as np
import pytest
import torch

from mcore_proxy.testing.trace_runs import replica_logits
from mcore_proxy.trace.cli import merge_folder
from mcore_proxy.engines.megatron import layer_id

pytestmark = pytest.mark.megatron  # real megatron-core models (slow)

TOKENS = 4 * 16  # batch x sequence of every run
TOPK = 2


def assert_same_stats(a, b, layers=None, saliency=False):
    for lid in layers or a.layer_ids:
        x, y = a.layers[lid], b.layers[lid]
        assert x.tokens == y.tokens, lid
        np.testing.assert_array_equal(x.freq, y.freq, err_msg=lid)
        np.testing.assert_array_equal(x.coact, y.coact, err_msg=lid)
        np.testing.assert_allclose(x.gate_mass, y.gate_mass, rtol=1e-5, atol=1e-5, err_msg=lid)
        np.testing.assert_allclose(x.proto_sum, y.proto_sum, rtol=1e-4, atol=1e-4, err_msg=lid)
        if saliency:
            np.testing.assert_allclose(x.saliency_sum, y.saliency_sum, rtol=1e-4, atol=1e-4, err_msg=lid)


@pytest.fixture(scope="module")
def ref(traced):
    return merge_folder(traced("ref"))


def test_layer_ids_from_megatron_layer_numbers():
    assert layer_id(1, 4) == "0" and layer_id(4, 4) == "3"
    assert layer_id(5, 4) == "mtp.0" and layer_id(6, 4) == "mtp.1"
    with pytest.raises(RuntimeError, match="no layer_number"):
        layer_id(None, 4)


def test_reference_run_is_consistent(ref, traced):
    assert ref.layer_ids == ["0", "1", "2", "3"] and ref.topk == TOPK
    assert ref.meta["model_layers"] == ["0", "1", "2", "3"]
    assert ref.meta["source"]["framework"] == "megatron-core"
    for s in ref.layers.values():
        assert s.tokens == TOKENS
        assert s.freq.sum() == TOKENS * TOPK
        np.testing.assert_array_equal(np.diag(s.coact), s.freq)
        np.testing.assert_allclose(s.gate_mass.sum(), TOKENS, rtol=1e-6)  # softmax over the top-k
        assert (s.freq > 0).sum() >= 4  # routing is diverse
        assert s.saliency_sum is not None and (s.saliency_sum[s.freq > 0] > 0).all()


@pytest.mark.parametrize("name, ranks", [("tp2ep2", 4), ("tp2ep2_sp", 4), ("pp2ep2_grouped", 4), ("pp2vpp2", 2)])
def test_parallel_layouts_match_single_rank(ref, traced, name, ranks):
    folder = traced(name)
    merged = merge_folder(folder)
    torch.testing.assert_close(replica_logits(folder), replica_logits(traced("ref")), rtol=1e-4, atol=1e-4)
    assert merged.layer_ids == ref.layer_ids
    assert merged.meta["world_size"] == ranks
    assert_same_stats(ref, merged, saliency=name == "pp2ep2_grouped")
    for s in merged.layers.values():
        assert s.freq.sum() == s.tokens * TOPK
    files = sorted(p.name for p in folder.glob("rank*.safetensors"))
    if name == "tp2ep2":  # TP w/o SP: only TP rank 0 of each data-parallel replica records
        assert files == ["rank00000.safetensors", "rank00002.safetensors"]
        assert all(s.saliency_sum is None for s in merged.layers.values())  # ETP=2: not exact
    else:  # SP: every rank has its own tokens; PP: each stage its layers
        assert len(files) == ranks


def test_pipeline_stages_hold_their_global_layers(traced):
    from mcore_proxy.core.stats import load_stats

    def layers(name):
        return sorted(tuple(load_stats(p).layer_ids) for p in traced(name).glob("rank*.safetensors"))

    assert layers("pp2ep2_grouped") == [("0", "1"), ("0", "1"), ("2", "3"), ("2", "3")]
    assert layers("pp2vpp2") == [("0", "2"), ("1", "3")]  # interleaved: chunk v of rank r


def test_recomputation_counts_each_token_once(ref, traced):
    """Full recompute (uniform, 1 layer) in a training forward + backward: the router runs twice
    per layer, the statistics equal those of the plain forward."""
    merged = merge_folder(traced("recompute"))
    assert merged.meta["recompute_calls_skipped"] == 4
    assert_same_stats(ref, merged)


def test_padding_tokens_are_excluded(traced):
    """Causal attention: positions 0..11 of a 16-token sequence whose last 4 positions are padding
    route exactly like a 12-token sequence."""
    padded, short = merge_folder(traced("padded")), merge_folder(traced("short_mtp"))
    for s in padded.layers.values():
        assert s.tokens == 4 * 12 and s.freq.sum() == 4 * 12 * TOPK
    assert_same_stats(short, padded, layers=["0", "1", "2", "3"])


def test_mtp_layer_is_traced_as_mtp_0(traced):
    short = merge_folder(traced("short_mtp"))
    assert short.layer_ids == ["0", "1", "2", "3", "mtp.0"]
    assert short.meta["model_layers"] == short.layer_ids
    assert short.layers["mtp.0"].tokens == 4 * 12
