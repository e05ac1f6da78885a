"""Plain-text summary of a plan and the optional picture report (`select --report DIR`).

`summary_table` is pure text; `write_report` imports matplotlib inside, because the trace side
runs where matplotlib is absent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from mcore_proxy.select.plan import SelectionPlan

log = logging.getLogger(__name__)

# what `write_report` writes into its folder (globs): the files a second report replaces
REPORT_FILES = ("distance_layer_*.png", "coverage.png", "summary.txt")


def summary_table(plan: SelectionPlan) -> str:
    """Per layer: kept count, token coverage, gate-mass coverage, dead experts (never selected)
    in the layer and kept; then the mean, and why any dead expert was kept."""
    lines = [
        f"method {plan.method}: keep K={plan.num_experts} of E={plan.source.num_experts} "
        f"experts in {len(plan.layers)} MoE layers (group policy "
        f"{plan.params.get('group_policy', 'none')})",
        f"{'layer':<8} {'kept':>5} {'tokens':>8} {'gate mass':>10} {'dead':>5} {'dead kept':>10}",
    ]
    for lid in plan.layer_ids:
        lp = plan.layers[lid]
        if lid in plan.unobserved:
            lines.append(f"{lid:<8} {len(lp.kept):>5}   no statistics: router-weight medoids ({plan.unobserved[lid]})")
            continue
        lines.append(
            f"{lid:<8} {len(lp.kept):>5} {lp.token_coverage:>8.3f} "
            f"{lp.gate_mass_coverage:>10.3f} {len(lp.never_selected):>5} {len(lp.dead_kept):>10}"
        )
    tok, mass = plan.mean_coverage()
    lines.append(f"{'mean':<8} {plan.num_experts:>5} {tok:>8.3f} {mass:>10.3f}")
    notes = [
        f"layer {lid}: {plan.layers[lid].dead_note} (kept dead: {list(plan.layers[lid].dead_kept)})"
        for lid in plan.layer_ids
        if plan.layers[lid].dead_kept
    ]
    if notes:
        lines += ["dead experts (never selected by any token) are kept only when fewer than K are live:"]
        lines += ["  " + n for n in notes]
    return "\n".join(lines)


def summary_dict(plan: SelectionPlan) -> dict:
    """The numbers of `summary_table` for `select --json` (coverage as shares in [0, 1])."""
    tok, mass = plan.mean_coverage()
    return {
        "method": plan.method,
        "num_experts": plan.num_experts,
        "source_experts": plan.source.num_experts,
        "group_policy": plan.params.get("group_policy"),
        "layers": {
            lid: {
                "kept": list(lp.kept),
                "token_coverage": lp.token_coverage,
                "gate_mass_coverage": lp.gate_mass_coverage,
                "never_selected": len(lp.never_selected),
                "dead_kept": list(lp.dead_kept),
                "dead_note": lp.dead_note,
            }
            for lid, lp in ((lid, plan.layers[lid]) for lid in plan.layer_ids)
        },
        "mean": {"token_coverage": tok, "gate_mass_coverage": mass},
    }


def coverage_note(plan: SelectionPlan, frequency: SelectionPlan) -> str:
    """Why the chosen method may cover fewer routed tokens than the frequency baseline."""
    tok, freq_tok = plan.mean_coverage()[0], frequency.mean_coverage()[0]
    return (
        f"Coverage against frequency: frequency keeps the {plan.num_experts} most selected "
        f"experts of each layer, so no set of {plan.num_experts} covers more routed tokens "
        f"than its {freq_tok:.3f}; {plan.method} covers {tok:.3f} because it keeps one expert "
        "per cluster of similar experts (diversity rather than the busiest experts): tokens "
        "whose experts were dropped are routed by the unchanged top-k rule to kept experts, "
        "and the clusters make those alike. Coverage measures how many selections survive, "
        "not how well the proxy computes (bench/RESULTS.md, quality section, compares "
        "accuracy and KL)."
    )


def cluster_order(layer_plan, num_experts: int) -> list[int]:
    """Experts ordered cluster by cluster (clusters in plan order, the kept expert first, then
    members by id); experts in no cluster go last."""
    order = []
    for c in layer_plan.clusters:
        order.append(c.representative)
        order.extend(m for m in c.members if m != c.representative)
    seen = set(order)
    return order + [e for e in range(num_experts) if e not in seen]


MAX_LABELLED = 64  # up to this many experts every tick is labelled with its id


def expert_ticks(order: list[int], layer_plan) -> tuple[list[int], list[str]]:
    """(positions, labels) of the ticks along a cluster-ordered axis: every expert's id when
    there are at most MAX_LABELLED experts, else the kept expert that opens each cluster."""
    kept = set(layer_plan.kept)
    if len(order) <= MAX_LABELLED:
        return list(range(len(order))), [str(e) for e in order]
    pos = [i for i, e in enumerate(order) if e in kept]
    return pos, [str(order[i]) for i in pos]


def _matrix_figure(lid: str, fused: np.ndarray, layer_plan, method: str):
    from matplotlib.figure import Figure

    E = fused.shape[0]
    order = cluster_order(layer_plan, E)
    side = min(12.0, max(6.4, 0.13 * E + 2.0))
    fig = Figure(figsize=(side + 1.4, side), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(fused[np.ix_(order, order)], cmap="viridis", interpolation="nearest", vmin=0.0)
    fig.colorbar(im, ax=ax, shrink=0.8, label="fused distance (weighted mean of views scaled to [0, 1]; 0 = alike)")
    edge = -0.5
    for c in layer_plan.clusters:  # cluster outlines along the diagonal
        size = len(c.members)
        ax.add_patch(_rect(edge, size))
        edge += size
    pos, labels = expert_ticks(order, layer_plan)
    size = 9 if len(pos) <= 32 else 6.5
    kept = set(layer_plan.kept)
    for axis_ticks, setter in ((ax.set_xticks, "x"), (ax.set_yticks, "y")):
        axis_ticks(pos, labels, fontsize=size, rotation=90 if setter == "x" else 0)
    for tick in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
        if int(tick.get_text()) in kept:  # kept experts in red, bold
            tick.set_color("red")
            tick.set_fontweight("bold")
    ax.set_xlim(-0.5, E - 0.5)
    ax.set_ylim(E - 0.5, -0.5)
    ax.set_title(
        f"layer {lid}: {method}, {len(layer_plan.clusters)} clusters outlined in white; kept experts in red",
        fontsize=11,
    )
    ax.set_xlabel("expert id (grouped by cluster, kept expert first)", fontsize=10)
    ax.set_ylabel("expert id (grouped by cluster, kept expert first)", fontsize=10)
    return fig


def _rect(edge: float, size: int):
    from matplotlib.patches import Rectangle

    return Rectangle((edge, edge), size, size, fill=False, edgecolor="white", linewidth=1.4)


def _coverage_figure(plans: dict[str, SelectionPlan]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for name, plan in plans.items():
        ids = plan.layer_ids
        x = np.arange(len(ids))
        axes[0].plot(x, [plan.layers[i].token_coverage for i in ids], marker=".", label=name)
        axes[1].plot(x, [plan.layers[i].gate_mass_coverage for i in ids], marker=".", label=name)
    ids = next(iter(plans.values())).layer_ids
    step = max(1, len(ids) // 15)  # at most ~15 readable tick labels
    for ax, what in zip(axes, ("routed tokens (freq)", "gate mass")):
        ax.set_title(f"share of {what} kept")
        ax.set_xlabel("MoE layer")
        ax.set_xticks(np.arange(0, len(ids), step), ids[::step], rotation=45)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend()
    return fig


def write_report(out_dir, plan: SelectionPlan, details: dict, baselines: dict[str, SelectionPlan]) -> list[Path]:
    """Write PNGs and summary.txt into out_dir; returns the files written.

    details: layer id -> LayerDetail (fused [E, E] distances; None for ranking baselines, which
    get no matrix picture); baselines: name -> plan compared in coverage.png.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for lid in plan.layer_ids:
        d = details.get(lid)
        if d is None or d.fused is None:
            continue
        path = out / f"distance_layer_{lid}.png"
        _matrix_figure(lid, d.fused, plan.layers[lid], plan.method).savefig(path)
        written.append(path)
    path = out / "coverage.png"
    _coverage_figure({plan.method: plan, **baselines}).savefig(path)
    written.append(path)
    lines = [summary_table(plan), "", "mean coverage (tokens, gate mass):"]
    for name, p in {plan.method: plan, **baselines}.items():
        tok, mass = p.mean_coverage()
        lines.append(f"  {name:<12} {tok:.3f}  {mass:.3f}")
    if "frequency" in baselines and plan.method != "frequency":
        lines += ["", coverage_note(plan, baselines["frequency"])]
    path = out / "summary.txt"
    path.write_text("\n".join(lines) + "\n")
    written.append(path)
    log.info("report: %d files in %s", len(written), out)
    return written
