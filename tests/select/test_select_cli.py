"""`mcore-proxy select` through the real entry point, with the checkpoint reader replaced by
an in-memory view of a planted model (the reader is tested in its own package)."""
import importlib.util
import json
import re

import pytest

import mcore_proxy.checkpoint as checkpoint
import mcore_proxy.cli as cli
from mcore_proxy.cli import main
from mcore_proxy.select import load_plan, select_experts
from mcore_proxy.stats import save_stats


@pytest.fixture
def cli_model(tmp_path, monkeypatch, planted_model):
    view, stats, planted = planted_model(num_groups=4, group_topk=2)
    stats_path = save_stats(stats, tmp_path / "routing_stats.safetensors")
    opened = []

    def fake_open(path):
        opened.append(str(path))
        return view

    monkeypatch.setattr(checkpoint, "open_checkpoint", fake_open, raising=False)
    # other commands are built in parallel; one not written yet must not hide this one
    present = tuple(m for m in cli.COMMAND_MODULES if importlib.util.find_spec(m) is not None)
    monkeypatch.setattr(cli, "COMMAND_MODULES", present)
    return view, stats, stats_path, opened


def test_select_writes_the_plan_and_prints_a_summary(tmp_path, cli_model, capsys):
    view, stats, stats_path, opened = cli_model
    out = tmp_path / "plan.json"
    code = main(["select", "--ckpt", "CKPT", "--stats", str(stats_path), "--num-experts", "8",
                 "--target-ep", "2", "--seed", "4", "--weights", "1,2,1", "-o", str(out)])
    assert code == 0 and opened == ["CKPT"]
    plan = load_plan(out)
    expected = select_experts(view, stats, 8, target_ep=2, seed=4, weights=(1, 2, 1))
    assert plan.to_json() == expected.to_json()
    printed = capsys.readouterr().out
    assert "mean" in printed and f"wrote {out}" in printed
    assert printed.count("\n") >= len(plan.layers) + 3


def test_select_with_report_and_flatten(tmp_path, cli_model, capsys):
    pytest.importorskip("matplotlib")
    _, _, stats_path, _ = cli_model
    out, rep = tmp_path / "plan.json", tmp_path / "report"
    code = main(["select", "--ckpt", "C", "--stats", str(stats_path), "-k", "4",
                 "--group-policy", "flatten", "--method", "router+proto", "--report", str(rep),
                 "-o", str(out)])
    assert code == 0
    d = json.loads(out.read_text())
    assert d["router"]["num_groups"] == 1 and d["params"]["group_policy"] == "flatten"
    assert "flattened" in capsys.readouterr().out
    assert (rep / "coverage.png").is_file() and (rep / "summary.txt").is_file()
    assert (rep / "distance_layer_mtp.0.png").is_file()


@pytest.mark.parametrize("argv, match", [
    (["-k", "32"], "--num-experts 32 must be in 1..31"),
    (["-k", "6"], "--num-experts 6 is not divisible by the 4 routing groups"),
    (["-k", "8", "--weights", "1,1"], "--weights '1,1' must be three"),
    (["-k", "8", "--target-ep", "3"], "not divisible by --target-ep 3"),
])
def test_bad_input_exits_2_with_one_sentence(tmp_path, cli_model, capsys, argv, match):
    _, _, stats_path, _ = cli_model
    out = tmp_path / "plan.json"
    code = main(["select", "--ckpt", "C", "--stats", str(stats_path), *argv, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.startswith("mcore-proxy select: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err)


def test_output_folder_is_refused_and_ep_alias_works(tmp_path, cli_model, capsys):
    _, _, stats_path, _ = cli_model
    base = ["select", "--ckpt", "C", "--stats", str(stats_path), "-k", "8"]
    assert main(base + ["-o", str(tmp_path)]) == 2
    assert "is a folder; pass the plan file" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert main(base + ["--target-expert-parallel-size", "8", "-o", str(out)]) == 0
    assert load_plan(out).expert_parallel_size == 8


def test_missing_stats_file_names_it(tmp_path, cli_model, capsys):
    code = main(["select", "--ckpt", "C", "--stats", str(tmp_path / "nope.safetensors"), "-k", "8",
                 "-o", str(tmp_path / "plan.json")])
    assert code == 2 and "nope.safetensors: routing-statistics file not found" in capsys.readouterr().err
