"""`mcore-proxy select` on real Megatron checkpoints written by megatron-core (session fixtures
from tests/conftest.py), with synthetic statistics for exactly their MoE layers."""

import json

from mcore_proxy.checkpoint import open_checkpoint, router_fingerprint
from mcore_proxy.cli import main
from mcore_proxy.select import load_plan
from mcore_proxy.select.synthetic import stats_like
from mcore_proxy.core.stats import save_stats


def stats_for(ckpt, tmp_path):
    view = open_checkpoint(ckpt)
    spec = view.spec
    stats = stats_like(spec, 4, tokens=2000)
    return view, save_stats(stats, tmp_path / "routing_stats.safetensors")


def test_select_on_a_real_tp2_pp2_ep2_checkpoint(tmp_path, megatron_ckpt, digest, capsys):
    ckpt, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    before = digest(ckpt)
    view, stats_path = stats_for(ckpt, tmp_path)
    out = tmp_path / "plan.json"
    assert (
        main(["select", "--ckpt", str(ckpt), "--stats", str(stats_path), "-k", "4", "--target-ep", "2", "-o", str(out)])
        == 0
    )
    plan = load_plan(out)
    assert plan.source.router_fingerprint == router_fingerprint(view)
    assert plan.source.iteration == view.iteration
    assert plan.layer_ids == view.spec.moe_layer_ids
    assert all(len(plan.kept(lid)) == 4 for lid in plan.layer_ids)
    plan.check_matches(open_checkpoint(ckpt))
    assert digest(ckpt) == before  # the input checkpoint is never modified
    assert "mean" in capsys.readouterr().out


def test_grouped_real_checkpoint_needs_flatten_for_small_k(tmp_path, megatron_ckpt, capsys):
    # 8 experts in 4 groups, top-4 over 2 groups: per group needs 2, so K=4 only flattened
    ckpt, _ = megatron_ckpt("deepseek_like_pp2_uneven")
    _, stats_path = stats_for(ckpt, tmp_path)
    out = tmp_path / "plan.json"
    argv = ["select", "--ckpt", str(ckpt), "--stats", str(stats_path), "-k", "4", "-o", str(out)]
    assert main(argv) == 2
    assert "leaves 1 experts per routing group" in capsys.readouterr().err
    assert main(argv + ["--group-policy", "flatten"]) == 0
    d = json.loads(out.read_text())
    assert (d["source"]["num_groups"], d["source"]["group_topk"]) == (4, 2)
    assert d["router"] == {"topk": 4, "num_groups": 1, "group_topk": 1, "score_function": "sigmoid"}
    assert list(d["layers"]) == ["1", "2", "3"]
