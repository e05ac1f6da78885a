"""`mcore-proxy convert` against `cp -r` and against megatron-core's own re-sharding (issues 5, 9).

    python bench/bench_convert.py [--out bench/out] [--repeat 3] [--layers 16] [--libs 5a17b50,HEAD]
                                  [--no-megatron] [--diag]
    # issue 9's checkpoint: 16 MoE layers, E=64, K=24, H=1024, EP 4 -> 1 (3.64 GiB)
    python bench/bench_convert.py --layers 16 --experts 64 --ffn 512 --keep 24 --target-ep 1 --no-double \
        --no-megatron --libs 4e90d54,HEAD

Builds once (cached under --out, named by layers, E, F and H) two synthetic Megatron MoE GPT legacy
checkpoints with the streaming writer: bf16, hidden 1024, 16 experts x F=1536 (top-4), TP=1 PP=2 EP=4 (8 rank
files), with L and 2L MoE layers, and a hand-written plan keeping K=6 of E=16 experts per
layer (K/E = 0.375; K divides the target EP=2). Then, in one run, repeated --repeat times and
interleaved so that the shared machine's noise falls on every command alike, each after
`sync; echo 3 > /proc/sys/vm/drop_caches` (cold page cache; falls back to warm-cache runs
after a warm-up when dropping is not permitted):

  cp -r SRC DST                                                  the floor: read + write all bytes
  mcore-proxy convert SRC --plan plan.json -o OUT --target-ep 2 --workers 1|2
  mcore-proxy convert SRC -o OUT --target-ep 2                   re-shard only (all E experts)
  python bench/convert_probe.py convert ... --workers 1          the same, with time per phase
  python bench/megatron_reshard.py SRC -o OUT --target-ep 2      megatron-core load-then-save (peer)

The library is measured as `git archive` copies of the commits in --libs (first on PYTHONPATH),
side by side, not as the shared working tree others edit during the run. --diag adds the probe
with POSIX_FADV_RANDOM on the source files and with MALLOC_MMAP_THRESHOLD_=1 MiB.

Each runs under `/usr/bin/time -v` (wall, maximum RSS of the largest single process, disk
blocks read/written); a sampler also sums the PSS (shared pages counted once) and the RSS of
the whole process tree every 0.2 s (workers, megatron ranks). "wall+sync" adds the `sync`
right after the command (the output written back to disk). Ratios to `cp -r` are taken within
each repetition, then the median. Outputs are deleted after each run. Every sample goes to
OUT/convert-results.json; the medians print as a markdown table.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from mcore_proxy.checkpoint import open_checkpoint
from mcore_proxy.checkpoint import write_checkpoint
from mcore_proxy.checkpoint.target import resolve_target
from mcore_proxy.checkpoint.names import group_of
from mcore_proxy.checkpoint.view import router_fingerprint, tensor_nbytes
from mcore_proxy.select.plan import LayerPlan, RouterSettings, SelectionPlan, SourceInfo
from mcore_proxy.testing.synthetic import SyntheticMoEView, synthetic_args

HERE = Path(__file__).resolve().parent
MIB = 2**20


# -- the inputs ------------------------------------------------------------------------------


def arch(layers: int, a) -> argparse.Namespace:
    return synthetic_args(
        num_layers=layers, hidden=a.hidden, experts=a.experts, ffn=a.ffn, topk=a.topk, heads=8, vocab=8192
    )


def build_checkpoint(path: Path, layers: int, a) -> None:
    if path.exists():  # write_checkpoint renames a complete folder into place, so it is whole
        return
    print(f"building {path} ({layers} layers, TP=1 PP=2 EP=4) ...", flush=True)
    view = SyntheticMoEView(arch(layers, a))
    write_checkpoint(view, path, resolve_target(view, tp=1, pp=2, ep=4))


def write_plan(ckpt: Path, path: Path, a) -> Path:
    """A hand plan (method "manual"): K experts per layer drawn with a per-layer seed."""
    if path.exists():
        return path
    view = open_checkpoint(ckpt)
    spec = view.spec
    layers = {
        lid: LayerPlan(kept=sorted(random.Random(int(lid)).sample(range(spec.num_experts), a.keep)))
        for lid in spec.moe_layer_ids
    }
    plan = SelectionPlan(
        source=SourceInfo(
            num_experts=spec.num_experts,
            topk=spec.topk,
            iteration=view.iteration,
            router_fingerprint=router_fingerprint(view),
        ),
        num_experts=a.keep,
        expert_parallel_size=a.target_ep,
        method="manual",
        params={"note": "bench/bench_convert.py: random.Random(layer).sample(range(E), K)"},
        router=RouterSettings(topk=spec.topk),
        layers=layers,
    )
    return plan.save(path)


def sizes(ckpt: Path, plan: Path) -> dict:
    from mcore_proxy.convert.pipeline import open_views

    _, pruned, _ = open_views(ckpt, plan)
    kept = sum(tensor_nbytes(pruned, n) for n in pruned.names())
    view = open_checkpoint(ckpt)
    per: dict[str, int] = {}
    for n in view.names():
        per[group_of(n)] = per.get(group_of(n), 0) + tensor_nbytes(view, n)
    files = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    largest = max(v for k, v in per.items() if k != "other")
    return {
        "tensor_bytes": sum(per.values()),
        "kept_bytes": kept,
        "file_bytes": files,
        "largest_layer": largest,
        "layers": len(per) - ("other" in per),
        "rank_files": len(list(ckpt.rglob("model_optim_rng.pt"))),
    }


# -- measuring -------------------------------------------------------------------------------


def print_header(cold: bool, *facts: str) -> None:
    """The machine, the interpreter, `facts` and the cache state, then the command line: the first
    lines of every side-by-side bench's output."""
    state = "dropped before every command" if cold else "warm"
    said = "".join(f", {f}" for f in facts)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}{said}; "
        f"page cache {state}",
        flush=True,
    )
    print(f"command: python {' '.join(sys.argv)}", flush=True)


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _pss(pid: int) -> int:
    """Proportional set size of one process (shared pages split among their users), bytes."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(proc: psutil.Process) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) over the process tree below /usr/bin/time."""
    try:
        procs = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    rss = pss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            pss += _pss(p.pid)
        except psutil.NoSuchProcess:
            pass
    return rss, pss


def measure(cmd: list[str], cold: bool, log: Path, env: dict | None = None) -> dict:
    if cold:
        drop_caches()
    start = time.perf_counter()
    proc = subprocess.Popen(
        ["/usr/bin/time", "-v", *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    peak, ps = [0, 0], psutil.Process(proc.pid)
    done = threading.Event()

    def sample():
        while not done.is_set():
            rss, pss = _tree(ps)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall_outer = time.perf_counter() - start
    done.set()
    sampler.join()
    t = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t
    with open(log, "a") as fh:
        fh.write(
            f"$ {' '.join(f'{k}={v}' for k, v in (env or {}).items())} {' '.join(cmd)}\n{out[-2000:]}{err[-6000:]}\n"
        )
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")

    def field(label):
        return re.search(re.escape(label) + r": ([\d:.]+)", err).group(1)

    wall = sum(
        float(x) * 60**i
        for i, x in enumerate(reversed(field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")))
    )
    phases = re.search(r"^PHASES (\{.*\})$", err, re.MULTILINE)
    return {
        "wall": wall,
        "wall_sync": wall_outer + sync_s,
        "rss_max": int(field("Maximum resident set size (kbytes)")) * 1024,
        "rss_tree": peak[0],
        "pss_tree": peak[1],
        "read_bytes": int(field("File system inputs")) * 512,
        "write_bytes": int(field("File system outputs")) * 512,
        "stdout": out[-2000:],
        "phases": json.loads(phases.group(1)) if phases else None,
    }


def library_state() -> str:
    """The commit and any uncommitted library change: others edit the same tree during runs."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=HERE.parent, capture_output=True, text=True, check=False
        ).stdout.strip()

    dirty = git("status", "--short", "--", "mcore_proxy", "setup.py").replace("\n", ", ")
    return git("rev-parse", "--short", "HEAD") + (f" + uncommitted: {dirty}" if dirty else "")


def pin_library(out: Path, rev: str) -> tuple[str, str]:
    """Export `rev`'s mcore_proxy (git archive) to put first on PYTHONPATH of the measured
    commands: several commits can then be measured side by side in one run, and uncommitted
    edits others make in the shared tree during the run do not mix into the samples. Its bytecode is
    compiled once. -> (short commit, library folder)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=HERE.parent, capture_output=True, text=True, check=True
    ).stdout.strip()
    lib = (out / f"convert-lib-{sha}").absolute()
    if not lib.exists():
        lib.mkdir()
        archive = subprocess.run(
            ["git", "archive", sha, "mcore_proxy"], cwd=HERE.parent, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(lib)], input=archive, check=True)
    # bytecode as an installed package has it (a machine with PYTHONDONTWRITEBYTECODE would otherwise
    # compile the library in every measured command); nothing to do when it is there already
    compileall.compile_dir(lib, quiet=1)
    found = subprocess.run(
        [sys.executable, "-c", "import mcore_proxy; print(mcore_proxy.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(lib)},
    ).stdout.strip()
    if not found.startswith(str(lib)):
        raise SystemExit(f"pinning failed: mcore_proxy still imports from {found}")
    return sha, str(lib)


def rm(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
        for side in p.parent.glob(f".{p.name}.partial-*"):
            shutil.rmtree(side, ignore_errors=True)


# -- the run ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--keep", type=int, default=6)
    ap.add_argument("--target-ep", type=int, default=2)
    ap.add_argument("--no-megatron", action="store_true")
    ap.add_argument("--no-double", action="store_true", help="skip the 2x-layers checkpoint")
    ap.add_argument("--libs", default="HEAD", help="library commits to measure side by side, e.g. 5a17b50,HEAD")
    ap.add_argument(
        "--diag", action="store_true", help="also the probe with POSIX_FADV_RANDOM and with MALLOC_MMAP_THRESHOLD_=1MiB"
    )
    ap.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="measure the working tree as it is (default: git archives of --libs)",
    )
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache (warm-up run first)")
    a = ap.parse_args()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # The console script beside this interpreter: CI runs the venv's python without activating it.
    mcore = (
        shutil.which("mcore-proxy", path=str(Path(sys.executable).parent))
        or shutil.which("mcore-proxy")
        or "mcore-proxy"
    )
    counts = [a.layers] + ([] if a.no_double else [2 * a.layers])
    src, plans, info = {}, {}, {}
    for n in counts:
        src[n] = out / f"convert-{n}L-E{a.experts}-F{a.ffn}-H{a.hidden}"  # inputs of other shapes coexist
        build_checkpoint(src[n], n, a)
        plans[n] = write_plan(src[n], out / f"{src[n].name}-K{a.keep}-ep{a.target_ep}.plan.json", a)
        info[n] = sizes(src[n], plans[n])
        print(
            f"{src[n]}: {info[n]['file_bytes'] / 2**30:.2f} GiB in {info[n]['rank_files']} rank files, "
            f"{info[n]['layers']} MoE layers, largest layer {info[n]['largest_layer'] / MIB:.0f} MiB",
            flush=True,
        )
    cold = not a.warm and drop_caches()
    if not cold:
        print("page cache: not dropped (warm-cache runs after a warm-up)")
    tmp = out / "convert-tmp"
    rm(tmp)
    tmp.mkdir()
    log = out / "convert-bench.log"
    log.write_text("")
    ep = str(a.target_ep)

    def convert_cmd(n: int, d: Path, workers: int, probe: bool = False) -> list[str]:
        head = [sys.executable, str(HERE / "convert_probe.py")] if probe else [mcore]
        return head + [
            "convert",
            str(src[n]),
            "--plan",
            str(plans[n]),
            "-o",
            str(d),
            "--target-ep",
            ep,
            "--workers",
            str(workers),
        ]

    if a.pin:
        libs = [pin_library(out, rev) for rev in a.libs.split(",")]
        state_before = ", ".join(f"{sha} (git archive)" for sha, _ in libs)
    else:
        libs, state_before = [("tree", "")], library_state()
    print(f"library: {state_before}", flush=True)
    last_env = {"PYTHONPATH": libs[-1][1]} if libs[-1][1] else {}

    def jobs(n: int) -> dict[str, tuple[list[str], list[Path], dict]]:
        d = tmp / f"o{n}"
        j = {f"cp -r ({n}L)": (["cp", "-r", str(src[n]), str(d)], [d], {})}
        reshard = [mcore, "convert", str(src[n]), "-o", str(d), "--target-ep", ep]
        for sha, lib in libs:
            env, tag = ({"PYTHONPATH": lib} if lib else {}), (f" @{sha}" if len(libs) > 1 else "")
            j[f"convert K={a.keep}, workers 1 ({n}L){tag}"] = (convert_cmd(n, d, 1), [d], env)
            j[f"convert K={a.keep}, workers 2 ({n}L){tag}"] = (convert_cmd(n, d, 2), [d], env)
            j[f"convert re-shard only, all {a.experts} experts ({n}L){tag}"] = (reshard, [d], env)
            j[f"phases: K={a.keep} w1 via convert_probe.py ({n}L){tag}"] = (convert_cmd(n, d, 1, True), [d], env)
            if a.diag:
                j[f"diag: ... + POSIX_FADV_RANDOM ({n}L){tag}"] = (
                    convert_cmd(n, d, 1, True),
                    [d],
                    {**env, "MCORE_PROXY_PROBE_FADVISE": "1"},
                )
                j[f"diag: ... + MALLOC_MMAP_THRESHOLD_=1MiB ({n}L){tag}"] = (
                    convert_cmd(n, d, 1, True),
                    [d],
                    {**env, "MALLOC_MMAP_THRESHOLD_": str(2**20)},
                )
                j[f"diag: re-shard only + MALLOC_MMAP_THRESHOLD_=1MiB ({n}L){tag}"] = (
                    reshard,
                    [d],
                    {**env, "MALLOC_MMAP_THRESHOLD_": str(2**20)},
                )
        if n == a.layers and not a.no_megatron:
            j[f"megatron-core load+save, all {a.experts} experts ({n}L)"] = (
                [
                    sys.executable,
                    str(HERE / "megatron_reshard.py"),
                    str(src[n]),
                    "-o",
                    str(d),
                    "--target-ep",
                    ep,
                    "--timings",
                    str(tmp / "megatron.json"),
                ],
                [d, d.with_name(d.name + ".torch_dist")],
                last_env,
            )
        return j

    order = {k: v for n in counts for k, v in jobs(n).items()}
    if not cold:
        for label, (cmd, outs, env) in order.items():  # warm-up: the same files in the page cache for all
            if label.startswith("cp"):
                measure(cmd, False, log)
                rm(*outs)
    samples: dict[str, list[dict]] = {k: [] for k in order}
    for r in range(a.repeat):
        for label, (cmd, outs, env) in order.items():
            rm(*outs)
            m = measure(cmd, cold, log, env)
            m["out_bytes"] = sum(p.stat().st_size for o in outs if o.exists() for p in o.rglob("*") if p.is_file())
            if label.startswith("megatron"):
                m["phases"] = json.loads((tmp / "megatron.json").read_text())
                m["out_bytes"] = m["phases"]["out_bytes"]
            if r == 0 and label.startswith(f"convert K={a.keep}, workers 1"):
                v = subprocess.run(
                    [mcore, "verify", "--orig", cmd[2], "--proxy", str(outs[0]), "--plan", cmd[4]],
                    check=False,
                    capture_output=True,
                    text=True,
                    env={**os.environ, **env},
                )
                m["verify"] = " / ".join(
                    ln.strip()
                    for ln in (v.stdout + v.stderr).splitlines()
                    if ln.strip() and "%|" not in ln and "Warning" not in ln
                )[-300:]
            samples[label].append(m)
            rm(*outs)
            print(
                f"[{r + 1}/{a.repeat}] {label}: wall {m['wall']:.1f} s (+sync {m['wall_sync']:.1f} s), "
                f"max RSS {m['rss_max'] / MIB:.0f} MiB, tree PSS {m['pss_tree'] / MIB:.0f} MiB "
                f"(RSS {m['rss_tree'] / MIB:.0f}), disk read {m['read_bytes'] / 2**30:.2f} GiB, "
                f"out {m['out_bytes'] / 2**30:.2f} GiB"
                + (f", verify: {m['verify']}" if "verify" in m else "")
                + (f", phases {json.dumps(m['phases'])}" if m.get("phases") else ""),
                flush=True,
            )
    rm(tmp)
    state_after = state_before if a.pin else library_state()
    print(f"library: {state_before} at start, {state_after} at the end", flush=True)

    def layers_of(label: str) -> int:
        return int(re.search(r"\((\d+)L\)", label).group(1))

    fields = ("wall", "wall_sync", "rss_max", "rss_tree", "pss_tree", "read_bytes", "out_bytes")
    med = {k: {f: statistics.median(x[f] for x in v) for f in fields} for k, v in samples.items()}
    for k, v in samples.items():  # ratios within each repetition (side by side), then the median
        cp = samples[f"cp -r ({layers_of(k)}L)"]
        med[k]["ratio"] = statistics.median(x["wall"] / c["wall"] for x, c in zip(v, cp))
        med[k]["ratio_sync"] = statistics.median(x["wall_sync"] / c["wall_sync"] for x, c in zip(v, cp))
        phases = [x["phases"] for x in v if x.get("phases")]
        if phases:
            med[k]["phases"] = {
                p: statistics.median(x[p] for x in phases) for p in phases[0] if isinstance(phases[0][p], (int, float))
            }
    (out / "convert-results.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "library": [state_before, state_after],
                "cold_cache": cold,
                "inputs": {str(n): info[n] for n in counts},
                "samples": samples,
                "medians": med,
            },
            indent=1,
            default=str,
        )
    )

    print(
        f"\npage cache {'dropped before every run' if cold else 'warm'}; medians of {a.repeat}; "
        "ratio = median over repetitions of (wall / wall of cp -r in the same repetition)"
    )
    for n in counts:
        print(
            f"{n}L: {info[n]['file_bytes'] / 2**30:.2f} GiB on disk, kept tensors "
            f"{info[n]['kept_bytes'] / 2**30:.2f} GiB, "
            f"largest layer {info[n]['largest_layer'] / MIB:.0f} MiB, bound 2 layers + 1 GiB = "
            f"{(2 * info[n]['largest_layer'] + 2**30) / MIB:.0f} MiB"
        )
    print(
        "| command | wall s | / cp -r | wall+sync s | / cp -r | peak RSS MiB (largest process) "
        "| peak PSS MiB (sum over processes) | disk read GiB | output GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k, m in med.items():
        print(
            f"| {k} | {m['wall']:.1f} | {m['ratio']:.2f} | {m['wall_sync']:.1f} | {m['ratio_sync']:.2f} "
            f"| {m['rss_max'] / MIB:.0f} | {m['pss_tree'] / MIB:.0f} | {m['read_bytes'] / 2**30:.2f} "
            f"| {m['out_bytes'] / 2**30:.2f} |"
        )
    for k, m in med.items():
        if "phases" in m:
            print(f"phases (median s) {k}: {json.dumps(m['phases'])}")


if __name__ == "__main__":
    main()
