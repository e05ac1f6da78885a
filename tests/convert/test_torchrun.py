"""`convert` under torchrun, 4 processes on one machine (the launch a multi-node conversion uses,
docs/cli-usage.md): every output format equals the one-process output byte for byte, and so does
`--workers 2`; a rank killed mid-write (SIGKILL: no handler runs) leaves nothing that looks like a
checkpoint, the launch exits non-zero, and the next run cleans up what the dead rank left."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mcore_proxy.cli import main
from mcore_proxy.convert.manifest import MANIFEST
from mcore_proxy.functional.cpu import free_port
from test_interrupt import leftovers, wait_held

FIXTURE = "seq_tp2_pp2_ep2"
RANKS = 4


def torchrun(*args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(RANKS),
        "--master_port",
        str(free_port()),
        "-m",
        "mcore_proxy.cli",
        *map(str, args),
    ]


def file_bytes(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file but the manifest, which names its own output folder's
    inputs relative to it; its file table is compared instead."""
    out = {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    out[MANIFEST] = json.dumps(json.loads((folder / MANIFEST).read_text())["files"], sort_keys=True)
    return out


def source_and_options(fmt, megatron_ckpt, proxy_plan, hf_proxy):
    if fmt == "hf":
        orig, _, plan_path, _, _ = hf_proxy("qwen3_moe")
        return orig, ["--plan", plan_path]
    ckpt, _ = megatron_ckpt(FIXTURE)
    plan_path, _ = proxy_plan(FIXTURE)
    return ckpt, ["--plan", plan_path, "--format", fmt, "--target-ep", "2"]


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist", "hf"])
def test_four_ranks_and_two_workers_write_what_one_process_writes(fmt, megatron_ckpt, proxy_plan, hf_proxy, tmp_path):
    src, options = source_and_options(fmt, megatron_ckpt, proxy_plan, hf_proxy)
    one, two, tr = tmp_path / "one", tmp_path / "two", tmp_path / "tr"
    assert main(["convert", str(src), "-o", str(one), *map(str, options)]) == 0
    assert main(["convert", str(src), "-o", str(two), "--workers", "2", *map(str, options)]) == 0
    done = subprocess.run(torchrun("convert", src, "-o", tr, *options), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = file_bytes(one)
    assert len(expected) > RANKS  # more output units than ranks: every rank wrote a share
    assert file_bytes(two) == expected
    assert file_bytes(tr) == expected
    assert main(["verify", "--orig", str(src), "--proxy", str(tr), "--plan", str(options[1])]) == 0
    assert leftovers(tmp_path) == []


def worker_of_rank(launcher: psutil.Process, rank: int) -> psutil.Process:
    for p in launcher.children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank):
                return p
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of rank {rank} under the launcher")


@pytest.mark.parametrize("victim", [2, 0])
def test_a_rank_killed_mid_write_leaves_no_complete_looking_output(victim, megatron_ckpt, tmp_path, capsys):
    """Rank 2 killed: the launcher stops the others (SIGTERM) and rank 0 removes the staging folder.
    Rank 0 killed: its staging folder stays behind, hidden and refused by every reader, and the next
    convert of the same output removes it."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    out, hold_file = tmp_path / "proxy", tmp_path / "held"
    env = {**os.environ, "MCORE_PROXY_TEST_HOLD": "write", "MCORE_PROXY_TEST_HOLD_FILE": str(hold_file)}
    proc = subprocess.Popen(
        torchrun("convert", ckpt, "-o", out, "--target-ep", "2"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_held(proc, hold_file)
    worker_of_rank(psutil.Process(proc.pid), victim).send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err[-3000:]
    assert not out.exists()
    left = leftovers(tmp_path)
    if victim == 0:
        staging = [name for name in left if ".mcore-proxy-staging-" in name]
        assert staging, left
        assert main(["inspect", str(tmp_path / staging[0])]) == 2
        assert "interrupted" in capsys.readouterr().err
    else:
        assert left == [], left
    assert main(["convert", str(ckpt), "-o", str(out), "--target-ep", "2"]) == 0
    assert leftovers(tmp_path) == []
