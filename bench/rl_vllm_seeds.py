"""The seed's faults in a two-engine GRPO run (vLLM rollouts, transformers training), original vs
proxy, over several seeds; a fix validated on the proxy first; a campaign and triage on the loop.

    python bench/rl_vllm_seeds.py --out DIR [--seeds 5] [--steps 15] [--workers 2]

Models: the tests' tiny Qwen3-MoE at vLLM's head size (`qwen3_moe@vllm`: 16 experts, top-4, 3 MoE
layers) and its K = 8 proxy made by the user's pipeline (collect, select, convert), built in DIR
once; their files' sha256 are checked against PINNED (a model that differs is said to differ, and
its numbers are new measurements, not the recorded ones). Every run is
`examples/rl_vllm/run.py --check-sync` in vLLM's interpreter, faults from the environment, each
placed in the engine where it lives (`engine=`), on from step ONSET:
- precision: the rollout's logits in bf16, in vLLM only;
- omission: every optimizer step left out, in the trainer only;
- router_noise: Gaussian noise of std 0.5 on vLLM's router logits only;
- tie_flip: near-ties (within 0.3) at vLLM's top-k boundary broken the other way; and
  tie_flip+replay: the same with the fix R3 (`--routing-replay`).
Then `mcore-proxy compare` over the seeds: each fault against the baseline on the metrics it is
defined on; a different-fault pair (original precision, proxy omission); the fix (tie_flip as the
baseline, tie_flip+replay as the change). A 40-step run proves the sync at every step. A campaign
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
}
# compare: name -> (original baseline, original change, proxy baseline, proxy change, metrics,
# the logged metric shown per seed)
COMPARES = {
    "precision": (
        "none",
        "precision",
        "none",
        "precision",
        ["logprob_diff", "rollout_kl"],
        "training/rollout_probs_diff_mean",
    ),
    "omission": ("none", "omission", "none", "omission", ["reward"], "critic/score/mean"),
    "router_noise": (
        "none",
        "router_noise",
        "none",
        "router_noise",
        ["routing_disagreement", "logprob_diff"],
        "routing/decision_disagreement",
    ),
    "tie_flip": (
        "none",
        "tie_flip",
        "none",
        "tie_flip",
        ["routing_disagreement", "logprob_diff"],
        "rollout_corr/k3_kl",
    ),
    "different pair": (
        "none",
        "precision",
        "none",
        "omission",
        ["logprob_diff", "rollout_kl", "reward"],
        "training/rollout_probs_diff_mean",
    ),
    "fix: routing replay": (
        "tie_flip",
        "tie_flip+replay",
        "tie_flip",
        "tie_flip+replay",
        ["logprob_diff", "rollout_kl"],
        "rollout_corr/k3_kl",
    ),
}
CAMPAIGN_FAULTS = [
    {"name": "precision", "spec": "logprob_precision:dtype={strength},engine=rollout", "strengths": ["bf16", "fp16"]},
    {"name": "omission", "spec": "update_omission:engine=trainer,every={strength}", "strengths": [1, 2]},
    {"name": "router_noise", "spec": "router_noise:std={strength},engine=rollout", "strengths": [0.2, 0.5]},
]
SYNC_STEPS = 40
# sha256 of the JSON of {file name: sha256} of each model folder, as first measured (bench/RESULTS.md)
PINNED = {
    "orig": "54d8c773385198807e1d57e5789ae666a13de6ac04aa9a5873685a835ea6b1ff",
    "proxy": "2d40202a73ca26339ea9aca15d4a3150173cee99ce9c014ba20f2c21bea0eea4",
}


def vllm_python() -> str:
    given = os.environ.get("MCORE_PROXY_VLLM_PYTHON")
    if given:
        return given
    return subprocess.run(
        ["bash", str(REPO / "tools" / "vllm_env.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()


def file_hashes(folder: Path) -> dict[str, str]:
    """file name -> sha256, as each run's run.json records its model's (examples/rl_vllm)."""
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}


def folder_digest(folder: Path) -> str:
    return hashlib.sha256(json.dumps(file_hashes(folder), sort_keys=True).encode()).hexdigest()


def finished(out: Path, steps: int, model: Path) -> bool:
    """A run of an earlier invocation, complete, on this very model (a model that changed is rerun,
    never mixed)."""
    log, run = out / "metrics.jsonl", out / "run.json"
    if not (log.exists() and run.exists()) or sum(1 for _ in open(log)) != steps:
        return False
    return json.loads(run.read_text())["model_sha256"] == file_hashes(model)


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


def shift(runs: Path, name: str, base: str, change: str, seed: int, metric: str) -> float:
    """Mean of `metric` from step ONSET on: the changed run minus its baseline (same seed)."""

    def mean(label: str) -> float:
        values = [r["data"][metric] for r in rows(runs / f"{name}-{label}-s{seed}") if r["step"] >= ONSET]
        return sum(values) / len(values)

    return mean(change) - mean(base)


def compare(runs: Path, seeds: int, name: str) -> dict:
    ob, of, pb, pf, metrics, _ = COMPARES[name]
    argv = [sys.executable, "-m", "mcore_proxy", "compare", "--json", "--metrics", *metrics]
    for role, model, label in (
        ("orig-base", "orig", ob),
        ("orig-fault", "orig", of),
        ("proxy-base", "proxy", pb),
        ("proxy-fault", "proxy", pf),
    ):
        argv += [f"--{role}", *(str(runs / f"{model}-{label}-s{s}" / "metrics.jsonl") for s in range(seeds))]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"compare {name}: exit {done.returncode}: {done.stderr[-1000:]}")
    return {"exit": done.returncode, "report": json.loads(done.stdout)}


def table(runs: Path, name: str, result: dict) -> str:
    ob, of, _, pf, metrics, shown = COMPARES[name]
    report = result["report"]
    lines = [
        f"**{name}**: `{of}` against `{ob}` (proxy: `{pf}`), metrics {', '.join(metrics)}; "
        f"shown: mean `{shown}` from step {ONSET}, change - baseline",
        "",
    ]
    lines += ["| seed | original | proxy | compare, this seed |", "|---|---|---|---|"]
    for seed, per_seed in enumerate(report["per_seed"]):
        o = shift(runs, "orig", ob, of, seed, shown)
        p = shift(runs, "proxy", COMPARES[name][2], pf, seed, shown)
        verdict = "consistent" if per_seed["consistent"] else "NOT: " + per_seed["verdict"].split(": ", 1)[-1]
        lines.append(f"| {seed} | {o:+.3g} | {p:+.3g} | {verdict[:110]} |")
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


def triage(runs: Path, library: Path, seeds: int) -> list[dict]:
    """The original's faulted runs of seeds 1.. (held out: another model, other seeds) against the library."""
    out = []
    for fault in ("precision", "omission", "router_noise"):
        for seed in range(1, seeds):
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
    full = args.conditions == list(CONDITIONS)
    py = vllm_python()
    orig, proxy, _, _ = models(args.out)
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
        for seed in range(args.seeds)
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
    summary = {"seeds": args.seeds, "steps": args.steps, "onset": ONSET, "conditions": CONDITIONS, "models": digests}
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
    summary["compare"] = {name: compare(runs, args.seeds, name) for name in covered}
    if full:
        summary["triage"] = triage(runs, campaign(py, proxy, args.out, args.steps, args.workers), args.seeds)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("models", "sync", "seconds_per_step_median")}, indent=1))
    for name, result in summary["compare"].items():
        print(table(runs, name, result))
    triaged = summary.get("triage", [])
    if triaged:
        right = sum(t["right"] for t in triaged)
        print(f"triage of the original's held-out runs against the proxy's library: {right}/{len(triaged)} right")
    for t in triaged:
        print(f"  {t['fault']} seed {t['seed']}: ranked first {t['top']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
