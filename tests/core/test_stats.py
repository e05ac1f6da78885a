"""Routing-statistics files read whole or one layer at a time (stats.py)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mcore_proxy.core.errors import StatsError
from mcore_proxy.select.synthetic import planted_layer
from mcore_proxy.core.stats import RoutingStats, StreamedLayers, load_stats, save_stats


@pytest.fixture
def stats_file(tmp_path):
    layers = {lid: planted_layer(32, 4, 16, 2, seed=i).stats for i, lid in enumerate(("1", "2", "mtp.0"))}
    return save_stats(RoutingStats(layers, topk=2, meta={"source": "test"}), tmp_path / "stats.safetensors")


def test_streamed_layers_equal_the_whole_file_and_are_read_when_asked(stats_file):
    whole, streamed = load_stats(stats_file), load_stats(stats_file, stream=True)
    assert isinstance(streamed.layers, StreamedLayers) and not isinstance(whole.layers, StreamedLayers)
    assert streamed.layer_ids == whole.layer_ids and streamed.topk == whole.topk
    assert (streamed.num_experts, streamed.hidden_size) == (whole.num_experts, whole.hidden_size) == (32, 16)
    for lid in whole.layer_ids:
        a, b = whole.layers[lid], streamed.layers[lid]
        assert a.tokens == b.tokens
        for name in ("freq", "gate_mass", "coact", "proto_sum"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (lid, name)
    stats_file.unlink()  # nothing was kept: a layer asked for now is read from the missing file
    with pytest.raises(StatsError, match="cannot be read any more"):
        streamed.layers["1"]


def test_a_field_of_the_wrong_shape_is_refused_from_the_header(stats_file):
    tensors = load_file(str(stats_file))
    tensors["layer.2.coact"] = tensors["layer.2.coact"][:, :31].copy()
    save_file(tensors, str(stats_file))
    with pytest.raises(StatsError, match=r"stats.safetensors: layer 2 field coact has shape \[32, 31\]"):
        load_stats(stats_file, stream=True)
    with pytest.raises(StatsError, match="coact"):
        load_stats(stats_file)
