"""More rank files than the process may open (checkpoint/descriptors.py).

A legacy checkpoint of a large job has more rank files than `ulimit -n`; the readers borrow
descriptors from a bounded pool instead of keeping one per file. Checked with a real limit: the
commands run in a child process under `ulimit -n 40` on a checkpoint of 128 rank folders.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mcore_proxy.checkpoint.descriptors import DescriptorPool
from mcore_proxy.cli import main


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_pool_keeps_at_most_its_limit_and_never_closes_a_descriptor_in_use(tmp_path):
    files = []
    for i in range(6):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(bytes([i]) * 8)
    pool, before = DescriptorPool(limit=2), _open_fds()
    for i, f in enumerate(files):
        with pool.borrow(f) as fd:
            assert os.pread(fd, 1, 3) == bytes([i])
        assert pool.open_count() <= 2 and _open_fds() - before <= 2
    # three files read at once: none of them is closed under its reader, the bound returns after
    with pool.borrow(files[0]) as a, pool.borrow(files[1]) as b, pool.borrow(files[2]) as c:
        assert [os.pread(fd, 1, 0) for fd in (a, b, c)] == [b"\0", b"\1", b"\2"]
    with pool.borrow(files[3]):
        pass
    assert pool.open_count() <= 2
    pool.forget(files[3])
    assert files[3] not in pool._open


@pytest.fixture(scope="module")
def many_ranks(hf_model, hf_proxy, tmp_path_factory):
    """The tiny Qwen3-MoE as 128 legacy rank folders (TP 2 x PP 4 x EP 16) and a plan (8 of 16)."""
    out = tmp_path_factory.mktemp("many-ranks") / "ckpt"
    assert (
        main(
            [
                "convert",
                hf_model("qwen3_moe"),
                "-o",
                out,
                "--format",
                "legacy",
                "--target-tp",
                "2",
                "--target-pp",
                "4",
                "--target-ep",
                "16",
            ]
        )
        == 0
    )
    return out, hf_proxy("qwen3_moe")[2]


def _limited(command: str, tmp_path) -> subprocess.CompletedProcess:
    cli = f"{sys.executable} -m mcore_proxy"
    return subprocess.run(
        ["bash", "-c", f"ulimit -n 40 && {command.format(cli=cli, tmp=tmp_path)}"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_128_rank_folders_under_ulimit_40(many_ranks, tmp_path):
    ckpt, plan = many_ranks
    folders = list(next(p for p in ckpt.iterdir() if p.is_dir()).iterdir())
    assert len(folders) == 128
    inspect = _limited(f"{{cli}} inspect {ckpt}", tmp_path)
    assert inspect.returncode == 0, inspect.stderr
    assert "TP=2 PP=4 EP=16" in inspect.stdout
    convert = _limited(f"{{cli}} convert {ckpt} --plan {plan} -o {{tmp}}/proxy --target-ep 2", tmp_path)
    assert convert.returncode == 0, convert.stderr
    verify = _limited(f"{{cli}} verify --orig {ckpt} --proxy {{tmp}}/proxy --plan {plan}", tmp_path)
    assert verify.returncode == 0 and "verify: OK" in verify.stdout, verify.stderr
