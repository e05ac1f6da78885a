"""Peak RSS of `inspect` and of a full streaming read of a >1 GB, 16-layer legacy checkpoint.

    python bench/bench_read.py [--out bench/out] [--layers 16]

Builds a synthetic Megatron MoE checkpoint (bf16, TP=2 PP=2 EP=4) with the streaming legacy
writer, then runs each reader command under `/usr/bin/time -v` and reports maximum resident
set size against the model's largest layer. Acceptance: full read < 2 layers + 1 GiB.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from mcore_proxy.checkpoint import write_checkpoint
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.checkpoint.names import group_of
from mcore_proxy.testing.synthetic import SyntheticMoEView, synthetic_args


def peak_rss_mib(cmd: list[str]) -> tuple[float, float]:
    out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=True)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)) / 1024
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", out.stderr).group(1)
    secs = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    return rss, secs


def layer_bytes(view) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for n in view.names():
        shape = view.shape(n)
        numel = 1
        for d in shape:
            numel *= d
        sizes[group_of(n)] = sizes.get(group_of(n), 0) + numel * (
            4 if view.dtype(n).is_floating_point and view.dtype(n).itemsize == 4 else 2
        )
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    view = SyntheticMoEView(synthetic_args(num_layers=a.layers))
    ckpt = Path(a.out) / f"read-{a.layers}L"
    if not ckpt.exists():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        write_checkpoint(view, ckpt, resolve_target(view, tp=2, pp=2, ep=4))
    sizes = layer_bytes(view)
    largest = max(v for k, v in sizes.items() if k != "other")
    total = sum(sizes.values())
    # The console script beside this interpreter: CI runs the venv's python without activating it.
    mcore = (
        shutil.which("mcore-proxy", path=str(Path(sys.executable).parent))
        or shutil.which("mcore-proxy")
        or "mcore-proxy"
    )
    runs = {"inspect": [mcore, "inspect", str(ckpt)], "full read": [sys.executable, "bench/read_all.py", str(ckpt)]}
    print(f"checkpoint {ckpt}: {total / 2**30:.2f} GiB, {a.layers} layers, largest layer {largest / 2**20:.0f} MiB")
    print(f"{'command':<10} {'peak RSS MiB (median)':>22} {'wall s (median)':>16} {'bound MiB':>10}")
    for label, cmd in runs.items():
        rss, wall = zip(*(peak_rss_mib(cmd) for _ in range(a.repeat)))
        bound = (2 * largest + 2**30) / 2**20
        print(f"{label:<10} {statistics.median(rss):>22.0f} {statistics.median(wall):>16.1f} {bound:>10.0f}")


if __name__ == "__main__":
    main()
