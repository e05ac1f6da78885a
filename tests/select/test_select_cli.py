"""`mcore-proxy select` through the real entry point, with the checkpoint reader replaced by
an in-memory view of a planted model (the reader is tested in its own package); and outputs that
are replaced only with --force, a failed forced run on a real checkpoint included."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

import mcore_proxy.checkpoint as checkpoint
import mcore_proxy.cli as cli
from mcore_proxy.cli import main
from mcore_proxy.select import load_plan, select_experts
from mcore_proxy.core.stats import save_stats


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
    code = main(
        [
            "select",
            "--ckpt",
            "CKPT",
            "--stats",
            stats_path,
            "--num-experts",
            "8",
            "--target-ep",
            "2",
            "--seed",
            "4",
            "--weights",
            "1,2,1",
            "-o",
            out,
        ]
    )
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
    code = main(
        [
            "select",
            "--ckpt",
            "C",
            "--stats",
            stats_path,
            "-k",
            "4",
            "--group-policy",
            "flatten",
            "--method",
            "router+proto",
            "--report",
            rep,
            "-o",
            out,
        ]
    )
    assert code == 0
    d = json.loads(out.read_text())
    assert d["router"]["num_groups"] == 1 and d["params"]["group_policy"] == "flatten"
    assert "flattened" in capsys.readouterr().out
    assert (rep / "coverage.png").is_file() and (rep / "summary.txt").is_file()
    assert (rep / "distance_layer_mtp.0.png").is_file()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["-k", "32"], "--num-experts 32 must be in 1..31"),
        (["-k", "6"], "--num-experts 6 is not divisible by the 4 routing groups"),
        (["-k", "8", "--weights", "1,1"], "--weights '1,1' must be three"),
        (["-k", "8", "--target-ep", "3"], "not divisible by --target-ep 3"),
        (["-k", "8", "--proxy-topk", "9"], "--proxy-topk 9 must be in 2..8"),
        (["-k", "8", "--proxy-topk", "two"], "'two' is neither a number nor 'auto'"),
    ],
)
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


def test_proxy_topk_auto_keeps_the_share_of_experts_a_token_uses(tmp_path, cli_model):
    view, stats, stats_path, _ = cli_model  # top-2 of 32, sigmoid scores; flattened, no groups to score
    out = tmp_path / "plan.json"
    argv = ["select", "--ckpt", "C", "--stats", str(stats_path), "-k", "16", "--group-policy", "flatten"]
    assert main([*argv, "--proxy-topk", "auto", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.router.topk == 1 and plan.source.topk == 2  # round(2 x 16 / 32)
    assert plan.params["proxy_topk"]["proxy"] == 1
    # the same experts as without it: only how many a token uses changes
    assert plan.layers == select_experts(view, stats, 16, group_policy="flatten").layers
    assert plan.to_json() == select_experts(view, stats, 16, group_policy="flatten", topk="auto").to_json()


def test_missing_stats_file_names_it(tmp_path, cli_model, capsys):
    code = main(
        ["select", "--ckpt", "C", "--stats", tmp_path / "nope.safetensors", "-k", "8", "-o", tmp_path / "plan.json"]
    )
    assert code == 2 and "nope.safetensors: routing-statistics file not found" in capsys.readouterr().err


# -- outputs replaced only by --force, never an input --------------------------------------------


def select_argv(stats_path, out, *extra):
    return ["select", "--ckpt", "C", "--stats", str(stats_path), "-k", "8", "-o", str(out), *map(str, extra)]


def test_an_existing_plan_is_replaced_only_with_force(tmp_path, cli_model, capsys):
    _, _, stats_path, _ = cli_model
    out = tmp_path / "plan.json"
    assert main(select_argv(stats_path, out, "--seed", "1")) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert main(select_argv(stats_path, out, "--seed", "2")) == 2
    assert f"{out}: exists; pass --force" in capsys.readouterr().err and out.read_bytes() == before
    assert main(select_argv(stats_path, out, "--seed", "2", "--force")) == 0
    assert load_plan(out).params["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "plan.json",
        "routing_stats.json",
        "routing_stats.safetensors",
    ]


def test_a_report_is_replaced_only_with_force(tmp_path, cli_model, capsys):
    pytest.importorskip("matplotlib")
    _, _, stats_path, _ = cli_model
    rep = tmp_path / "report"
    rep.mkdir()
    (rep / "summary.txt").write_text("old")
    (rep / "distance_layer_99.png").write_bytes(b"old")  # of an earlier report on other layers
    (rep / "mine.txt").write_text("not the report's")
    argv = select_argv(stats_path, tmp_path / "plan.json", "--report", rep)
    capsys.readouterr()
    assert main(argv) == 2 and "exists; pass --force" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists() and (rep / "summary.txt").read_text() == "old"
    assert main(argv + ["--force", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)["report"]
    assert sorted(p.name for p in rep.iterdir()) == sorted([Path(f).name for f in written] + ["mine.txt"])
    assert "distance_layer_99.png" not in {Path(f).name for f in written}
    assert (rep / "summary.txt").read_text().startswith("method multiview")


@pytest.mark.parametrize("where", ["stats", "sidecar", "inside_ckpt"])
def test_the_plan_never_replaces_or_enters_an_input(tmp_path, cli_model, capsys, where):
    _, _, stats_path, _ = cli_model
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = {"stats": stats_path, "sidecar": stats_path.with_suffix(".json"), "inside_ckpt": ckpt / "plan.json"}[where]
    before = out.read_bytes() if out.exists() else None
    capsys.readouterr()
    argv = ["select", "--ckpt", str(ckpt), "--stats", str(stats_path), "-k", "8", "-o", str(out), "--force"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("lies inside the input" if where == "inside_ckpt" else "is an input of this command") in err
    assert (out.read_bytes() if out.exists() else None) == before and list(ckpt.iterdir()) == []


def test_a_forced_select_that_fails_to_write_leaves_the_old_plan(megatron_ckpt, tmp_path):
    """On a real checkpoint, in a process of its own: a real file-size limit (RLIMIT_FSIZE, EFBIG)
    stops the new plan; the old one stays as it was."""
    import os
    import resource
    import subprocess
    import sys

    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.select.synthetic import stats_like

    ckpt, _ = megatron_ckpt("seq_tp2_pp2_ep2")
    spec = open_checkpoint(ckpt).spec
    stats = stats_like(spec, 4, tokens=500, seed=1)
    stats_path = save_stats(stats, tmp_path / "routing_stats.safetensors")
    out = tmp_path / "plan.json"
    argv = [
        sys.executable,
        "-m",
        "mcore_proxy.cli",
        "select",
        "--ckpt",
        str(ckpt),
        "--stats",
        str(stats_path),
        "-k",
        "4",
        "-o",
        str(out),
    ]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    assert subprocess.run(argv, capture_output=True, env=env, timeout=300).returncode == 0
    before = out.read_bytes()
    limit = len(before) // 2

    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        argv + ["--seed", "5", "--force"], capture_output=True, text=True, env=env, timeout=300, preexec_fn=apply
    )
    assert done.returncode == 2 and "file-size limit" in done.stderr.strip().splitlines()[-1], done.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "plan.json",
        "routing_stats.json",
        "routing_stats.safetensors",
    ]
