"""The three distance views between the E experts of one MoE layer (DESIGN.md 1).

Each function returns an [E, E] float64 matrix: symmetric, zero diagonal, non-negative.
Experts never selected in the statistics (freq 0) have no co-activation and no prototype; in
those two views their distances are set to the mean of the defined off-diagonal entries, so
the view neither pulls them into nor pushes them out of any cluster.
"""

from __future__ import annotations

import numpy as np

COACT_MODES = ("partners", "substitutes")
ROUTER_METRICS = ("cosine", "euclidean")


def _finish(d: np.ndarray) -> np.ndarray:
    """Exact symmetry, zero diagonal, no negative round-off: what K-Medoids expects."""
    d = 0.5 * (d + d.T)
    np.maximum(d, 0.0, out=d)
    np.fill_diagonal(d, 0.0)
    return d


def cosine_distance(x: np.ndarray) -> np.ndarray:
    """1 - cos(x_i, x_j) for rows of x [E, H] -> [E, E] in [0, 2]; a zero row is at distance 1
    (orthogonal) from every other row."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    unit = x / np.where(norms > 0, norms, 1.0)[:, None]
    # `a @ a.T` on one buffer lets BLAS use the symmetric rank-k update: half the work
    return _finish(1.0 - unit @ unit.T)


def euclidean_distance(x: np.ndarray) -> np.ndarray:
    """||x_i - x_j|| for rows of x [E, H] -> [E, E], via one Gram matrix."""
    x = np.asarray(x, dtype=np.float64)
    sq = np.einsum("ij,ij->i", x, x)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    return _finish(np.sqrt(np.maximum(d2, 0.0)))


def fill_unobserved(d: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Set every off-diagonal entry touching an unobserved expert to the mean of the entries
    between observed experts (0 when fewer than two are observed). d [E, E], observed [E] bool."""
    d = d.copy()
    both = observed[:, None] & observed[None, :]
    np.fill_diagonal(both, False)
    neutral = float(d[both].mean()) if both.any() else 0.0
    d[~(observed[:, None] & observed[None, :])] = neutral
    np.fill_diagonal(d, 0.0)
    return d


def router_distance(weight: np.ndarray, metric: str = "cosine") -> np.ndarray:
    """Distance between router weight rows, weight [E, H] -> [E, E]."""
    if metric == "cosine":
        return cosine_distance(weight)
    if metric == "euclidean":
        return euclidean_distance(weight)
    raise ValueError(f"router metric {metric!r} is not one of {ROUTER_METRICS}")


def coactivation_similarity(coact: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """C_ij / sqrt(f_i f_j) in [0, 1] (a cosine of the experts' token-indicator vectors);
    0 where either expert was never selected. coact [E, E] counts, freq [E] counts."""
    f = np.asarray(freq, dtype=np.float64)
    root = np.sqrt(f)
    denom = root[:, None] * root[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(denom > 0, np.asarray(coact, dtype=np.float64) / denom, 0.0)
    return np.clip(s, 0.0, 1.0)


def coactivation_distance(coact: np.ndarray, freq: np.ndarray, mode: str = "partners") -> np.ndarray:
    """Co-activation view [E, E].

    partners: distance = C_ij / sqrt(f_i f_j); experts tokens choose together land in different
    clusters, where both can survive. substitutes: distance = 1 - C_ij / sqrt(f_i f_j);
    experts chosen together are interchangeable and one representative covers both.
    """
    s = coactivation_similarity(coact, freq)
    if mode == "partners":
        d = s
    elif mode == "substitutes":
        d = 1.0 - s
    else:
        raise ValueError(f"co-activation mode {mode!r} is not one of {COACT_MODES}")
    return fill_unobserved(_finish(d), np.asarray(freq) > 0)


def prototype_distance(proto_sum: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """Cosine distance between mean routed hidden states proto_sum / freq, [E, H] -> [E, E]."""
    freq = np.asarray(freq)
    # scaling a row does not change its cosine, so proto_sum can be used without dividing
    return fill_unobserved(cosine_distance(proto_sum), freq > 0)
