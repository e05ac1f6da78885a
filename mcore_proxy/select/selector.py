"""Multi-view, frequency-aware expert selection: checks, then per layer views -> fusion ->
K-Medoids -> representatives (or a ranking baseline), then the plan (DESIGN.md 1, 4.2)."""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from mcore_proxy.core.errors import PlanError
from mcore_proxy.select import baselines, cluster, fuse, reconstruct, refine, views
from mcore_proxy.select.constraints import (
    PROXY_TOPK_RULE,
    GroupSetup,
    check_sizes,
    check_stats_match,
    fewest_proxy_topk,
    proxy_topk,
    resolve_groups,
)
from mcore_proxy.select.plan import Cluster, LayerPlan, SelectionPlan, SourceInfo
from mcore_proxy.mcore.spec import router_weight_name
from mcore_proxy.core.stats import LayerStats, RoutingStats, layer_sort_key

log = logging.getLogger(__name__)

VIEW_NAMES = ("router", "coact", "proto")
VIEW_METHODS = {
    "multiview": VIEW_NAMES,
    "router": ("router",),
    "coact": ("coact",),
    "proto": ("proto",),
    "router+coact": ("router", "coact"),
    "router+proto": ("router", "proto"),
    "coact+proto": ("coact", "proto"),
}
RECON_METHODS = ("recon-prune",)
METHODS = tuple(VIEW_METHODS) + baselines.RANKING_METHODS + RECON_METHODS
REPRESENTATIVES = ("frequency", "reconstruction")
# candidate (R, C, P) weights of the per-layer weight search (`weight_search`), default first
WEIGHT_GRID = (
    (1.0, 1.0, 1.0),
    (1.0, 0.0, 0.0),
    (0.0, 1.0, 0.0),
    (0.0, 0.0, 1.0),
    (1.0, 1.0, 0.0),
    (1.0, 0.0, 1.0),
    (0.0, 1.0, 1.0),
    (2.0, 1.0, 1.0),
    (1.0, 2.0, 1.0),
    (1.0, 1.0, 2.0),
)
# Default (router, co-activation, prototype) fusion weights: the paper's equal weights. In the
# issue-13 ablation (bench/RESULTS.md, quality section) halving the co-activation weight lost
# less accuracy on the fine-grained model at every K but more on the coarse one at K = 25 %,
# within the noise of 1000 test problems either way: not a consistent winner.
DEFAULT_WEIGHTS = (1.0, 1.0, 1.0)
# The default refinements of --method multiview, chosen by the issue-13 ablation
# (bench/RESULTS.md, quality section). Where the default reconstructs but the source holds no
# expert weights, it falls back to the paper's rule and the plan says so.
DEFAULT_REFINEMENTS = {"representative": "frequency", "weight_search": False}
DEAD_POLICY = (
    "live before dead: an expert no token selected is kept only when fewer than K (per routing group) were selected"
)


@dataclass(frozen=True)
class Options:
    """Every knob of one selection, validated before any work (see `run_selection`)."""

    method: str = "multiview"
    weights: tuple[float, float, float] = DEFAULT_WEIGHTS
    coact_mode: str = "partners"
    norm: str = "minmax"
    router_metric: str = "cosine"
    seed: int = 0
    restarts: int = 8
    representative: str = "frequency"
    weight_search: bool = False

    def __post_init__(self):
        for name, value, allowed in (
            ("--method", self.method, METHODS),
            ("--representative", self.representative, REPRESENTATIVES),
            ("--coact-mode", self.coact_mode, views.COACT_MODES),
            ("--norm", self.norm, fuse.NORMALISATIONS),
            ("--router-metric", self.router_metric, views.ROUTER_METRICS),
        ):
            if value not in allowed:
                raise PlanError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        try:
            w = tuple(float(x) for x in self.weights)
        except (TypeError, ValueError):
            w = ()
        if len(w) != 3 or any(not np.isfinite(x) or x < 0 for x in w):
            raise PlanError(f"--weights {self.weights} must be three non-negative numbers R,C,P")
        object.__setattr__(self, "weights", w)
        if self.method in VIEW_METHODS and not any(self.view_weights.values()):
            raise PlanError(
                f"--weights {','.join(map(str, w))} give every view of --method "
                f"{self.method} weight 0; give at least one a positive weight"
            )
        if self.restarts < 1:
            raise PlanError(f"--restarts {self.restarts} must be at least 1")
        if (self.weight_search or self.representative != "frequency") and self.method != "multiview":
            raise PlanError(
                f"--weight-search and --representative reconstruction refine the "
                f"three-view clustering; use them with --method multiview, not "
                f"{self.method}"
            )

    @property
    def reconstructs(self) -> bool:
        """Whether this selection evaluates the MoE layer (reads expert weights)."""
        return self.method in RECON_METHODS or self.weight_search or self.representative != "frequency"

    @property
    def view_weights(self) -> dict[str, float]:
        """Weights of the method's views, summing to 1 ({} for ranking baselines)."""
        if self.method not in VIEW_METHODS:
            return {}
        raw = {v: w for v, w in zip(VIEW_NAMES, self.weights) if v in VIEW_METHODS[self.method]}
        total = sum(raw.values())
        return {v: w / total for v, w in raw.items()} if total else raw

    def params(self, group_policy: str, stats: RoutingStats) -> dict:
        p = {
            "seed": self.seed,
            "group_policy": group_policy,
            "stats": {"total_tokens": stats.total_tokens, "topk": stats.topk},
            "dead_policy": DEAD_POLICY,
        }
        if self.method in VIEW_METHODS:
            used = [v for v, w in self.view_weights.items() if w > 0]
            p.update(
                views=used,
                weights={v: self.view_weights[v] for v in used},
                normalisation=self.norm,
                coact_mode=self.coact_mode,
                router_metric=self.router_metric,
                proto_metric="cosine",
                clustering="kmedoids.fasterpam",
                restarts=self.restarts,
                representative=(
                    "most frequent member; ties: medoid, then lowest id"
                    if self.representative == "frequency"
                    else "member minimising the layer's reconstruction error R given "
                    "the other kept experts (coordinate descent, 2 passes)"
                ),
            )
            if self.weight_search:
                p.update(
                    weight_search={
                        "grid": [list(w) for w in WEIGHT_GRID],
                        "criterion": "lowest reconstruction error R per layer",
                    }
                )
        if self.reconstructs:
            p.update(
                reconstruction={
                    "points": "live experts' routed-context prototypes proto_sum/freq, weighted by freq",
                    "error": "sum f ||y - y_S||^2 / sum f ||y||^2 of the routed experts' output",
                }
            )
        return p


@dataclass(frozen=True, repr=False)
class LayerDetail:
    """What the report draws for one layer: fused [E, E] distances (None for ranking
    baselines) and labels [E], the cluster index of each expert in `plan.clusters` order."""

    fused: np.ndarray | None
    labels: np.ndarray | None
    weights: tuple[float, float, float] | None = None  # chosen by the weight search
    recon_error: float | None = None  # R of the kept set, when evaluated


def layer_seed(seed: int, layer_id: str) -> int:
    """A 31-bit seed per (seed, layer): layers differ, runs repeat (crc32, not Python's hash)."""
    ss = np.random.SeedSequence([int(seed), zlib.crc32(layer_id.encode())])
    return int(ss.generate_state(1)[0] % (2**31 - 1))


def layer_views(s: LayerStats, weight: np.ndarray | None, opts: Options) -> dict[str, np.ndarray]:
    """The [E, E] distance views the method uses (views with weight 0 are not computed)."""
    out = {}
    for name, w in opts.view_weights.items():
        if w == 0:
            continue
        if name == "router":
            out[name] = views.router_distance(weight, opts.router_metric)
        elif name == "coact":
            out[name] = views.coactivation_distance(s.coact, s.freq, opts.coact_mode)
        else:
            out[name] = views.prototype_distance(s.proto_sum, s.freq)
    return out


def cluster_group(d: np.ndarray, freq: np.ndarray, k: int, seed: int, restarts: int) -> list[tuple[list[int], int]]:
    """Live before dead in one routing group: [(members, kept member)] of k clusters.

    d [n, n] fused distances, freq [n]. When at least k experts were selected by some token
    (live), K-Medoids clusters only the live ones, so every cluster keeps a live expert, and
    each never-selected (dead) expert joins the cluster of its nearest medoid. When fewer than k
    are live, every live expert is kept as its own cluster and K-Medoids on the dead ones picks
    the k - live dead experts that fill the remaining places (their medoids).
    """
    live, dead = np.flatnonzero(freq > 0), np.flatnonzero(freq == 0)
    if live.size >= k:
        c = cluster.kmedoids(d[np.ix_(live, live)], k, seed, restarts)
        labels = np.empty(d.shape[0], dtype=np.int64)
        labels[live] = c.labels
        if dead.size:
            labels[dead] = np.argmin(d[np.ix_(dead, live[c.medoids])], axis=1)
        return cluster.representatives(labels, live[c.medoids], freq)
    out = [([int(e)], int(e)) for e in live]
    c = cluster.kmedoids(d[np.ix_(dead, dead)], k - live.size, seed, restarts)
    for members, rep in cluster.representatives(c.labels, c.medoids, freq[dead]):
        out.append(([int(dead[m]) for m in members], int(dead[rep])))
    return sorted(out, key=lambda mr: mr[1])


def cluster_layer(fused: np.ndarray, freq: np.ndarray, setup: GroupSetup, seed: int, restarts: int) -> list[Cluster]:
    """K-Medoids inside each routing group on fused [E, E]; one representative per cluster."""
    clusters = []
    for ids in setup.groups:
        for members, rep in cluster_group(fused[np.ix_(ids, ids)], freq[ids], setup.per_group_k, seed, restarts):
            member_ids = tuple(int(ids[m]) for m in members)
            clusters.append(Cluster(member_ids, int(ids[rep]), tuple(int(freq[e]) for e in member_ids)))
    return sorted(clusters, key=lambda c: c.representative)


def dead_kept_note(kept_dead: list[int], freq: np.ndarray, setup: GroupSetup) -> str:
    """Why never-selected experts were kept ('' when none were): the groups short of live ones."""
    if not kept_dead:
        return ""
    short = [
        (int((freq[ids] > 0).sum()), len(ids)) for ids in setup.groups if (freq[ids] > 0).sum() < setup.per_group_k
    ]
    where = (
        f"only {short[0][0]} of {short[0][1]} experts were selected by any token, fewer than K={setup.per_group_k}"
        if len(setup.groups) == 1
        else f"{len(short)} routing group(s) had fewer than {setup.per_group_k} experts selected by any token"
    )
    return f"{len(kept_dead)} never-selected expert(s) kept because {where}; every selected expert is kept"


def coverage(s: LayerStats, kept: list[int]) -> tuple[float, float]:
    """Share of routed selections (freq) and of gate mass received by the kept experts."""
    f_total, g_total = float(s.freq.sum()), float(s.gate_mass.sum())
    tokens = float(s.freq[kept].sum()) / f_total if f_total > 0 else 0.0
    mass = float(s.gate_mass[kept].sum()) / g_total if g_total > 0 else 0.0
    return min(tokens, 1.0), min(mass, 1.0)


def _clustered(s: LayerStats, weight, setup: GroupSetup, opts: Options, seed: int, fn):
    """(fused [E, E], clusters) of the view methods; with `fn` (a LayerFunction) the
    representatives are chosen by reconstruction."""
    fused = fuse.fuse(layer_views(s, weight, opts), opts.view_weights, opts.norm)
    clusters = cluster_layer(fused, s.freq, setup, seed, opts.restarts)
    if fn is not None and opts.representative == "reconstruction":
        clusters = refine.refine_representatives(clusters, fn, s.freq)
    return fused, tuple(clusters)


def select_layer(
    layer_id: str, s: LayerStats, weight: np.ndarray | None, setup: GroupSetup, opts: Options, fn=None
) -> tuple[LayerPlan, LayerDetail]:
    """Selection for one layer. weight: router weight [E, H] float64 (None if unused); fn: the
    layer's `reconstruct.LayerFunction` when `opts.reconstructs` (else None)."""
    seed = layer_seed(opts.seed, layer_id)
    fused, labels, clusters, chosen = None, None, (), None
    if opts.method in VIEW_METHODS:
        if opts.weight_search:  # the grid point whose kept set reconstructs the layer best
            trials = []
            for w in WEIGHT_GRID:
                o = dataclasses.replace(opts, weights=w, weight_search=False)
                f, c = _clustered(s, weight, setup, o, seed, fn)
                trials.append((fn.error([x.representative for x in c]), w, f, c))
            _, chosen, fused, clusters = min(trials, key=lambda t: t[0])  # ties: earlier grid point
        else:
            fused, clusters = _clustered(s, weight, setup, opts, seed, fn)
        kept = [c.representative for c in clusters]
        labels = np.empty(s.num_experts, dtype=np.int64)
        for i, c in enumerate(clusters):
            labels[list(c.members)] = i
    elif opts.method in RECON_METHODS:
        kept = refine.prune(fn, s.freq, setup.groups, setup.per_group_k)
    else:
        scores = baselines.ranking_scores(opts.method, s, np.random.default_rng(seed), layer_id)
        live = s.freq > 0
        kept = sorted(i for ids in setup.groups for i in baselines.top_k(scores, setup.per_group_k, ids, live))
    never = np.flatnonzero(s.freq == 0)
    dead_kept = sorted(set(kept) & set(never.tolist()))
    note = dead_kept_note(dead_kept, s.freq, setup)
    if dead_kept:
        log.warning("layer %s: %s", layer_id, note)
    tok, mass = coverage(s, kept)
    plan = LayerPlan(tuple(sorted(kept)), clusters, tok, mass, tuple(int(i) for i in never), tuple(dead_kept), note)
    return plan, LayerDetail(fused, labels, chosen, None if fn is None else fn.error(sorted(kept)))


UNOBSERVED_RULE = (
    "a MoE layer the statistics could not observe keeps, in each routing group, the medoids of "
    "K-Medoids on router-weight distance alone (no frequency, co-activation or prototype exists for it)"
)


def select_unobserved(layer_id: str, weight: np.ndarray, setup: GroupSetup, opts: Options) -> LayerPlan:
    """A MoE layer without routing statistics (an MTP layer transformers does not run): the
    router view alone, each cluster kept by its medoid (UNOBSERVED_RULE); hash-routed layers get
    their substitutes from these clusters as any other."""
    d = views.router_distance(weight, opts.router_metric)
    seed = layer_seed(opts.seed, layer_id)
    clusters = []
    for ids in setup.groups:
        c = cluster.kmedoids(d[np.ix_(ids, ids)], setup.per_group_k, seed, opts.restarts)
        for i, medoid in enumerate(c.medoids):
            members = [int(ids[m]) for m in np.flatnonzero(c.labels == i)]
            clusters.append(Cluster(tuple(members), int(ids[medoid])))
    clusters.sort(key=lambda c: c.representative)
    return LayerPlan(tuple(sorted(c.representative for c in clusters)), tuple(clusters))


SUBSTITUTE_RULE = (
    "in a hash-routed layer each slot of a token that names a dropped expert goes to the first of "
    "that expert's ranked kept experts which the token's row does not already name: its cluster's "
    "kept expert, then the other kept experts by router-row cosine (for ranking methods: by cosine "
    "alone), so every token keeps k distinct experts; the proxy's table and verify's reference "
    "follow it"
)


def hash_substitutes(plan: LayerPlan, weight: np.ndarray) -> dict[int, tuple[int, ...]]:
    """Dropped expert -> all kept experts, in the order its hash-routed tokens' slots take them
    (SUBSTITUTE_RULE); `weight` [E, H] is the layer's router.

    A token's hashed experts are fixed by its id, so dropping one would leave the token without
    it; the expert that stands for it in the proxy (its cluster's representative) receives its
    tokens and its gate mass, as the paper's proxy gives it the dropped expert's routed tokens.
    When the token already has that expert, the next nearest kept one takes the slot: a repeated
    expert would be summed by transformers but counted once by Megatron-LM's hash router, so the
    two frameworks would compute different proxies."""
    kept = list(plan.kept)
    rep = {m: c.representative for c in plan.clusters for m in c.members if m != c.representative}
    unit = weight / np.linalg.norm(weight, axis=1, keepdims=True).clip(1e-12)
    similarity = unit @ unit[kept].T  # [E, K]
    out = {}
    for e in range(weight.shape[0]):
        if e in kept:
            continue
        by_cosine = [kept[int(j)] for j in np.argsort(-similarity[e], kind="stable")]
        first = [rep[e]] if e in rep else []
        out[e] = tuple(first + [k for k in by_cosine if k not in first])
    return out


def _router_source(source, stats: RoutingStats, num_groups, group_topk, score_function):
    """(spec or None, routing facts, router-weight getter, iteration, fingerprint thunk) for a
    ModelView or a {layer id: [E, H]} mapping. Reads no tensor: the fingerprint is deferred
    until every check has passed."""
    from mcore_proxy.checkpoint.view import ModelView, router_fingerprint

    if isinstance(source, ModelView):
        spec = source.spec
        names = set(source.names())
        missing = [lid for lid in spec.moe_layer_ids if router_weight_name(lid) not in names]
        if missing:
            raise PlanError(
                f"the checkpoint has no router weight for MoE layers {missing}; "
                "check that it is a complete MoE checkpoint"
            )
        facts = dict(
            topk=spec.topk,
            num_groups=spec.num_groups if num_groups is None else num_groups,
            group_topk=spec.group_topk if group_topk is None else group_topk,
            score_function=score_function or spec.score_function,
            pre_softmax=spec.pre_softmax,
        )
        get = lambda lid: source.get(router_weight_name(lid))  # noqa: E731
        return spec, facts, get, source.iteration, lambda: router_fingerprint(source)
    if not isinstance(source, Mapping):
        raise TypeError("select_experts needs a ModelView or a {layer id: router weight} mapping")
    missing = sorted(set(stats.layers) - set(source), key=layer_sort_key)
    if missing:
        raise PlanError(f"no router weight given for layers {', '.join(missing)}")
    facts = dict(
        topk=stats.topk,
        num_groups=num_groups,
        group_topk=group_topk,
        score_function=score_function or "softmax",
        pre_softmax=False,
    )
    return None, facts, source.__getitem__, None, lambda: None


def has_expert_weights(view) -> bool:
    """Whether a ModelView holds the routed experts' weights of its first MoE layer."""
    names = set(view.names())
    return all(n in names for n in reconstruct.expert_weight_names(view.spec.moe_layer_ids[0], 0))


def resolve_refinements(
    method: str, representative: str | None, weight_search: bool | None, experts_available: bool
) -> tuple[str, bool, str]:
    """(representative, weight_search, fallback note): None takes DEFAULT_REFINEMENTS for
    multiview (the paper's rule for every other method); a default that needs expert weights the
    source lacks falls back to the paper's rule, with a note for the plan."""
    defaults = DEFAULT_REFINEMENTS if method == "multiview" else {"representative": "frequency", "weight_search": False}
    rep = defaults["representative"] if representative is None else representative
    search = defaults["weight_search"] if weight_search is None else bool(weight_search)
    needs = rep != "frequency" or search
    if needs and not experts_available and representative is None and weight_search is None:
        return (
            "frequency",
            False,
            ("the default refinements read expert weights, which the source does not hold: the paper's rule was used"),
        )
    return rep, search, ""


def run_selection(
    source,
    stats: RoutingStats,
    num_experts: int,
    *,
    method: str = "multiview",
    target_ep: int = 1,
    weights=DEFAULT_WEIGHTS,
    coact_mode: str = "partners",
    norm: str = "minmax",
    router_metric: str = "cosine",
    group_policy: str | None = None,
    seed: int = 0,
    restarts: int = 8,
    num_groups: int | None = None,
    group_topk: int | None = None,
    score_function: str | None = None,
    representative: str | None = None,
    weight_search: bool | None = None,
    topk: int | str | None = None,
    progress: Callable[[Iterable], Iterable] | None = None,
    keep_matrices: bool = True,
) -> tuple[SelectionPlan, dict[str, LayerDetail]]:
    """Choose `num_experts` (K) experts in every MoE layer: (the plan, per-layer details for the
    report). `select_experts` returns the plan alone.

    source: a ModelView (router weights `decoder.layers.{L}.mlp.router.weight` [E, H], model
    spec, iteration and router fingerprint come from it) or a mapping {layer id: [E, H] array or
    tensor} (then the fingerprint is None and routing groups come from the keywords).
    stats: RoutingStats of exactly the checkpoint's MoE layers (MTP included).
    method: one of METHODS ("multiview", a view subset such as "router+coact", or a ranking
    baseline "frequency", "gate-mass", "saliency", "random", "first-k").
    target_ep: expert-parallel degree K must divide. weights: (R, C, P) fusion weights
    (DEFAULT_WEIGHTS).
    coact_mode: "partners" | "substitutes". norm: "minmax" | "rank". router_metric: "cosine" |
    "euclidean". group_policy: "per-group" | "flatten" (None: per-group when the router is
    group-limited). seed, restarts: K-Medoids restarts (and the random baseline's seed).
    num_groups / group_topk / score_function: override the checkpoint's routing settings.
    representative: "frequency" (the most frequent member of each cluster) | "reconstruction"
    (the member that best reconstructs the layer's output, `refine.refine_representatives`).
    weight_search: choose each layer's (R, C, P) weights from WEIGHT_GRID by reconstruction.
    Both None: DEFAULT_REFINEMENTS for "multiview" (see `resolve_refinements`).
    topk: the proxy router's top-k, `constraints.proxy_topk` (None: the source's; a number; "auto").
    method "recon-prune": backward elimination by reconstruction, no clustering. The
    reconstruction options read the layer's expert weights (`reconstruct.layer_function`).
    progress: wraps the iterable of layer ids (e.g. tqdm). keep_matrices False: details without
    the fused distance matrices and cluster labels, so memory does not grow with depth.
    Raises PlanError / StatsError (ProxyError) on infeasible settings before reading tensors.
    """
    spec, facts, get_weight, iteration, fingerprint = _router_source(
        source, stats, num_groups, group_topk, score_function
    )
    representative, weight_search, fallback = resolve_refinements(
        method, representative, weight_search, spec is not None and has_expert_weights(source)
    )
    opts = Options(
        method, tuple(weights), coact_mode, norm, router_metric, int(seed), int(restarts), representative, weight_search
    )
    if spec is not None:  # bare router weights take top-k from the statistics: nothing to match
        check_stats_match(stats, spec)
    E = stats.num_experts
    grouped = group_policy != "flatten"  # flattened, the proxy routes without groups
    fewest = fewest_proxy_topk(
        facts["score_function"],
        facts["pre_softmax"],
        facts["num_groups"] if grouped else None,
        facts["group_topk"] if grouped else None,
    )
    routed = proxy_topk(topk, facts["topk"], E, num_experts, fewest)
    check_sizes(E, num_experts, routed, target_ep)
    setup = resolve_groups(
        E, num_experts, routed, facts["num_groups"], facts["group_topk"], facts["score_function"], group_policy
    )
    needs_router = opts.view_weights.get("router", 0) > 0 or opts.reconstructs
    if opts.reconstructs and spec is None:
        raise PlanError(
            f"--method {opts.method} with reconstruction reads expert weights: "
            "select from a checkpoint (a ModelView), not bare router weights"
        )
    layer_ids = spec.moe_layer_ids if spec is not None else stats.layer_ids
    hashed = set(spec.hash_layer_ids) if spec is not None else set()
    unobserved = {lid: why for lid, why in stats.meta.get("unobserved_layers", {}).items() if lid in layer_ids}
    layers, details = {}, {}
    for lid in progress(layer_ids) if progress else layer_ids:
        weight = None
        if lid in unobserved:
            layers[lid] = select_unobserved(lid, reconstruct.as_float64(get_weight(lid)), setup, opts)
            details[lid] = LayerDetail(None, None, None, None)
            continue
        if needs_router:
            weight = reconstruct.as_float64(get_weight(lid))
            if weight.shape != (E, stats.hidden_size):
                raise PlanError(
                    f"router weight of layer {lid} has shape {weight.shape}, expected "
                    f"({E}, {stats.hidden_size}) as in the statistics"
                )
        fn = reconstruct.layer_function(source, lid, stats.layers[lid], weight) if opts.reconstructs else None
        layers[lid], details[lid] = select_layer(lid, stats.layers[lid], weight, setup, opts, fn)
        if not keep_matrices:  # [E, E] per layer: only the report draws them
            details[lid] = dataclasses.replace(details[lid], fused=None, labels=None)
        if lid in hashed:
            weight = reconstruct.as_float64(get_weight(lid)) if weight is None else weight
            layers[lid] = dataclasses.replace(layers[lid], substitutes=hash_substitutes(layers[lid], weight))
    source_info = SourceInfo(E, facts["topk"], facts["num_groups"], facts["group_topk"], iteration, fingerprint())
    params = opts.params(setup.policy, stats)
    if opts.weight_search:
        params["layer_weights"] = {lid: list(details[lid].weights) for lid in layer_ids}
    if opts.reconstructs:
        params["reconstruction"]["error"] = {lid: details[lid].recon_error for lid in layer_ids}
    if fallback:
        params["refinement_fallback"] = fallback
    if routed != facts["topk"]:
        params["proxy_topk"] = {"requested": topk, "source": facts["topk"], "proxy": routed, "rule": PROXY_TOPK_RULE}
    if hashed:
        params["hash_routing"] = {"layers": sorted(hashed, key=layer_sort_key), "rule": SUBSTITUTE_RULE}
    if unobserved:
        params["unobserved_layers"] = {"layers": unobserved, "rule": UNOBSERVED_RULE}
    plan = SelectionPlan(source_info, num_experts, target_ep, opts.method, params, setup.router, layers)
    return plan, details


def select_experts(source, stats: RoutingStats, num_experts: int, **options) -> SelectionPlan:
    """Choose `num_experts` (K) experts in every MoE layer and return the plan: `run_selection`
    with its keywords, without the per-layer details."""
    return run_selection(source, stats, num_experts, keep_matrices=False, **options)[0]
