"""K-Medoids on a precomputed distance matrix and the frequency-aware representative rule."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, repr=False)
class Clustering:
    """labels [n] int (cluster index per point), medoids [k] int (point index per cluster),
    loss: sum of each point's distance to its medoid."""

    labels: np.ndarray
    medoids: np.ndarray
    loss: float


def restart_seeds(seed: int, restarts: int) -> list[int]:
    """Independent 31-bit seeds for the restarts, fixed by `seed`."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(restarts) % (2**31 - 1)]


def kmedoids(d: np.ndarray, k: int, seed: int = 0, restarts: int = 8) -> Clustering:
    """FasterPAM (package `kmedoids`) on d [n, n] with k clusters; keeps the lowest loss.

    Restart 0 starts from the deterministic BUILD initialisation, the others from random
    medoids drawn with their own seed; every run is single-threaded with a fixed processing
    order, so a seed gives the same answer everywhere. Ties in loss keep the earliest restart.
    """
    import kmedoids as km  # heavy native import: only where clustering happens

    n = d.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"cannot make {k} clusters of {n} points")
    d = np.ascontiguousarray(d, dtype=np.float64)
    best = None
    for r, s in enumerate(restart_seeds(seed, max(restarts, 1))):
        if r == 0:
            res = km.fasterpam(d, k, init="build", n_cpu=1)
        else:
            # medoids drawn here rather than through kmedoids' RandomState path: as
            # deterministic, at a fraction of the per-call cost (thousands of calls per model)
            start = np.random.default_rng(s).choice(n, k, replace=False).astype(np.uintp)
            res = km.fasterpam(d, start, n_cpu=1)
        if best is None or res.loss < best.loss - 1e-12:
            best = res
    labels = np.asarray(best.labels, dtype=np.int64)
    medoids = np.asarray(best.medoids, dtype=np.int64)
    return Clustering(labels=labels, medoids=medoids, loss=float(best.loss))


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
