"""bench/bench_real_width.py (issue 23 item 2): its smoke mode runs the whole measurement (cp -r, dd,
the I/O floor, select, convert, verify) on a tiny checkpoint, and the floor writes exactly the tensor
bytes convert writes, read from the byte ranges its own zip/pickle index finds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.bench_real_width import build, floor_spec, rank_files, rank_index, smoke_model

ROOT = Path(__file__).resolve().parents[2]


def test_rank_index_finds_each_tensors_bytes(tmp_path):
    """The torch-free index gives, for every model tensor, the byte range torch.load reads it from."""
    src = tmp_path / "ckpt"
    build(src, tmp_path / "stats.safetensors", smoke_model(), ep=2, tokens=64)
    f = rank_files(src)[1]
    index, (pkl_off, pkl_len) = rank_index(f)
    state = torch.load(f, map_location="cpu", weights_only=False)["model"]
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert set(index) == set(tensors) and pkl_len > 0
    raw = f.read_bytes()
    for key, t in tensors.items():
        off, n = index[key]
        assert raw[off : off + n] == t.contiguous().view(torch.uint8).numpy().tobytes(), key
    # routed experts are tiled from one random block: not constant, different per expert
    e0 = state["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    e1 = state["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert e0.unique().numel() > 1 and not torch.equal(e0, e1)


def test_smoke_runs_the_measurement(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "bench/bench_real_width.py", "--smoke", "--warm", "--keeps", "16", "--target-eps", "2"]
        + ["--data", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "verify ok" in r.stdout and "note:" not in r.stdout  # floor and convert: the same tensor bytes
    rows = [ln.split(" | ")[0][2:] for ln in r.stdout.splitlines() if ln.startswith("| ")]
    assert rows[:7] == [
        "command",
        "cp -r",
        "dd read (2 rank files)",
        "dd write (64 MiB, conv=fsync)",
        "start-up (imports)",
        "floor K=16 -> EP 2",
        "convert K=16 -> EP 2",
    ]
    assert "K=16 -> EP 2" in rows
    res = json.loads((tmp_path / "wide-results.json").read_text())
    s = res["summary"]["convert K=16 -> EP 2"]
    assert s["floor_tensor_bytes"] == s["convert_tensor_bytes"] == s["write_bytes"] > 0
    assert not (tmp_path / "wide-tmp").exists()


def test_floor_spec_counts_every_kept_byte(tmp_path):
    """What the floor writes: the non-expert tensors in every output file (routers cut to the kept
    rows), each kept expert's fc1 and fc2 in exactly one."""
    src = tmp_path / "ckpt"
    build(src, tmp_path / "stats.safetensors", smoke_model(), ep=4, tokens=64)
    kept = [0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"1": {"kept": kept}}}))
    spec = floor_spec(src, plan, target_ep=2)
    first = rank_index(rank_files(src)[0])[0]
    h = smoke_model().hidden_size
    non_expert = sum(n for k, (_, n) in first.items() if ".local_experts." not in k and ".router." not in k)
    router = len(kept) * (h * 2 + 4)  # bf16 rows of [E, H] and float32 entries of the bias
    expert = sum(n for k, (_, n) in first.items() if ".local_experts.0." in k)
    assert spec["write_bytes"] == 2 * (non_expert + router) + len(kept) * expert
    assert spec["read_bytes"] == non_expert + router + len(kept) * expert
    assert len(spec["outputs"]) == 2 and {r[0] for r in spec["reads"]} == {0, 1, 2, 3}
