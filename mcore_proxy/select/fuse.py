"""Normalise each view over its off-diagonal entries and fuse the views with weights.

Views live on different scales (cosine distances near 1 for high-dimensional router rows,
co-activation shares near 0), so each is mapped to [0, 1] before the weighted sum.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

NORMALISATIONS = ("minmax", "rank")


def _off_diagonal(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """0-based ranks of a 1-d array, ties sharing their average rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + ends - 1) / 2.0)[inverse.ravel()]


def normalise(d: np.ndarray, how: str = "minmax") -> np.ndarray:
    """Map the off-diagonal entries of a symmetric d [E, E] to [0, 1]; diagonal stays 0.

    minmax: (d - min) / (max - min). rank: average rank / (number of pairs - 1), robust to a
    few extreme pairs. A constant view carries no information and becomes all zeros (adding a
    constant to every off-diagonal entry does not change which clustering is best).
    """
    if how not in NORMALISATIONS:
        raise ValueError(f"normalisation {how!r} is not one of {NORMALISATIONS}")
    n = d.shape[0]
    iu = _off_diagonal(n)
    vals = d[iu]
    out = np.zeros_like(d, dtype=np.float64)
    if vals.size == 0:
        return out
    if how == "minmax":
        lo, hi = float(vals.min()), float(vals.max())
        scaled = (vals - lo) / (hi - lo) if hi > lo else np.zeros_like(vals)
    else:
        scaled = average_ranks(vals) / max(vals.size - 1, 1)
        if np.ptp(vals) == 0:
            scaled = np.zeros_like(vals)
    if not np.any(scaled):
        log.info("a distance view is constant over its off-diagonal entries; it adds nothing")
    out[iu] = scaled
    out.T[iu] = scaled
    return out


def fuse(views: dict[str, np.ndarray], weights: dict[str, float], how: str = "minmax") -> np.ndarray:
    """Weighted sum of normalised views, [E, E]; weights are divided by their sum.

    views and weights share keys (view names); a view with weight 0 is skipped.
    """
    total = sum(weights[name] for name in views)
    if total <= 0:
        raise ValueError("fusion weights of the chosen views sum to zero")
    fused = None
    for name, d in views.items():
        w = weights[name] / total
        if w == 0:
            continue
        term = w * normalise(d, how)
        fused = term if fused is None else fused + term
    return fused
