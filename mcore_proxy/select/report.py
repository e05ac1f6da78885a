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


def summary_table(plan: SelectionPlan) -> str:
    """Per layer: kept count, token coverage, gate-mass coverage, dead experts (never selected)
    in the layer and kept; then the mean, and why any dead expert was kept."""
    lines = [f"method {plan.method}: keep K={plan.num_experts} of E={plan.source.num_experts} "
             f"experts in {len(plan.layers)} MoE layers (group policy "
             f"{plan.params.get('group_policy', 'none')})",
             f"{'layer':<8} {'kept':>5} {'tokens':>8} {'gate mass':>10} {'dead':>5} {'dead kept':>10}"]
    for lid in plan.layer_ids:
        lp = plan.layers[lid]
        lines.append(f"{lid:<8} {len(lp.kept):>5} {lp.token_coverage:>8.3f} "
                     f"{lp.gate_mass_coverage:>10.3f} {len(lp.never_selected):>5} {len(lp.dead_kept):>10}")
    tok, mass = plan.mean_coverage()
    lines.append(f"{'mean':<8} {plan.num_experts:>5} {tok:>8.3f} {mass:>10.3f}")
    notes = [f"layer {lid}: {plan.layers[lid].dead_note} (kept dead: {list(plan.layers[lid].dead_kept)})"
             for lid in plan.layer_ids if plan.layers[lid].dead_kept]
    if notes:
        lines += ["dead experts (never selected by any token) are kept only when fewer than K are live:"]
        lines += ["  " + n for n in notes]
    return "\n".join(lines)


def cluster_order(layer_plan, num_experts: int) -> list[int]:
    """Experts ordered cluster by cluster (clusters in plan order, the kept expert first, then
    members by id); experts in no cluster go last."""
    order = []
    for c in layer_plan.clusters:
        order.append(c.representative)
        order.extend(m for m in c.members if m != c.representative)
    seen = set(order)
    return order + [e for e in range(num_experts) if e not in seen]


def _matrix_figure(lid: str, fused: np.ndarray, layer_plan, method: str):
    from matplotlib.figure import Figure

    E = fused.shape[0]
    order = cluster_order(layer_plan, E)
    fig = Figure(figsize=(6.4, 5.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(fused[np.ix_(order, order)], cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="fused distance")
    edge = -0.5
    for c in layer_plan.clusters:  # cluster boundaries along the diagonal
        size = len(c.members)
        ax.add_patch(_rect(edge, size))
        edge += size
    kept_pos = [i for i, e in enumerate(order) if e in set(layer_plan.kept)]
    ax.scatter(kept_pos, [-1.5] * len(kept_pos), marker="v", color="red", s=12, clip_on=False,
               label="kept")
    ax.set_xlim(-0.5, E - 0.5)
    ax.set_ylim(E - 0.5, -2.5)
    ax.set_title(f"layer {lid}: {method}, {len(layer_plan.clusters)} clusters (red: kept)")
    ax.set_xlabel("experts ordered by cluster")
    ax.set_ylabel("experts ordered by cluster")
    return fig


def _rect(edge: float, size: int):
    from matplotlib.patches import Rectangle

    return Rectangle((edge, edge), size, size, fill=False, edgecolor="white", linewidth=0.8)


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


def write_report(out_dir, plan: SelectionPlan, details: dict,
                 baselines: dict[str, SelectionPlan]) -> list[Path]:
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
    path = out / "summary.txt"
    path.write_text("\n".join(lines) + "\n")
    written.append(path)
    log.info("report: %d files in %s", len(written), out)
    return written
