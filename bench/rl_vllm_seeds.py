"""The seed's faults in a two-engine GRPO run (vLLM rollouts, transformers training), original vs
proxy, over several seeds; a fix validated on the proxy first; a campaign and triage on the loop.

    python bench/rl_vllm_seeds.py --out DIR [--seeds 5] [--first-seed 0] [--steps 15] [--workers 2]

Models: the tests' tiny Qwen3-MoE at vLLM's head size (`qwen3_moe@vllm`: 16 experts, top-4, 3 MoE
layers, deterministic weights) and its K = 8 proxy, converted from the stored plan PINNED_PLAN
(which the user's pipeline, collect and select, made once), built in DIR once; their files'
sha256 are checked against PINNED (a model that differs is said to differ, and its numbers are
new measurements, not the recorded ones). Every run is
`examples/rl_vllm/run.py --check-sync` in vLLM's interpreter, faults from the environment, each
placed in the engine where it lives (`engine=`), on from step ONSET:
- precision: the rollout's logits in bf16, in vLLM only;
- omission: every optimizer step left out, in the trainer only;
- router_noise: Gaussian noise of std 0.5 on vLLM's router logits only;
- tie_flip: near-ties (within 0.3) at vLLM's top-k boundary broken the other way; and
  tie_flip+replay: the same with the fix R3 (`--routing-replay`);
- router_precision: vLLM's router logits in bf16 (the trainer's stay fp32); and
  router_precision+replay: the same with R3;
- router_fp8: vLLM's router logits in fp8 E4M3 (FP8 rollout inference); and router_fp8+replay:
  the same with R3;
- precision_fp8: the rollout's logits in fp8 (E4M3), in vLLM only; and precision_fp8+no_tis: the
  same trained without TIS (`--no-tis`), so that TIS is the fix compared.
Then `mcore-proxy compare` over the seeds: each fault against the baseline on the metrics it is
defined on; a different-fault pair (original precision, proxy omission); the fix, each faulted run
as the baseline and the same with R3 as the change, and the fp8 runs without TIS against those
with it. A 40-step run proves the sync at every step. A campaign
(3 faults x 2 strengths on the proxy, seed 0) builds a signature library, and the original's
faulted runs of the other seeds are triaged against it. Runs go `--workers` at a time, each bound
to one core; finished runs are reused by a later invocation. Writes DIR/summary.json and prints
the tables bench/RESULTS.md records. About 1 min per run here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from rollout_consistency import models  # noqa: E402  (the same model and proxy)

from mcore_proxy.checkpoint.torchfile import file_sha256  # noqa: E402

ONSET = 3
CONDITIONS = {  # label -> (MCORE_PROXY_FAULTS, extra arguments)
    "none": ("", []),
    "precision": (f"logprob_precision:dtype=bf16,engine=rollout,start={ONSET}", []),
    "omission": (f"update_omission:engine=trainer,start={ONSET}", []),
    "router_noise": (f"router_noise:std=0.5,engine=rollout,start={ONSET}", []),
    "tie_flip": (f"router_tie_flip:margin=0.3,engine=rollout,start={ONSET}", []),
    "tie_flip+replay": (f"router_tie_flip:margin=0.3,engine=rollout,start={ONSET}", ["--routing-replay"]),
    "router_precision": (f"router_precision:dtype=bf16,engine=rollout,start={ONSET}", []),
    "router_precision+replay": (f"router_precision:dtype=bf16,engine=rollout,start={ONSET}", ["--routing-replay"]),
    "router_fp8": (f"router_precision:dtype=fp8,engine=rollout,start={ONSET}", []),
    "router_fp8+replay": (f"router_precision:dtype=fp8,engine=rollout,start={ONSET}", ["--routing-replay"]),
    "precision_fp8": (f"logprob_precision:dtype=fp8,engine=rollout,start={ONSET}", []),
    "precision_fp8+no_tis": (f"logprob_precision:dtype=fp8,engine=rollout,start={ONSET}", ["--no-tis"]),
}
# compare: name -> (original baseline, original change, proxy baseline, proxy change, metrics)
COMPARES = {
    "precision": (
        "none",
        "precision",
        "none",
        "precision",
        ["logprob_diff", "rollout_kl"],
    ),
    "omission": ("none", "omission", "none", "omission", ["reward"]),
    "router_noise": (
        "none",
        "router_noise",
        "none",
        "router_noise",
        ["routing_disagreement", "logprob_diff"],
    ),
    "tie_flip": (
        "none",
        "tie_flip",
        "none",
        "tie_flip",
        ["routing_disagreement", "logprob_diff"],
    ),
    "different pair": (
        "none",
        "precision",
        "none",
        "omission",
        ["logprob_diff", "rollout_kl", "reward"],
    ),
    "fix: routing replay": (
        "tie_flip",
        "tie_flip+replay",
        "tie_flip",
        "tie_flip+replay",
        ["logprob_diff", "rollout_kl"],
    ),
    "fix: routing replay, router precision": (
        "router_precision",
        "router_precision+replay",
        "router_precision",
        "router_precision+replay",
        ["logprob_diff", "rollout_kl"],
    ),
    "router fp8": (
        "none",
        "router_fp8",
        "none",
        "router_fp8",
        ["routing_disagreement", "logprob_diff", "rollout_kl"],
    ),
    "fix: routing replay, router fp8": (
        "router_fp8",
        "router_fp8+replay",
        "router_fp8",
        "router_fp8+replay",
        ["logprob_diff", "rollout_kl"],
    ),
    "fix: TIS, fp8 precision": (
        "precision_fp8+no_tis",
        "precision_fp8",
        "precision_fp8+no_tis",
        "precision_fp8",
        ["reward", "logprob_diff", "rollout_kl"],
    ),
    "precision fp8, no TIS": (
        "none",
        "precision_fp8+no_tis",
        "none",
        "precision_fp8+no_tis",
        ["reward", "logprob_diff", "rollout_kl"],
    ),
}
CAMPAIGN_FAULTS = [
    {"name": "precision", "spec": "logprob_precision:dtype={strength},engine=rollout", "strengths": ["bf16", "fp16"]},
    {"name": "omission", "spec": "update_omission:engine=trainer,every={strength}", "strengths": [1, 2]},
    {"name": "router_noise", "spec": "router_noise:std={strength},engine=rollout", "strengths": [0.2, 0.5]},
]
SYNC_STEPS = 40
# the proxy's plan (the kept experts), stored: collect's statistics come from a transformers forward
# pass, whose numerics may move with the installed release; the conversion from a plan is exact
PINNED_PLAN = REPO / "bench" / "pinned" / "qwen3_moe-vllm-k8-plan.json"
# sha256 of the JSON of {file name: sha256} of each model folder but its provenance (bench/RESULTS.md).
# The first proxy digest (2d40202a...) also hashed convert's manifest, whose provenance path moved with
# the fixture's cache key on a fresh machine; the weights were the same (the runs reproduce digit for
# digit), so only the digest's rule changed.
PINNED = {
    "orig": "54d8c773385198807e1d57e5789ae666a13de6ac04aa9a5873685a835ea6b1ff",
    "proxy": "7ce5bde9a4d2ed6f959af5db77ac61de862c151258e32bb8d4a66bd55abbd3ed",
}


def vllm_python() -> str:
    given = os.environ.get("MCORE_PROXY_VLLM_PYTHON")
    if given:
        return given
    return subprocess.run(
        ["bash", str(REPO / "tools" / "vllm_env.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()


# convert's manifest records where its inputs were (provenance: the fixture folder's name moves
# with the fixture code), so a model's identity is every other file
PROVENANCE = ("manifest.json",)


def file_hashes(folder: Path) -> dict[str, str]:
    """file name -> sha256 of every file but the provenance, as each run's run.json records its
    model's (examples/rl_vllm)."""
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name not in PROVENANCE}


def folder_digest(folder: Path) -> str:
    return hashlib.sha256(json.dumps(file_hashes(folder), sort_keys=True).encode()).hexdigest()


def finished(out: Path, steps: int, model: Path) -> bool:
    """A run of an earlier invocation, complete, on this very model (a model that changed is rerun,
    never mixed)."""
    log, run = out / "metrics.jsonl", out / "run.json"
    if not (log.exists() and run.exists()) or sum(1 for _ in open(log)) != steps:
        return False
    recorded = json.loads(run.read_text())["model_sha256"]
    return {k: v for k, v in recorded.items() if k not in PROVENANCE} == file_hashes(model)


def run_one(py: str, model: Path, out: Path, label: str, seed: int, steps: int, core: int) -> tuple[Path, float]:
    if finished(out, steps, model):
        return out, 0.0
    shutil.rmtree(out, ignore_errors=True)
    faults, extra = CONDITIONS[label]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_PROXY_")}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
    if faults:
        env.update(PYTHONPATH=str(REPO / "patches"), MCORE_PROXY_FAULTS=faults)
    cmd = [py, str(REPO / "examples/rl_vllm/run.py"), "--model", str(model), "--out", str(out)]
    cmd += ["--seed", str(seed), "--steps", str(steps), "--check-sync", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{out.name}: exit {done.returncode}: {done.stderr[-2000:]}")
    return out, time.perf_counter() - start


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def compare(runs: Path, seeds: list[int], name: str) -> dict:
    ob, of, pb, pf, metrics = COMPARES[name]
    argv = [sys.executable, "-m", "mcore_proxy", "compare", "--json", "--metrics", *metrics]
    for role, model, label in (
        ("orig-base", "orig", ob),
        ("orig-fault", "orig", of),
        ("proxy-base", "proxy", pb),
        ("proxy-fault", "proxy", pf),
    ):
        argv += [f"--{role}", *(str(runs / f"{model}-{label}-s{s}" / "metrics.jsonl") for s in seeds)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"compare {name}: exit {done.returncode}: {done.stderr[-1000:]}")
    return {"exit": done.returncode, "report": json.loads(done.stdout)}


def table(name: str, result: dict, seeds: list[int]) -> str:
    """Per seed: `compare`'s shift of each metric (faulted - baseline, mean from the seed-mean onset),
    original / proxy, whether the seed reproduces the fault, and its single-run verdict."""
    ob, of, pb, pf, metrics = COMPARES[name]
    report = result["report"]
    found = report["metrics"]
    lines = [f"**{name}**: `{of}` against `{ob}` (proxy: `{pf}` against `{pb}`), metrics {', '.join(metrics)}", ""]
    lines += [
        "| seed | " + " | ".join(f"{m}: original / proxy" for m in found) + " | reproduces | this seed alone |",
        "|---" * (len(found) + 3) + "|",
    ]
    for i, seed in enumerate(seeds):
        cells = [f"{found[m]['original']['shifts'][i]:+.3g} / {found[m]['proxy']['shifts'][i]:+.3g}" for m in found]
        per_seed, alone = report["per_seed"][i], report["single_run"][i]
        said = "yes" if per_seed["reproduces"] else "no: " + ", ".join(per_seed["not_reproduced"])
        lines.append(f"| {seed} | {' | '.join(cells)} | {said} | {'consistent' if alone['consistent'] else 'not'} |")
    lines += [
        "",
        "| metric | original: direction, mean shift, p over seeds, onset | proxy | match |",
        "|---|---|---|---|",
    ]
    for m, x in found.items():
        o, p = x["original"]["signature"], x["proxy"]["signature"]
        cell = lambda g: f"{g['direction']:+d}, {g['shift']:+.3g}, p {g['p_shift']:.2g}, onset {g['onset']}"  # noqa: E731
        lines.append(f"| {m} | {cell(o)} | {cell(p)} | {'yes' if x['match'] else 'no: ' + ', '.join(x['reasons'])} |")
    return "\n".join(lines + ["", f"`compare` exit {result['exit']}: {report['verdict']}", ""])


def campaign(py: str, proxy: Path, out: Path, steps: int, workers: int) -> Path:
    """The proxy's signature library: each campaign fault x strength from ONSET, seed 0."""
    config = {
        "format": "mcore-proxy-campaign-config/1",
        "command": [
            py,
            str(REPO / "examples/rl_vllm/run.py"),
            "--model",
            str(proxy),
            "--out",
            "{run_dir}/run",
            "--steps",
            str(steps),
            "--seed",
            "0",
        ],
        "log": "{run_dir}/run/metrics.jsonl",  # the run's own folder: the campaign keeps console.log beside it
        "work": str(out / "campaign"),
        "jobs": workers,
        "env": {"OMP_NUM_THREADS": "1"},
        "metrics": ["reward", "logprob_diff", "rollout_kl", "routing_disagreement"],
        "faults": [dict(f, schedule=f"start={ONSET}") for f in CAMPAIGN_FAULTS],
    }
    path = out / "campaign.json"
    path.write_text(json.dumps(config, indent=1))
    done = subprocess.run([sys.executable, "-m", "mcore_proxy", "campaign", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"campaign: exit {done.returncode}: {done.stderr[-2000:]}")
    return out / "campaign" / "library.json"


def triage(runs: Path, library: Path, seeds: list[int]) -> list[dict]:
    """The original's faulted runs of every seed but the campaign's (held out: another model, other
    seeds) against the library."""
    out = []
    for fault in ("precision", "omission", "router_noise"):
        for seed in (s for s in seeds if s != 0):
            argv = [sys.executable, "-m", "mcore_proxy", "compare", "--json", "--library", str(library)]
            argv += ["--run", str(runs / f"orig-{fault}-s{seed}" / "metrics.jsonl")]
            argv += ["--baseline", str(runs / f"orig-none-s{seed}" / "metrics.jsonl")]
            done = subprocess.run(argv, capture_output=True, text=True)
            ranked = json.loads(done.stdout)["ranking"] if done.returncode == 0 else []
            top = ranked[0]["fault"] if ranked else None
            out.append({"fault": fault, "seed": seed, "top": top, "right": top == fault})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/mcore-proxy-rl-vllm"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0, help="e.g. 5 with --seeds 5: held-out seeds 5-9")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--conditions",
        nargs="+",
        choices=list(CONDITIONS),
        default=list(CONDITIONS),
        help="a subset (e.g. none omission with more --steps): only the compares they cover, no campaign",
    )
    args = ap.parse_args()
    if args.seeds < 2:
        ap.error("--seeds must be 2 or more: compare over seeds needs them (a verdict needs 4 of 5)")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    full = args.conditions == list(CONDITIONS)
    py = vllm_python()
    orig, proxy, _, _ = models(args.out, pinned_plan=PINNED_PLAN)
    digests = {"orig": folder_digest(orig), "proxy": folder_digest(proxy)}
    for name, digest in digests.items():
        if PINNED[name] and digest != PINNED[name]:
            print(
                f"NOTE: the {name} model differs from the pinned one ({digest[:12]} != {PINNED[name][:12]}): "
                "these are new measurements, not those bench/RESULTS.md records",
                flush=True,
            )
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    jobs = [
        (name, path, label, seed, args.steps, runs / f"{name}-{label}-s{seed}")
        for seed in seeds
        for label in args.conditions
        for name, path in (("orig", orig), ("proxy", proxy))
    ]
    if full:
        jobs.append(("orig", orig, "none", 0, SYNC_STEPS, runs / "orig-sync40"))
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        futures = [
            pool.submit(run_one, py, path, out, label, seed, steps, i % args.workers)
            for i, (name, path, label, seed, steps, out) in enumerate(jobs)
        ]
        for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
            out, took = future.result()
            print(f"[{n}/{len(jobs)}] {out.name} {took:.0f} s", flush=True)
    summary = {"seeds": seeds, "steps": args.steps, "onset": ONSET, "conditions": CONDITIONS, "models": digests}
    summary["sync"] = {
        "no_fault_runs_max": max(r["data"]["sync/max_logprob_diff"] for d in runs.glob("*-none-s*") for r in rows(d)),
    }
    if full:
        summary["sync"]["steps"] = SYNC_STEPS
        summary["sync"]["max_logprob_diff"] = max(
            r["data"]["sync/max_logprob_diff"] for r in rows(runs / "orig-sync40")
        )
    summary["seconds_per_step_median"] = {
        name: statistics.median(
            r["data"]["timing_s/step"]
            for d in runs.glob(f"{name}-*-s*")
            for r in rows(d)
            if "timing_s/step" in r["data"]
        )
        for name in ("orig", "proxy")
    }
    covered = [name for name, c in COMPARES.items() if set(c[:4]) <= set(args.conditions)]
    summary["compare"] = {name: compare(runs, seeds, name) for name in covered}
    if full:
        summary["triage"] = triage(runs, campaign(py, proxy, args.out, args.steps, args.workers), seeds)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("models", "sync", "seconds_per_step_median")}, indent=1))
    for name, result in summary["compare"].items():
        print(table(name, result, seeds))
    triaged = summary.get("triage", [])
    if triaged:
        right = sum(t["right"] for t in triaged)
        print(f"triage of the original's held-out runs against the proxy's library: {right}/{len(triaged)} right")
    for t in triaged:
        print(f"  {t['fault']} seed {t['seed']}: ranked first {t['top']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
