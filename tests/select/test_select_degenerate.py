"""Issue 16 items 1-2 on real inputs: fixture checkpoints written by megatron-core and sparse
statistics written by the trace (many never-selected experts, most pairs never co-activated).

Every method and K must keep exactly K distinct experts per layer, and an expert no token
selected is kept only when fewer than K (per routing group) were selected."""

import itertools
import json

import numpy as np
import pytest

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.select import METHODS, VIEW_METHODS, load_plan, run_selection
from mcore_proxy.select import cluster
from mcore_proxy.select.report import summary_table
from mcore_proxy.core.stats import load_stats

pytestmark = pytest.mark.megatron
FLAT, GROUPED = "seq_tp2_pp2_ep2", "deepseek_like_pp2_uneven"


def live_counts(stats):
    return {lid: int((s.freq > 0).sum()) for lid, s in stats.layers.items()}


def test_the_traced_statistics_are_degenerate(sparse_traced):
    # the preconditions that make the tests below bite: zero co-activation pairs, dead
    # experts in every layer, layers with fewer live experts than K=4 and layers with more
    stats = load_stats(sparse_traced(FLAT)[1])
    for s in stats.layers.values():
        off = s.coact[np.triu_indices(8, 1)]
        assert (off == 0).sum() >= 20 and (s.freq == 0).any()
    live = live_counts(stats).values()
    assert min(live) < 4 < max(live)


@pytest.mark.parametrize("mode", ["partners", "substitutes"])
def test_coact_alone_keeps_k_at_every_k_through_the_cli(sparse_traced, tmp_path, mode):
    ckpt, stats = sparse_traced(FLAT)
    for k in range(2, 8):
        out = tmp_path / f"plan_{k}.json"
        assert (
            main(
                [
                    "select",
                    "--ckpt",
                    ckpt,
                    "--stats",
                    stats,
                    "-k",
                    k,
                    "--method",
                    "coact",
                    "--coact-mode",
                    mode,
                    "-o",
                    out,
                ]
            )
            == 0
        )
        plan = load_plan(out)
        assert all(len(set(plan.kept(lid))) == k for lid in plan.layer_ids)


@pytest.mark.parametrize("fixture, ks", [(FLAT, (2, 3, 4, 6, 7)), (GROUPED, (8, 12))])
def test_every_method_keeps_k_distinct_and_live_before_dead(sparse_traced, fixture, ks):
    ckpt, stats_path = sparse_traced(fixture)
    view, stats = open_checkpoint(ckpt), load_stats(stats_path)
    groups = np.arange(16).reshape(4, 4) if fixture == GROUPED else np.arange(8)[None]
    variants = [
        (m, dict(coact_mode=mode))
        for m in METHODS
        for mode in (("partners", "substitutes") if m in VIEW_METHODS else ("partners",))
    ]
    variants += [
        ("multiview", dict(representative="reconstruction")),
        ("multiview", dict(weight_search=True, representative="reconstruction")),
    ]
    for (method, options), k in itertools.product(variants, ks):
        plan = run_selection(view, stats, k, method=method, **options)[0]
        for lid, lp in plan.layers.items():
            freq = stats.layers[lid].freq
            assert len(set(lp.kept)) == k, (method, options, k, lid)
            for ids in groups:
                kept_here = [e for e in lp.kept if e in ids]
                live = [e for e in ids if freq[e] > 0]
                assert len(kept_here) == k // len(groups)
                # live before dead: all live kept, or only live kept
                assert set(live) <= set(kept_here) or set(kept_here) <= set(live), (
                    method,
                    options,
                    k,
                    lid,
                    live,
                    kept_here,
                )
            dead_kept = [e for e in lp.kept if freq[e] == 0]
            assert list(lp.dead_kept) == dead_kept
            assert bool(lp.dead_note) == bool(dead_kept)


def test_old_clustering_kept_dead_for_live_on_these_statistics(sparse_traced):
    # K-Medoids over all experts, as before the fix: clusters of dead experts each gave a
    # representative while live experts were dropped; the selection now keeps them
    ckpt, stats_path = sparse_traced(FLAT)
    view, stats = open_checkpoint(ckpt), load_stats(stats_path)
    k, displaced = 4, 0
    plan, details = run_selection(view, stats, k)
    for lid, s in stats.layers.items():
        c = cluster.kmedoids(details[lid].fused, k, seed=0, restarts=8)
        old = [rep for _, rep in cluster.representatives(c.labels, c.medoids, s.freq)]
        live = int((s.freq > 0).sum())
        displaced += sum(s.freq[old] == 0) - max(0, k - live)
        assert len(plan.layers[lid].dead_kept) == max(0, k - live)
    assert displaced > 0


def test_plan_and_summary_say_how_many_dead_were_kept_and_why(sparse_traced, tmp_path, capsys):
    ckpt, stats_path = sparse_traced(FLAT)
    stats = load_stats(stats_path)
    out = tmp_path / "plan.json"
    assert main(["select", "--ckpt", str(ckpt), "--stats", str(stats_path), "-k", "6", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    layers = json.loads(out.read_text())["layers"]
    short = {lid: n for lid, n in live_counts(stats).items() if n < 6}
    assert short, "the statistics should have a layer with fewer than 6 live experts"
    for lid, entry in layers.items():
        want = 6 - short.get(lid, 6)
        assert entry["dead_kept"]["count"] == want
        if want:
            assert f"only {short[lid]} of 8 experts were selected by any token" in entry["dead_kept"]["why"]
            assert f"layer {lid}: {want} never-selected expert(s) kept" in printed
    assert summary_table(load_plan(out)).count("never-selected expert(s) kept") == len(short)
