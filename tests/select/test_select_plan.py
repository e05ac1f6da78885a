import dataclasses
import json

import pytest

from mcore_proxy.core.errors import PlanError
from mcore_proxy.select.plan import FORMAT, Cluster, LayerPlan, RouterSettings, SelectionPlan, SourceInfo, load_plan


def make_plan(**changes):
    layers = {
        "3": LayerPlan((1, 4), (Cluster((0, 1, 2), 1), Cluster((3, 4, 5, 6, 7), 4)), 0.6, 0.55, (7,)),
        "mtp.0": LayerPlan((0, 5), (), 0.5, 0.5, ()),
    }
    fields = dict(
        source=SourceInfo(8, 2, None, None, 1000, "ab" * 32),
        num_experts=2,
        expert_parallel_size=2,
        method="multiview",
        params={"seed": 0, "weights": {"router": 0.5, "coact": 0.5}},
        router=RouterSettings(2, None, None, "softmax"),
        layers=layers,
    )
    fields.update(changes)
    return SelectionPlan(**fields)


def test_json_layout_follows_design_4_2():
    d = make_plan().to_json()
    assert d["format"] == FORMAT
    assert d["source"] == {
        "num_experts": 8,
        "topk": 2,
        "num_groups": None,
        "group_topk": None,
        "iteration": 1000,
        "router_fingerprint": "ab" * 32,
    }
    assert d["target"] == {"num_experts": 2, "expert_parallel_size": 2}
    assert d["router"] == {"topk": 2, "num_groups": None, "group_topk": None, "score_function": "softmax"}
    assert list(d["layers"]) == ["3", "mtp.0"]
    assert d["layers"]["3"] == {
        "kept": [1, 4],
        "clusters": [{"members": [0, 1, 2], "representative": 1}, {"members": [3, 4, 5, 6, 7], "representative": 4}],
        "coverage": {"tokens": 0.6, "gate_mass": 0.55},
        "never_selected": [7],
        "dead_kept": {"count": 0, "experts": [], "why": ""},
    }


def test_dead_kept_round_trips_and_older_plans_without_it_still_read(tmp_path):
    layer = LayerPlan((1, 7), never_selected=(6, 7), dead_kept=(7,), dead_note="only 1 of 8 live")
    plan = make_plan(layers={"3": layer, "mtp.0": LayerPlan((0, 5))})
    path = plan.save(tmp_path / "plan.json")
    assert load_plan(path).layers["3"] == layer
    older = json.loads(path.read_text())
    for entry in older["layers"].values():  # as written before the field existed
        del entry["dead_kept"]
    path.write_text(json.dumps(older))
    assert load_plan(path).layers["3"].dead_kept == ()
    with pytest.raises(PlanError, match="must be kept, never-selected"):
        LayerPlan((1, 7), never_selected=(6,), dead_kept=(7,))


def test_save_load_round_trip_and_overwrite(tmp_path):
    path = tmp_path / "plan.json"
    plan = make_plan()
    plan.save(path)
    make_plan(method="frequency").save(path)  # overwriting a plan is fine
    again = load_plan(path)
    assert again == dataclasses.replace(plan, method="frequency")
    assert again.kept("3") == [1, 4] and again.kept("mtp.0") == [0, 5]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left


def test_kept_of_unknown_layer_names_the_layers():
    with pytest.raises(PlanError, match=r"no MoE layer '9'.*\['3', 'mtp.0'\]"):
        make_plan().kept("9")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_experts=8), "must be in 1..7"),
        (dict(expert_parallel_size=3), "not divisible by the expert-parallel degree 3"),
        (dict(router=RouterSettings(4)), "top-k 4 exceeds K=2"),
        (dict(layers={}), "no MoE layer"),
        (dict(layers={"3": LayerPlan((1, 2, 3))}), "keeps 3 experts, expected K=2"),
        (dict(layers={"3": LayerPlan((1, 9))}), "keeps expert 9 but the source has 8"),
        (dict(layers={"x3": LayerPlan((1, 2))}), "neither"),
    ],
)
def test_plan_validation(changes, match):
    with pytest.raises(PlanError, match=match):
        make_plan(**changes)


def test_layer_plan_validation():
    with pytest.raises(PlanError, match="sorted and distinct"):
        LayerPlan((4, 1))
    with pytest.raises(PlanError, match="not among its members"):
        Cluster((0, 1), 2)
    with pytest.raises(PlanError, match="differ from kept"):
        LayerPlan((0, 2), (Cluster((0, 1), 0), Cluster((2, 3), 3)))
    with pytest.raises(PlanError, match="more than one cluster"):
        LayerPlan((0, 2), (Cluster((0, 1), 0), Cluster((1, 2), 2)))
    with pytest.raises(PlanError, match="share in"):
        LayerPlan((0,), token_coverage=1.5)
    with pytest.raises(PlanError, match="non-negative integer"):
        LayerPlan((0.5,))
    with pytest.raises(PlanError, match="one per member"):
        Cluster((0, 1), 0, frequencies=(5,))


def test_cluster_frequencies_round_trip_and_give_the_merge_weights(tmp_path):
    clusters = (Cluster((0, 1, 2), 1, (10, 30, 0)), Cluster((4, 5), 5, (0, 0)))
    plan = make_plan(layers={"3": LayerPlan((1, 5), clusters), "mtp.0": LayerPlan((0, 5))})
    path = plan.save(tmp_path / "plan.json")
    assert load_plan(path).layers["3"].clusters == clusters
    assert clusters[0].merge_weights() == (0.25, 0.75, 0.0)
    # one member, or nothing selected: nothing to weigh, the representative stays as it is
    assert Cluster((3,), 3, (4,)).merge_weights() is None and clusters[1].merge_weights() is None
    older = json.loads(path.read_text())
    for c in older["layers"]["3"]["clusters"]:  # as written before the field existed
        del c["frequencies"]
    path.write_text(json.dumps(older))
    assert all(c.frequencies is None and c.merge_weights() is None for c in load_plan(path).layers["3"].clusters)


def write(tmp_path, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def test_load_plan_errors_name_the_file(tmp_path):
    with pytest.raises(PlanError, match=r"missing\.json: plan file not found"):
        load_plan(tmp_path / "missing.json")
    path = write(tmp_path, "{not json")
    with pytest.raises(PlanError, match=rf"{path}: plan file is not valid JSON"):
        load_plan(path)
    with pytest.raises(PlanError, match="plan file holds a JSON list, expected an object"):
        load_plan(write(tmp_path, "[]"))
    d = make_plan().to_json()
    with pytest.raises(PlanError, match=r"plan.json: format is 'other/1'.*regenerate"):
        load_plan(write(tmp_path, json.dumps({**d, "format": "other/1"})))
    with pytest.raises(PlanError, match=r"plan.json: not a valid .*missing key 'router'"):
        load_plan(write(tmp_path, json.dumps({k: v for k, v in d.items() if k != "router"})))
    d["layers"]["mtp.0"]["kept"] = [0, 5, 6]
    with pytest.raises(PlanError, match=r"plan.json: layer mtp.0 keeps 3 experts"):
        load_plan(write(tmp_path, json.dumps(d)))
    d["layers"]["3"]["kept"] = [1, 5]
    with pytest.raises(PlanError, match=r"plan.json: layer 3: cluster representatives \[1, 4\] differ"):
        load_plan(write(tmp_path, json.dumps(d)))


def test_check_matches(planted_model):
    from mcore_proxy.select import select_experts

    view, stats, _ = planted_model()
    plan = select_experts(view, stats, 8, method="frequency")
    plan.check_matches(view)
    other, _, _ = planted_model(seed=5)
    with pytest.raises(PlanError, match="router weights differ"):
        plan.check_matches(other)
    fewer, _, _ = planted_model(moe_layers=(1,))
    with pytest.raises(PlanError, match=r"missing \[\], not MoE \['2'\]"):
        plan.check_matches(fewer)


def test_check_matches_refuses_another_top_k(planted_model):
    """A checkpoint whose config.json routes to another top-k than the plan was made for (fuzz: an
    HF config with num_experts_per_tok changed converted with exit 0, the proxy silently taking the
    plan's top-k)."""
    from mcore_proxy.select import select_experts

    view, stats, _ = planted_model()
    plan = select_experts(view, stats, 8, method="frequency")
    other = dataclasses.replace(plan, source=dataclasses.replace(plan.source, topk=plan.source.topk + 1))
    with pytest.raises(
        PlanError,
        match=rf"top {plan.source.topk + 1} experts but the checkpoint's chooses the top "
        rf"{plan.source.topk}; select again",
    ):
        other.check_matches(view)
