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


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("gate_mass", np.nan, r"layer 2 field gate_mass holds nan at \[3\], not a finite number"),
        ("proto_sum", np.inf, r"layer 2 field proto_sum holds inf at \[0, 3\], not a finite number"),
        ("saliency_sum", -np.inf, r"layer 2 field saliency_sum holds -inf"),
        ("freq", -4, r"layer 2 field freq holds -4, a negative count"),
        ("gate_mass", -0.5, r"layer 2 field gate_mass holds -0.5, a negative sum"),
        ("coact", 1 << 62, r"layer 2 field coact holds 4611686018427387904, a count above 2\*\*48"),
        ("tokens", -1, r"layer 2 field tokens holds -1, a negative count"),
    ],
)
def test_impossible_values_are_refused_naming_file_layer_and_field(stats_file, field, value, says):
    """NaN, inf, negative counts and counts that would wrap a sum never reach select (whole or streamed)."""
    tensors = load_file(str(stats_file))
    if field == "saliency_sum":
        tensors["layer.2.saliency_sum"] = np.zeros(32)
    array = tensors[f"layer.2.{field}"].copy()
    array.reshape(-1)[3 % array.size] = value
    tensors[f"layer.2.{field}"] = array
    save_file(tensors, str(stats_file))
    for stream in (False, True):
        with pytest.raises(StatsError, match=f"stats.safetensors: {says}"):
            stats = load_stats(stats_file, stream=stream)
            stats.layers["2"]  # streamed: the values are read (and judged) when the layer is
