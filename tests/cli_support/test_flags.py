"""The command line as a whole: help written for users, `--version`, usage errors naming their
subcommand, the Megatron / MindSpeed-LLM spellings of the one table accepted wherever their option
exists, and `--json` documents that carry the numbers of the text, on a real checkpoint."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from mcore_proxy import __version__
from mcore_proxy.cli import build_parser, main, parse
from mcore_proxy.cli_support.flags import NOT_YET, SPELLINGS
from mcore_proxy.core.units import format_bytes

# Where each spelling must work, by what it means (not read from the code): the commands that
# have the option it names.
APPLIES = {
    "--load-dir": {"inspect", "convert", "select", "verify", "estimate", "distill"},
    "--save-dir": {"convert", "verify"},
    "--target-tensor-parallel-size": {"convert"},
    "--target-tensor-model-parallel-size": {"convert"},
    "--target-pipeline-parallel-size": {"convert"},
    "--target-pipeline-model-parallel-size": {"convert"},
    "--target-expert-parallel-size": {"convert", "select"},
    "--target-expert-model-parallel-size": {"convert", "select"},
    "--target-expert-tensor-parallel-size": {"convert"},
    "--num-layer-list": {"convert"},
    "--target-num-layer-list": {"convert"},
    "--moe-grouped-gemm": {"convert"},
    "--tensor-model-parallel-size": {"estimate"},
    "--pipeline-model-parallel-size": {"estimate"},
    "--expert-model-parallel-size": {"estimate"},
    "--expert-tensor-parallel-size": {"estimate"},
    "--micro-batch-size": {"estimate"},
    "--seq-length": {"estimate"},
}
# the smallest valid command line of each command, by our spellings ("CKPT": the positional)
BASE = {
    "inspect": {"CKPT": "ck"},
    "estimate": {"-k": "4"},
    "patches": {},
    "stats merge": {"DIR": "trace"},
    "stats show": {"STATS": "s.safetensors"},
    "select": {"--ckpt": "ck", "--stats": "s.safetensors", "-k": "4", "-o": "plan.json"},
    "convert": {"CKPT": "ck", "--out": "out"},
    "verify": {"--orig": "a", "--proxy": "b", "--plan": "p.json"},
    "distill": {"--orig": "a", "--proxy": "b", "--tokens": "t.npy", "-o": "out"},
    "compare": {"--orig-base": "a", "--orig-fault": "b", "--proxy-base": "c", "--proxy-fault": "d"},
    "collect": {"--hf": "m", "--data": "d.jsonl", "-o": "stats"},
    "fidelity": {"--orig": "a", "--proxy": "b", "--plan": "p.json", "--data": "d.jsonl"},
    "consistency": {"--orig": "a", "--data": "d.jsonl"},
    "campaign": {"CONFIG": "campaign.json"},
    "watch": {"LOGDIR": "run.jsonl"},
}
POSITIONAL = {"CKPT", "DIR", "STATS", "CONFIG", "LOGDIR"}


def leaf_parsers(parser=None, prefix=()) -> dict[str, argparse.ArgumentParser]:
    """'stats merge' -> its parser, for every command."""
    parser = parser or build_parser()
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = leaf_parsers(sub, prefix + (name,))
                found.update(inner or {" ".join(prefix + (name,)): sub})
    return found


def accepts(sub: argparse.ArgumentParser, option: str) -> bool:
    if option == "CKPT":
        return any(a.metavar == "CKPT" and not a.option_strings for a in sub._actions)
    return any(option in a.option_strings for a in sub._actions)


def argv_of(command: str, options: dict[str, str | None]) -> list[str]:
    """A command line: positionals first, then `option value` (value None: a switch)."""
    argv = command.split()
    argv += [v for k, v in options.items() if k in POSITIONAL]
    for k, v in options.items():
        if k not in POSITIONAL:
            argv += [k] if v is None else [k, v]
    return argv


def parsed(argv: list[str]) -> dict:
    return {k: v for k, v in vars(parse(build_parser(), argv)).items() if not k.startswith("_")}


def test_the_spelling_table_is_what_the_commands_accept():
    leaves = leaf_parsers()
    assert set(BASE) == set(leaves)  # a new command gets its base command line here
    names = {n for s in SPELLINGS for n in s.names}
    assert names == set(APPLIES)
    for name in names:
        assert {cmd for cmd, sub in leaves.items() if accepts(sub, name)} == APPLIES[name], name


CASES = [
    (cmd, s, name)
    for s in SPELLINGS
    for name in s.names
    for cmd in sorted(APPLIES[name])
    if accepts(leaf_parsers()[cmd], s.ours)
]


@pytest.mark.parametrize("command, spelling, name", CASES, ids=[f"{c}:{s.ours}={n}" for c, s, n in CASES])
def test_every_spelling_means_our_option(command, spelling, name):
    value = {"--target-stage-layers": "1,3", "--expert-layout": spelling.value}.get(spelling.ours, "7")
    ours = argv_of(command, {**BASE[command], spelling.ours: value})
    rest = {k: v for k, v in BASE[command].items() if k != spelling.ours}
    theirs = argv_of(command, {**rest, name: None if spelling.value else value})
    assert name in theirs and parsed(theirs) == parsed(ours)


def test_the_spellings_cover_the_issue_and_every_alias_is_tested():
    for name in (
        "--load-dir",
        "--save-dir",
        "--target-tensor-parallel-size",
        "--target-pipeline-parallel-size",
        "--target-expert-parallel-size",
        "--target-expert-tensor-parallel-size",
        "--num-layer-list",
        "--moe-grouped-gemm",
    ):
        assert name in APPLIES
    assert {(c, n) for c, _, n in CASES} == {(c, n) for n, cmds in APPLIES.items() for c in cmds}


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("name", [n for row in NOT_YET for n in row.names])
def test_spellings_not_supported_yet_are_refused_by_name(capsys, name):
    err = usage_error(capsys, argv_of("convert", {**BASE["convert"], name: "3"}))
    assert err.startswith("usage: mcore-proxy convert")
    assert f"{name} is accepted but not supported yet: mcore-proxy does not write" in err
    help_text = leaf_parsers()["convert"].format_help()
    assert "not supported yet" in help_text and name in help_text


@pytest.mark.parametrize("command", sorted(BASE))
def test_a_usage_error_shows_the_usage_of_its_command(capsys, command):
    err = usage_error(capsys, argv_of(command, BASE[command]) + ["--bogus"])
    assert err.startswith(f"usage: mcore-proxy {command} ") and "unrecognized arguments: --bogus" in err
    assert "COMMAND ..." not in err  # not the top level's usage


def test_the_checkpoint_is_given_once_as_ckpt_or_load_dir(capsys):
    assert parsed(["convert", "--load-dir", "a", "-o", "b"])["ckpt"] == parsed(["convert", "a", "-o", "b"])["ckpt"]
    assert "the checkpoint is required" in usage_error(capsys, ["convert", "-o", "b"])
    assert "given twice" in usage_error(capsys, ["inspect", "a", "--load-dir", "b"])
    # abbreviations are off: with several spellings a prefix would silently pick one
    assert "unrecognized arguments: --target-e 2" in usage_error(capsys, ["convert", "a", "-o", "b", "--target-e", "2"])


def test_top_level_help_is_written_for_users(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    assert "Mixture-of-Experts" in text and "thin argparse layer" not in text
    listed = re.findall(r"^    (\w+)\s", text.split("commands, in pipeline order:")[1], re.M)
    assert listed == [
        "inspect",
        "estimate",
        "patches",
        "stats",
        "collect",
        "select",
        "convert",
        "verify",
        "distill",
        "fidelity",
        "consistency",
        "campaign",
        "watch",
        "compare",
    ]
    for code in ("0", "1", "2", "3", "128+N"):
        assert re.search(rf"^  {re.escape(code)}\s+\w", text, re.M), code
    assert "--load-dir" in text and "--json" in text and "--force" in text


@pytest.mark.parametrize("command", sorted(BASE))
def test_every_command_documents_its_exit_codes(command):
    text = leaf_parsers()[command].format_help()
    assert "exit codes:" in text and re.search(r"^  2\s+bad input or usage", text, re.M)
    assert bool(re.search(r"^  1\s+a check found a difference", text, re.M)) == (
        command in ("verify", "compare", "campaign", "watch")
    )
    assert "--json" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"mcore-proxy {__version__}"


# -- on a real checkpoint: --json carries the numbers of the text --------------------------------

FIXTURE = "seq_tp2_pp2_ep2"


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    return code, captured.out


def both(capsys, *argv) -> tuple[str, dict]:
    """(text, parsed JSON document) of one command line; stdout with --json is one JSON object."""
    _, text = run(capsys, *argv)
    _, raw = run(capsys, *argv, "--json")
    doc = json.loads(raw)
    assert doc["format"] == f"mcore-proxy-{argv[0] if argv[0] != 'stats' else 'stats-' + argv[1]}/1"
    return text, doc


@pytest.fixture
def real_stats(megatron_ckpt, tmp_path):
    """A real checkpoint and statistics shaped like it (planted clusters, saved by save_stats)."""
    from mcore_proxy.checkpoint import open_checkpoint
    from mcore_proxy.select.synthetic import stats_like
    from mcore_proxy.core.stats import save_stats

    ckpt, _ = megatron_ckpt(FIXTURE)
    spec = open_checkpoint(ckpt).spec
    stats = stats_like(spec, 4, tokens=500, seed=1)
    return ckpt, save_stats(stats, tmp_path / "routing_stats.safetensors")


def test_json_documents_carry_the_numbers_of_the_text(real_stats, tmp_path, capsys):
    ckpt, stats = real_stats

    text, d = both(capsys, "inspect", ckpt)
    assert f"{format_bytes(d['total_bytes'])} model ({d['tensors']} tensors)" in text
    assert f"{format_bytes(d['file_bytes'])} in {d['files']} files" in text
    assert f"TP={d['parallel']['tp']} PP={d['parallel']['pp']} EP={d['parallel']['ep']}" in text

    text, d = both(capsys, "stats", "show", stats)
    assert d["layers"] and f"E={d['num_experts']}, top-{d['topk']}" in text
    for lid, layer in d["layers"].items():
        top = " ".join(f"{t['expert']}:{100 * t['share']:.1f}%" for t in layer["top"])
        assert re.search(
            rf"^\s*{re.escape(lid)}\s+{layer['tokens']}\s+{re.escape(top)}\s.*\s{len(layer['dead'])}\s+"
            rf"{layer['entropy']:.3f}\s+pairs seen {layer['pairs_seen']}/{layer['pairs_total']}",
            text,
            re.M,
        )

    plan = tmp_path / "plan.json"
    _, text = run(capsys, "select", "--ckpt", ckpt, "--stats", stats, "-k", "4", "-o", plan)
    _, raw = run(capsys, "select", "--ckpt", ckpt, "--stats", stats, "-k", "4", "-o", plan, "--force", "--json")
    d = json.loads(raw)
    assert d["plan"] == str(plan) and d["num_experts"] == 4
    saved = json.loads(plan.read_text())["layers"]
    for lid, layer in d["layers"].items():
        assert layer["kept"] == saved[lid]["kept"]
        assert re.search(
            rf"^{re.escape(lid)}\s+4\s+{layer['token_coverage']:.3f}\s+{layer['gate_mass_coverage']:.3f}"
            rf"\s+{layer['never_selected']}\s",
            text,
            re.M,
        )
    assert re.search(
        rf"^mean\s+4\s+{d['mean']['token_coverage']:.3f}\s+{d['mean']['gate_mass_coverage']:.3f}$", text, re.M
    )

    _, text = run(capsys, "convert", ckpt, "--plan", plan, "-o", tmp_path / "a", "--target-ep", "1")
    _, raw = run(capsys, "convert", ckpt, "--plan", plan, "-o", tmp_path / "b", "--target-ep", "1", "--json")
    d = json.loads(raw)
    t = d["target"]
    assert (
        d["num_experts"] == 4
        and t["ep"] == 1
        and d["files"] == len([p for p in (tmp_path / "b").rglob("*") if p.is_file()])
    )
    assert f"4 of {d['source_experts']} experts per MoE layer, TP={t['tp']} PP={t['pp']} EP=1 ETP={t['etp']}" in text
    assert (
        f"reads {format_bytes(d['read_bytes'])} of tensors, writes about {format_bytes(d['output_bytes'])}; "
        f"{d['files']} files in " in text
    )
    assert "  " + " ".join(d["launch_flags"]) in text.splitlines()
    # a sequential-expert proxy must be launched without the source's grouped GEMM, and is told so
    assert d["remove_flags"] == ["--moe-grouped-gemm"] and "and without: --moe-grouped-gemm" in text.splitlines()

    text, d = both(capsys, "verify", "--orig", ckpt, "--proxy", tmp_path / "b", "--plan", plan)
    assert d["ok"] and d["problems"] == [] and d["functional"] is None
    assert f"checked {d['checked_tensors']} tensors ({format_bytes(d['checked_bytes'])}) bit for bit" in text


def test_megatron_spellings_run_the_pipeline_like_ours(real_stats, tmp_path, capsys):
    """Converter command lines of Megatron / MindSpeed-LLM, unchanged but for the program name,
    give the same plan and the same proxy as ours, and verify it."""
    ckpt, stats = real_stats
    plans = tmp_path / "ours.json", tmp_path / "theirs.json"
    assert (
        run(capsys, "select", "--ckpt", ckpt, "--stats", stats, "-k", "4", "--target-ep", "2", "-o", plans[0])[0] == 0
    )
    assert (
        run(
            capsys,
            "select",
            "--load-dir",
            ckpt,
            "--stats",
            stats,
            "-k",
            "4",
            "--target-expert-parallel-size",
            "2",
            "-o",
            plans[1],
        )[0]
        == 0
    )
    assert plans[0].read_bytes() == plans[1].read_bytes()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert (
        run(
            capsys,
            "convert",
            ckpt,
            "--plan",
            plans[0],
            "-o",
            ours,
            "--target-tp",
            "1",
            "--target-pp",
            "2",
            "--target-ep",
            "1",
            "--target-etp",
            "1",
            "--target-stage-layers",
            "1,3",
            "--expert-layout",
            "grouped",
        )[0]
        == 0
    )
    assert (
        run(
            capsys,
            "convert",
            "--load-dir",
            ckpt,
            "--plan",
            plans[1],
            "--save-dir",
            theirs,
            "--target-tensor-parallel-size",
            "1",
            "--target-pipeline-parallel-size",
            "2",
            "--target-expert-parallel-size",
            "1",
            "--target-expert-tensor-parallel-size",
            "1",
            "--num-layer-list",
            "1,3",
            "--moe-grouped-gemm",
        )[0]
        == 0
    )
    files = [json.loads((p / "manifest.json").read_text())["files"] for p in (ours, theirs)]
    assert files[0] == files[1] and any("mp_rank_00_001" in f for f in files[0])
    from mcore_proxy.checkpoint import open_checkpoint

    layout = open_checkpoint(theirs).layout
    assert (layout.pp, layout.ep, list(layout.stage_layers), layout.expert_layout) == (2, 1, [1, 3], "grouped")
    _, text = run(capsys, "verify", "--load-dir", ckpt, "--save-dir", theirs, "--plan", plans[1])
    assert "verify: OK" in text
