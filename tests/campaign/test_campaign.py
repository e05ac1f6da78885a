"""campaign: runs a command under each fault (MCORE_PROXY_FAULTS per run) and a baseline, a few at a
time, into a versioned signature library; a real SIGINT stops it, removes partial runs, and a
restart runs only what had not finished; a second campaign on the same work folder is refused; a failed run is
reported (exit 1) and rerun next time;
bad configs are one sentence (exit 2). The command is a stand-in trainer (stand_in_train.py), not
a training run: the RL demonstration's campaign is measured in bench/rl_campaign.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_proxy.campaign.config import ConfigError, load_config
from mcore_proxy.cli import main
from mcore_proxy.diagnose.library import load_library

TRAIN = Path(__file__).with_name("stand_in_train.py")


def write_config(tmp_path, jobs=2, delay=0.0, steps=60, extra_faults=(), **over) -> Path:
    config = {
        "format": "mcore-proxy-campaign-config/1",
        "command": ["{python}", str(TRAIN), "--out", "{run_dir}", "--steps", str(steps)],
        "env": {"STAND_IN_DELAY": str(delay)},  # not part of a run's identity: changing it reruns nothing
        "log": "{run_dir}/metrics.jsonl",
        "work": "work",
        "jobs": jobs,
        "faults": [
            {"name": "noise", "spec": "router_noise:std={strength}", "strengths": [0.2, 0.6]},
            {"name": "precision", "spec": "logprob_precision:dtype=bf16", "args": ["--seed", "3"]},
            *extra_faults,
        ],
        **over,
    }
    path = tmp_path / "campaign.json"
    path.write_text(json.dumps(config))
    return path


def cli(*args):
    return [sys.executable, "-m", "mcore_proxy.cli", *map(str, args)]


def test_campaign_builds_a_library_with_the_earliest_warnings(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["campaign", str(config), "--png"]) == 0
    out = capsys.readouterr().out
    work = tmp_path / "work"
    assert (work / "library.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (work / "runs").iterdir()) == ["baseline", "noise@0.2", "noise@0.6", "precision"]
    assert (work / "runs" / "noise@0.6" / "seen_fault.txt").read_text() == "router_noise:std=0.6"
    assert (work / "runs" / "baseline" / "seen_fault.txt").read_text() == ""
    library = load_library(work / "library.json")
    assert json.loads((work / "library.json").read_text())["format"] == "mcore-proxy-library/1"
    assert [e.name for e in library.entries] == ["noise@0.2", "noise@0.6", "precision"]
    noise = library.entries[1].signature.metrics["reward"]
    assert noise.direction == -1 and 8 <= noise.onset <= 12
    assert library.entries[2].signature.metrics["logprob_diff"].direction == 1
    # the earliest-warning table: one line per run with its first shifted metric and onset
    line = next(ln for ln in out.splitlines() if ln.startswith("noise@0.6") and "reward" in ln)
    assert int(line.split()[2]) == noise.onset
    assert "library: " in out and "(3 entries)" in out
    # a run of the campaign is triaged back to its fault
    assert (
        main(
            [
                "compare",
                "--run",
                work / "runs" / "noise@0.6" / "metrics.jsonl",
                "--baseline",
                work / "runs" / "baseline" / "metrics.jsonl",
                "--library",
                work / "library.json",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["ranking"][0]["fault"] == "noise"


def test_sigint_stops_the_runs_and_a_restart_resumes(tmp_path):
    config = write_config(tmp_path, jobs=1, delay=0.3, steps=30)  # 9 s per run
    work = tmp_path / "work" / "runs"
    proc = subprocess.Popen(cli("campaign", config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (work / "noise@0.2" / "metrics.jsonl").is_file() and time.time() < deadline:
        time.sleep(0.1)
    # while it runs, a second campaign on the same work folder is refused
    second = subprocess.run(cli("campaign", config), capture_output=True, text=True, timeout=60)
    assert second.returncode == 2
    assert f"another campaign is running on this work folder, pid {proc.pid}" in second.stderr
    finished = {p.parent.name: p.stat().st_mtime_ns for p in work.glob("*/run.json")}
    assert "baseline" in finished and len(finished) < 4
    partial = [p.name for p in work.iterdir() if not (p / "run.json").exists()]
    assert partial  # a run is under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT" in err
    assert not any((work / name).exists() for name in partial)  # the partial run was removed
    assert subprocess.run(["pgrep", "-f", str(TRAIN)], capture_output=True).returncode == 1  # none left
    write_config(tmp_path, jobs=2, delay=0.0, steps=30)  # the rest at full speed
    again = subprocess.run(cli("campaign", config), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "baseline                 finished earlier" in again.stdout
    for name, mtime in finished.items():  # not rerun
        assert (work / name / "run.json").stat().st_mtime_ns == mtime
    assert sorted(p.parent.name for p in work.glob("*/run.json")) == ["baseline", "noise@0.2", "noise@0.6", "precision"]


def test_json_document(tmp_path, capsys):
    config = write_config(tmp_path, steps=20)
    assert main(["campaign", str(config), "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["format"] == "mcore-proxy-campaign/1" and dry["dry_run"]
    assert [(r["name"], r["state"]) for r in dry["runs"]][:2] == [("baseline", "to run"), ("noise@0.2", "to run")]
    assert main(["campaign", str(config), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and [r["status"] for r in doc["runs"]] == ["done"] * 4
    assert doc["library"] == str(tmp_path / "work" / "library.json")
    assert doc["earliest_warning"]["noise@0.6"]["metric"] == "reward"
    assert doc["earliest_warning"]["precision"]["metric"] == "logprob_diff"


def test_a_failed_run_is_reported_and_rerun(tmp_path, capsys):
    config = write_config(
        tmp_path, steps=20, extra_faults=[{"name": "broken", "spec": "topk:rate=0.1", "args": ["--fail"]}]
    )
    assert main(["campaign", str(config)]) == 1
    err = capsys.readouterr().err
    assert "1 run(s) failed: broken (exit 3" in err and "console.log" in err
    assert [e.name for e in load_library(tmp_path / "work" / "library.json").entries] == [
        "noise@0.2",
        "noise@0.6",
        "precision",
    ]
    assert main(["campaign", str(config), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("broken") and "to run" in ln for ln in lines)
    assert any(ln.startswith("precision") and "finished" in ln for ln in lines)


def test_a_changed_entry_is_rerun(tmp_path, capsys):
    config = write_config(tmp_path, steps=20)
    assert main(["campaign", str(config)]) == 0
    data = json.loads(config.read_text())
    data["faults"][0]["strengths"] = [0.2, 0.9]
    data["faults"][1]["args"] = ["--seed", "4"]
    config.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["campaign", str(config)]) == 0
    status = {
        ln.split()[0]: ln.split()[1]
        for ln in capsys.readouterr().out.splitlines()
        if ln.split()[1:2] in (["done"], ["finished"])
    }
    assert status == {"baseline": "finished", "noise@0.2": "finished", "noise@0.9": "done", "precision": "done"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "x/1"}, "format 'x/1' is not 'mcore-proxy-campaign-config/1'"),
        ({"command": "python train.py"}, '"command" must be a non-empty list of strings'),
        ({"jobs": 0}, '"jobs" must be an integer >= 1'),
        ({"launcher": "x"}, "unknown key(s) ['launcher']"),
        ({"faults": [{"name": "bad", "spec": "router_noise:stdd=1"}]}, "fault 'bad'"),
        ({"faults": [{"name": "a b", "spec": "router_noise"}]}, "may use only letters"),
        ({"faults": [{"name": "n", "spec": "router_noise"}, {"name": "n", "spec": "topk"}]}, "occur twice"),
        ({"log": "{rundir}/m.jsonl"}, "placeholder in '{rundir}/m.jsonl'"),
        ({"faults": [{"name": "n", "spec": "topk", "schedule": "start=1", "schedules": ["start=2"]}]}, "not both"),
    ],
)
def test_bad_configs(tmp_path, capsys, change, message):
    config = write_config(tmp_path)
    data = {**json.loads(config.read_text()), **change}
    config.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="campaign.json: "):
        load_config(config)
    assert main(["campaign", str(config)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_schedule_is_added_to_every_fault_of_a_spec(tmp_path):
    config = write_config(
        tmp_path,
        faults=[{"name": "both", "spec": "router_noise:std=0.1;update_omission", "schedule": "start=5,stop=9"}],
    )
    entry = load_config(config).entries[1]
    assert entry.spec == "router_noise:std=0.1,start=5,stop=9;update_omission:start=5,stop=9"
    assert os.path.isabs(entry.command[3]) and entry.command[3].endswith("work/runs/both")


def test_schedules_make_one_run_each(tmp_path):
    config = write_config(
        tmp_path,
        faults=[
            {
                "name": "omission",
                "spec": "update_omission",
                "strengths": ["a"],
                "schedules": ["start=5", "start=5,every=2"],
            }
        ],
    )
    _, first, second = load_config(config).entries
    assert (first.name, first.spec) == ("omission@a@start=5", "update_omission:start=5")
    assert (second.name, second.spec) == ("omission@a@start=5+every=2", "update_omission:start=5,every=2")
    assert second.fault == "omission" and second.strength == "a"


def test_the_work_folder_is_new_or_a_campaigns_and_keeps_no_lock(tmp_path, capsys):
    """`work` set to "/" or to a checkpoint is refused before anything is written; a campaign marks
    its own folder (campaign.json), runs again in it, and leaves no .lock behind."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    for work, says in (
        ("/", 'holds other files'),
        (str(ckpt), "holds other files"),
        (str(ckpt / "sub"), "checkpoint folder"),
        ("", '"work" must name a folder'),
    ):
        config = write_config(tmp_path, steps=20, work=work)
        before = sorted(p.name for p in ckpt.iterdir())
        assert main(["campaign", str(config)]) == 2
        assert says in capsys.readouterr().err
        assert sorted(p.name for p in ckpt.iterdir()) == before and not os.path.exists("/library.json")
    config = write_config(tmp_path, steps=20)
    assert main(["campaign", str(config)]) == 0
    work = tmp_path / "work"
    assert json.loads((work / "campaign.json").read_text())["format"] == "mcore-proxy-campaign-work/1"
    assert not (work / ".lock").exists()
    assert main(["campaign", str(config)]) == 0  # its own folder: resumed, nothing rerun
    assert "finished earlier" in capsys.readouterr().out and not (work / ".lock").exists()
