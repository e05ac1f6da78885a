"""select_experts end to end on planted statistics (issue 4 acceptance)."""

import json

import numpy as np
import pytest

from mcore_proxy.core.errors import PlanError, StatsError
from mcore_proxy.select import METHODS, VIEW_METHODS, select_experts
from mcore_proxy.select.selector import RECON_METHODS
from mcore_proxy.select.synthetic import adjusted_rand_index, plan_labels

E, K = 32, 8
NOISY = {"router": dict(router_noise=4.0), "coact": dict(coact_noise=0.97), "proto": dict(proto_noise=4.0)}


def recovery(plan, planted):
    """Mean adjusted Rand index of the plan's clusters against the planted ones."""
    return np.mean([adjusted_rand_index(plan_labels(plan.layers[lid], E), p.labels) for lid, p in planted.items()])


def test_adjusted_rand_index_by_hand():
    assert adjusted_rand_index([0, 0, 1, 1], [5, 5, 7, 7]) == 1.0
    # contingency [[1, 1], [0, 2]]: index 1 pair, expected 2 * 3 / 6 = 1, max 2.5 -> 0
    assert adjusted_rand_index([0, 0, 1, 1], [0, 1, 1, 1]) == pytest.approx(0.0)
    # contingency [[2, 1, 0], [0, 1, 2]]: index 2, expected 6 * 3 / 15, max 4.5
    assert adjusted_rand_index([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]) == pytest.approx(0.8 / 3.3)
    assert adjusted_rand_index([0, 1, 2, 3], [0, 1, 2, 3]) == 1.0


@pytest.mark.parametrize("mode", ["partners", "substitutes"])
def test_multiview_recovers_planted_clusters_and_keeps_most_frequent(planted_model, mode):
    view, stats, planted = planted_model(mode=mode)
    plan = select_experts(view, stats, K, coact_mode=mode)
    assert recovery(plan, planted) >= 0.9
    for lid, p in planted.items():
        freq = stats.layers[lid].freq
        expected = sorted(int(np.flatnonzero(p.labels == c)[np.argmax(freq[p.labels == c])]) for c in range(K))
        assert plan.kept(lid) == expected
        # each cluster records its members' frequencies: the weights of convert --merge-clusters
        for c in plan.layers[lid].clusters:
            assert c.frequencies == tuple(int(freq[m]) for m in c.members)
    assert plan.params["coact_mode"] == mode


@pytest.mark.parametrize("mode", ["partners", "substitutes"])
@pytest.mark.parametrize("noisy", ["router", "coact", "proto"])
def test_a_noisy_view_alone_recovers_less_than_all_three(planted_model, mode, noisy):
    view, stats, planted = planted_model(mode=mode, **NOISY[noisy])
    fused = recovery(select_experts(view, stats, K, coact_mode=mode), planted)
    alone = recovery(select_experts(view, stats, K, coact_mode=mode, method=noisy), planted)
    assert fused >= 0.9
    assert alone < fused - 0.3


def test_every_method_keeps_k_per_layer_and_records_itself(default_model):
    view, stats, _ = default_model
    for method in METHODS:
        if method in RECON_METHODS:  # needs expert weights: tests/select/test_select_recon.py
            with pytest.raises(PlanError, match="reconstruction reads every expert's weights"):
                select_experts(view, stats, K, method=method)
            continue
        plan = select_experts(view, stats, K, method=method)
        assert plan.method == method and sorted(plan.layers) == sorted(view.spec.moe_layer_ids)
        assert all(len(plan.kept(lid)) == K for lid in plan.layers)
        if method in VIEW_METHODS:
            assert sorted(plan.params["views"]) == sorted(VIEW_METHODS[method])
            assert all(len(lp.clusters) == K for lp in plan.layers.values())
        else:
            assert all(lp.clusters == () for lp in plan.layers.values())


def test_baselines_through_select_experts(default_model):
    view, stats, _ = default_model
    for lid, s in stats.layers.items():
        by = {
            m: select_experts(view, stats, K, method=m).kept(lid)
            for m in ("frequency", "gate-mass", "saliency", "first-k")
        }
        assert by["frequency"] == sorted(np.argsort(-s.freq, kind="stable")[:K].tolist())
        assert by["gate-mass"] == sorted(np.argsort(-s.gate_mass, kind="stable")[:K].tolist())
        mean_sal = s.saliency_sum / s.freq
        assert by["saliency"] == sorted(np.argsort(-mean_sal, kind="stable")[:K].tolist())
        assert by["first-k"] == list(range(K))


def test_frequency_has_the_best_token_coverage(default_model):
    view, stats, _ = default_model
    freq_plan = select_experts(view, stats, K, method="frequency")
    for method in ("multiview", "random", "first-k"):
        plan = select_experts(view, stats, K, method=method)
        for lid in plan.layers:
            assert plan.layers[lid].token_coverage <= freq_plan.layers[lid].token_coverage + 1e-12


def test_coverage_is_the_kept_share(default_model):
    view, stats, _ = default_model
    plan = select_experts(view, stats, K)
    for lid, lp in plan.layers.items():
        s = stats.layers[lid]
        assert lp.token_coverage == pytest.approx(s.freq[list(lp.kept)].sum() / s.freq.sum())
        assert lp.gate_mass_coverage == pytest.approx(s.gate_mass[list(lp.kept)].sum() / s.gate_mass.sum())


@pytest.mark.parametrize("method", ["multiview", "random", "router+proto"])
def test_deterministic_for_a_seed(default_model, method):
    view, stats, _ = default_model
    runs = [json.dumps(select_experts(view, stats, K, method=method, seed=3).to_json()) for _ in range(2)]
    assert runs[0] == runs[1]


def test_random_depends_on_seed_and_layer(default_model):
    view, stats, _ = default_model
    a = select_experts(view, stats, K, method="random", seed=0)
    b = select_experts(view, stats, K, method="random", seed=1)
    assert a.kept("1") != b.kept("1")
    assert a.kept("1") != a.kept("2")


@pytest.mark.parametrize("method", [m for m in METHODS if m not in RECON_METHODS])
def test_per_group_keeps_exactly_k_over_g_in_each_group(planted_model, method):
    # 32 experts in 4 groups of 8, 2 groups selected, top-2: K=8 keeps 2 per group
    view, stats, _ = planted_model(num_groups=4, group_topk=2)
    plan = select_experts(view, stats, K, method=method)
    assert plan.params["group_policy"] == "per-group"
    assert plan.router.to_json() == {"topk": 2, "num_groups": 4, "group_topk": 2, "score_function": "sigmoid"}
    for lid in plan.layers:
        per_group = np.bincount(np.array(plan.kept(lid)) // 8, minlength=4)
        assert per_group.tolist() == [2, 2, 2, 2]
        for c in plan.layers[lid].clusters:  # clusters never cross a group
            assert len({m // 8 for m in c.members}) == 1


def test_per_group_infeasible_and_flatten(planted_model):
    view, stats, _ = planted_model(num_groups=4, group_topk=1)
    with pytest.raises(PlanError, match="--num-experts 6 is not divisible by the 4 routing groups"):
        select_experts(view, stats, 6)
    # top-2 over 1 group needs 2 per group; K=4 leaves 1
    with pytest.raises(PlanError, match="leaves 1 experts per routing group"):
        select_experts(view, stats, 4)
    plan = select_experts(view, stats, 4, group_policy="flatten")
    assert plan.params["group_policy"] == "flatten"
    assert (plan.router.num_groups, plan.router.group_topk) == (1, 1)
    assert (plan.source.num_groups, plan.source.group_topk) == (4, 1)


def test_never_selected_experts_are_listed_and_lose_to_selected_ones(planted_model):
    dead = (0, 5, 9)
    view, stats, _ = planted_model(dead=dead)
    plan = select_experts(view, stats, K)
    for lid, lp in plan.layers.items():
        assert lp.never_selected == dead
        for c in lp.clusters:
            if any(stats.layers[lid].freq[m] > 0 for m in c.members):
                assert c.representative not in dead


def test_plan_records_source_and_params(default_model):
    view, stats, _ = default_model
    from mcore_proxy.checkpoint.view import router_fingerprint

    plan = select_experts(
        view, stats, K, target_ep=4, weights=(2, 1, 1), norm="rank", router_metric="euclidean", restarts=3, seed=9
    )
    d = plan.to_json()
    assert d["source"] == {
        "num_experts": E,
        "topk": 2,
        "num_groups": None,
        "group_topk": None,
        "iteration": 100,
        "router_fingerprint": router_fingerprint(view),
    }
    assert d["target"] == {"num_experts": K, "expert_parallel_size": 4}
    assert d["params"]["weights"] == {"router": 0.5, "coact": 0.25, "proto": 0.25}
    assert {
        k: d["params"][k] for k in ("normalisation", "router_metric", "restarts", "seed", "coact_mode", "group_policy")
    } == {
        "normalisation": "rank",
        "router_metric": "euclidean",
        "restarts": 3,
        "seed": 9,
        "coact_mode": "partners",
        "group_policy": "none",
    }
    assert list(d["layers"]) == ["1", "2", "mtp.0"]


def test_a_view_with_zero_weight_is_not_used(default_model):
    view, stats, _ = default_model
    plan = select_experts(view, stats, K, weights=(0, 1, 1))
    assert plan.params["views"] == ["coact", "proto"]
    pair = select_experts(view, stats, K, method="coact+proto")
    assert plan.to_json()["layers"] == pair.to_json()["layers"]


def test_router_weights_as_a_mapping(default_model):
    view, stats, planted = default_model
    weights = {lid: p.router for lid, p in planted.items()}
    plan = select_experts(weights, stats, K)
    assert plan.source.router_fingerprint is None
    assert plan.kept("1") == select_experts(view, stats, K).kept("1")
    with pytest.raises(PlanError, match="no router weight given for layers mtp.0"):
        select_experts({"1": weights["1"], "2": weights["2"]}, stats, K)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(method="kmeans"), PlanError, "--method 'kmeans' is not one of"),
        (dict(weights=(1, -1, 1)), PlanError, "three non-negative numbers"),
        (dict(weights=("a", 1, 1)), PlanError, "three non-negative numbers"),
        (dict(weights=(1, 1)), PlanError, "three non-negative numbers"),
        (dict(weights=(1, 0, 0), method="coact+proto"), PlanError, "every view of --method coact\\+proto weight 0"),
        (dict(coact_mode="rivals"), PlanError, "--coact-mode 'rivals'"),
        (dict(restarts=0), PlanError, "--restarts 0"),
        (dict(target_ep=3), PlanError, "not divisible by --target-ep 3"),
    ],
)
def test_bad_options_are_refused(default_model, kwargs, error, match):
    view, stats, _ = default_model
    with pytest.raises(error, match=match):
        select_experts(view, stats, K, **kwargs)


def test_missing_router_weight_and_layer_mismatch(planted_model):
    view, stats, _ = planted_model()
    _, stats_other, _ = planted_model(moe_layers=(1,))
    with pytest.raises(StatsError, match="no statistics for MoE layers 2 of the checkpoint"):
        select_experts(view, stats_other, K)
    del view._tensors["decoder.layers.2.mlp.router.weight"]
    with pytest.raises(PlanError, match=r"no router weight for MoE layers \['2'\]"):
        select_experts(view, stats, K)
