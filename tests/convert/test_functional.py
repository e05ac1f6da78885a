"""Backbone: the proxy loaded by megatron-core computes what the original computes when its
routers may only choose the kept experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_proxy.cli import main
from mcore_proxy.functional.model import Layout
from mcore_proxy.functional.run import load_and_run
from mcore_proxy.testing.dist_ckpt import load_torch_dist_and_run
from mcore_proxy.testing.fixtures import FIXTURES

# (fixture, convert options, layout the proxy is run at, output format)
CASES = [
    ("seq_tp2_pp2_ep2", ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"], Layout(), "legacy"),
    ("seq_tp2_pp2_ep2", ["--target-tp", "1", "--target-pp", "1", "--target-ep", "2"], Layout(ep=2), "torch_dist"),
    ("deepseek_like_pp2_uneven", ["--target-ep", "1"], Layout(pp=2, first_stage_layers=1), "legacy"),
    ("deepseek_like_pp2_uneven", ["--target-pp", "1", "--target-ep", "2"], Layout(ep=2), "torch_dist"),
    ("grouped_ep4", ["--target-ep", "2"], Layout(ep=2, grouped=True), "legacy"),
    ("grouped_ep4", ["--target-tp", "2", "--target-ep", "1", "--expert-layout", "sequential"], Layout(tp=2), "legacy"),
]

_refs: dict = {}


def restricted_reference(megatron_ckpt, fixture, plan, tmp_path_factory):
    """The original model at its own layout, routers restricted to the plan's kept experts."""
    if fixture not in _refs:
        ckpt, _ = megatron_ckpt(fixture)
        model, layout = FIXTURES[fixture]
        keep = {lid: plan.kept(lid) for lid in plan.layer_ids}
        out = tmp_path_factory.mktemp("restricted") / "logits.pt"
        _refs[fixture] = load_and_run(model, layout, ckpt, out, keep=keep)
    return _refs[fixture]


@pytest.mark.parametrize(
    "fixture,options,run_layout,fmt", CASES, ids=[f"{c[0]}-{c[3]}-{'_'.join(c[1][1::2])}" for c in CASES]
)
def test_proxy_equals_restricted_original(
    megatron_ckpt, proxy_plan, tmp_path, tmp_path_factory, digest, fixture, options, run_layout, fmt
):
    ckpt, full_logits = megatron_ckpt(fixture)
    plan_path, plan = proxy_plan(fixture)
    before = digest(ckpt)
    out = tmp_path / "proxy"
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out), "--format", fmt, *options]) == 0
    assert digest(ckpt) == before, "the input checkpoint was modified"

    model, _ = FIXTURES[fixture]
    proxy_model = dataclasses.replace(model, num_experts=plan.num_experts)
    run = load_and_run if fmt == "legacy" else load_torch_dist_and_run
    got = run(proxy_model, run_layout, out, tmp_path / "proxy.pt")
    want = restricted_reference(megatron_ckpt, fixture, plan, tmp_path_factory)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the restriction matters: the unrestricted original computes something else
    assert (torch.load(full_logits) - want).abs().max() > 1e-3


def test_verify_functional_and_bit_exact(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    plan_path, _ = proxy_plan("deepseek_like_pp2_uneven")
    out = tmp_path / "proxy"
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out), "--target-ep", "1"]) == 0
    capsys.readouterr()
    assert main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan_path), "--functional"]) == 0
    text = capsys.readouterr().out
    assert "verify: OK" in text and "functional: max |logit difference|" in text


def test_a_proxy_top_k_runs_as_the_restricted_original_at_that_top_k(megatron_ckpt, proxy_plan, tmp_path, capsys):
    """A proxy top-k (`select --proxy-topk auto`: top-4 of 16, K = 8 -> top-2): the proxy's args route
    top-2, `verify --functional` accepts it, and megatron-core running it computes the original
    restricted to the kept experts at top-2 (sigmoid scores, group-limited routing)."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.select.constraints import fewest_proxy_topk, proxy_topk

    fixture = "deepseek_like_pp2_uneven"
    ckpt, _ = megatron_ckpt(fixture)
    _, plan = proxy_plan(fixture)
    topk = proxy_topk(
        "auto", plan.source.topk, plan.source.num_experts, plan.num_experts, fewest_proxy_topk("sigmoid", False, 4, 2)
    )
    assert topk == 2
    plan = dataclasses.replace(plan, router=dataclasses.replace(plan.router, topk=topk))
    plan_path = tmp_path / "plan-top2.json"
    plan.save(plan_path)
    out = tmp_path / "proxy"
    argv = ["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out), "--target-pp", "1", "--target-ep", "1"]
    assert main(argv) == 0
    assert open_checkpoint(out).spec.topk == 2
    capsys.readouterr()
    assert main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan_path), "--functional"]) == 0
    assert "verify: OK" in capsys.readouterr().out

    model, layout = FIXTURES[fixture]
    keep = {lid: plan.kept(lid) for lid in plan.layer_ids}
    got = load_and_run(dataclasses.replace(model, num_experts=8, topk=2), Layout(), out, tmp_path / "proxy.pt")
    want = load_and_run(dataclasses.replace(model, topk=2), layout, ckpt, tmp_path / "ref.pt", keep=keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # top-2 is not top-4: the restricted original at its own top-k computes something else
    at_top4 = load_and_run(model, layout, ckpt, tmp_path / "ref4.pt", keep=keep)
    assert (at_top4 - want).abs().max() > 1e-3
