"""convert and verify: format round trips, parallel writers, bad input, detected differences."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.cli import main
from mcore_proxy.select.plan import load_plan

FIXTURE = "seq_tp2_pp2_ep2"


def canonical(path):
    view = open_checkpoint(path)
    return {n: view.get(n) for n in view.names()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_legacy_to_torch_dist_and_back_is_bit_identical(megatron_ckpt, tmp_path):
    ckpt, _ = megatron_ckpt(FIXTURE)
    dist, back = tmp_path / "dist", tmp_path / "back"
    assert (
        main(
            [
                "convert",
                ckpt,
                "-o",
                dist,
                "--format",
                "torch_dist",
                "--target-tp",
                "1",
                "--target-pp",
                "1",
                "--target-ep",
                "1",
            ]
        )
        == 0
    )
    assert open_checkpoint(dist).info.format == "torch_dist"
    assert main(["convert", str(dist), "-o", str(back), "--target-tp", "2", "--target-ep", "2"]) == 0
    source = canonical(ckpt)
    assert_same_tensors(source, canonical(dist))
    assert_same_tensors(source, canonical(back))


def test_workers_and_single_process_write_the_same(megatron_ckpt, proxy_plan, tmp_path):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--plan", str(plan_path), "--target-tp", "2", "--target-ep", "2"]
    assert main(["convert", str(ckpt), "-o", str(one), *common]) == 0
    assert main(["convert", str(ckpt), "-o", str(two), "--workers", "2", *common]) == 0
    assert_same_tensors(canonical(one), canonical(two))
    files = sorted(p.relative_to(two).as_posix() for p in two.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file())


def test_manifest_lists_every_file(megatron_ckpt, proxy_plan, tmp_path):
    from mcore_proxy.checkpoint.torchfile import file_sha256

    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, plan = proxy_plan(FIXTURE)
    out = tmp_path / "p"
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out), "--target-ep", "1"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == file_sha256(out / name)
    assert manifest["plan"]["sha256"] and manifest["target"]["num_experts"] == plan.num_experts
    assert manifest["source"]["router_fingerprint"] == plan.source.router_fingerprint


# -- verify finds differences (exit 1) ---------------------------------------------------------


@pytest.fixture
def converted(megatron_ckpt, proxy_plan, tmp_path):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    out = tmp_path / "proxy"
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out), "--target-ep", "2"]) == 0
    return ckpt, plan_path, out


def test_verify_reports_a_changed_tensor(converted, capsys):
    ckpt, plan_path, out = converted
    f = out / "iter_0000010" / "mp_rank_01_001_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    key = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    state["model"][key][0, 0] += 1.0
    torch.save(state, f)
    capsys.readouterr()
    argv = ["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan_path)]
    assert main(argv) == 1
    text, err = capsys.readouterr()
    changed = "decoder.layers.3.mlp.experts.2.linear_fc2.weight: differs from source"
    assert changed in err and "sha256 differs from the manifest" in err
    # the report says what differs, and never first that everything matched
    assert "bit for bit" not in text and "OK" not in text
    assert text.startswith("verify: 2 difference(s) found, checking ") and f"  {changed}" in text.splitlines()[1]
    assert main(argv + ["--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and len(doc["problems"]) == 2 and doc["problems"][0].startswith(changed)
    assert doc["checked_tensors"] > 0


def test_verify_reports_a_plan_mismatch_in_args(converted, capsys, tmp_path):
    ckpt, plan_path, out = converted
    doc = json.loads(plan_path.read_text())
    doc["router"]["topk"] = 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    assert main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(other)]) == 1
    assert "args moe_router_topk is 2, expected 1" in capsys.readouterr().err


# -- bad input: one sentence, exit 2, nothing left, input untouched -----------------------------


def run_convert(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["convert", *map(str, args)])
    return code, capsys.readouterr().err.strip()


def assert_clean_failure(code, err, out, *fragments):
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("mcore-proxy ")]
    assert len(errors) == 1 and "Traceback" not in err, err  # tqdm may have drawn a bar before
    for f in fragments:
        assert f in err, (f, err)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_plan_from_another_checkpoint(megatron_ckpt, proxy_plan, tmp_path, capsys, digest):
    ckpt, _ = megatron_ckpt(FIXTURE)
    _, plan = proxy_plan(FIXTURE)
    other_ckpt, _ = megatron_ckpt("grouped_ep4")  # same E and layers, other router weights
    before = digest(other_ckpt)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    out = tmp_path / "out"
    code, err = run_convert(capsys, other_ckpt, "--plan", plan_path, "-o", out)
    assert_clean_failure(code, err, out, str(plan_path), "router weights differ", "select again")
    assert digest(other_ckpt) == before


def test_k_not_divisible_by_target_ep(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, plan = proxy_plan(FIXTURE)
    out = tmp_path / "out"
    code, err = run_convert(capsys, ckpt, "--plan", plan_path, "-o", out, "--target-ep", "3")
    assert_clean_failure(code, err, out, f"{plan.num_experts} experts do not divide over target EP=3")


def test_corrupted_shard(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt, broken)
    f = broken / "iter_0000010" / "mp_rank_00_001_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:1000])
    out = tmp_path / "out"
    code, err = run_convert(capsys, broken, "--plan", plan_path, "-o", out)
    assert_clean_failure(code, err, out, str(f), "truncated")


def test_existing_output(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and str(out) in err
    assert list(out.iterdir()) == []


def test_plan_file_that_is_not_a_plan(megatron_ckpt, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    out = tmp_path / "out"
    code, err = run_convert(capsys, ckpt, "--plan", bad, "-o", out)
    assert_clean_failure(code, err, out, str(bad))


def test_dry_run_writes_nothing(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, plan = proxy_plan(FIXTURE)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(ckpt), "--plan", str(plan_path), "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "would write" in text and f"--num-experts {plan.num_experts}" in text and "--no-load-optim" in text
    assert not out.exists()
    assert load_plan(plan_path).num_experts == plan.num_experts
