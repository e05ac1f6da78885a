import pytest

from mcore_proxy.select import run_selection
from mcore_proxy.select.report import cluster_order, summary_table, write_report

K = 8


def test_summary_table_lists_every_layer_and_the_mean(default_model):
    view, stats, _ = default_model
    plan = run_selection(view, stats, K)[0]
    text = summary_table(plan)
    lines = text.splitlines()
    assert "keep K=8 of E=32" in lines[0]
    assert lines[1].split() == ["layer", "kept", "tokens", "gate", "mass", "dead", "dead", "kept"]
    assert [ln.split()[0] for ln in lines[2:]] == ["1", "2", "mtp.0", "mean"]
    tok, mass = plan.mean_coverage()
    assert lines[-1].split() == ["mean", "8", f"{tok:.3f}", f"{mass:.3f}"]


def test_cluster_order_puts_the_kept_expert_first(default_model):
    view, stats, _ = default_model
    lp = run_selection(view, stats, K)[0].layers["1"]
    order = cluster_order(lp, 32)
    assert sorted(order) == list(range(32))
    assert order[0] == lp.clusters[0].representative


def test_write_report_draws_matrices_coverage_and_summary(tmp_path, default_model):
    pytest.importorskip("matplotlib")
    view, stats, _ = default_model
    plan, details = run_selection(view, stats, K)
    base = {m: run_selection(view, stats, K, method=m)[0] for m in ("frequency", "random")}
    files = write_report(tmp_path / "rep", plan, details, base)
    names = sorted(p.name for p in files)
    assert names == [
        "coverage.png",
        "distance_layer_1.png",
        "distance_layer_2.png",
        "distance_layer_mtp.0.png",
        "summary.txt",
    ]
    for p in files:
        assert p.stat().st_size > 0
    assert (tmp_path / "rep" / "coverage.png").read_bytes()[:4] == b"\x89PNG"
    summary = (tmp_path / "rep" / "summary.txt").read_text()
    assert "frequency" in summary and "random" in summary


def test_ranking_methods_get_no_matrix_picture(tmp_path, default_model):
    pytest.importorskip("matplotlib")
    view, stats, _ = default_model
    plan, details = run_selection(view, stats, K, method="frequency")
    files = write_report(tmp_path, plan, details, {})
    assert sorted(p.name for p in files) == ["coverage.png", "summary.txt"]


def test_heatmap_ticks_are_expert_ids_in_cluster_order(default_model):
    from mcore_proxy.select.report import MAX_LABELLED, expert_ticks

    view, stats, _ = default_model
    lp = run_selection(view, stats, K)[0].layers["1"]
    order = cluster_order(lp, 32)
    pos, labels = expert_ticks(order, lp)
    assert pos == list(range(32)) and labels == [str(e) for e in order]  # ids, not positions
    big = list(range(MAX_LABELLED + 8))
    pos, labels = expert_ticks(big[::-1], lp)  # too many: kept ones
    assert sorted(int(x) for x in labels) == sorted(lp.kept)


def test_summary_explains_coverage_against_frequency(tmp_path, default_model):
    pytest.importorskip("matplotlib")
    view, stats, _ = default_model
    plan, details = run_selection(view, stats, K)
    freq = run_selection(view, stats, K, method="frequency")[0]
    write_report(tmp_path, plan, details, {"frequency": freq})
    text = (tmp_path / "summary.txt").read_text()
    tok, freq_tok = plan.mean_coverage()[0], freq.mean_coverage()[0]
    assert tok <= freq_tok  # frequency is the ceiling of token coverage
    assert (
        f"no set of {K} covers more routed tokens than its {freq_tok:.3f}; multiview covers "
        f"{tok:.3f} because it keeps one expert per cluster"
    ) in text
