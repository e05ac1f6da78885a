"""Interruption: real signals at the write and manifest phases, with 1 and 2 writer processes and
under torchrun; then a rerun. Nothing left may look like a checkpoint, no worker outlives the
converter, a second converter on the same output is refused.

The converter is held at a phase by its fault-injection point (`pipeline.hold`: it writes its pid
to a file and sleeps), so each signal arrives at a known moment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from mcore_proxy.cli import main
from mcore_proxy.convert.manifest import check_manifest

FIXTURE = "seq_tp2_pp2_ep2"


def start(ckpt, out, hold_file, phase, *options):
    env = {**os.environ, "MCORE_PROXY_TEST_HOLD": phase, "MCORE_PROXY_TEST_HOLD_FILE": str(hold_file)}
    return subprocess.Popen(
        [sys.executable, "-m", "mcore_proxy.cli", "convert", str(ckpt), "-o", str(out), "--target-ep", "1", *options],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_held(proc, hold_file, timeout=180):
    deadline = time.time() + timeout
    while not hold_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before the hold: {proc.stderr.read()[-2000:]}")
        assert time.time() < deadline, "never reached the hold point"
        time.sleep(0.1)
    time.sleep(0.2)


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def assert_all_gone(procs, timeout=15):
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"still running: {[p.pid for p in alive]}"


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# SIGTERM at both phases with 1 and 2 writers; SIGINT and SIGHUP take the same path: one case each
SIGNAL_CASES = [(signal.SIGTERM, w, p) for p in ("write", "manifest") for w in (1, 2)] + [
    (signal.SIGINT, 1, "write"),
    (signal.SIGHUP, 2, "write"),
]


@pytest.mark.parametrize("sig,workers,phase", SIGNAL_CASES, ids=[f"{s.name}-{w}-{p}" for s, w, p in SIGNAL_CASES])
def test_signal_stops_everything_and_removes_the_staging_folder(megatron_ckpt, tmp_path, workers, phase, sig):
    ckpt, _ = megatron_ckpt(FIXTURE)
    out, hold_file = tmp_path / "proxy", tmp_path / "held"
    proc = start(ckpt, out, hold_file, phase, "--workers", str(workers))
    wait_held(proc, hold_file)
    children = descendants(proc.pid)
    if phase == "write" and workers > 1:  # both writers are alive, held after their files
        assert len([c for c in children if "python" in c.name()]) >= workers
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    lines = [line for line in err.splitlines() if line.startswith("mcore-proxy ")]
    assert lines == [f"mcore-proxy convert: stopped by {signal.Signals(sig).name}; partial output removed"], err
    assert "Traceback" not in err
    assert_all_gone(children)
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("phase", ["write", "manifest"])
def test_kill_9_leaves_only_a_staging_folder_and_the_rerun_succeeds(megatron_ckpt, tmp_path, capsys, workers, phase):
    ckpt, _ = megatron_ckpt(FIXTURE)
    out, hold_file = tmp_path / "proxy", tmp_path / "held"
    proc = start(ckpt, out, hold_file, phase, "--workers", str(workers))
    wait_held(proc, hold_file)
    children = descendants(proc.pid)
    proc.kill()
    proc.communicate(timeout=60)
    assert_all_gone(children)  # workers die with their parent
    assert not out.exists()
    staging = [tmp_path / n for n in leftovers(tmp_path) if ".mcore-proxy-staging-" in n]
    assert len(staging) == 1
    files = {p.relative_to(staging[0]).as_posix() for p in staging[0].rglob("*") if p.is_file()}
    assert "latest_checkpointed_iteration.txt" not in files  # the tracker is the very last file
    assert ("manifest.json" in files) == (phase == "manifest")
    for command in (["inspect", staging[0]], ["convert", staging[0], "-o", tmp_path / "other"]):
        capsys.readouterr()
        assert main([str(a) for a in command]) == 2
        assert "staging folder of an unfinished mcore-proxy output" in capsys.readouterr().err
    # the next run on the same output removes the stale folder and succeeds
    assert main(["convert", str(ckpt), "-o", str(out), "--target-ep", "1"]) == 0
    assert check_manifest(out) == []
    assert leftovers(tmp_path) == []


def test_a_second_converter_on_the_same_output_is_refused(megatron_ckpt, tmp_path, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    out, hold_file = tmp_path / "proxy", tmp_path / "held"
    proc = start(ckpt, out, hold_file, "write")
    wait_held(proc, hold_file)
    for extra in ([], ["--dry-run"]):
        capsys.readouterr()
        assert main(["convert", str(ckpt), "-o", str(out), *extra]) == 2
        assert "another mcore-proxy run is writing this output" in capsys.readouterr().err
    proc.terminate()
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert main(["convert", str(ckpt), "-o", str(out)]) == 0
    assert leftovers(tmp_path) == []


def test_sigterm_to_torchrun_stops_every_rank(megatron_ckpt, tmp_path):
    from mcore_proxy.functional.cpu import free_port

    ckpt, _ = megatron_ckpt(FIXTURE)
    out, hold_file = tmp_path / "proxy", tmp_path / "held"
    env = {**os.environ, "MCORE_PROXY_TEST_HOLD": "write", "MCORE_PROXY_TEST_HOLD_FILE": str(hold_file)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "mcore_proxy.cli",
            "convert",
            str(ckpt),
            "-o",
            str(out),
            "--target-ep",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_held(proc, hold_file)
    ranks = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.count("stopped by SIGTERM; partial output removed") >= 1, err[-3000:]
    assert_all_gone(ranks)
    assert not out.exists() and leftovers(tmp_path) == []
