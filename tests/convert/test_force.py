"""`convert --force` replaces an earlier output only once the new one is complete (a forced run that
fails, by a real signal or a real file-size limit, leaves the old output as it was), refuses what
it must not replace; and a moved proxy's manifest still verifies and names no place."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mcore_proxy.cli import main
from mcore_proxy.convert.manifest import check_manifest

FIXTURE = "seq_tp2_pp2_ep2"


def manifest(out) -> dict:
    return json.loads((out / "manifest.json").read_text())


def convert(capsys, ckpt, plan, out, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["convert", str(ckpt), "--plan", str(plan), "-o", str(out), *map(str, extra)])
    return code, capsys.readouterr().err


def verify_ok(capsys, ckpt, plan, out) -> bool:
    capsys.readouterr()
    return (
        main(["verify", "--orig", str(ckpt), "--proxy", str(out), "--plan", str(plan)]) == 0
        and "verify: OK" in capsys.readouterr().out
    )


@pytest.fixture
def earlier(megatron_ckpt, proxy_plan, tmp_path, capsys):
    """(ckpt, plan, out, its manifest): an earlier proxy at EP=2, alone in its folder."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan, _ = proxy_plan(FIXTURE)
    out = tmp_path / "proxy"
    assert convert(capsys, ckpt, plan, out, "--target-ep", "2")[0] == 0
    return ckpt, plan, out, manifest(out)


def test_force_replaces_an_earlier_output(earlier, tmp_path, capsys):
    ckpt, plan, out, before = earlier
    code, err = convert(capsys, ckpt, plan, out, "--target-ep", "1")
    assert code == 2 and "already exists; pass --force" in err and manifest(out) == before
    assert convert(capsys, ckpt, plan, out, "--target-ep", "1", "--force")[0] == 0
    after = manifest(out)
    assert before["target"]["ep"] == 2 and after["target"]["ep"] == 1
    assert not (out / "iter_0000010" / "mp_rank_00_000_001").exists()  # nothing of the old one mixed in
    assert verify_ok(capsys, ckpt, plan, out)
    assert [p.name for p in tmp_path.iterdir()] == ["proxy"]  # no staging folder, old copy or lock left


def test_force_replaces_an_empty_folder(megatron_ckpt, proxy_plan, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan, _ = proxy_plan(FIXTURE)
    out = tmp_path / "proxy"
    out.mkdir()
    assert convert(capsys, ckpt, plan, out, "--target-ep", "1", "--force")[0] == 0
    assert verify_ok(capsys, ckpt, plan, out)


@pytest.mark.parametrize("case", ["other_data", "a_file", "the_input", "holds_the_plan"])
def test_force_refuses_what_it_must_not_replace(megatron_ckpt, proxy_plan, tmp_path, capsys, digest, case):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan, _ = proxy_plan(FIXTURE)
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    out = tmp_path / "out"
    if case == "other_data":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        expected = "holds no mcore-proxy manifest.json (or compare report.json), so --force does not replace it"
    elif case == "a_file":
        out.write_text("mine")
        expected = "exists and is not a folder"
    elif case == "the_input":
        out, expected = src, "must not be inside the input"
    else:
        out.mkdir()
        plan = shutil.copy(plan, out / "plan.json")
        expected = "must not be inside the input"
    before = digest(tmp_path)
    code, err = convert(capsys, src, plan, out, "--target-ep", "1", "--force")
    assert code == 2 and expected in err and str(out) in err, err
    assert digest(tmp_path) == before


def _start(ckpt, plan, out, *extra, env=None, **kwargs):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mcore_proxy.cli",
            "convert",
            str(ckpt),
            "--plan",
            str(plan),
            "-o",
            str(out),
            "--target-ep",
            "1",
            "--force",
            *extra,
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _assert_untouched(capsys, ckpt, plan, out, before, tmp_path):
    assert manifest(out) == before and check_manifest(out) == []
    assert verify_ok(capsys, ckpt, plan, out)
    assert [p.name for p in tmp_path.iterdir()] == ["proxy"]


def test_a_forced_run_stopped_by_a_signal_leaves_the_old_output(earlier, tmp_path, capsys):
    ckpt, plan, out, before = earlier
    hold = tmp_path.parent / f"{tmp_path.name}-held"
    proc = _start(ckpt, plan, out, env={"MCORE_PROXY_TEST_HOLD": "manifest", "MCORE_PROXY_TEST_HOLD_FILE": str(hold)})
    deadline = time.time() + 180
    while not hold.exists():  # held after the new output's data files and manifest are written
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "never reached the hold point"
        time.sleep(0.1)
    assert [p for p in tmp_path.iterdir() if ".mcore-proxy-staging-" in p.name]  # the new one, beside the old
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    hold.unlink()
    assert proc.returncode == 128 + signal.SIGTERM, err
    _assert_untouched(capsys, ckpt, plan, out, before, tmp_path)


def test_a_forced_run_that_fails_to_write_leaves_the_old_output(earlier, tmp_path, capsys):
    """A real file-size limit (RLIMIT_FSIZE: EFBIG) stops the new output's first large file."""
    ckpt, plan, out, before = earlier

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (48 << 10, 48 << 10))

    proc = _start(
        ckpt, plan, out, "--target-tp", "1", "--target-pp", "1", env={"PYTHONDONTWRITEBYTECODE": "1"}, preexec_fn=limit
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "file-size limit" in err, err
    _assert_untouched(capsys, ckpt, plan, out, before, tmp_path)


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_moved_proxy_verifies_and_its_manifest_names_no_place(
    megatron_ckpt, proxy_plan, tmp_path, monkeypatch, capsys, fmt
):
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan, _ = proxy_plan(FIXTURE)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ckpt, "orig")
    shutil.copy(plan, "plan.json")
    # an absolute and a relative input alike are recorded relative to the proxy
    assert convert(capsys, tmp_path / "orig", "plan.json", "proxy", "--target-ep", "1", "--format", fmt)[0] == 0
    m = manifest(tmp_path / "proxy")
    assert m["source"]["path"] == "../orig" and m["plan"]["path"] == "../plan.json"
    assert "relative to this folder" in m["paths"] and "never read back" in m["paths"]
    assert not [s for s in _strings(m) if str(tmp_path) in s or s.startswith(os.sep)]
    # the workspace moved as a whole: the manifest still names the inputs, and the proxy verifies
    ws = tmp_path / "elsewhere" / "ws"
    ws.mkdir(parents=True)
    for name in ("orig", "plan.json", "proxy"):
        shutil.move(tmp_path / name, ws / name)
    moved = ws / "proxy"
    assert (moved / m["source"]["path"]).resolve() == (ws / "orig").resolve()
    assert (moved / m["plan"]["path"]).resolve() == (ws / "plan.json").resolve()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert verify_ok(capsys, ws / "orig", ws / "plan.json", moved)
