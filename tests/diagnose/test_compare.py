"""compare: a proxy that reproduces the fault is consistent (exit 0), a different fault is not
(exit 1), bad input is one sentence (exit 2); what does not overlap is named and left out; the
report has its PNG curves."""

import json

import pytest

from mcore_proxy.cli import main
from mcore_proxy.diagnose.compare import ROLES, compare_runs
from mcore_proxy.diagnose.readers import read_log


def four(tmp_path, synthetic, orig_fault, proxy_fault, proxy_steps=120, drop=(), onset=30):
    """Logs of the four runs: the proxy's curves are another model's (other seed, other scale)."""
    runs = {
        "orig_base": synthetic.curves(seed=0),
        "orig_fault": synthetic.curves(orig_fault, seed=0, onset=onset),
        "proxy_base": synthetic.curves(seed=5, scale=0.8, steps=proxy_steps),
        "proxy_fault": synthetic.curves(proxy_fault, seed=5, scale=0.8, steps=proxy_steps, onset=onset),
    }
    return {
        role: synthetic.write_jsonl(tmp_path / f"{role}.jsonl", data, drop if role == "proxy_fault" else ())
        for role, data in runs.items()
    }


def argv(paths, *extra):
    return [a for role in ROLES for a in (f"--{role.replace('_', '-')}", paths[role])] + list(extra)


def test_reproduced_fault_is_consistent(tmp_path, synthetic, capsys):
    paths = four(tmp_path, synthetic, "omission", "omission")
    assert main(["compare", *argv(paths), "-o", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "CONSISTENT: the proxy reproduces the original's fault signature" in out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["consistent"] and report["metrics"]["reward"]["match"]
    reward = report["signatures"]["original"]["metrics"]["reward"]
    assert reward["direction"] == -1 and reward["trend"] == -1
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == [
        "entropy.png",
        "kl_loss.png",
        "logprob_diff.png",
        "report.json",
        "report.md",
        "reward.png",
    ]
    assert (tmp_path / "report" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_different_fault_is_not_consistent(tmp_path, synthetic, capsys):
    paths = four(tmp_path, synthetic, "noise", "omission")
    assert main(["compare", *argv(paths)]) == 1
    captured = capsys.readouterr()
    assert "check failed: NOT CONSISTENT: the proxy's signature differs in" in captured.err
    assert "entropy (direction +1 vs +0" in captured.err


def test_no_fault_in_the_original_is_inconclusive(tmp_path, synthetic):
    paths = four(tmp_path, synthetic, None, None)
    comparison = compare_runs({r: read_log(p) for r, p in paths.items()})
    assert not comparison.consistent and "inconclusive" in comparison.verdict()


def test_missing_metric_and_shorter_run_are_left_out_and_said(tmp_path, synthetic, capsys):
    paths = four(tmp_path, synthetic, "precision", "precision", proxy_steps=50, drop=("actor/entropy",), onset=10)
    assert main(["compare", *argv(paths)]) == 0
    out = capsys.readouterr().out
    assert f"left out: entropy: not in proxy-fault ({paths['proxy_fault']}); left out" in out
    assert (
        "left out: logprob_diff: compared steps 0-49, the overlap of the four runs (runs of very "
        "different lengths); steps outside it left out (logged: orig-base 0-119, orig-fault 0-119)"
    ) in out
    comparison = compare_runs({r: read_log(p) for r, p in paths.items()})
    assert comparison.matches["logprob_diff"].orig.last_step == 49


def test_requested_metric_missing_everywhere_and_bad_logs_exit_2(tmp_path, synthetic, capsys):
    paths = four(tmp_path, synthetic, "omission", "omission")
    assert main(["compare", *argv(paths, "--metrics", "grad_norm")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("mcore-proxy compare: error: no metric can be compared: grad_norm: not in orig-base")
        and err.count("\n") == 1
    )
    (tmp_path / "broken.jsonl").write_text("{oops\n{}\n")
    bad = dict(paths, proxy_base=str(tmp_path / "broken.jsonl"))
    assert main(["compare", *argv(bad)]) == 2
    assert "broken.jsonl: line 1 is not JSON" in capsys.readouterr().err
    assert main(["compare", *argv(paths, "-o", str(tmp_path))]) == 2  # existing output folder
    assert "already exists" in capsys.readouterr().err


def test_raw_metric_names_and_consoles_across_frameworks(tmp_path, synthetic):
    """The original logs verl JSONL, the proxy MindSpeed-RL console lines: matched by alias."""
    paths = four(tmp_path, synthetic, "omission", "omission")
    for role in ("proxy_base", "proxy_fault"):
        run = read_log(paths[role])
        lines = []
        for i, step in enumerate(run.metrics["critic/score/mean"].steps):
            lines.append(
                f"[2025-01-01 00:00:00] iteration: {step} / 120 | grpo/score/mean : "
                f"{run.metrics['critic/score/mean'].values[i]:.4f} | actor/kl_loss : "
                f"{run.metrics['actor/kl_loss'].values[i]:.6f}"
            )
        (tmp_path / f"{role}.log").write_text("\n".join(lines) + "\n")
        paths[role] = str(tmp_path / f"{role}.log")
    comparison = compare_runs({r: read_log(p) for r, p in paths.items()})
    assert set(comparison.matches) == {"reward", "kl_loss"} and comparison.consistent
    assert comparison.raw_names["reward"]["proxy_base"] == "grpo/score/mean"


def test_signs_agree_tolerates_a_borderline_side_only():
    from mcore_proxy.diagnose.compare import signs_agree

    assert signs_agree(1, 0.3, 0.01, 1, 0.2, 0.02)
    assert signs_agree(0, 0.0, 1.0, 0, 0.1, 0.9)
    assert signs_agree(-1, -0.36, 0.01, 0, -0.2, 0.12)  # leans the same way: agrees
    assert not signs_agree(-1, -0.36, 0.01, 0, -0.2, 0.40)  # too weak to count
    assert not signs_agree(-1, -0.36, 0.01, 0, 0.2, 0.12)  # leans the other way
    assert not signs_agree(0, 0.0, 1.0, 1, 0.5, 0.001)  # nothing against a shift
    assert not signs_agree(1, 0.3, 0.01, -1, -0.3, 0.01)


# -- the shared command-line conventions: --json, --force ---------------------------------------


def test_json_carries_the_numbers_of_the_text(tmp_path, synthetic, capsys):
    paths = four(tmp_path, synthetic, "noise", "omission")
    assert main(["compare", *argv(paths)]) == 1
    text = capsys.readouterr().out
    assert main(["compare", *argv(paths), "--json"]) == 1  # a failed check still prints its document
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["format"] == "mcore-proxy-compare/1" and doc["consistent"] is False and doc["report"] is None
    assert "check failed: NOT CONSISTENT" in captured.err and doc["verdict"] in text.splitlines()
    assert doc["metrics"] and not all(m["match"] for m in doc["metrics"].values())
    for metric, m in doc["metrics"].items():
        sig = doc["signatures"]["original"]["metrics"][metric]
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{metric} "))
        assert f"{sig['direction']:+d} " in line and line.endswith("yes") == m["match"], line


def test_an_existing_report_is_replaced_only_with_force(tmp_path, synthetic, capsys):
    paths = four(tmp_path, synthetic, "omission", "omission")
    out = tmp_path / "report"
    assert main(["compare", *argv(paths), "-o", str(out)]) == 0
    first = (out / "report.json").read_bytes()
    capsys.readouterr()
    narrower = argv(paths, "-o", str(out), "--metrics", "reward")
    assert main(["compare", *narrower]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err and (out / "report.json").read_bytes() == first
    assert main(["compare", *narrower, "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["report"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "reward.png"]  # nothing old mixed in
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("case", ["other_data", "holds_a_log"])
def test_force_never_replaces_other_data_or_the_logs(tmp_path, synthetic, capsys, case):
    paths = four(tmp_path, synthetic, "omission", "omission")
    if case == "other_data":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        expected = "holds no mcore-proxy manifest.json (or compare report.json), so --force does not replace it"
    else:
        out, expected = tmp_path, "must not be inside the input"
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    capsys.readouterr()
    assert main(["compare", *argv(paths, "-o", str(out), "--force")]) == 2
    assert expected in capsys.readouterr().err
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == before


def seeds_of(tmp_path, synthetic, proxy_faults):
    """Logs of the four roles over seeds: seed i's proxy runs the fault proxy_faults[i]."""
    paths = {role: [] for role in ROLES}
    for seed, proxy_fault in enumerate(proxy_faults):
        runs = {
            "orig_base": synthetic.curves(seed=seed),
            "orig_fault": synthetic.curves("omission", seed=seed, onset=30),
            "proxy_base": synthetic.curves(seed=seed + 50, scale=0.8),
            "proxy_fault": synthetic.curves(proxy_fault, seed=seed + 50, scale=0.8, onset=30),
        }
        for role, data in runs.items():
            paths[role].append(synthetic.write_jsonl(tmp_path / f"{role}-s{seed}.jsonl", data))
    return [a for role in ROLES for a in (f"--{role.replace('_', '-')}", *paths[role])]


def test_over_seeds_a_verdict_needs_the_share_of_seeds(tmp_path, synthetic, capsys):
    """Five seeds, the proxy reproduces omission in four: consistent at the default 0.8, not at 1.0;
    the report counts per metric, seed by seed, and draws every seed's curves."""
    argv = seeds_of(tmp_path, synthetic, ["omission"] * 4 + [None])  # seed 4: the proxy shows nothing
    assert main(["compare", *argv, "--metrics", "reward", "-o", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "CONSISTENT over 5 seeds: the proxy reproduces the original's fault signature in 4 of 5 seeds" in out
    assert "seed 4: does not reproduce reward" in out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["agreeing"] == 4 and report["needed"] == 4 and len(report["per_seed"]) == 5
    reward = report["metrics"]["reward"]
    assert reward["departed"] and reward["reproduced"] == [True] * 4 + [False]
    assert reward["original"]["signature"]["direction"] == -1 and len(reward["proxy"]["shifts"]) == 5
    assert (tmp_path / "report" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", *argv, "--metrics", "reward", "--min-share", "1", "--json"]) == 1
    captured = capsys.readouterr()
    assert "NOT CONSISTENT over 5 seeds" in captured.err
    doc = json.loads(captured.out)
    assert doc["format"] == "mcore-proxy-compare/1" and doc["mode"] == "seeds" and not doc["consistent"]


def test_over_seeds_the_roles_need_as_many_logs(tmp_path, synthetic, capsys):
    argv = seeds_of(tmp_path, synthetic, ["omission"] * 2)
    cut = argv.index("--proxy-fault") + 2  # one proxy-fault log instead of two
    assert main(["compare", *argv[:cut]]) == 2
    assert "give the same number of logs (one per seed) to each role" in capsys.readouterr().err
