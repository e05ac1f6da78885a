"""Real write failures: a full file system (tmpfs), a file-size limit (RLIMIT_FSIZE), a read-only
mount. Each is one sentence and exit code 2, never an abort, and leaves nothing behind."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import uuid

import pytest

from mcore_proxy.cli import main

FIXTURE = "seq_tp2_pp2_ep2"


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size)` -> a freshly mounted tmpfs of that size (skips where mounting is not permitted)."""
    mounted = []

    def mount(size: str):
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}); needs root")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_one_error(err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("mcore-proxy ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize(
    "options",
    [["--format", "legacy"], ["--format", "legacy", "--workers", "2"], ["--format", "torch_dist"]],
    ids=["legacy", "legacy-workers2", "torch_dist"],
)
def test_full_file_system(megatron_ckpt, tmpfs, capsys, digest, options):
    ckpt, _ = megatron_ckpt(FIXTURE)
    before = digest(ckpt)
    fs = tmpfs("128k")
    out = fs / "proxy"
    # refused before a byte is written: the estimate exceeds the free space
    code, err = run(capsys, "convert", ckpt, "-o", out, *options)
    assert code == 2
    assert_one_error(err, str(out), "needs about", "free", "--no-space-check")
    assert list(fs.iterdir()) == []
    # without the early check the real writes fail with ENOSPC
    code, err = run(capsys, "convert", ckpt, "-o", out, "--no-space-check", *options)
    assert code == 2
    assert_one_error(err, str(out), "writing the output failed (the file system is full", "nothing was left behind")
    assert list(fs.iterdir()) == []
    assert digest(ckpt) == before


def test_read_only_target(megatron_ckpt, tmpfs, capsys):
    ckpt, _ = megatron_ckpt(FIXTURE)
    fs = tmpfs("4m")
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    out = fs / "proxy"
    code, err = run(capsys, "convert", ckpt, "-o", out, "--no-space-check")
    assert code == 2
    assert_one_error(err, str(out), "the file system is read-only")
    assert list(fs.iterdir()) == []


def _limit_file_size(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_file_size_limit(megatron_ckpt, tmp_path, fmt):
    """Past RLIMIT_FSIZE a write fails with EFBIG (and the kernel's SIGXFSZ is ignored): no privileges needed."""
    ckpt, _ = megatron_ckpt(FIXTURE)
    out = tmp_path / f"proxy-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_proxy.cli",
            "convert",
            str(ckpt),
            "-o",
            str(out),
            "--format",
            fmt,
            "--target-tp",
            "1",
            "--target-pp",
            "1",
            "--target-ep",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=_limit_file_size(48 << 10),
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert_one_error(done.stderr, str(out), "file-size limit")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []
