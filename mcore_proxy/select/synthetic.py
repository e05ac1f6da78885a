"""Synthetic routing statistics with planted expert clusters (tests, benchmarks, demos).

Experts come in K planted clusters of E/K: similar router rows, nearby prototypes, and
co-activation planted in one reading's sense. `partners`: each token picks top-k *different*
clusters (one member each), so co-selected experts sit across clusters. `substitutes`: each
token picks one cluster and top-k of its members, so co-selected experts sit within one.
Noise knobs blur one view at a time: router_noise / proto_noise are per-element standard
deviations relative to unit-variance cluster centres; coact_noise is the share of tokens that
pick experts regardless of clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcore_proxy.core.stats import LayerStats, RoutingStats


@dataclass(frozen=True, repr=False)
class PlantedLayer:
    """labels [E]: planted cluster of each expert; router [E, H] float32; stats: LayerStats."""

    labels: np.ndarray
    router: np.ndarray
    stats: LayerStats


def _gumbel_topk(logp: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k distinct column indices per row, drawn without replacement with weights exp(logp)."""
    keys = logp + rng.gumbel(size=logp.shape)
    return np.argpartition(-keys, k - 1, axis=-1)[..., :k]


def _token_choices(
    labels: np.ndarray, pop: np.ndarray, topk: int, tokens: int, mode: str, rng: np.random.Generator
) -> np.ndarray:
    """[tokens, topk] expert ids chosen per token under the planted reading."""
    K = int(labels.max()) + 1
    members = np.stack([np.flatnonzero(labels == c) for c in range(K)])  # [K, m]
    with np.errstate(divide="ignore"):
        logp = np.log(pop[members])  # [K, m]
    if mode == "partners":
        clusters = _gumbel_topk(np.zeros((tokens, K)), topk, rng)  # [T, topk]
        pick = _gumbel_topk(logp[clusters], 1, rng)[..., 0]  # [T, topk]
        return members[clusters, pick]
    if mode == "substitutes":
        c = rng.integers(0, K, size=tokens)  # [T]
        pick = _gumbel_topk(logp[c], topk, rng)  # [T, topk]
        return members[c[:, None], pick]
    raise ValueError(f"mode {mode!r} is not partners or substitutes")


def planted_layer(
    num_experts: int = 32,
    clusters: int = 8,
    hidden: int = 64,
    topk: int = 2,
    tokens: int = 4000,
    mode: str = "partners",
    router_noise: float = 0.3,
    proto_noise: float = 0.3,
    coact_noise: float = 0.0,
    dead: tuple[int, ...] = (),
    seed: int = 0,
) -> PlantedLayer:
    """One MoE layer with `clusters` planted clusters of num_experts/clusters experts each.

    dead: expert ids never selected (freq 0); leave at least top-k live members per cluster.
    """
    rng = np.random.default_rng(seed)
    E, K, H = num_experts, clusters, hidden
    if E % K:
        raise ValueError("num_experts must be a multiple of clusters")
    labels = rng.permutation(np.repeat(np.arange(K), E // K))
    pop = rng.uniform(0.2, 1.0, size=E)
    pop[list(dead)] = 0.0
    n_noise = int(round(coact_noise * tokens))
    chosen = _token_choices(labels, pop, topk, tokens - n_noise, mode, rng)
    if n_noise:
        with np.errstate(divide="ignore"):
            noise = _gumbel_topk(np.broadcast_to(np.log(pop), (n_noise, E)), topk, rng)
        chosen = np.concatenate([chosen, noise])
    x = np.zeros((tokens, E), dtype=np.float32)
    np.put_along_axis(x, chosen, 1.0, axis=1)
    freq = x.sum(0).astype(np.int64)
    coact = np.rint(x.T @ x).astype(np.int64)
    router = rng.normal(size=(K, H))[labels] + router_noise * rng.normal(size=(E, H))
    proto = rng.normal(size=(K, H))[labels] + proto_noise * rng.normal(size=(E, H))
    gate_mass = freq * rng.uniform(0.5, 1.5, size=E) / topk
    saliency = freq * rng.uniform(0.5, 2.0, size=E)
    stats = LayerStats(tokens, freq, gate_mass, coact, freq[:, None] * proto, saliency)
    return PlantedLayer(labels, router.astype(np.float32), stats)


def planted_stats(layer_ids: list[str], topk: int = 2, **kwargs) -> tuple[RoutingStats, dict[str, PlantedLayer]]:
    """RoutingStats over `layer_ids`, each layer planted with its own seed (kwargs as for
    `planted_layer`, `seed` offsets every layer's seed)."""
    base = kwargs.pop("seed", 0)
    layers = {lid: planted_layer(topk=topk, seed=base * 100003 + i, **kwargs) for i, lid in enumerate(layer_ids)}
    stats = RoutingStats({lid: p.stats for lid, p in layers.items()}, topk, {"source": "synthetic planted clusters"})
    return stats, layers


def stats_like(spec, clusters: int, **kwargs) -> RoutingStats:
    """Planted statistics over a ModelSpec's MoE layers, in its shape (top-k, E, hidden size), with
    `clusters` clusters per layer; kwargs as for `planted_layer` (tokens, seed, ...)."""
    return planted_stats(
        spec.moe_layer_ids,
        topk=spec.topk,
        num_experts=spec.num_experts,
        clusters=clusters,
        hidden=spec.hidden_size,
        **kwargs,
    )[0]


def planted_plan(view, keep: int, path=None, *, tokens: int = 2000, seed: int = 3, **options):
    """The real selection (`select_experts` with `options`; multiview by default) of `keep`
    experts per MoE layer of `view`, on `stats_like` statistics with `keep` clusters; saved to
    `path` when given. For tests and benchmarks that need a plan without a trace."""
    from mcore_proxy.select.selector import select_experts

    plan = select_experts(view, stats_like(view.spec, keep, tokens=tokens, seed=seed), keep, **options)
    if path is not None:
        plan.save(path)
    return plan


def plan_labels(layer_plan, num_experts: int) -> np.ndarray:
    """Cluster index of every expert [E] from a LayerPlan's clusters (-1: in no cluster)."""
    labels = np.full(num_experts, -1, dtype=np.int64)
    for i, c in enumerate(layer_plan.clusters):
        labels[list(c.members)] = i
    return labels


def adjusted_rand_index(a, b) -> float:
    """Adjusted Rand index of two labelings of the same items (1: identical partitions,
    about 0: chance agreement). Hubert and Arabie (1985), from the contingency table."""
    a = np.unique(np.asarray(a), return_inverse=True)[1].ravel()
    b = np.unique(np.asarray(b), return_inverse=True)[1].ravel()
    if a.shape != b.shape:
        raise ValueError("labelings differ in length")
    if a.size < 2:
        return 1.0
    table = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(table, (a, b), 1)

    def pairs(x):
        return float((x * (x - 1) / 2).sum())

    both, rows, cols = pairs(table), pairs(table.sum(1)), pairs(table.sum(0))
    expected = rows * cols / pairs(np.array([a.size]))
    best = (rows + cols) / 2
    # both labelings one cluster, or both all singletons: identical, no room for chance
    return 1.0 if best == expected else (both - expected) / (best - expected)
