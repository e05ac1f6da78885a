"""Selection steps driven by the reconstruction error R(S) of `reconstruct.LayerFunction`.

- `refine_representatives`: keep the clusters, choose each cluster's kept expert as the member
  that minimises R given the others (coordinate descent over clusters);
- `prune`: backward elimination without clusters: start from every candidate and repeatedly drop
  the expert whose removal raises R least, until K remain.

Both keep the method's constraints: experts are kept whole (no averaging), nothing is trained,
and the proxy routes with the original top-k rule over the kept experts. Live experts come
before dead ones: a never-selected expert is a candidate only where fewer than K are live.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mcore_proxy.select.plan import Cluster
from mcore_proxy.select.reconstruct import LayerFunction


def refine_representatives(
    clusters: list[Cluster], fn: LayerFunction, freq: np.ndarray, passes: int = 2
) -> list[Cluster]:
    """Clusters with representatives chosen by reconstruction; members unchanged. A cluster
    with a live member keeps a live one; ties keep the current representative."""
    clusters = list(clusters)
    kept = [c.representative for c in clusters]
    for _ in range(passes):
        changed = False
        for i, c in enumerate(clusters):
            live = [m for m in c.members if freq[m] > 0]
            candidates = live or list(c.members)
            best, best_err = kept[i], fn.error(kept)
            for m in candidates:
                if m == kept[i]:
                    continue
                trial = kept[:i] + [m] + kept[i + 1 :]
                err = fn.error(trial)
                if err < best_err - 1e-15:
                    best, best_err = m, err
            if best != kept[i]:
                kept[i], changed = best, True
                clusters[i] = dataclasses.replace(c, representative=best)
        if not changed:
            break
    return sorted(clusters, key=lambda c: c.representative)


def prune(fn: LayerFunction, freq: np.ndarray, groups, per_group_k: int) -> list[int]:
    """Backward elimination inside each routing group until `per_group_k` remain per group
    (the other groups' experts stay in while one is pruned). Returns sorted kept ids."""
    kept, live = [], freq > 0
    for g, ids in enumerate(groups):
        ids = [int(i) for i in ids]
        n_live = sum(bool(live[i]) for i in ids)
        current = [i for i in ids if live[i]] if n_live >= per_group_k else ids
        others = [int(i) for h, other in enumerate(groups) if h != g for i in other]
        while len(current) > per_group_k:
            # with fewer than K live experts, every live one stays: only dead ones may go
            removable = current if n_live >= per_group_k else [e for e in current if not live[e]]
            errs = [fn.error([x for x in current if x != e] + others) for e in removable]
            current.remove(removable[int(np.argmin(errs))])
        kept += current
    return sorted(kept)
