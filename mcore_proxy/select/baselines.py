"""Ranking baselines: keep the K experts with the highest score (no clustering).

Each scorer maps a layer's statistics to a score per expert, [E] float64; `top_k` keeps the
highest scores, ties going to the lowest id, so every baseline is deterministic.
"""

from __future__ import annotations

import numpy as np

from mcore_proxy.core.errors import StatsError
from mcore_proxy.core.stats import LayerStats

RANKING_METHODS = ("frequency", "gate-mass", "saliency", "random", "first-k")


def top_k(
    scores: np.ndarray, k: int, candidates: np.ndarray | None = None, live: np.ndarray | None = None
) -> list[int]:
    """Sorted ids of the k highest scores among `candidates` (default: all); ties -> lowest id.

    live [E] bool (experts some token selected): live experts come before dead ones whatever
    their score, so a dead expert is kept only when fewer than k candidates are live."""
    ids = np.arange(scores.shape[0]) if candidates is None else np.asarray(candidates)
    dead = np.zeros(ids.size, dtype=bool) if live is None else ~np.asarray(live)[ids]
    # lexsort sorts by the last key first: live first, then descending score, then ascending id
    order = np.lexsort((ids, -scores[ids], dead))
    return sorted(int(i) for i in ids[order[:k]])


def frequency_scores(s: LayerStats) -> np.ndarray:
    return s.freq.astype(np.float64)


def gate_mass_scores(s: LayerStats) -> np.ndarray:
    return s.gate_mass.astype(np.float64)


def saliency_scores(s: LayerStats, layer_id: str = "?") -> np.ndarray:
    """Mean saliency per activation, saliency_sum / freq; never-selected experts rank last."""
    if s.saliency_sum is None:
        raise StatsError(
            f"the statistics hold no saliency_sum for layer {layer_id}; collect "
            "them with saliency enabled or choose another --method"
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s.freq > 0, s.saliency_sum / np.maximum(s.freq, 1), -1.0)


def first_k_scores(num_experts: int) -> np.ndarray:
    return -np.arange(num_experts, dtype=np.float64)


def random_scores(num_experts: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random scores: their top k is a uniformly random subset."""
    return rng.random(num_experts)


def ranking_scores(method: str, s: LayerStats, rng: np.random.Generator, layer_id: str = "?") -> np.ndarray:
    """Score per expert [E] for one of RANKING_METHODS."""
    if method == "frequency":
        return frequency_scores(s)
    if method == "gate-mass":
        return gate_mass_scores(s)
    if method == "saliency":
        return saliency_scores(s, layer_id)
    if method == "random":
        return random_scores(s.num_experts, rng)
    if method == "first-k":
        return first_k_scores(s.num_experts)
    raise ValueError(f"{method!r} is not a ranking method {RANKING_METHODS}")
