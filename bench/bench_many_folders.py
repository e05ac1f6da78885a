"""Indexing many rank folders (issue 23): cold `inspect` of the same 8-layer DeepSeek-V3-shaped model
saved as 256 rank folders (PP 8 x EP 32) and as 2,048 (PP 8 x EP 256, one expert per folder), under
`ulimit -n 256`, interleaved, for one or more library commits side by side.

    python bench/bench_many_folders.py [--data /work/benchdata-many] [--repeat 5] [--libs 8d5682e,HEAD]
    python bench/bench_many_folders.py --smoke --warm --data DIR      # tiny sizes, seconds (tests/bench)

The checkpoints come from `bench_deepseek_scale.write_checkpoint` (built on first use, 0.65 and
3.73 GiB). Every command runs under `/usr/bin/time -v` after `sync; echo 3 > /proc/sys/vm/drop_caches`
(warm, and said so, where that is not permitted), the soft descriptor limit lowered to 256 first;
each library's bytecode is compiled first, as an installed package's is.
The bar: inspect on 2,048 folders in less than twice its time on 256. Prints each sample, then a
markdown table of medians with the ratio (the median of per-repetition ratios); samples go to
DATA/many-results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_convert import drop_caches, measure, pin_library, print_header  # noqa: E402
from bench_deepseek_scale import disk_bytes, scale_model, smoke_model, write_checkpoint  # noqa: E402

MIB, GIB = 2**20, 2**30
DESCRIPTORS = 256


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/work/benchdata-many", help="checkpoints and results (built if missing)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--libs", default="HEAD", help="library commits measured side by side (git archives)")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache")
    ap.add_argument("--smoke", action="store_true", help="5 layers, 32 experts, PP 2, EP 4 and 32, once")
    a = ap.parse_args(argv)
    pp, eps, make = 8, (32, 256), scale_model
    if a.smoke:
        a.layers, a.repeat, pp, eps, make = 5, 1, 2, (4, 32), smoke_model
    data = Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    ckpts = {}
    for ep in eps:
        ckpt = ckpts[ep] = data / f"{'smoke' if a.smoke else 'dsv3'}-{a.layers}L-pp{pp}-ep{ep}"
        if not ckpt.exists():
            t = time.perf_counter()
            write_checkpoint(ckpt, make(a.layers), pp, ep, "first-last")
            print(f"built {ckpt} in {time.perf_counter() - t:.0f} s", flush=True)
        print(f"{ckpt.name}: {disk_bytes(ckpt) / GIB:.2f} GiB in {pp * ep} rank folders", flush=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(DESCRIPTORS, hard), hard))  # inherited by the commands
    cold = not a.warm and drop_caches()
    mcore = shutil.which("mcore-proxy", path=str(Path(sys.executable).parent)) or "mcore-proxy"
    libs = [pin_library(data, rev) for rev in a.libs.split(",")]  # bytecode compiled, as installed
    log = data / "many-bench.log"
    log.write_text("")
    print_header(cold, f"ulimit -n {DESCRIPTORS}")
    load_before = os.getloadavg()
    samples: dict[tuple[str, int], list[dict]] = {(sha, ep): [] for sha, _ in libs for ep in eps}
    for r in range(a.repeat):
        for sha, lib in libs:
            for ep in eps:
                m = measure([mcore, "inspect", str(ckpts[ep])], cold, log, {"PYTHONPATH": lib})
                samples[(sha, ep)].append(m)
                print(
                    f"[{r + 1}/{a.repeat}] inspect @{sha} {pp * ep} folders: wall {m['wall']:.2f} s, "
                    f"max RSS {m['rss_max'] / MIB:.0f} MiB, disk read {m['read_bytes'] / MIB:.0f} MiB",
                    flush=True,
                )
    load_after = os.getloadavg()
    small, large = eps
    rows = []
    for sha, _ in libs:
        walls = {ep: [m["wall"] for m in samples[(sha, ep)]] for ep in eps}
        ratio = statistics.median(b / a for a, b in zip(walls[small], walls[large]))
        rows.append((sha, *(statistics.median(walls[ep]) for ep in eps), ratio))
    (data / "many-results.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "argv": sys.argv,
                "cold_cache": cold,
                "load_before": load_before,
                "load_after": load_after,
                "samples": {f"{sha} {pp * ep}": v for (sha, ep), v in samples.items()},
                "medians": rows,
            },
            indent=1,
            default=str,
        )
    )
    print(f"\nload average (1 min): before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(
        f"medians of {a.repeat}; ratio = median over repetitions of "
        f"({pp * large}-folder wall / {pp * small}-folder wall)"
    )
    print(f"| library | inspect, {pp * small} folders s | inspect, {pp * large} folders s | ratio |")
    print("|---|---|---|---|")
    for sha, t_small, t_large, ratio in rows:
        print(f"| {sha} | {t_small:.2f} | {t_large:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
