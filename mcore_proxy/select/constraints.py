"""Feasibility checks made before any work, and the proxy's routing groups.

With group-limited routing (G groups, the router first picks g groups, then top-k experts
inside them) the proxy either keeps G groups of K/G experts (`per-group`) or drops grouping
(`flatten`, G = 1). Megatron scores a group by its best top-k/g experts, so every kept group
needs at least top-k/g experts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from mcore_proxy.core.errors import PlanError, StatsError
from mcore_proxy.select.plan import RouterSettings
from mcore_proxy.core.stats import RoutingStats, layer_sort_key

log = logging.getLogger(__name__)

GROUP_POLICIES = ("per-group", "flatten")


@dataclass(frozen=True, repr=False)
class GroupSetup:
    """groups: original expert ids of each routing group, [G] arrays of E/G (one group of E when
    routing is not grouped or is flattened); per_group_k: experts to keep in each group;
    policy: "per-group", "flatten" or "none" (source not grouped); router: the proxy's settings."""

    groups: tuple[np.ndarray, ...]
    per_group_k: int
    policy: str
    router: RouterSettings


PROXY_TOPK_RULE = "round(top-k x K / E), at least the fewest Megatron routes: the share of experts a token uses kept"


def fewest_proxy_topk(
    score_function: str, pre_softmax: bool, num_groups: int | None, group_topk: int | None
) -> tuple[int, str]:
    """(the smallest top-k Megatron routes correctly for this router, why): 2 where scores are a
    softmax over the chosen experts (Megatron refuses top-1, whose every gate is 1); with
    group-limited routing over g groups at least g, since a group is scored by its best top-k // g
    experts (`--group-policy flatten` routes without groups)."""
    if num_groups and num_groups > 1 and group_topk:
        return int(
            group_topk
        ), f"group-limited routing scores each of its {group_topk} groups by its best top-k // {group_topk} experts"
    if score_function == "softmax" and not pre_softmax:
        return 2, "softmax after top-k: Megatron refuses top-1, whose every gate is 1"
    return 1, ""


def proxy_topk(
    requested: int | str | None, topk: int, num_experts: int, k: int, fewest: tuple[int, str] = (1, "")
) -> int:
    """The proxy router's top-k (experts per token): the source's `topk` when `requested` is None,
    the number asked for, or "auto" (PROXY_TOPK_RULE): with top-8 of 64 and K = 16, top-2, so a
    token mixes a quarter of the kept experts as it mixed an eighth of all, instead of half of them.
    Kept experts' weights are untouched either way; only the number each token uses changes.
    fewest: `fewest_proxy_topk` of the proxy's router."""
    least, why = fewest
    if requested is None:
        return topk
    if requested == "auto":
        return min(topk, max(least, round(topk * k / num_experts)))
    try:
        n = int(requested)
    except ValueError:
        raise PlanError(f"--proxy-topk {requested!r} is neither a number nor 'auto', e.g. --proxy-topk 2") from None
    if not least <= n <= k:
        raise PlanError(f"--proxy-topk {n} must be in {least}..{k}" + (f" ({why})" if n < least else ""))
    return n


def check_sizes(num_experts: int, k: int, topk: int, target_ep: int) -> None:
    """K < E, K divisible by the target EP degree, top-k <= K."""
    if not 0 < k < num_experts:
        raise PlanError(
            f"--num-experts {k} must be in 1..{num_experts - 1}: the checkpoint has "
            f"{num_experts} experts per layer and a proxy keeps fewer (to keep all of them and only "
            "re-shard, run `mcore-proxy convert` without --plan)"
        )
    if target_ep < 1 or k % target_ep:
        raise PlanError(
            f"--num-experts {k} is not divisible by --target-ep {target_ep}; choose K "
            f"as a multiple of the expert-parallel degree"
        )
    if topk > k:
        raise PlanError(
            f"--num-experts {k} is smaller than the router top-k {topk}; a token "
            f"needs at least {topk} experts, choose K >= {topk}"
        )


def resolve_groups(
    num_experts: int,
    k: int,
    topk: int,
    num_groups: int | None,
    group_topk: int | None,
    score_function: str = "softmax",
    policy: str | None = None,
) -> GroupSetup:
    """Decide the proxy's routing groups; PlanError when the policy cannot be met."""
    if policy is not None and policy not in GROUP_POLICIES:
        raise PlanError(f"--group-policy {policy!r} is not one of {GROUP_POLICIES}")
    grouped = bool(num_groups and num_groups > 1 and group_topk)
    all_ids = (np.arange(num_experts),)
    if not grouped:
        if policy == "per-group":
            log.info("the source router is not group-limited; --group-policy per-group has no effect")
        return GroupSetup(all_ids, k, "none", RouterSettings(topk, num_groups, group_topk, score_function))
    G, g = int(num_groups), int(group_topk)
    if num_experts % G:
        raise PlanError(
            f"the checkpoint has {num_experts} experts in {G} routing groups, which "
            "does not divide; check moe_router_num_groups in its args"
        )
    if (policy or "per-group") == "flatten":
        log.warning(
            "--group-policy flatten: the proxy routes over its %d experts without "
            "groups (num_groups=1, group_topk=1) instead of %d groups / top-%d",
            k,
            G,
            g,
        )
        return GroupSetup(all_ids, k, "flatten", RouterSettings(topk, 1, 1, score_function))
    if k % G:
        raise PlanError(
            f"--num-experts {k} is not divisible by the {G} routing groups; choose a "
            f"multiple of {G} or pass --group-policy flatten"
        )
    if (k // G) * g < topk:
        need = -(-topk // g)
        raise PlanError(
            f"--num-experts {k} leaves {k // G} experts per routing group, but top-{topk} "
            f"over {g} groups needs at least {need} per group; choose K >= {need * G} "
            "or pass --group-policy flatten"
        )
    groups = tuple(np.arange(num_experts).reshape(G, num_experts // G))
    return GroupSetup(groups, k // G, "per-group", RouterSettings(topk, G, g, score_function))


def check_stats_match(stats: RoutingStats, spec, stats_name: str = "the statistics") -> None:
    """The statistics describe the checkpoint's model: E, H, top-k and exactly its MoE layers
    (MTP included). spec: a ModelSpec."""
    if stats.num_experts != spec.num_experts:
        raise StatsError(
            f"{stats_name}: {stats.num_experts} experts per layer but the checkpoint "
            f"has {spec.num_experts}; use statistics traced on this model"
        )
    if stats.hidden_size != spec.hidden_size:
        raise StatsError(
            f"{stats_name}: hidden size {stats.hidden_size} but the checkpoint has "
            f"{spec.hidden_size}; use statistics traced on this model"
        )
    if stats.topk != spec.topk:
        raise StatsError(
            f"{stats_name}: traced with top-{stats.topk} but the checkpoint routes "
            f"top-{spec.topk}; use statistics traced on this model"
        )
    want = set(spec.moe_layer_ids)
    # layers the collector could not run (e.g. MTP layers transformers does not build) are selected
    # without statistics (selector.select_unobserved); any other missing layer is an error
    missing = sorted(want - set(stats.layers) - set(stats.meta.get("unobserved_layers", {})), key=layer_sort_key)
    extra = sorted(set(stats.layers) - want, key=layer_sort_key)
    if missing:
        raise StatsError(
            f"{stats_name}: no statistics for MoE layers {', '.join(missing)} of the "
            "checkpoint; trace every MoE layer (MTP included) and merge all rank files"
        )
    if extra:
        raise StatsError(
            f"{stats_name}: layers {', '.join(extra)} are not MoE layers of the "
            "checkpoint; use statistics traced on this model"
        )
    empty = [lid for lid in stats.layer_ids if stats.layers[lid].freq.sum() <= 0]
    if empty:
        raise StatsError(
            f"{stats_name}: MoE layers {', '.join(empty)} routed no tokens; collect statistics over some data"
        )
