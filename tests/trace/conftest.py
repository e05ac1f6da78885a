"""Fixtures of the trace tests: synthetic rank files, and traced real megatron-core runs on CPU
(spawned gloo ranks, cached for the session because each rank costs seconds of imports)."""

from __future__ import annotations

import numpy as np
import pytest

from mcore_proxy.core.stats import LayerStats, RoutingStats, save_stats
from mcore_proxy.functional.model import Layout
from mcore_proxy.testing.trace_runs import TraceRun, run_traced


def synthetic_layer(e=4, h=3, tokens=10, topk=2, seed=0) -> LayerStats:
    rng = np.random.default_rng(seed)
    chosen = np.stack([rng.choice(e, topk, replace=False) for _ in range(tokens)])
    onehot = np.zeros((tokens, e), np.int64)
    np.put_along_axis(onehot, chosen, 1, axis=1)
    hidden = rng.normal(size=(tokens, h))
    return LayerStats(
        tokens, onehot.sum(0), onehot.sum(0) * 0.5, onehot.T @ onehot, onehot.T.astype(np.float64) @ hidden
    )


def write_rank_file(
    folder, rank, layers=("0", "1"), *, e=4, h=3, topk=2, world_size=2, model_layers=("0", "1"), seed=None
):
    stats = RoutingStats(
        {lid: synthetic_layer(e, h, topk=topk, seed=rank if seed is None else seed) for lid in layers},
        topk,
        {
            "rank": rank,
            "world_size": world_size,
            "ranks_merged": 1,
            "model_layers": list(model_layers) if model_layers is not None else None,
        },
    )
    return save_stats(stats, folder / f"rank{rank:05d}.safetensors")


@pytest.fixture
def make_rank_file():
    """Factory: make_rank_file(folder, rank, layers=..., e=, h=, topk=, world_size=, model_layers=)."""
    return write_rank_file


@pytest.fixture
def make_layer():
    """Factory: make_layer(e=4, h=3, tokens=10, topk=2, seed=0) -> consistent LayerStats."""
    return synthetic_layer


@pytest.fixture
def rank_files(tmp_path):
    """A folder with two consistent rank files (data-parallel ranks of one run)."""
    folder = tmp_path / "run"
    write_rank_file(folder, 0)
    write_rank_file(folder, 1)
    return folder


# -- real megatron-core runs ---------------------------------------------------------------------
# Grouped by layout: the runs of a group share one set of spawned ranks.
RUNS = {
    "single": {  # 1 rank
        "ref": TraceRun(saliency=True),
        "recompute": TraceRun(recompute=True),  # training fwd + bwd, full recompute
        "padded": TraceRun(pad_from=12),  # positions 12..15 are padding
        "short_mtp": TraceRun(seq=12, mtp_layers=1),  # positions 0..11, plus an MTP layer
    },
    "tp2ep2": {"tp2ep2": TraceRun(layout=Layout(tp=2, ep=2), saliency=True)},  # 4 ranks, DP 2
    "tp2ep2_sp": {"tp2ep2_sp": TraceRun(layout=Layout(tp=2, ep=2), sequence_parallel=True)},
    "pp2ep2_grouped": {
        "pp2ep2_grouped": TraceRun(layout=Layout(pp=2, ep=2, grouped=True), saliency=True)
    },  # 4 ranks, DP 2
    "pp2vpp2": {"pp2vpp2": TraceRun(layout=Layout(pp=2), vpp=2)},  # 2 ranks x 2 model chunks
}
GROUP_OF = {name: group for group, runs in RUNS.items() for name in runs}


@pytest.fixture(scope="session")
def traced(tmp_path_factory):
    """traced(name) -> folder of that run; its layout group runs once per session."""
    done = {}

    def get(name):
        group = GROUP_OF[name]
        if group not in done:
            done[group] = run_traced(RUNS[group], tmp_path_factory.mktemp(f"trace_{group}"))
        return done[group][name]

    return get
