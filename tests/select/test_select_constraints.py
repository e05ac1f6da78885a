import dataclasses
import logging

import pytest

from mcore_proxy.core.errors import PlanError, StatsError
from mcore_proxy.select.constraints import (
    check_sizes,
    check_stats_match,
    fewest_proxy_topk,
    proxy_topk,
    resolve_groups,
)


@pytest.mark.parametrize(
    "args, match",
    [
        ((8, 8, 2, 1), "--num-experts 8 must be in 1..7"),
        ((8, 0, 2, 1), "must be in 1..7"),
        ((16, 6, 2, 4), "--num-experts 6 is not divisible by --target-ep 4"),
        ((16, 4, 8, 1), "smaller than the router top-k 8"),
    ],
)
def test_sizes_are_checked(args, match):
    with pytest.raises(PlanError, match=match):
        check_sizes(*args)


def test_ungrouped_router_keeps_one_group():
    setup = resolve_groups(16, 4, 2, None, None, "softmax", None)
    assert setup.policy == "none" and setup.per_group_k == 4
    assert [g.tolist() for g in setup.groups] == [list(range(16))]
    assert (setup.router.num_groups, setup.router.group_topk) == (None, None)


def test_per_group_is_the_default_for_grouped_routers():
    # DeepSeek-V3 shape: 256 experts in 8 groups, 4 groups selected, top-8
    setup = resolve_groups(256, 16, 8, 8, 4, "sigmoid", None)
    assert setup.policy == "per-group" and setup.per_group_k == 2
    assert [g.tolist() for g in setup.groups] == [list(range(32 * i, 32 * i + 32)) for i in range(8)]
    assert setup.router.to_json() == {"topk": 8, "num_groups": 8, "group_topk": 4, "score_function": "sigmoid"}


def test_per_group_rejects_infeasible_settings():
    with pytest.raises(PlanError, match="--num-experts 20 is not divisible by the 8 routing groups"):
        resolve_groups(256, 20, 8, 8, 4, "sigmoid", "per-group")
    # top-8 over 4 groups needs 2 per group; K=8 leaves 1
    with pytest.raises(PlanError, match="leaves 1 experts per routing group.*at least 2.*K >= 16"):
        resolve_groups(256, 8, 8, 8, 4, "sigmoid", None)
    with pytest.raises(PlanError, match="48 experts in 5 routing groups"):
        resolve_groups(48, 10, 2, 5, 2, "softmax", None)
    with pytest.raises(PlanError, match="--group-policy 'spread'"):
        resolve_groups(16, 4, 2, 4, 2, "softmax", "spread")


def test_flatten_sets_one_group_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        setup = resolve_groups(256, 8, 8, 8, 4, "sigmoid", "flatten")
    assert setup.policy == "flatten" and setup.per_group_k == 8 and len(setup.groups) == 1
    assert (setup.router.num_groups, setup.router.group_topk) == (1, 1)
    assert "without groups" in caplog.text


def test_statistics_must_match_the_checkpoint(default_model):
    view, stats, _ = default_model
    check_stats_match(stats, view.spec, "s.safetensors")
    no_mtp = dataclasses.replace(stats, layers={k: v for k, v in stats.layers.items() if k != "mtp.0"})
    with pytest.raises(StatsError, match="s.safetensors: no statistics for MoE layers mtp.0"):
        check_stats_match(no_mtp, view.spec, "s.safetensors")
    extra = dataclasses.replace(stats, layers={**stats.layers, "0": stats.layers["1"]})
    with pytest.raises(StatsError, match="layers 0 are not MoE layers"):
        check_stats_match(extra, view.spec)
    with pytest.raises(StatsError, match="top-3 but the checkpoint routes top-2"):
        check_stats_match(dataclasses.replace(stats, topk=3), view.spec)
    spec = dataclasses.replace(view.spec, num_experts=64)
    with pytest.raises(StatsError, match="32 experts per layer but the checkpoint has 64"):
        check_stats_match(stats, spec)
    spec = dataclasses.replace(view.spec, hidden_size=128)
    with pytest.raises(StatsError, match="hidden size 64 but the checkpoint has 128"):
        check_stats_match(stats, spec)
    s1 = stats.layers["1"]
    empty = dataclasses.replace(s1, tokens=0, freq=s1.freq * 0)
    with pytest.raises(StatsError, match="MoE layers 1 routed no tokens"):
        check_stats_match(dataclasses.replace(stats, layers={**stats.layers, "1": empty}), view.spec)


SOFTMAX_AFTER = fewest_proxy_topk("softmax", False, None, None)


@pytest.mark.parametrize(
    "requested, topk, num_experts, k, fewest, expected",
    [
        (None, 8, 64, 16, SOFTMAX_AFTER, 8),  # the source's
        ("auto", 8, 64, 16, SOFTMAX_AFTER, 2),  # fine-grained experts at K = E/4
        ("auto", 8, 256, 16, fewest_proxy_topk("sigmoid", False, None, None), 1),  # K = E/16: at least one
        ("auto", 8, 256, 16, SOFTMAX_AFTER, 2),  # softmax after top-k: at least two
        ("auto", 8, 256, 16, fewest_proxy_topk("sigmoid", False, 8, 4), 4),  # DeepSeek-V3: one per chosen group
        ("auto", 2, 16, 4, SOFTMAX_AFTER, 2),  # never more than the source's
        ("3", 8, 64, 16, SOFTMAX_AFTER, 3),
    ],
)
def test_proxy_topk(requested, topk, num_experts, k, fewest, expected):
    assert proxy_topk(requested, topk, num_experts, k, fewest) == expected


@pytest.mark.parametrize(
    "requested, fewest, match",
    [
        (17, SOFTMAX_AFTER, "--proxy-topk 17 must be in 2..16$"),
        (1, SOFTMAX_AFTER, "must be in 2..16 .softmax after top-k: Megatron refuses top-1"),
        (2, fewest_proxy_topk("sigmoid", False, 8, 4), "must be in 4..16 .group-limited routing scores each of its 4"),
        (0, fewest_proxy_topk("sigmoid", True, None, None), "must be in 1..16"),
        ("two", SOFTMAX_AFTER, "'two' is neither a number nor 'auto'"),
    ],
)
def test_proxy_topk_out_of_range_is_refused(requested, fewest, match):
    with pytest.raises(PlanError, match=match):
        proxy_topk(requested, 8, 64, 16, fewest)
