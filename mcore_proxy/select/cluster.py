"""K-Medoids on a precomputed distance matrix and the frequency-aware representative rule."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True, repr=False)
class Clustering:
    """labels [n] int (cluster index per point), medoids [k] int (point index per cluster, k
    distinct points, medoid c in cluster c), loss: sum of each point's distance to its medoid."""

    labels: np.ndarray
    medoids: np.ndarray
    loss: float


def restart_seeds(seed: int, restarts: int) -> list[int]:
    """Independent 31-bit seeds for the restarts, fixed by `seed`."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(restarts) % (2**31 - 1)]


def assign(d: np.ndarray, medoids: np.ndarray) -> tuple[np.ndarray, float]:
    """(labels [n], loss): every point joins its nearest medoid (ties: the earlier medoid), and
    every medoid its own cluster, so no cluster is empty even when distances tie at 0."""
    medoids = np.asarray(medoids, dtype=np.int64)
    labels = np.argmin(d[:, medoids], axis=1)
    labels[medoids] = np.arange(medoids.size)
    return labels.astype(np.int64), float(d[np.arange(d.shape[0]), medoids[labels]].sum())


def complete_medoids(d: np.ndarray, medoids, k: int) -> np.ndarray:
    """Add points farthest from their nearest medoid (ties: lowest id) until k distinct
    medoids; the fallback when every restart stopped early (e.g. all distances 0)."""
    med = list(dict.fromkeys(int(m) for m in medoids))
    while len(med) < k:
        gap = d[:, med].min(axis=1) if med else np.zeros(d.shape[0])
        gap[med] = -1.0
        med.append(int(np.argmax(gap)))
    return np.asarray(med, dtype=np.int64)


def kmedoids(d: np.ndarray, k: int, seed: int = 0, restarts: int = 8) -> Clustering:
    """FasterPAM (package `kmedoids`) on d [n, n] with exactly k clusters; keeps the lowest loss.

    Restart 0 starts from the deterministic BUILD initialisation, the others from random
    medoids drawn with their own seed; every run is single-threaded with a fixed processing
    order, so a seed gives the same answer everywhere. Ties in loss keep the earliest restart.
    A restart that returns fewer than k distinct medoids (BUILD stops once the loss is 0, which
    many zero distances allow) is never chosen; if every restart does, the medoids are
    completed farthest-first. Disagreeing restarts are logged.
    """
    import kmedoids as km  # heavy native import: only where clustering happens

    n = d.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"cannot make {k} clusters of {n} points")
    d = np.ascontiguousarray(d, dtype=np.float64)
    best, short, longest, losses = None, 0, np.empty(0, dtype=np.int64), set()
    for r, s in enumerate(restart_seeds(seed, max(restarts, 1))):
        if r == 0:
            res = km.fasterpam(d, k, init="build", n_cpu=1)
        else:
            # medoids drawn here rather than through kmedoids' RandomState path: as
            # deterministic, at a fraction of the per-call cost (thousands of calls per model)
            start = np.random.default_rng(s).choice(n, k, replace=False).astype(np.uintp)
            res = km.fasterpam(d, start, n_cpu=1)
        med = np.unique(np.asarray(res.medoids, dtype=np.int64))
        if med.size < k:
            short += 1
            longest = med if med.size > longest.size else longest
            continue
        losses.add(round(float(res.loss), 9))
        if best is None or res.loss < best[1] - 1e-12:
            best = (np.asarray(res.medoids, dtype=np.int64), float(res.loss))
    if short:
        log.info(
            "K-Medoids (%d points, k=%d): %d of %d restarts returned fewer than k distinct "
            "medoids (many equal distances) and were not used",
            n,
            k,
            short,
            max(restarts, 1),
        )
    if len(losses) > 1:
        log.info(
            "K-Medoids (%d points, k=%d): restarts disagree, losses %.4g..%.4g; the lowest is kept",
            n,
            k,
            min(losses),
            max(losses),
        )
    medoids = best[0] if best is not None else complete_medoids(d, longest, k)
    labels, loss = assign(d, medoids)
    return Clustering(labels=labels, medoids=medoids, loss=loss)


def representatives(labels: np.ndarray, medoids: np.ndarray, freq: np.ndarray) -> list[tuple[list[int], int]]:
    """Per cluster (members, kept member): the most frequently activated member; ties go to
    the medoid, then to the lowest id. An expert never selected (freq 0) therefore wins only
    when no member of its cluster was ever selected. Clusters come in order of their kept id.
    """
    out = []
    for c, medoid in enumerate(medoids):
        members = np.flatnonzero(labels == c)
        f = freq[members]
        best = members[f == f.max()]
        rep = int(medoid) if medoid in best else int(best.min())
        out.append(([int(m) for m in members], rep))
    return sorted(out, key=lambda mr: mr[1])
