"""`convert --merge-clusters` (issue 24 item 3): each kept expert becomes its plan cluster's
frequency-weighted mean. The source is written by megatron-core (TP 2, PP 2, EP 2); the merged proxy
holds the means computed here independently, every other tensor of the plain proxy bit for bit, loads
strictly in megatron-core and runs; verify recomputes the means and still finds a changed one."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.functional.model import Layout
from mcore_proxy.functional.run import load_and_run
from mcore_proxy.testing.fixtures import FIXTURES

FIXTURE = "seq_tp2_pp2_ep2"
ONE_RANK = ["--target-tp", "1", "--target-pp", "1", "--target-ep", "1"]
EXPERT_TENSORS = ("linear_fc1.weight", "linear_fc2.weight")


def convert_json(argv: list[str]) -> dict:
    """`mcore-proxy convert ARGV --json`, run here; its document."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["convert", *argv, "--json"]) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def proxies(megatron_ckpt, proxy_plan, tmp_path_factory, digest):
    """(source, plan path, plan, plain proxy, merged proxy, convert's --json of each)."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, plan = proxy_plan(FIXTURE)
    base = tmp_path_factory.mktemp("merge")
    before = digest(ckpt)
    argv = [str(ckpt), "--plan", str(plan_path), *ONE_RANK]
    docs = {
        "plain": convert_json([*argv, "-o", str(base / "plain")]),
        "merged": convert_json([*argv, "-o", str(base / "merged"), "--merge-clusters"]),
    }
    assert digest(ckpt) == before, "convert modified its input"
    return ckpt, plan_path, plan, base / "plain", base / "merged", docs


def expert(layer: str, e: int, rest: str) -> str:
    return f"decoder.layers.{layer}.mlp.experts.{e}.{rest}"


def test_kept_experts_are_their_clusters_frequency_weighted_means(proxies):
    ckpt, _, plan, plain, merged, docs = proxies
    source, plain_view, got = open_checkpoint(ckpt), open_checkpoint(plain), open_checkpoint(merged)
    assert got.names() == plain_view.names()
    merged_names = set()
    for lid in plan.layer_ids:
        for c in plan.layers[lid].clusters:
            freq = torch.tensor(c.frequencies, dtype=torch.float64)
            j = plan.kept(lid).index(c.representative)
            for rest in EXPERT_TENSORS:
                members = torch.stack([source.get(expert(lid, m, rest)).double() for m in c.members])
                want = (freq.view(-1, 1, 1) * members).sum(0) / freq.sum()
                have = got.get(expert(lid, j, rest))
                assert have.dtype == source.get(expert(lid, c.representative, rest)).dtype
                torch.testing.assert_close(have.double(), want, rtol=1e-5, atol=1e-6)
                if (freq > 0).sum() > 1:
                    merged_names.add(expert(lid, j, rest))
    # the planted statistics give clusters of several selected experts: the check above saw real means
    assert len(merged_names) >= 4, merged_names
    for name in plain_view.names():
        if name not in merged_names:
            assert torch.equal(got.get(name), plain_view.get(name)), name
    # it says so, and reads the dropped members it averages
    assert docs["merged"]["merged_clusters"] is True and docs["plain"]["merged_clusters"] is False
    assert docs["merged"]["read_bytes"] > docs["plain"]["read_bytes"]
    manifest = json.loads((merged / "manifest.json").read_text())
    assert "weighted by its share of the cluster's routed selections" in manifest["plan"]["merged_clusters"]


def test_megatron_core_loads_the_merged_proxy_and_it_computes_otherwise(proxies, tmp_path):
    _, _, plan, plain, merged, _ = proxies
    model, _ = FIXTURES[FIXTURE]
    proxy_model = dataclasses.replace(model, num_experts=plan.num_experts)
    got = load_and_run(proxy_model, Layout(), merged, tmp_path / "merged.pt")
    unmerged = load_and_run(proxy_model, Layout(), plain, tmp_path / "plain.pt")
    assert torch.isfinite(got).all() and (got - unmerged).abs().max() > 1e-4


def test_verify_recomputes_the_means_and_finds_a_changed_one(proxies, tmp_path, capsys):
    ckpt, plan_path, plan, _, merged, _ = proxies
    argv = ["verify", "--orig", str(ckpt), "--proxy", str(merged), "--plan", str(plan_path)]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cluster" in out and "means recomputed" in out and "verify: OK" in out

    assert main([*argv, "--functional"]) == 2
    err = capsys.readouterr().err
    assert "--merge-clusters" in err and "leave out --functional" in err and len(err.strip().splitlines()) == 1

    changed = tmp_path / "changed"
    shutil.copytree(merged, changed)
    f = next(changed.rglob("model_optim_rng.pt"))
    state = torch.load(f, weights_only=False)
    key = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    state["model"][key][0, 0] += 1.0
    torch.save(state, f)
    assert main(["verify", "--orig", str(ckpt), "--proxy", str(changed), "--plan", str(plan_path)]) == 1
    assert "decoder.layers.1.mlp.experts.0.linear_fc1.weight: differs from source" in capsys.readouterr().err


def test_workers_write_the_same_merged_proxy(proxies, tmp_path):
    ckpt, plan_path, _, _, merged, _ = proxies
    out = tmp_path / "two"
    argv = ["convert", str(ckpt), "--plan", str(plan_path), *ONE_RANK, "--merge-clusters", "--workers", "2"]
    assert main([*argv, "-o", str(out)]) == 0
    files = {k: v["sha256"] for k, v in json.loads((out / "manifest.json").read_text())["files"].items()}
    assert files == {k: v["sha256"] for k, v in json.loads((merged / "manifest.json").read_text())["files"].items()}


def test_merge_refuses_a_plan_without_clusters_and_a_missing_plan(megatron_ckpt, planted_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    ranking = tmp_path / "frequency.json"
    planted_plan(ckpt, 4, ranking, method="frequency")
    cases = [
        (["--plan", str(ranking)], "make it with a clustering method"),
        ([], "pass --plan"),
    ]
    for extra, match in cases:
        out = tmp_path / "out"
        assert main(["convert", str(ckpt), *extra, "--merge-clusters", "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
