"""Reconstruction-driven selection (issue 13 item 3): the layer function equals megatron-core's
MoE layer, and the methods built on it keep K experts, live before dead, on real checkpoints."""

import numpy as np
import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.core.errors import PlanError
from mcore_proxy.functional.model import Layout
from mcore_proxy.select import run_selection
from mcore_proxy.mcore.spec import ModelSpec
from mcore_proxy.select.reconstruct import LayerFunction, expert_outputs
from mcore_proxy.select.refine import prune, refine_representatives
from mcore_proxy.core.stats import load_stats

pytestmark = pytest.mark.megatron


def _megatron_moe_worker(rank, port, model, points, keep, out_path):
    from mcore_proxy.functional.model import build_gpt, Layout
    from mcore_proxy.functional.run import restrict_routers
    from mcore_proxy.testing.global_weights import fill_global_weights
    from mcore_proxy.functional.cpu import destroy_distributed, init_distributed

    init_distributed(0, 1, port)
    try:
        gpt = build_gpt(model, Layout())
        fill_global_weights(gpt, seed=3, router_std=model.router_std)
        mlp = gpt.decoder.layers[0].mlp
        x = torch.as_tensor(points, dtype=torch.float32)[:, None, :]  # [s, b=1, H]
        with torch.no_grad():
            full = mlp(x)[0][:, 0]
            with restrict_routers(gpt, {str(i): keep for i in range(model.num_layers)}):
                restricted = mlp(x)[0][:, 0]
        weights = {
            "router": mlp.router.weight.detach().double().numpy(),
            "fc1": [e.linear_fc1.weight.detach().double().numpy() for e in mlp.experts.local_experts],
            "fc2": [e.linear_fc2.weight.detach().double().numpy() for e in mlp.experts.local_experts],
        }
        torch.save({"full": full.double(), "restricted": restricted.double(), "weights": weights}, out_path)
    finally:
        destroy_distributed()


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_layer_function_equals_megatron_core_moe_layer(tmp_path, activation):
    from mcore_proxy.functional.cpu import free_port
    from mcore_proxy.functional.model import ToyMoE

    model = ToyMoE(num_experts=8, topk=2, activation=activation)
    points = np.random.default_rng(0).normal(size=(12, model.hidden_size))
    keep = [1, 2, 5, 6]
    out = tmp_path / "moe.pt"
    torch.multiprocessing.spawn(
        _megatron_moe_worker, args=(free_port(), model, points, keep, str(out)), nprocs=1, join=True
    )
    got = torch.load(out, weights_only=False)
    w = got["weights"]
    # the model is built as its args say (`--swiglu`: SiLU-gated), the reconstruction reads them so
    assert ModelSpec.from_args(model.megatron_args(Layout())).activation == activation
    outputs = np.stack([expert_outputs(points, w["fc1"][e], w["fc2"][e], activation) for e in range(8)], 1)
    fn = LayerFunction(points @ w["router"].T, outputs, np.ones(12), topk=2)
    np.testing.assert_allclose(fn.output(None), got["full"].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fn.output(keep), got["restricted"].numpy(), rtol=1e-4, atol=1e-5)
    assert fn.error(range(8)) == 0.0 and fn.error(keep) > 0.0


def test_refined_representatives_never_reconstruct_worse(sparse_traced):
    from mcore_proxy.select.reconstruct import layer_function
    from mcore_proxy.mcore.spec import router_weight_name

    ckpt, stats_path = sparse_traced("seq_tp2_pp2_ep2")
    view, stats = open_checkpoint(ckpt), load_stats(stats_path)
    for k in (2, 4, 6):
        base = run_selection(view, stats, k)[0]
        plan, details = run_selection(view, stats, k, representative="reconstruction")
        for lid, lp in plan.layers.items():
            members = lambda p: sorted(sorted(c.members) for c in p.layers[lid].clusters)  # noqa: E731
            assert members(plan) == members(base)  # same clusters, other representatives
            fn = layer_function(view, lid, stats.layers[lid], view.get(router_weight_name(lid)).double().numpy())
            err = plan.params["reconstruction"]["error"][lid]
            assert err == pytest.approx(fn.error(lp.kept)) == pytest.approx(details[lid].recon_error)
            assert err <= fn.error(base.layers[lid].kept) + 1e-12


def test_weight_search_records_its_choice_and_prune_keeps_live_first(sparse_traced):
    ckpt, stats_path = sparse_traced("seq_tp2_pp2_ep2")
    view, stats = open_checkpoint(ckpt), load_stats(stats_path)
    plan = run_selection(view, stats, 4, weight_search=True)[0]
    assert set(plan.params["layer_weights"]) == set(plan.layer_ids)
    assert all(w in plan.params["weight_search"]["grid"] for w in plan.params["layer_weights"].values())
    pruned = run_selection(view, stats, 4, method="recon-prune")[0]
    for lid, lp in pruned.layers.items():
        live = set(np.flatnonzero(stats.layers[lid].freq > 0).tolist())
        assert set(lp.kept) <= live or live <= set(lp.kept)


def test_refine_and_prune_on_a_hand_made_layer():
    # 4 experts, top-1, one point each routed to its own expert; expert 3 is a copy of 2 and
    # point 3 is rare: dropping 3 costs least, and keeping 2 for the cluster {2, 3} beats 3
    rng = np.random.default_rng(1)
    out = rng.normal(size=(4, 4, 5))
    out[:, 3] = out[:, 2]
    fn = LayerFunction(np.eye(4) * 5, out, np.array([5.0, 5.0, 5.0, 1.0]), topk=1)
    freq = np.array([5, 5, 5, 1])
    assert prune(fn, freq, [np.arange(4)], 3) == [0, 1, 2]
    from mcore_proxy.select.plan import Cluster

    clusters = refine_representatives([Cluster((0,), 0), Cluster((1,), 1), Cluster((2, 3), 3)], fn, freq)
    assert [c.representative for c in clusters] == [0, 1, 2]
    assert fn.error([0, 1, 2]) <= fn.error([0, 1, 3])


def test_defaults_resolve_and_fall_back_without_expert_weights(monkeypatch, default_model):
    from mcore_proxy.select import selector

    monkeypatch.setattr(selector, "DEFAULT_REFINEMENTS", {"representative": "reconstruction", "weight_search": True})
    assert selector.resolve_refinements("multiview", None, None, True) == ("reconstruction", True, "")
    assert selector.resolve_refinements("router", None, None, True) == ("frequency", False, "")
    rep, search, note = selector.resolve_refinements("multiview", None, None, False)
    assert (rep, search) == ("frequency", False) and "source does not hold" in note
    # the planted view has router weights only: the default falls back and the plan says so
    view, stats, _ = default_model
    plan = selector.select_experts(view, stats, 8)
    assert "source does not hold" in plan.params["refinement_fallback"]
    assert "reconstruction" not in plan.params
    # asked for explicitly, it is an error naming the missing tensor
    with pytest.raises(PlanError, match="reconstruction reads every expert's weights"):
        selector.select_experts(view, stats, 8, representative="reconstruction")
