"""Each injector on real megatron-core training steps (tiny MoE GPT: 4 MoE layers, 8 experts, top-2,
AdamW): it shows its effect on the steps its schedule names, and switched off (by schedule, or
attached then closed) the run is bit-identical to one without it."""

import pytest
import torch

pytestmark = pytest.mark.megatron

FIELDS = ("maps", "probs", "experts", "rollout_logits", "train_logits", "params")
# one switched-off variant per kind (tests/faults/conftest.py SCENARIOS)
OFF = [
    "router_noise_off",
    "router_noise_closed",
    "router_weight_off",
    "router_precision_off",
    "router_tie_flip_off",
    "topk_off",
    "expert_noise_off",
    "logprob_off",
    "omit_off",
]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b  # as conftest.same


def per_step(runs, name, field="train_logits"):
    """Whether each step's record equals the baseline's, bit for bit."""
    return [same(x, y) for x, y in zip(runs[name][field], runs["none"][field])]


def test_every_kind_has_a_switched_off_scenario(scenarios):
    from mcore_proxy.faults import KINDS

    assert sorted(n for n in scenarios if n.endswith(("_off", "_closed"))) == sorted(OFF)
    kinds = {entry["fault"].split(":")[0] for n in OFF for entry in scenarios[n]["report"]}
    assert kinds | {"router_noise"} == set(KINDS)  # _closed has no report: it was closed


@pytest.mark.parametrize("name", OFF)
def test_switched_off_is_bit_identical_to_no_injector(scenarios, name):
    for field in FIELDS:
        assert same(scenarios[name][field], scenarios["none"][field]), (name, field)
    for entry in scenarios[name]["report"]:
        assert entry["active_calls"] == 0 and entry["calls"] > 0  # attached, consulted, silent
    assert name.endswith("_closed") or scenarios[name]["report"]


def test_router_noise_changes_routing_from_its_start_step(scenarios):
    assert per_step(scenarios, "router_noise", "maps") == [True, False, False, False]
    assert scenarios["router_noise"]["report"][0]["active_steps"] == [1, 2, 3]
    # only layer 2 corrupted: layers 0 and 1 route exactly as before at step 0, layer 2 does not
    run, base = scenarios["router_noise_layer"], scenarios["none"]
    for lid in ("0", "1"):
        assert torch.equal(run["probs"][0][lid], base["probs"][0][lid])
    assert not torch.equal(run["maps"][0]["2"], base["maps"][0]["2"])


def test_router_weight_is_a_fixed_perturbation_on_its_steps(scenarios):
    run, base = scenarios["router_weight"], scenarios["none"]
    assert not torch.equal(run["maps"][0]["0"], base["maps"][0]["0"])
    assert same(run, scenarios["router_weight_again"])  # reproducible
    assert run["report"][0]["active_steps"] == [0, 2]


def test_router_precision_rounds_the_router_logits(scenarios):
    """bf16 logits (about 3 significant digits) move every probability a little from the first step."""
    run, base = scenarios["router_precision"], scenarios["none"]
    assert not torch.equal(run["probs"][0]["0"], base["probs"][0]["0"])
    torch.testing.assert_close(run["probs"][0]["0"], base["probs"][0]["0"], rtol=0.05, atol=0.02)
    assert run["report"][0]["active_steps"] == [0, 1, 2, 3]


def test_router_tie_flip_moves_only_near_tied_choices(scenarios):
    """At step 0 (same weights, same input to layer 0) some tokens' k-th choice changes, each token
    keeps k experts, and every token that changed had its k-th and (k+1)-th logits within the margin."""
    run, base = scenarios["router_tie_flip"], scenarios["none"]
    new, old = run["maps"][0]["0"], base["maps"][0]["0"]
    changed = (new != old).any(dim=1)
    assert changed.any() and not changed.all()
    assert (new.sum(dim=1) == old.sum(dim=1)).all()
    assert ((old & ~new).sum(dim=1) <= 1).all()  # one choice at most: the last one


def test_flip_near_ties_swaps_the_boundary_pair_only():
    from mcore_proxy.faults.router import flip_near_ties

    logits = torch.tensor([[3.0, 1.00, 1.02, -1.0], [3.0, 1.0, 2.0, -1.0]])
    out = flip_near_ties(logits, 2, 0.05)
    assert torch.equal(out[0], logits[0, [0, 2, 1, 3]])  # 1.02 vs 1.00: within the margin, swapped
    assert torch.equal(out[1], logits[1])  # 2.0 vs 1.0: not a near-tie
    assert torch.equal(flip_near_ties(logits, 2, 0.0), logits)
    assert flip_near_ties(logits, 4, 1.0) is logits  # k = E: nothing outside the top-k


def test_topk_swap_keeps_k_experts_and_moves_about_the_rate(scenarios):
    run, base = scenarios["topk_swap"], scenarios["none"]
    new, old = run["maps"][0]["0"], base["maps"][0]["0"]
    assert (new.sum(dim=1) == 2).all()
    changed = (old & ~new).sum().item() / old.sum().item()
    assert 0.15 < changed < 0.35, changed  # rate 0.25 of 128 choices
    torch.testing.assert_close(run["probs"][0]["0"].sum(dim=1), base["probs"][0]["0"].sum(dim=1))
    assert torch.equal(run["probs"][0]["0"] > 0, new)


def test_topk_drop_removes_about_the_rate(scenarios):
    run, base = scenarios["topk_drop"], scenarios["none"]
    new, old = run["maps"][0]["0"], base["maps"][0]["0"]
    assert not (new & ~old).any()  # only removals
    dropped = 1 - new.sum().item() / old.sum().item()
    assert 0.15 < dropped < 0.35, dropped
    kept = run["probs"][0]["0"][new]
    torch.testing.assert_close(kept, base["probs"][0]["0"][new])


def test_expert_noise_is_relative_at_the_requested_size(scenarios):
    run, base = scenarios["expert_noise"], scenarios["none"]
    out, ref = run["experts"][0]["0"], base["experts"][0]["0"]  # layer 0 sees unchanged inputs
    ratio = out[ref.abs() > 1e-6] / ref[ref.abs() > 1e-6] - 1
    assert 0.008 < ratio.std().item() < 0.012
    assert abs(ratio.mean().item()) < 0.002
    assert torch.equal(run["maps"][0]["0"], base["maps"][0]["0"])


def test_logprob_precision_rounds_rollout_logits_only(scenarios):
    run, base = scenarios["logprob_bf16"], scenarios["none"]
    assert torch.equal(run["rollout_logits"][0], base["rollout_logits"][0].bfloat16().float())
    assert not torch.equal(run["rollout_logits"][0], base["rollout_logits"][0])
    assert same(run["train_logits"], base["train_logits"])  # training stays fp32
    assert same(run["params"], base["params"])
    fp16 = scenarios["logprob_fp16"]  # when=always: training too
    assert torch.equal(fp16["train_logits"][0], base["train_logits"][0].half().float())
    # when=rollout and no rollout() block in the loop: never acts
    assert same(scenarios["logprob_rollout_only"]["rollout_logits"], base["rollout_logits"])


def moved(before: dict, after: dict) -> set:
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_update_omission_every_second_step(scenarios):
    run = scenarios["omit_every2"]
    p, initial = run["params"], run["initial"]
    assert moved(initial, scenarios["none"]["params"][0])  # the baseline's step 0 moves
    assert not moved(initial, p[0])  # omitted
    assert moved(p[0], p[1])  # taken
    assert not moved(p[1], p[2])  # omitted
    assert moved(p[2], p[3])  # taken
    assert run["report"][0]["active_steps"] == [0, 2]
    assert per_step(scenarios, "omit_every2")[0]  # same step-0 forward


def test_update_omission_of_one_group(scenarios):
    experts = set(scenarios["omit_experts"]["expert_params"])
    assert len(experts) == 4 * 8 * 2  # 4 layers x 8 experts x fc1/fc2
    initial = scenarios["none"]["initial"]
    frozen_experts = moved(initial, scenarios["omit_experts"]["params"][-1])
    assert frozen_experts and not frozen_experts & experts  # experts never move, the rest does
    frozen_dense = moved(initial, scenarios["omit_dense"]["params"][-1])
    assert frozen_dense and frozen_dense <= experts  # only experts move
