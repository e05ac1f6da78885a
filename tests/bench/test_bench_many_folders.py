"""bench/bench_many_folders.py (issue 23): its smoke mode builds both layouts of one model and times
`inspect` on each under a lowered descriptor limit, printing the ratio table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_inspects_both_layouts(tmp_path):
    r = subprocess.run(
        [sys.executable, "bench/bench_many_folders.py", "--smoke", "--warm", "--data", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "ulimit -n 256" in r.stdout
    (row,) = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and ln.endswith("x |")]
    _, small, large, ratio = (c.strip() for c in row.strip("|").split("|"))
    assert float(small) > 0 and float(large) > 0 and float(ratio[:-1]) > 0
    results = json.loads((tmp_path / "many-results.json").read_text())
    assert sorted(results["samples"]) == sorted(f"{row.split()[1]} {n}" for n in (8, 64))
    assert all(s["stdout"].startswith("checkpoint") for v in results["samples"].values() for s in v)
