"""Read-outs of routing statistics for `mcore-proxy stats show`: a text table and heatmaps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mcore_proxy.core.stats import LayerStats, RoutingStats

HEATMAPS = ("load.png", "coact.png")  # what `write_heatmaps` writes into its folder


@dataclass(frozen=True)
class LayerSummary:
    """Load and co-activation figures of one layer (shares are of all top-k selections)."""

    layer_id: str
    tokens: int
    top: list[tuple[int, float]]  # (expert, share), most loaded first
    bottom: list[tuple[int, float]]  # (expert, share), least loaded first
    dead: list[int]  # experts never selected
    entropy: float  # load entropy / log(E): 1 = perfectly balanced
    pairs_seen: int  # expert pairs selected together at least once
    pairs_total: int
    top_pair: tuple[int, int, int, float] | None  # (i, j, tokens, lift = P(i,j) / P(i)P(j))


def summarize_layer(layer_id: str, s: LayerStats, n: int = 3) -> LayerSummary:
    freq = s.freq.astype(np.float64)
    total = freq.sum()
    share = freq / total if total else freq
    order = np.argsort(-freq, kind="stable")
    nonzero = share[share > 0]
    entropy = 1.0
    if s.num_experts > 1:
        entropy = float(-(nonzero * np.log(nonzero)).sum() / math.log(s.num_experts))
    off = s.coact.astype(np.float64).copy()
    np.fill_diagonal(off, 0)
    iu = np.triu_indices(s.num_experts, 1)
    pairs_seen = int((off[iu] > 0).sum())
    top_pair = None
    if pairs_seen:
        i, j = np.unravel_index(int(np.argmax(np.triu(off, 1))), off.shape)
        lift = off[i, j] * s.tokens / (freq[i] * freq[j]) if freq[i] and freq[j] else float("nan")
        top_pair = (int(i), int(j), int(off[i, j]), float(lift))
    return LayerSummary(
        layer_id,
        s.tokens,
        [(int(e), float(share[e])) for e in order[:n]],
        [(int(e), float(share[e])) for e in order[::-1][:n]],
        [int(e) for e in np.flatnonzero(freq == 0)],
        entropy,
        pairs_seen,
        len(iu[0]),
        top_pair,
    )


def _experts(items) -> str:
    return " ".join(f"{e}:{100 * sh:.1f}%" for e, sh in items)


def summary_dict(stats: RoutingStats, n: int = 3) -> dict:
    """The numbers of `summary_table` for `stats show --json` (shares as fractions in [0, 1])."""

    def experts(items):
        return [{"expert": e, "share": sh} for e, sh in items]

    layers = {}
    for layer_id in stats.layer_ids:
        ls = summarize_layer(layer_id, stats.layers[layer_id], n)
        pair = None if ls.top_pair is None else dict(zip(("i", "j", "tokens", "lift"), ls.top_pair))
        layers[layer_id] = {
            "tokens": ls.tokens,
            "top": experts(ls.top),
            "bottom": experts(ls.bottom),
            "dead": ls.dead,
            "entropy": ls.entropy,
            "pairs_seen": ls.pairs_seen,
            "pairs_total": ls.pairs_total,
            "top_pair": pair,
        }
    return {
        "num_experts": stats.num_experts,
        "topk": stats.topk,
        "hidden_size": stats.hidden_size,
        "ranks_merged": stats.meta.get("ranks_merged", 1),
        "layers": layers,
    }


def summary_table(stats: RoutingStats, n: int = 3) -> str:
    """Plain-text table, one row per layer."""
    header = (
        f"{'layer':>7} {'tokens':>10}  {'top experts (share)':<{n * 11}} "
        f"{'bottom experts':<{n * 11}} {'dead':>4} {'entropy':>7}  co-activation"
    )
    lines = [
        f"{len(stats.layers)} MoE layers, E={stats.num_experts}, top-{stats.topk}, "
        f"H={stats.hidden_size}, {stats.meta.get('ranks_merged', 1)} rank file(s)",
        header,
    ]
    for layer_id in stats.layer_ids:
        ls = summarize_layer(layer_id, stats.layers[layer_id], n)
        co = f"pairs seen {ls.pairs_seen}/{ls.pairs_total}"
        if ls.top_pair:
            i, j, tok, lift = ls.top_pair
            co += f", top pair {i}+{j}: {tok} tokens (lift {lift:.2f})"
        lines.append(
            f"{layer_id:>7} {ls.tokens:>10}  {_experts(ls.top):<{n * 11}} "
            f"{_experts(ls.bottom):<{n * 11}} {len(ls.dead):>4} {ls.entropy:>7.3f}  {co}"
        )
        if ls.dead:
            lines.append(f"{'':>7} dead experts: {ls.dead}")
    return "\n".join(lines)


def _expert_ticks(num_experts: int) -> np.ndarray:
    """Tick positions that label expert ids legibly: all up to 32, else about 16."""
    step = 1 if num_experts <= 32 else int(np.ceil(num_experts / 16))
    return np.arange(0, num_experts, step)


def write_heatmaps(stats: RoutingStats, out_dir: str | Path) -> list[Path]:
    """`load.png`: share of selections per (layer, expert); `coact.png`: per layer, co-activation
    counts normalised by the layer's tokens (diagonal blanked). Axes carry expert ids and layer
    ids, colour bars their units."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = stats.layer_ids
    E = stats.num_experts
    ticks = _expert_ticks(E)
    load = np.stack([s.freq / max(s.freq.sum(), 1) for s in (stats.layers[i] for i in ids)])
    fig, ax = plt.subplots(figsize=(min(16, max(8, E / 6)), min(14, max(3.5, 0.32 * len(ids) + 1.8))))
    im = ax.imshow(100 * load, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0)
    ax.set_yticks(range(len(ids)), ids, fontsize=9 if len(ids) <= 40 else 6)
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=9)
    ax.set_xlabel("expert id", fontsize=11)
    ax.set_ylabel("MoE layer", fontsize=11)
    ax.set_title(
        f"expert load: share of each layer's top-{stats.topk} selections "
        f"(uniform = {100 / E:.2g} %; dark columns: never selected)",
        fontsize=11,
    )
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label("share of the layer's selections (%)", fontsize=10)
    fig.tight_layout()
    paths = [out_dir / "load.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    cols = math.ceil(math.sqrt(len(ids)))
    rows = math.ceil(len(ids) / cols)
    co_all = []
    for layer_id in ids:
        s = stats.layers[layer_id]
        co = 100 * s.coact.astype(np.float64) / max(s.tokens, 1)
        np.fill_diagonal(co, np.nan)
        co_all.append(co)
    vmax = max(float(np.nanmax(c)) if np.isfinite(c).any() else 0.0 for c in co_all) or 1.0
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1.2, 3.4 * rows + 0.6), squeeze=False)
    small = ticks if E <= 16 else ticks[:: max(1, len(ticks) // 4)]
    for ax, layer_id, co in zip(axes.flat, ids, co_all):  # spare axes are blanked below
        im = ax.imshow(co, cmap="magma", interpolation="nearest", vmin=0, vmax=vmax)
        ax.set_title(f"layer {layer_id}", fontsize=10)
        ax.set_xticks(small, [str(t) for t in small], fontsize=8)
        ax.set_yticks(small, [str(t) for t in small], fontsize=8)
    for i, ax in enumerate(list(axes.flat)[: len(ids)]):
        if i + cols >= len(ids):  # nothing drawn below it
            ax.set_xlabel("expert id", fontsize=9)
    for ax in axes[:, 0]:
        ax.set_ylabel("expert id", fontsize=9)
    for ax in list(axes.flat)[len(ids) :]:
        ax.axis("off")
    fig.suptitle(
        "co-activation: tokens that selected both experts, % of the layer's tokens (diagonal blank)", fontsize=12
    )
    fig.tight_layout(rect=(0, 0, 0.9, 0.97))
    cax = fig.add_axes((0.92, 0.15, 0.02, 0.7))
    fig.colorbar(im, cax=cax).set_label("% of tokens selecting both", fontsize=10)
    paths.append(out_dir / "coact.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
